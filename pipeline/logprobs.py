"""Stage 3: teacher-forced per-token logprobs of every completion under the old policy and the
reference model, with logits divided by the sampling temperature (as TRL does).

    iter-k/rollout/part-p.parquet --policy/iter-k, ref--> iter-k/logprobs/part-p.parquet

`token_logprobs` is also what the update uses for the current policy, so the two can never
disagree on how a logprob is computed.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import torch

from pipeline.errors import GRPOError
from pipeline.models.tokens import Batch, budget_batches, resolve_precision, token_logprobs
from pipeline.models.lora import AdapterOff, lora_models
from pipeline.store.parts import Shard, read_part, run_parts, upstream
from pipeline.store.run import Run
from schemas.artifacts import LOGPROBS, ROLLOUT


def load_model(path):
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


@torch.no_grad()
def sequence_logprobs(model, prompt_ids, completion_ids, temperature: float, budget: int, pad_id: int = 0,
                      precision: str = "fp32") -> list[np.ndarray]:
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    out: list[np.ndarray | None] = [None] * len(lengths)
    for idx in budget_batches(lengths, budget):
        batch = Batch.build([prompt_ids[i] for i in idx], [completion_ids[i] for i in idx], pad_id).to(model.device)
        logp, _ = token_logprobs(model, batch, temperature, precision=precision)
        logp = logp.cpu()
        for j, i in enumerate(idx):
            out[i] = logp[j, : len(completion_ids[i])].numpy().astype(np.float32)
    return out


def logprobs_table(rollout: pa.Table, old_model, ref_model, temperature: float, budget: int, k: int,
                   precision: str = "fp32", ref_is_old: bool = False) -> pa.Table:
    """`ref_is_old`: the reference is the old policy itself (iteration 0 without a separate
    ref_model), so its logprobs are the old ones, computed once."""
    prompts = rollout.column("prompt_ids").to_pylist()
    comps = rollout.column("completion_ids").to_pylist()
    old = sequence_logprobs(old_model, prompts, comps, temperature, budget, precision=precision)
    if ref_model is None:
        ref = None
    elif ref_is_old:
        ref = old
    elif isinstance(ref_model, AdapterOff):  # LoRA: the same loaded base, adapter disabled
        with ref_model.active() as base:
            ref = sequence_logprobs(base, prompts, comps, temperature, budget, precision=precision)
    else:
        ref = sequence_logprobs(ref_model, prompts, comps, temperature, budget, precision=precision)
    sampler = rollout.column("sampler_logprobs").to_pylist()
    for name, values in (("old_logprobs", old), ("ref_logprobs", ref or [])):
        for i, v in enumerate(values):
            if not np.isfinite(v).all():
                raise GRPOError(f"logprobs iteration {k} row {i} (prompt_id {rollout.column('prompt_id')[i]}): {name} has NaN/inf")
    gaps = [np.abs(o - np.asarray(s, np.float32)) if len(o) else np.zeros(1, np.float32) for o, s in zip(old, sampler)]
    return pa.table(
        {
            "prompt_id": rollout.column("prompt_id"),
            "sample_idx": rollout.column("sample_idx"),
            "old_logprobs": pa.array([o.tolist() for o in old], pa.list_(pa.float32())),
            "ref_logprobs": pa.array([r.tolist() for r in ref] if ref is not None else [None] * len(old), pa.list_(pa.float32())),
            "sampler_gap_mean": pa.array([float(g.mean()) for g in gaps], pa.float32()),
            "sampler_gap_max": pa.array([float(g.max()) for g in gaps], pa.float32()),
        }
    )


def run_logprobs(run: Run, k: int, shard: Shard = Shard(), models: dict | None = None) -> dict | None:
    """`models` lets `iterate` pass warm {"old": model, "ref": model} instances."""
    if run.done(k, "logprobs"):
        return run.manifest(k, "logprobs")
    rollout_m = run.require(k, "logprobs", "rollout")
    cfg = run.cfg
    models = dict(models or {})
    stats = {"tokens": 0, "load_s": 0.0}
    precision = resolve_precision(cfg.train.precision)  # the update computes its logprobs the same way

    # at iteration 0 the old policy is the reference (same weights, same arithmetic): one pass
    ref_is_old = cfg.uses_ref and k == 0 and cfg.ref_model is None

    def make_part(p: int) -> pa.Table:
        if "old" not in models:
            t = time.time()
            if cfg.train.lora is not None:
                models.update(lora_models(run, k))
            else:
                models["old"] = load_model(run.policy_dir(k))
                models["ref"] = (models["old"] if ref_is_old else load_model(run.ref_dir())) if cfg.uses_ref else None
            stats["load_s"] += time.time() - t
        rollout = read_part(run, k, "rollout", ROLLOUT, p)
        stats["tokens"] += int(sum(rollout.column("completion_length").to_pylist()))
        return logprobs_table(rollout, models["old"], models.get("ref") if cfg.uses_ref else None, cfg.rollout.temperature,
                              cfg.train.token_budget, k, precision, ref_is_old)

    inputs = {
        "rollout": upstream(run, k, "rollout"),
        "policy_hash": run.policy_hash(k),
        "ref": ("policy/iter-0000 (adapter off)" if cfg.train.lora is not None else "policy/iter-0000") if cfg.ref_model is None else cfg.ref_model,
        "uses_ref": cfg.uses_ref,
        "precision": precision,
    }
    # which policy each column came from, and how many forward passes were made
    passes = {"old_logprobs": f"policy/iter-{k:04d}", "ref_logprobs": None, "forward_passes": 1}
    if cfg.uses_ref:
        passes["ref_logprobs"] = "= old_logprobs (policy/iter-0000 is the reference)" if ref_is_old else inputs["ref"]
        passes["forward_passes"] = 1 if ref_is_old else 2
    return run_parts(run, k, "logprobs", LOGPROBS, len(rollout_m.outputs), shard, inputs, make_part,
                     manifest_extra=lambda: {"stats": stats, "passes": passes})
