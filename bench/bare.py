"""The bare engines doing the same work as one iteration's stages: the floor each stage is held to.

    rollout   vllm.LLM.generate on the same prompt ids with the same SamplingParams (same seeds,
              so the same tokens: checked)
    logprobs  one plain HF forward per batch (the same budget batches), log-softmax of the
              logits / temperature gathered at the completion tokens (checked against ours)
    precision both under the run's resolved `train.precision` (bf16 autocast where `auto` picks
              it), so that each stage is held to a floor of the same arithmetic
    update    a plain DeepSpeed loop: the same config (optimizer, clipping, ZeRO stage), the same
              mini-batches in the same shuffled order, forward -> clipped surrogate -> backward
              -> step; no metrics, no state saving

Each runs in the `iterate` process between iterations, on the engines `iterate` keeps warm (the
vLLM engine and the logprob model hold policy k then), so both sides see the same machine load.
The bare DeepSpeed engine is a second engine on its own copy of the policy, so it never touches
the run's trainer.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import torch

from pipeline.schedule import old_from_update


def iteration_data(run, k: int) -> dict:
    """Iteration k's prompts, completions, old logprobs and advantages, read from the run."""
    from pipeline.run.parts import read_parts
    from schemas.artifacts import LOGPROBS, ROLLOUT, SCORE

    roll = pa.concat_tables(read_parts(run, k, "rollout", ROLLOUT))
    score = pa.concat_tables(read_parts(run, k, "score", SCORE))
    lp = pa.concat_tables(read_parts(run, k, "logprobs", LOGPROBS))
    key = lambda t: list(zip(t.column("prompt_id").to_pylist(), t.column("sample_idx").to_pylist()))  # noqa: E731
    assert key(roll) == key(score) == key(lp), "parts are written in the same row order"
    return {
        "prompt_ids": roll.column("prompt_ids").to_pylist(),
        "completion_ids": roll.column("completion_ids").to_pylist(),
        "group_prompt_ids": [ids for ids, j in zip(roll.column("prompt_ids").to_pylist(), roll.column("sample_idx").to_pylist()) if j == 0],
        "group_prompt_rows": [p for p, j in zip(roll.column("prompt_id").to_pylist(), roll.column("sample_idx").to_pylist()) if j == 0],
        "old_logprobs": _old_logprobs(run, k, lp, key(roll)),
        "old_from_update": old_from_update(run.cfg),
        "advantages": score.column("advantage").to_numpy(zero_copy_only=False).astype(np.float32),
        "tokens": int(sum(roll.column("completion_length").to_pylist())),
    }


def _old_logprobs(run, k: int, lp: pa.Table, keys: list) -> list:
    """The old logprobs the run's update used: the logprobs parts', or when the update took them
    from its own forward (`train.old_logprobs`), what it stored beside its metrics."""
    from pipeline.store import stage_rel
    from schemas.artifacts import LOGPROBS, OLD_LOGPROBS

    old = lp.column("old_logprobs").to_pylist()
    if all(o is not None for o in old) or not run.done(k, "update"):
        return old
    t = run.store.read_table(f"{stage_rel(k, 'update')}/{OLD_LOGPROBS}", LOGPROBS)
    got = dict(zip(zip(t.column("prompt_id").to_pylist(), t.column("sample_idx").to_pylist()), t.column("old_logprobs").to_pylist()))
    return [got.get(key) for key in keys]


# ------------------------------------------------------------------------------------ rollout
def vllm_generate(llm, cfg, k: int, data: dict) -> dict:
    """vLLM's `generate` alone: the rollout stage's prompts, seeds and sampling settings."""
    from vllm import SamplingParams

    from pipeline.data.prompts import derive_seed

    r = cfg.rollout
    params = [
        SamplingParams(
            n=r.num_generations, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
            max_tokens=r.max_new_tokens, stop=r.stop or None, seed=derive_seed(cfg.seed, k, pid), logprobs=0,
        )
        for pid in data["group_prompt_rows"]
    ]
    prompts = [{"prompt_token_ids": ids} for ids in data["group_prompt_ids"]]
    t, c = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu = time.perf_counter() - t, time.process_time() - c
    ids = [list(o.token_ids) for out in outs for o in sorted(out.outputs, key=lambda o: o.index)]
    return {"seconds": seconds, "cpu_s": cpu, "tokens": sum(len(x) for x in ids), "same_tokens": ids == data["completion_ids"]}


# ----------------------------------------------------------------------------------- logprobs
def _padded(prompt_ids, completion_ids, pad: int = 0):
    """Right-padded prompt+completion ids [B, L], attention mask, and each completion's start."""
    seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)  # [B, L]
    mask = torch.zeros((len(seqs), L), dtype=torch.long)  # [B, L]
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask, [len(p) for p in prompt_ids]


def _completion_logprobs(logits, ids, starts, lengths, temperature):
    """log p(token) of each completion token from full logits [B, L, V]: a list of [T_i]."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, L-1, V]
    tok = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, L-1]; row t predicts ids[t+1]
    return [tok[i, s - 1 : s - 1 + n] for i, (s, n) in enumerate(zip(starts, lengths))]


def _precision(cfg) -> str:
    """The run's forward arithmetic: its `train.precision` as resolved on this machine."""
    from pipeline.models.tokens import resolve_precision

    return resolve_precision(cfg.train.precision)


def _budget_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive index groups whose padded size (count x longest) fits the token budget: a plain
    forward's batches, every row with its own prompt (the stage's rule before it shared prompts)."""
    out, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


@torch.no_grad()
def hf_forward(model, cfg, data: dict) -> dict:
    """A plain HF forward per token-budget batch (every row with its own prompt) and the logprobs."""
    from pipeline.models.tokens import autocast

    P, C = data["prompt_ids"], data["completion_ids"]
    batches = _budget_batches([len(p) + len(c) for p, c in zip(P, C)], cfg.train.token_budget)
    inputs = [(_padded([P[i] for i in b], [C[i] for i in b]), [len(C[i]) for i in b]) for b in batches]
    precision = _precision(cfg)
    t, c = time.perf_counter(), time.process_time()
    out = []
    for (ids, mask, starts), lengths in inputs:
        with autocast(precision):
            logits = model(input_ids=ids, attention_mask=mask).logits  # [B, L, V]
        out += _completion_logprobs(logits, ids, starts, lengths, cfg.rollout.temperature)
    seconds, cpu = time.perf_counter() - t, time.process_time() - c
    gap = max((float((o - torch.tensor(ref)).abs().max()) for o, ref in zip(out, data["old_logprobs"]) if ref), default=0.0)
    return {"seconds": seconds, "cpu_s": cpu, "tokens": data["tokens"], "max_abs_diff_vs_ours": gap}


# ------------------------------------------------------------------------------------- update
class BareDeepSpeed:
    """deepspeed.initialize over a copy of the policy with the run's DeepSpeed config; with
    `train.lora`, PEFT's adapter on it and only the adapter trained. `micro_batch`: sequences per
    forward/backward (gradient accumulation over the mini-batch), as TRL runs it; default the
    run's grad_accum split."""

    def __init__(self, cfg, policy_dir, micro_batch: int | None = None):
        import deepspeed
        from transformers import AutoModelForCausalLM

        from pipeline.update.distributed import ds_config, init_distributed, local_rank_env

        self.cfg = cfg
        self.micro_batch = micro_batch or cfg.train.mini_batch_size // cfg.train.grad_accum
        init_distributed()  # the run's trainer already joined the one-process group
        model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
        model.config.use_cache = False
        if cfg.train.lora is not None:
            from peft import get_peft_model

            from pipeline.run.lora import peft_config

            model = get_peft_model(model, peft_config(cfg.train.lora))
        params = [p for p in model.parameters() if p.requires_grad]
        with local_rank_env():  # DeepSpeed reads it as it starts
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config(cfg, 1))

    def step_loop(self, k: int, data: dict) -> dict:
        from pipeline.models.tokens import autocast

        cfg, t = self.cfg, self.cfg.train
        n = len(data["completion_ids"])
        micro = self.micro_batch
        # the same mini-batches in the same order as the run's update, tensors built up front
        plan = []
        for epoch in range(t.epochs):
            order = np.random.default_rng([cfg.seed, k, epoch]).permutation(n)
            for start in range(0, n, t.mini_batch_size):
                mb = order[start : start + t.mini_batch_size]
                tokens = int(sum(len(data["completion_ids"][i]) for i in mb))
                micros = []
                for j in range(0, len(mb), micro):
                    idx = mb[j : j + micro]
                    ids, mask, starts = _padded([data["prompt_ids"][i] for i in idx], [data["completion_ids"][i] for i in idx])
                    comp = torch.zeros((len(idx), ids.shape[1] - 1))  # [B, L-1] 1 where a completion token is predicted
                    old = torch.zeros((len(idx), ids.shape[1] - 1))  # [B, L-1]
                    for r, (i, s) in enumerate(zip(idx, starts)):
                        m = len(data["completion_ids"][i])
                        comp[r, s - 1 : s - 1 + m] = 1.0
                        if not data["old_from_update"]:
                            old[r, s - 1 : s - 1 + m] = torch.tensor(data["old_logprobs"][i])
                    adv = torch.from_numpy(data["advantages"][idx]).unsqueeze(1)  # [B, 1]
                    micros.append((ids, mask, comp, old, adv))
                plan.append((micros, tokens))
        lo, hi = 1 - cfg.loss.clip_eps_low, 1 + cfg.loss.clip_eps_high
        precision = _precision(cfg)
        self.engine.train()
        steps = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for micros, tokens in plan:
            for j, (ids, mask, comp, old, adv) in enumerate(micros):
                self.engine.set_gradient_accumulation_boundary(j == len(micros) - 1)
                with autocast(precision):
                    logits = self.engine(input_ids=ids, attention_mask=mask).logits  # [B, L, V]
                logp = torch.log_softmax(logits[:, :-1].float() / cfg.rollout.temperature, dim=-1)  # [B, L-1, V]
                logp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, L-1]
                # one optimizer step per epoch: the run's first-epoch forward, detached, is the old policy (the
                # same arithmetic whichever epoch; later epochs reuse it, which changes no timing)
                ratio = torch.exp(logp - (logp.detach() if data["old_from_update"] else old))  # [B, L-1]
                # clipped surrogate summed over the mini-batch's completion tokens / their count (DAPO)
                surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)  # [B, L-1]
                loss = -(surrogate * comp).sum() / max(tokens, 1)
                self.engine.backward(loss, scale_wrt_gas=False)
            self.engine.step()
            steps += 1
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {"seconds": seconds, "cpu_s": cpu, "tokens": t.epochs * data["tokens"], "optimizer_steps": steps}
