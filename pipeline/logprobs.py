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
from pipeline.models.tokens import Batch, resolve_precision, shared_budget_batches, token_logprobs
from pipeline.run.lora import AdapterOff
from pipeline.models.packing import resolve as resolve_packing
from pipeline.run.policy import LogprobModels
from pipeline.run.sampler_proof import check_sampler_gap
from pipeline.schedule import iteration_plan
from pipeline.store import stage_rel
from pipeline.run.parts import Shard, read_part, run_parts, upstream
from pipeline.run.run import Run
from schemas.artifacts import LOGPROBS, OLD_LOGPROBS, ROLLOUT


@torch.no_grad()
def sequence_logprobs(model, prompt_ids, completion_ids, temperature: float, budget: int, pad_id: int = 0,
                      precision: str = "fp32", packing: str = "off") -> list[np.ndarray]:
    """`packing`: train.packing (padding-free batches where the model allows)."""
    out: list[np.ndarray | None] = [None] * len(prompt_ids)
    packed = resolve_packing(packing, model)
    for idx in shared_budget_batches(prompt_ids, completion_ids, budget, packed=packed):  # a group's rows are adjacent in a rollout
        batch = Batch.build([prompt_ids[i] for i in idx], [completion_ids[i] for i in idx], pad_id, share_prompts=True,
                            packed=packed).to(model.device)
        logp, _ = token_logprobs(model, batch, temperature, precision=precision)
        logp = logp.cpu()
        for j, i in enumerate(idx):
            out[i] = logp[j, : len(completion_ids[i])].numpy().astype(np.float32)
    return out


def logprobs_table(rollout: pa.Table, old_model, ref_model, temperature: float, budget: int, k: int,
                   precision: str = "fp32", ref_is_old: bool = False, packing: str = "off") -> pa.Table:
    """`ref_is_old`: the reference is the old policy itself (iteration 0 without a separate
    ref_model), so its logprobs are the old ones, computed once. `old_model` None: the update
    takes the old logprobs from its own forward (`schedule.old_from_update`); the old and gap
    columns stay null here and the update stores what it used."""
    prompts = rollout.column("prompt_ids").to_pylist()
    comps = rollout.column("completion_ids").to_pylist()
    old = None if old_model is None else sequence_logprobs(old_model, prompts, comps, temperature, budget, precision=precision,
                                                           packing=packing)
    if ref_model is None:
        ref = None
    elif ref_is_old:
        ref = old
    elif isinstance(ref_model, AdapterOff):  # LoRA: the same loaded base, adapter disabled
        with ref_model.active() as base:
            ref = sequence_logprobs(base, prompts, comps, temperature, budget, precision=precision, packing=packing)
    else:
        ref = sequence_logprobs(ref_model, prompts, comps, temperature, budget, precision=precision, packing=packing)
    for name, values in (("old_logprobs", old or []), ("ref_logprobs", ref or [])):
        for i, v in enumerate(values):
            if not np.isfinite(v).all():
                raise GRPOError(f"logprobs iteration {k} row {i} (prompt_id {rollout.column('prompt_id')[i]}): {name} has NaN/inf")
    return old_logprobs_table(rollout.column("prompt_id"), rollout.column("sample_idx"), old,
                              rollout.column("sampler_logprobs").to_pylist(), ref, rollout.column("completion_mask").to_pylist())


def sampler_gaps(old: list[np.ndarray], sampler: list, masks: list | None = None) -> list[np.ndarray]:
    """|old - sampler| of each row over the tokens the model sampled (`masks`: the rollout's
    completion_mask, None for every token); a row without any: [0]."""
    gaps = []
    for i, (o, s) in enumerate(zip(old, sampler)):
        g = np.abs(o - np.asarray(s, np.float32))
        if masks is not None and masks[i] is not None:
            g = g[np.asarray(masks[i], bool)]  # a tool result's tokens were not sampled: their 0.0 is no logprob
        gaps.append(g if len(g) else np.zeros(1, np.float32))
    return gaps


def old_logprobs_table(prompt_id, sample_idx, old: list[np.ndarray] | None, sampler: list, ref: list | None = None,
                       masks: list | None = None) -> pa.Table:
    """A LOGPROBS table: the old logprobs and their gap to the sampler's over the model's tokens
    (null where `old` is None)."""
    n = len(sampler)
    nulls = pa.nulls(n, pa.list_(pa.float32()))
    if old is None:
        old_col, gap_mean, gap_max = nulls, pa.nulls(n, pa.float32()), pa.nulls(n, pa.float32())
    else:
        gaps = sampler_gaps(old, sampler, masks)
        old_col = pa.array([o.tolist() for o in old], pa.list_(pa.float32()))
        gap_mean = pa.array([float(g.mean()) for g in gaps], pa.float32())
        gap_max = pa.array([float(g.max()) for g in gaps], pa.float32())
    return pa.table(
        {
            "prompt_id": prompt_id,
            "sample_idx": sample_idx,
            "old_logprobs": old_col,
            "ref_logprobs": pa.array([r.tolist() for r in ref], pa.list_(pa.float32())) if ref is not None else nulls,
            "sampler_gap_mean": gap_mean,
            "sampler_gap_max": gap_max,
        }
    )


def run_logprobs(run: Run, k: int, shard: Shard = Shard(), models: LogprobModels | None = None) -> dict | None:
    """`models`: `iterate`'s warm `LogprobModels` (else this stage makes its own, loaded at the
    first part it computes)."""
    if run.done(k, "logprobs"):
        return run.manifest(k, "logprobs")
    rollout_m = run.require(k, "logprobs", "rollout")
    cfg = run.cfg
    models = models or LogprobModels(run)
    stats = {"tokens": 0, "load_s": 0.0}
    precision = resolve_precision(cfg.train.precision)  # the update computes its logprobs the same way
    plan = iteration_plan(cfg, k)
    ref_is_old = plan.ref_is_old

    def make_part(p: int) -> pa.Table:
        t = time.time()
        old_model, ref_model, _ = models.for_iteration(k)  # loaded once, or given policy k in place
        stats["load_s"] += time.time() - t
        rollout = read_part(run, k, "rollout", ROLLOUT, p)
        stats["tokens"] += int(sum(rollout.column("completion_length").to_pylist()))
        table = logprobs_table(rollout, old_model, ref_model, cfg.rollout.temperature, cfg.train.token_budget, k, precision,
                               ref_is_old, cfg.train.packing)
        if old_model is not None:  # on policy, a gap over what the dtypes explain is an engine that held another policy
            check_sampler_gap(cfg, k, table.column("sampler_gap_mean").to_pylist(), f"logprobs iteration {k} part {p}", run)
        return table

    inputs = {
        "rollout": upstream(run, k, "rollout"),
        "policy_hash": run.policy_hash(k),
        "ref": models.policy.ref_label if cfg.ref_model is None else cfg.ref_model,
        "uses_ref": plan.reference,
        "precision": precision,
    }
    # which policy each column came from, and how many forward passes were made
    passes = {"old_logprobs": f"policy/iter-{k:04d}", "ref_logprobs": None, "forward_passes": 1}
    if plan.old_from_update:
        passes["old_logprobs"] = (f"none here: the update's forward of policy/iter-{k:04d}, detached (one optimizer step, "
                                  f"ratio 1), stored in {stage_rel(k, 'update')}/{OLD_LOGPROBS}")
        passes["forward_passes"] = 0
    if plan.reference:
        passes["ref_logprobs"] = "= old_logprobs (policy/iter-0000 is the reference)" if ref_is_old else inputs["ref"]
        passes["forward_passes"] += 0 if ref_is_old else 1
    return run_parts(run, k, "logprobs", LOGPROBS, len(rollout_m.outputs), shard, inputs, make_part,
                     manifest_extra=lambda: {"stats": stats, "passes": passes})
