"""The protocol every part-writing stage (rollout, score, logprobs) follows.

Parts are fixed chunks of groups (`rollout.groups_per_part` prompts each), numbered the same
however many workers run: `--shard i/N` makes worker i write the parts p with p % N == i, so
N workers write byte-identical parts to one worker. Each part is stamped with the hash of
everything it was computed from (`input_hash`); after its own parts, a worker checks whether
all parts carry the current input hash and, if so, writes the manifest (under a lock, once).
Parts from an attempt that died before its manifest are rewritten, never counted as they are.

A stage names an upstream stage it reads with `upstream()`: the sha256 of its MANIFEST.json
(the lineage link `grpo audit` follows) and the hash of its outputs (what the data is). The
input hash leaves the manifest sha256 out: a manifest also holds timestamps and timings, and
two runs of the same config must stamp, and so write, byte-identical parts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa

from pipeline.errors import GRPOError
from pipeline.progress import progress
from pipeline.store.faults import fault_point
from pipeline.run.run import Run
from pipeline.store import TMP_MARK, canonical_hash, part_name, sha256_bytes, stage_rel
from schemas.artifacts import ArtifactSchema
from schemas.manifests import FileEntry, PartsManifest


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str | None) -> "Shard":
        if not text:
            return cls()
        try:
            i, n = (int(x) for x in text.split("/"))
        except ValueError:
            raise GRPOError(f"--shard {text!r}: expected i/N, e.g. 0/2") from None
        if n < 1 or not 0 <= i < n:
            raise GRPOError(f"--shard {text!r}: need 0 <= i < N")
        return cls(i, n)

    def owns(self, part: int) -> bool:
        return part % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def upstream(run: Run, k: int, stage: str) -> dict:
    """How a stage's inputs name an upstream stage of iteration k (which must be done)."""
    m = run.manifest(k, stage)
    return {"manifest_sha256": run.store.manifest_hash(stage_rel(k, stage)), "outputs_sha256": outputs_hash(m)}


def outputs_hash(m: PartsManifest) -> str:
    """The hash of a stage's output list, as a downstream stage records it."""
    return canonical_hash({name: o.model_dump(exclude_none=True) for name, o in m.outputs.items()})


def input_hash(cfg_hash: str, stage: str, k: int, inputs: dict) -> str:
    """The stamp of a stage's parts: config, stage, iteration and inputs, minus manifest sha256s."""

    def content(x):
        if isinstance(x, dict):
            return {key: content(v) for key, v in x.items() if key != "manifest_sha256"}
        return [content(v) for v in x] if isinstance(x, list) else x

    return canonical_hash({"config": cfg_hash, "stage": stage, "iteration": k, "inputs": content(inputs)})


def n_parts(num_groups: int, groups_per_part: int) -> int:
    return max(1, -(-num_groups // groups_per_part))


def part_groups(part: int, num_groups: int, groups_per_part: int) -> range:
    start = part * groups_per_part
    return range(start, min(num_groups, start + groups_per_part))


def run_parts(
    run: Run,
    k: int,
    stage: str,
    schema: ArtifactSchema,
    num_parts: int,
    shard: Shard,
    inputs: dict | Callable[[], dict],
    make_part: Callable[[int], pa.Table],
    manifest_extra: Callable[[], dict] | None = None,
    started: float | None = None,
) -> PartsManifest | None:
    """Write this shard's parts of `stage` for iteration k, then the manifest if all are in.
    `inputs`: what the parts are made from, stamped into each (a function giving them: asked only
    once a part exists to compare, or one is made: a rollout's policy hash may still be being
    recorded while its first part is sampled). `started`: when the stage began, where its parts
    were written elsewhere first (the Ray executor's score tasks), so the manifest's seconds count them.

    Returns the manifest, or None when other shards' parts are still missing.
    """
    sd = stage_rel(k, stage)
    store = run.store
    if (m := store.manifest(sd)) is not None:
        return m
    given: dict = {}

    def stamp() -> str:
        if not given:
            given["inputs"] = inputs() if callable(inputs) else inputs
            given["stamp"] = input_hash(run.cfg_hash, stage, k, given["inputs"])
        return given["stamp"]

    t0 = started or time.time()
    with store.lock(f"{sd}/.lock-shard-{shard.index}-of-{shard.count}", f"{stage} iteration {k} shard {shard}"):
        if (m := store.manifest(sd)) is not None:
            return m
        mine = [p for p in range(num_parts) if shard.owns(p)]
        with progress(f"{stage} iteration {k} parts", len(mine)) as bar:
            for p in mine:
                rel = f"{sd}/{part_name(p)}"
                meta = store.table_meta(rel)
                if not meta or meta.get("input_hash") != stamp():  # else: an earlier attempt wrote it from these inputs
                    table = make_part(p)
                    write_part(store, rel, table, schema, stamp(), p)
                    fault_point(f"{stage}:part", k)
                bar.advance()
    seconds = time.time() - t0
    return finalize(run, k, stage, num_parts, stamp(), given["inputs"], seconds, manifest_extra)


def write_part(store, rel: str, table: pa.Table, schema: ArtifactSchema, stamp: str, part: int):
    """Write one part atomically, stamped with its input hash and number (and the `grpo.*`
    metadata the stage put on the table); the same bytes whichever process writes it."""
    own = {key.decode()[5:]: v.decode() for key, v in (table.schema.metadata or {}).items() if key.startswith(b"grpo.")}
    return store.write_table(rel, table, schema, meta={**own, "input_hash": stamp, "part": part})


def finalize(run, k, stage, num_parts, input_hash, inputs, seconds, manifest_extra=None) -> PartsManifest | None:
    sd = stage_rel(k, stage)
    store = run.store
    with store.lock(f"{sd}/.lock-manifest", f"{stage} iteration {k} manifest", wait=60):
        if (m := store.manifest(sd)) is not None:
            return m
        outputs = {}
        for p in range(num_parts):
            rel = f"{sd}/{part_name(p)}"
            if store.table_meta(rel).get("input_hash") != input_hash:
                return None  # another shard has not written this part yet
            data = store.read_bytes(rel)
            outputs[part_name(p)] = FileEntry(sha256=sha256_bytes(data), bytes=len(data), rows=_rows(store, rel))
        _clean_leftovers(store, sd, set(outputs))
        body = PartsManifest(
            stage=stage, iteration=k, schema_version=_version(stage), config_hash=run.cfg_hash, seed=run.cfg.seed,
            input_hash=input_hash, inputs=inputs, outputs=outputs, rows=sum(o.rows for o in outputs.values()),
            timings={"seconds": round(seconds, 3)}, **(manifest_extra() if manifest_extra else {}),
        )
        fault_point(f"{stage}:manifest", k)
        return store.write_manifest(sd, body)


def _rows(store, rel) -> int:
    import pyarrow.parquet as pq

    with store.fs.open(store.path(rel), "rb") as f:
        return pq.ParquetFile(f).metadata.num_rows


def _version(stage: str) -> int:
    from schemas.artifacts import BY_KIND

    return BY_KIND[stage].version


def _clean_leftovers(store, sd: str, keep: set[str]) -> None:
    """Remove temporary files and parts beyond the expected ones (from a different config)."""
    for name in store.listdir(sd):
        if name.startswith(TMP_MARK) or (name.startswith("part-") and name not in keep):
            store.remove(f"{sd}/{name}")


def read_parts(run: Run, k: int, stage: str, schema: ArtifactSchema, shard: Shard | None = None) -> list[pa.Table]:
    """The parts listed in a stage's manifest (or only this shard's), schema- and sha256-checked."""
    m = run.manifest(k, stage)
    if m is None:
        raise GRPOError(f"iteration {k}: {stage} is not done")
    tables = []
    for i, name in enumerate(sorted(m.outputs)):
        if shard is None or shard.owns(i):
            tables.append(run.store.read_table(f"{stage_rel(k, stage)}/{name}", schema, sha256=m.outputs[name].sha256))
    return tables


def read_part(run: Run, k: int, stage: str, schema: ArtifactSchema, part: int) -> pa.Table:
    """One part of a done stage, checked against the sha256 its manifest lists."""
    m = run.manifest(k, stage)
    listed = m.outputs.get(part_name(part)) if m is not None else None
    return run.store.read_table(f"{stage_rel(k, stage)}/{part_name(part)}", schema, sha256=listed.sha256 if listed else None)
