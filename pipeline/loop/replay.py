"""`grpo replay SRC --iter K --to NEW [--set key=value ...] [--until score|logprobs|update]`:
re-run the later stages of a past iteration on its stored completions, with new settings.

    SRC/policy/iter-K       --copy-->  NEW/policy/iter-0000
    SRC/iter-K/rollout      --copy-->  NEW/iter-0000/rollout   (same bytes, linked by hash)
                                       NEW/iter-0000/{score, logprobs, update}  (computed anew)

Re-score old completions with a fixed reward function (`--set 'rewards=[{fn: correct}]'
--until score`), or compare loss types on identical data (two replays differing only in
`--set loss.type=...`).

Iteration numbering: NEW counts from 0 and its iteration 0 *is* SRC's iteration K.
NEW/policy/iter-0000 is a copy of SRC/policy/iter-K (NEW's `model` names that directory, so
its policy hash is SRC's), and NEW/iter-0000/rollout holds SRC's parts byte for byte under a
manifest whose `replayed_from` records {run, iteration, manifest_sha256} of the source, plus
the stamp the copied parts carry. The reference model stays SRC's: when NEW needs one and
SRC's config set no `ref_model`, NEW's `ref_model` is SRC/policy/iter-0000. Where SRC sampled
iteration K from an older policy b(K) (train.max_staleness), the copied rollout is checked
against SRC's policy b(K) and keeps its `staleness`: its sampler_logprobs are b(K)'s, which is
what the update's rollout correction weighs against NEW's policy 0 (SRC's policy K).

Not carried over, by design: the optimizer state (NEW's update starts a fresh AdamW, as
iteration 0 of any run does; SRC keeps only its newest trainer state anyway) and iteration-
keyed seeds (NEW's update shuffles with (seed, 0, epoch), not (seed, K, epoch)). So a replay
without overrides is a fresh update from policy K on SRC's samples, not a bit-copy of SRC's
update K; two replays with the same settings are identical, which is what a comparison needs.
`grpo iterate NEW --more N` then continues with iteration 1's prompts, as any run does.

Settings the stored completions were made with (model, rollout.*, data.train, prompt_column,
system_prompt, chat_template) cannot be overridden: the copied rollout would not match them.

A LoRA run's policy K >= 1 is an adapter: NEW's model is then that adapter merged into SRC's
base (policy 0 of NEW records both hashes as `merged_from`, and the replayed rollout is checked
against the adapter's hash), and NEW trains a fresh adapter on it, as iteration 0 of any LoRA
run does. Its reference is, as in every LoRA run, its base with the adapter off: policy K, not
SRC's policy 0 (with `loss.kl_coef: 0`, the default, nothing depends on it).

A policy pruned by SRC's `train.keep_policies` has no weights left: replaying its iteration is
a one-line error, raised before NEW is created.
"""

from __future__ import annotations

import time
from pathlib import Path

from pipeline import config as config_mod
from pipeline.config import Config
from pipeline.config.errors import parse_overrides
from pipeline.errors import GRPOError
from pipeline.run.policy import policy_kind
from pipeline.run.parts import input_hash
from pipeline.run.retention import pruned_error
from pipeline.rewards.contract import load_reward, run_code
from pipeline.schedule import iteration_plan
from pipeline.run.run import Run, init_run
from pipeline.store import RunStore, policy_rel, sha256_bytes, stage_rel
from schemas.artifacts import ROLLOUT
from schemas.manifests import PartsManifest, ReplayLink

LOCKED = ("model", "rollout", "data.train", "data.prompt_column", "data.prompt_template", "data.system_prompt", "data.chat_template")
UNTIL = ("score", "logprobs", "update")


def replay_config(src: Run, k: int, sets: list[str] | None) -> Config:
    """SRC's config with `model` = SRC's policy K, the reference kept, and the overrides."""
    for key, _ in parse_overrides(sets):
        if any(key == p or key.startswith(p + ".") for p in LOCKED):
            raise GRPOError(f"--set {key}: replay reuses the completions {src.store.display()} sampled with this setting; it cannot change")
    tree = src.cfg.model_dump(mode="json")
    tree["model"] = str(replay_model(src, k))
    cfg = config_mod.resolve(tree, sets, source="replay --set")
    if iteration_plan(cfg, k).reference and cfg.ref_model is None and (ref := policy_kind(cfg).replay_reference(src)) is not None:
        tree["ref_model"] = str(ref)  # SRC's reference: its initial policy
        cfg = config_mod.resolve(tree, sets, source="replay --set")
    with run_code(src):  # a reward that cannot even load fails before NEW exists (SRC's copy of one it names)
        for j, spec in enumerate(cfg.rewards):
            load_reward(spec, index=j)
    return cfg


def is_adapter_policy(src: Run, k: int) -> bool:
    """Whether SRC's policy K is a LoRA adapter (K >= 1 of a LoRA run) rather than full weights."""
    return src.policy.stored_as_adapter(k)


def replay_model(src: Run, k: int) -> Path:
    """NEW's model: SRC's policy K; for an adapter, the adapter merged into SRC's base (built once
    per policy in the local cache), on which NEW trains a fresh adapter."""
    return src.policy.replay_model(src, k)


def merged_origin(src: Run, k: int) -> dict | None:
    """The `merged_from` record of NEW's policy 0 when it is SRC's adapter K merged, else None."""
    if not is_adapter_policy(src, k):
        return None
    return {"run": src.store.display(), "iteration": k, "adapter_policy_hash": src.policy_hash(k), "base_policy_hash": src.policy_hash(0)}


def link_rollout(src: Run, k: int, new: Run) -> PartsManifest:
    """NEW/iter-0000/rollout := SRC/iter-K/rollout: the parts' bytes, verified against SRC's
    manifest, under a manifest of NEW that records where they came from."""
    src_dir, new_dir = stage_rel(k, "rollout"), stage_rel(0, "rollout")
    src_m = src.manifest(k, "rollout")
    link = {"run": src.store.display(), "iteration": k, "manifest_sha256": src.store.manifest_hash(src_dir)}
    if (m := new.manifest(0, "rollout")) is not None:
        if m.replayed_from is None or m.replayed_from.manifest_sha256 != link["manifest_sha256"]:
            raise GRPOError(f"{new.store.display(new_dir)}: holds another rollout than {src.store.display(src_dir)}; choose a new run directory")
        return m
    if src_m.schema_version not in (ROLLOUT.version, *ROLLOUT.reads):
        raise GRPOError(f"{src.store.display(src_dir)}: rollout schema version {src_m.schema_version}, this grpo reads version {ROLLOUT.version}")
    policy_hash = new.policy_hash(0)
    merged = new.store.manifest(policy_rel(0)).merged_from  # SRC's adapter K merged: sampled from that adapter
    sampled_from = merged.adapter_policy_hash if merged is not None else policy_hash
    if (b := iteration_plan(src.cfg, k).behaviour) != k:  # SRC sampled iteration K from an older policy (train.max_staleness)
        sampled_from = src.policy_hash(b)
    if (src_m.inputs.get("policy") or {}).get("policy_hash") != sampled_from:
        raise GRPOError(f"{src.store.display(src_dir)}: was not sampled from {src.store.display(policy_rel(b))} (policy hash differs)")
    t0 = time.time()
    with new.store.lock(f"{new_dir}/.lock-manifest", "replay of the rollout", wait=60):
        if (m := new.manifest(0, "rollout")) is not None:
            return m
        for name, listed in sorted(src_m.outputs.items()):
            data = src.store.read_bytes(f"{src_dir}/{name}")
            if sha256_bytes(data) != listed.sha256:
                raise GRPOError(f"{src.store.display(f'{src_dir}/{name}')}: sha256 differs from its manifest; the source run is damaged (run `grpo audit {src.uri}`)")
            new.store.write_bytes(f"{new_dir}/{name}", data)
        inputs = {"policy": {"path": policy_rel(0), "policy_hash": policy_hash}, "data": new.cfg.data.train, "replayed_from": link}
        if "stop_token_ids" in src_m.inputs:  # what the copied completions stopped on (absent before issue 32)
            inputs["stop_token_ids"] = src_m.inputs["stop_token_ids"]
        body = PartsManifest(
            stage="rollout", iteration=0, schema_version=src_m.schema_version, config_hash=new.cfg_hash, seed=new.cfg.seed,
            input_hash=input_hash(new.cfg_hash, "rollout", 0, inputs), inputs=inputs, outputs=src_m.outputs,
            rows=src_m.rows, timings={"seconds": round(time.time() - t0, 3)}, policy_hash=policy_hash, engine=src_m.engine,
            replayed_from=ReplayLink(**link, input_hash=src_m.input_hash),  # the stamp the copied parts carry
            # the state the source iteration's reward functions saw, so a re-score is reproducible
            trainer_state=src_m.trainer_state, staleness=src_m.staleness,  # the source's: its sampler_logprobs are b(K)'s
        )
        return new.store.write_manifest(new_dir, body)


def replay(src_uri: str, k: int, new_uri: str, sets: list[str] | None = None, until: str = "update") -> Run:
    """Create (or resume) NEW as a replay of SRC's iteration K and run its stages up to `until`."""
    from pipeline.logprobs import run_logprobs
    from pipeline.score import run_score
    from pipeline.report.tracking import reporting
    from pipeline.update.publish import run_update

    if until not in UNTIL:
        raise GRPOError(f"--until {until!r}: expected one of {', '.join(UNTIL)}")
    src = Run(src_uri)
    if RunStore(new_uri).display() == src.store.display():
        raise GRPOError(f"--to {new_uri}: the replay needs a new run directory, not the source run")
    if src.manifest(k, "rollout") is None:
        raise GRPOError(f"{src.store.display(stage_rel(k, 'rollout'))}: no manifest; --iter {k} must be an iteration whose rollout is done")
    src.policy_hash(k)
    if src.policy_pruned(k):  # checked before NEW exists: nothing is written
        raise pruned_error(src, k, f"replay of iteration {k}")
    new = init_run(new_uri, replay_config(src, k, sets), merged_from=merged_origin(src, k), code_from=src)  # SRC's reward code
    link_rollout(src, k, new)
    with reporting(new, 0, "score"):
        run_score(new, 0)
    if until in ("logprobs", "update"):
        with reporting(new, 0, "logprobs"):
            run_logprobs(new, 0)
    if until == "update":
        with reporting(new, 0, "update"):
            _, trainer = run_update(new, 0)
        if trainer is not None:
            trainer.close()
    return new
