"""The trainer state a run stores (iter-K/update/state) and the hash that vouches for it.

A state update K writes with its record (every `train.state_every`) is hashed into update K's
manifest (`outputs.state`). The one a command writes at its end or on Ctrl-C (`publish.flush_state`)
comes after that manifest, so it carries its own MANIFEST.json naming its hash (`seal`). Before a
resume loads a state it checks it against whichever recorded it (`checked`): an edited or damaged
state stops the command with one line naming it, before any work. A run written before either was
recorded (no hash anywhere) is read as before.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import GRPOError
from pipeline.run.run import Run
from pipeline.store import MANIFEST, canonical_hash, code_version, hash_dir, now, stage_rel
from pipeline.update.trainer import STATE
from schemas.manifests import StateManifest, dump_manifest


def state_rel(k: int) -> str:
    return f"{stage_rel(k, 'update')}/{STATE}"


def seal(state_dir: Path, k: int) -> None:
    """State k's MANIFEST.json, naming its hash, written into `state_dir` (the scratch copy, which
    then moves into the run with it in one rename)."""
    m = StateManifest(stage="state", iteration=k, state_hash=canonical_hash(hash_dir(state_dir)), created=now(),
                      code_version=code_version())
    (state_dir / MANIFEST).write_bytes(dump_manifest(m))


def checked(run: Run, k: int) -> Path:
    """State k's (local) directory, once its files hash to what was recorded when it was written:
    update k's manifest, or the state's own MANIFEST.json; else one line naming it."""
    rel, store = state_rel(k), run.store
    where = store.local_dir(rel)
    update = run.manifest(k, "update")
    recorded, by = (update.outputs.state if update is not None else None), f"{stage_rel(k, 'update')}/{MANIFEST}"
    if recorded is None and store.exists(f"{rel}/{MANIFEST}"):
        own = store.manifest(rel)
        if not isinstance(own, StateManifest) or own.iteration != k:
            raise GRPOError(f"{store.display(f'{rel}/{MANIFEST}')}: not the record of iteration {k}'s trainer state")
        recorded, by = own.state_hash, f"{rel}/{MANIFEST}"
    if recorded is not None and (got := canonical_hash(hash_dir(where))) != recorded:
        raise GRPOError(f"{store.display(rel)}: the trainer state of iteration {k} hashes to {got[:16]} but {by} records "
                        f"{recorded[:16]} (it changed after it was written); remove it to resume from an earlier state "
                        f"(the updates after that are re-run, each checked against its recorded policy hash)")
    return where
