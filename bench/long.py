"""`make bench-long`: the logprobs pass and one update step as completions grow, ours (packed
and right-padded) beside TRL 1.16's GRPOTrainer (its fused LM head on) on identical work.

    python -m bench.long [--lengths 256,1024,2048,4096,mix] [--impls packed,padded,trl,trl-1,vllm,hf-generate] [--report]

The work: SmolLM2-135M-Instruct (fp32), 2 chat-rendered word problems x G=4 = 8 rows, each with a
made-up completion (seeded random tokens, a replayed rollout: the trainer cells time no generation; the vllm and hf-generate cells time the rollout apart) of the
forced length, or the uneven `mix` (most short, one long: an agent episode's tail, shuffled so
the long row does not sit with its like). Per length and implementation, in a fresh process:
seconds and peak RSS above the loaded model of (a) the logprobs pass (no grad, over the batch)
and (b) one optimizer step over the 8 rows (forward, backward, AdamW). Ours runs
`token_logprobs` in `train.update_token_budget` pieces (default 1024 tokens), as the trainer does,
with its loss; TRL runs `_get_per_token_logps_and_entropies` and `compute_loss` (loss_type grpo,
beta 0) in micro-batches of 2 rows, the way its trainer does. The padded-token share is the
share of the tokens a forward runs that are padding. Results: bench/long.json, the plot
bench/long.png and the "Long completions" section of bench/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from bench.probes import current_rss_mb, loadavg, machine_info

ROOT = Path(__file__).resolve().parent
OUT, PLOT = ROOT / "long.json", ROOT / "long.png"
ROWS, G, SEED = 8, 4, 0
MIX = [48, 64, 80, 96, 128, 160, 512, 2048]
"""The uneven mix's completion lengths (shuffled): mean 392, longest 2048."""
ROLLOUTS = ("vllm", "hf-generate")
"""The rollout's implementations: ours (vLLM) and TRL's path without vLLM (transformers generate)."""
TRL_MICRO = 2
"""TRL's rows per forward/backward (per_device_train_batch_size, gradient accumulation 4)."""


def lengths_of(spec: str) -> list[int]:
    lengths = MIX[:] if spec == "mix" else [int(spec)] * ROWS
    random.Random(SEED).shuffle(lengths)
    return lengths


def workload(tok, spec: str) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, completion ids) of the 8 rows: G rows per prompt, adjacent."""
    from bench.real import problem

    rng = random.Random(SEED)
    prompts = [tok.apply_chat_template([{"role": "user", "content": problem(rng)["prompt"]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for _ in range(ROWS // G)]
    g = random.Random(SEED + 1)
    comps = [[g.randrange(100, tok.vocab_size) for _ in range(n)] for n in lengths_of(spec)]
    return [list(prompts[i // G]) for i in range(ROWS)], comps


class Peak:
    """Wall and CPU seconds (all threads: the honest figure on a shared machine) and peak RSS (MB)
    of this process over a phase, sampled every 10 ms on a thread."""

    def __enter__(self):
        import threading

        self.base, self.peak, self._stop = current_rss_mb(), current_rss_mb(), threading.Event()
        self.t0, self.c0 = time.perf_counter(), time.process_time()

        def loop():
            while not self._stop.wait(0.01):
                self.peak = max(self.peak, current_rss_mb())

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.seconds, self.cpu = time.perf_counter() - self.t0, time.process_time() - self.c0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_mb())

    def row(self) -> dict:
        return {"s": round(self.seconds, 3), "cpu_s": round(self.cpu, 3), "peak_mb": round(self.peak),
                "above_mb": round(self.peak - self.base)}


def padded_share(prompts, comps, pieces, packed: bool, shared: bool = True) -> float:
    """Padding over the tokens the forwards run: a padded piece runs distinct prompts x longest
    prompt + rows x longest completion (rows x longest prompt + completion where no prompt
    repeats), a packed one its real tokens."""
    if packed:
        return 0.0
    run = real = 0
    for idx in pieces:
        ps, cs = [prompts[i] for i in idx], [comps[i] for i in idx]
        distinct = {tuple(p) for p in ps}
        lp, lc = max(map(len, ps)), max(map(len, cs))
        if shared and len(distinct) < len(idx):
            run += len(distinct) * lp + len(idx) * lc
            real += sum(len(p) for p in distinct) + sum(map(len, cs))
        else:
            run += len(idx) * max(len(p) + len(c) for p, c in zip(ps, cs))
            real += sum(len(p) + len(c) for p, c in zip(ps, cs))
    return 1 - real / run


def ours(model_dir: str, spec: str, packed: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config.loss import LossConfig
    from pipeline.config.train import TrainConfig
    from pipeline.models import fused
    from pipeline.models.tokens import Batch, shared_budget_batches, token_logprobs
    from pipeline.objective import loss as grpo

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    fused.lean_activations(model)
    prompts, comps = workload(tok, spec)
    train = TrainConfig()
    out = {}
    with torch.no_grad(), Peak() as lp:
        for idx in shared_budget_batches(prompts, comps, train.token_budget, packed=packed):
            token_logprobs(model, Batch.build([prompts[i] for i in idx], [comps[i] for i in idx], share_prompts=True, packed=packed), 1.0)
    out["logprobs"] = lp.row()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    adv = torch.randn(ROWS, generator=torch.Generator().manual_seed(SEED))
    tokens = sum(map(len, comps))
    pieces = shared_budget_batches(prompts, comps, train.update_token_budget, packed=packed)
    with Peak() as up:
        for idx in pieces:
            b = Batch.build([prompts[i] for i in idx], [comps[i] for i in idx], share_prompts=True, packed=packed)
            logp, ent = token_logprobs(model, b, 1.0, with_entropy=True)
            loss, _ = grpo.policy_loss(logp, logp.detach(), adv[idx], b.loss_mask, LossConfig(), num_items=tokens,
                                       entropy=ent.detach(), max_completion_length=max(map(len, comps)))
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["update"] = up.row()
    out["padded_share"] = round(padded_share(prompts, comps, pieces, packed), 4)
    out["pieces"] = len(pieces)
    return out


def trl(model_dir: str, spec: str, micro_batches: int = ROWS // TRL_MICRO) -> dict:
    """`micro_batches` < 4 (`trl-1`: the first only, rows 0-1): the logprobs pass and the update over those
    micro-batches and one optimizer step; the update's peak is a micro-batch's and the step's, so it
    is the full update's peak, and its seconds are that share of the full update's (a machine too
    loaded to run all four)."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts, comps = workload(tok, spec)
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=TRL_MICRO, gradient_accumulation_steps=ROWS // TRL_MICRO,
                      num_generations=G, max_completion_length=max(map(len, comps)), beta=0.0, loss_type="grpo", use_cpu=True,
                      bf16=False, gradient_checkpointing=False, report_to=[], learning_rate=1e-6, logging_steps=1)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * ROWS}), processing_class=tok)
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = ROWS // TRL_MICRO  # what its train() loop sets: its loss divides by it
    Lp, T = max(map(len, prompts)), max(map(len, comps))
    pid = torch.full((ROWS, Lp), tok.pad_token_id or 0)
    pmask = torch.zeros((ROWS, Lp), dtype=torch.long)
    cid = torch.full((ROWS, T), tok.pad_token_id or 0)
    cmask = torch.zeros((ROWS, T), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        pid[i, Lp - len(p):], pmask[i, Lp - len(p):] = torch.tensor(p), 1  # TRL left-pads prompts
        cid[i, : len(c)], cmask[i, : len(c)] = torch.tensor(c), 1
    adv = torch.randn(ROWS, generator=torch.Generator().manual_seed(SEED))
    out, run = {}, 0
    with torch.no_grad(), Peak() as lp:
        for s in range(0, micro_batches * TRL_MICRO, TRL_MICRO):  # TRL's old-logprob pass, per micro-batch as it slices the generation batch
            sl = slice(s, s + TRL_MICRO)
            t = int(cmask[sl].sum(1).max())  # TRL trims each micro-batch's padding to its longest completion
            trainer._get_per_token_logps_and_entropies(model, torch.cat([pid[sl], cid[sl, :t]], 1), torch.cat([pmask[sl], cmask[sl, :t]], 1),
                                                       t, batch_size=TRL_MICRO)
    out["logprobs"] = lp.row()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    real = sum(len(p) + len(c) for p, c in zip(prompts, comps))
    with Peak() as up:
        for s in range(0, micro_batches * TRL_MICRO, TRL_MICRO):
            sl = slice(s, s + TRL_MICRO)
            t = int(cmask[sl].sum(1).max())
            run += TRL_MICRO * (Lp + t)
            loss = trainer.compute_loss(model, {"prompt_ids": pid[sl], "prompt_mask": pmask[sl], "completion_ids": cid[sl, :t],
                                                "completion_mask": cmask[sl, :t], "advantages": adv[sl],
                                                "num_items_in_batch": cmask.sum()})
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["update"] = up.row()
    out["padded_share"] = round(1 - real / run, 4) if micro_batches == ROWS // TRL_MICRO else None
    out["micro_batches"] = micro_batches
    return out


def rollout(model_dir: str, spec: str, impl: str) -> dict:
    """The rollout's seconds and peak RSS (MB, this process: vLLM's CPU engine runs in it) for the
    8 rows at their forced lengths (min_tokens = max_tokens), sampled at temperature 1.
    `vllm`: ours, the product's engine (make_engine: its KV-cache sizing, eager, no prefix cache);
    `hf-generate`: TRL's generation path without vLLM, transformers' `generate` on the 8 left-padded
    rows at once (min_new_tokens = max_new_tokens = the longest: a batch runs until its last row
    ends, so on the mix every row costs the longest row's steps, as it does in TRL)."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts, comps = workload(tok, spec)
    lengths = list(map(len, comps))
    if impl == "vllm":
        from vllm import SamplingParams

        from pipeline.config.rollout import RolloutConfig
        from pipeline.models.engines import make_engine

        with Peak() as start:
            work = RolloutConfig(max_new_tokens=max(lengths), num_generations=G, prompts_per_iter=ROWS // G, groups_per_part=ROWS // G)
            eng = make_engine(Path(model_dir), work, max(map(len, prompts)) + max(lengths), SEED)  # its KV cache planned for these rows
        params = [SamplingParams(n=1, temperature=1.0, min_tokens=n, max_tokens=n, seed=SEED + i, logprobs=0, detokenize=False)
                  for i, n in enumerate(lengths)]
        with Peak() as gen:
            outs = eng.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        made = [len(o.outputs[0].token_ids) for o in outs]
        kv = eng.settings.kv_cache_bytes
        eng.close()
    else:
        from transformers import AutoModelForCausalLM

        with Peak() as start:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        Lp, T = max(map(len, prompts)), max(lengths)
        ids = torch.tensor([[tok.pad_token_id or 0] * (Lp - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (Lp - len(p)) + [1] * len(p) for p in prompts])
        torch.manual_seed(SEED)
        with torch.no_grad(), Peak() as gen:
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 min_new_tokens=T, max_new_tokens=T, pad_token_id=tok.pad_token_id or 0)
        made, kv = [out.shape[1] - Lp] * ROWS, None
    return {"start": start.row(), "rollout": gen.row(), "tokens": made, "real_tokens": sum(lengths),
            "kv_cache_bytes": kv}


def fit(model_dir: str, tokens: int) -> dict:
    """device_budget's activation fit: peak RSS above the loaded model while one packed row of `tokens`
    real tokens (a chat prompt + made-up completion) runs forward and backward (lean forwards, the
    product's chunked head with its entropy, the GRPO loss), no optimizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config.loss import LossConfig
    from pipeline.models import fused
    from pipeline.models.tokens import Batch, token_logprobs
    from pipeline.objective import loss as grpo

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    fused.lean_activations(model)
    prompts, _ = workload(tok, "1")
    comp = [random.Random(SEED).randrange(100, tok.vocab_size) for _ in range(tokens - len(prompts[0]) + 1)]
    with Peak() as bw:
        b = Batch.build(prompts[:1], [comp], share_prompts=True, packed=True)
        logp, ent = token_logprobs(model, b, 1.0, with_entropy=True)
        loss, _ = grpo.policy_loss(logp, logp.detach(), torch.ones(1), b.loss_mask, LossConfig(), num_items=len(comp),
                                   entropy=ent.detach(), max_completion_length=len(comp))
        loss.backward()
    params = sum(p.numel() for p in model.parameters())
    return {"backward": bw.row(), "tokens": b.packed.tokens, "grad_mb": round(4 * params / 2**20)}


def one(impl: str, spec: str, out: str | None = None) -> None:
    """One cell in this process: its JSON to `out`, or printed when there is none (`--one fit 512`)."""
    from pipeline.models.engines import cpu_env

    cpu_env()
    from bench.real import model_dir

    d = str(model_dir())
    if impl == "fit":
        r = fit(d, int(spec))
    elif impl in ROLLOUTS:
        r = rollout(d, spec, impl)
    else:
        r = trl(d, spec, 1 if impl == "trl-1" else ROWS // TRL_MICRO) if impl.startswith("trl") else ours(d, spec, impl == "packed")
    if out is None:
        print(json.dumps(r))
    else:
        Path(out).write_text(json.dumps(r))


def trl_row(rows: dict) -> dict:
    """TRL's cell at a length, its seconds scaled to the full 4 micro-batches where only `trl-1` ran."""
    r = rows.get("trl") or rows.get("trl-1") or {}
    if "update" not in r:
        return {}
    k = (ROWS // TRL_MICRO) / r.get("micro_batches", ROWS // TRL_MICRO)
    return r | {ph: r[ph] | {"cpu_s": r[ph]["cpu_s"] * k, "s": r[ph]["s"] * k} for ph in ("logprobs", "update")}


def iteration_s(rows: dict, impls: tuple[str, str]) -> float | None:
    """CPU seconds of one iteration's rollout + logprobs + update (`impls`: trainer side, rollout side)."""
    train, roll = trl_row(rows) if impls[0] == "trl" else rows.get(impls[0], {}), rows.get(impls[1], {})
    if "update" not in train or "rollout" not in roll:
        return None
    return train["logprobs"]["cpu_s"] + train["update"]["cpu_s"] + roll["rollout"]["cpu_s"]


def goals(result: dict) -> list[str]:
    """The issue's goals at 2k tokens and on the mix, each with its measured figure."""
    out, at = [], result["runs"].get("2048", {})
    ours_s, trl_s = iteration_s(at, ("packed", "vllm")), iteration_s(at, ("trl", "hf-generate"))
    if ours_s and trl_s:
        loads = [at[i].get("loadavg", [None])[0] for i in ("packed", "vllm", "trl", "hf-generate")]
        even = None not in loads and max(loads) <= 2 * max(min(loads), 1.0)  # CPU seconds inflate on a crowded machine
        verdict = ("met" if ours_s <= 0.5 * trl_s else "missed") if even else "not judged: its cells ran under uneven or unrecorded load (see the notes)"
        out.append(f"- 2k tokens, CPU seconds per iteration (rollout + logprobs + update) ours packed / TRL <= 0.5: "
                   f"**{ours_s / trl_s:.2f}** ({ours_s:.0f} s against {trl_s:.0f} s) {verdict}.")
    if ours_s is None and "update" in at.get("packed", {}) and trl_row(at):
        a, b = (sum(r[ph]["cpu_s"] for ph in ("logprobs", "update")) for r in (at["packed"], trl_row(at)))
        out.append(f"- 2k tokens, CPU seconds of logprobs + update (the rollout not measured) ours packed / TRL: **{a / b:.2f}** "
                   f"({a:.0f} s against {b:.0f} s{', TRL scaled from its first micro-batch' if 'trl' not in at else ''}).")
    if "update" in at.get("packed", {}) and trl_row(at):
        a, b = at["packed"]["update"]["above_mb"], trl_row(at)["update"]["above_mb"]
        out.append(f"- 2k tokens, update peak MB above the model ours packed <= TRL: **{a}** against **{b}** {'met' if a <= b else 'missed'}.")
    mix = result["runs"].get("mix", {})
    if "padded_share" in mix.get("packed", {}):
        others = ", ".join(f"{i}: {100 * mix[i]['padded_share']:.1f} %" for i in ("padded", "trl") if "padded_share" in mix.get(i, {}))
        out.append(f"- mix, padded-token share < 10 %: packed **{100 * mix['packed']['padded_share']:.1f} %**"
                   f"{f' ({others})' if others else ''} {'met' if mix['packed']['padded_share'] < 0.1 else 'missed'}.")
    return out


def section(result: dict) -> list[str]:
    """bench/results.md's "Long completions" section."""
    m = result["machine"]
    out = ["## Long completions (`make bench-long`)", "",
           f"SmolLM2-135M-Instruct, fp32, {ROWS} rows (2 prompts x G={G}), made-up completions of the forced length (`mix`: "
           f"{', '.join(map(str, sorted(MIX)))}); one logprobs pass and one optimizer step, each in a fresh process; peak RSS "
           "above the loaded model. TRL 1.16 GRPOTrainer with its fused LM head, micro-batches of 2 rows. The rollout: "
           "ours through the product's vLLM engine (`min_tokens = max_tokens` per row), TRL's path without vLLM "
           "(transformers `generate`, the 8 rows as one batch to the longest row). CPU seconds (all threads) are the "
           "figure to compare on a shared machine; `load` is the 1-minute load average when the cell started. "
           f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, OMP threads per process: {result.get('threads', 'default')}; `uptime` before: {result['uptime_before']}; "
           f"after: {result['uptime_after']} (other workers share this machine).", "", *goals(result),
           *[f"- {n}" for n in result.get("notes", [])], "",
           "| completion tokens | impl | logprobs s (CPU s) | logprobs MB | update s (CPU s) | update MB | padded share | update CPU s / TRL | load |",
           "|---|---|---|---|---|---|---|---|---|"]
    load = lambda r: f"{r['loadavg'][0]:.1f}" if "loadavg" in r else "-"
    for spec, rows in result["runs"].items():
        base = trl_row(rows).get("update", {}).get("cpu_s")
        for impl, r in rows.items():
            if impl in ROLLOUTS:
                continue
            if "error" in r:
                out.append(f"| {spec} | {impl} | error: {r['error']} | | | | | | {load(r)} |")
                continue
            ratio = f"{r['update']['cpu_s'] / base:.2f}" if base else "-"
            ratio = f"{r['micro_batches']} of {ROWS // TRL_MICRO} micro-batches" if impl == "trl-1" else ratio
            lp, up = r["logprobs"], r["update"]
            share = "-" if r.get("padded_share") is None else f"{100 * r['padded_share']:.1f} %"
            out.append(f"| {spec} | {impl} | {lp['s']:.1f} ({lp['cpu_s']:.1f}) | {lp['above_mb']} | {up['s']:.1f} ({up['cpu_s']:.1f}) | "
                       f"{up['above_mb']} | {share} | {ratio} | {load(r)} |")
    rolls = [(spec, impl, r) for spec, rows in result["runs"].items() for impl, r in rows.items() if impl in ROLLOUTS]
    if rolls:
        out += ["", "| completion tokens | rollout | start s | generate s (CPU s) | peak MB (process) | tokens generated / real | "
                "KV cache planned MB | load |", "|---|---|---|---|---|---|---|---|"]
        for spec, impl, r in rolls:
            if "error" in r:
                out.append(f"| {spec} | {impl} | error: {r['error']} | | | | | {load(r)} |")
                continue
            kv = f"{r['kv_cache_bytes'] / 2**20:.0f}" if r.get("kv_cache_bytes") else "-"
            g = r["rollout"]
            out.append(f"| {spec} | {impl} | {r['start']['s']:.1f} | {g['s']:.1f} ({g['cpu_s']:.1f}) | {g['peak_mb']} | "
                       f"{sum(r['tokens'])} / {r['real_tokens']} | {kv} | {load(r)} |")
    if result.get("fit"):
        pts = ", ".join(f"{n} tokens {f['backward']['above_mb']} MB ({f['backward']['cpu_s']:.0f} CPU s)" for n, f in sorted(result["fit"].items(), key=lambda x: int(x[0])))
        out += ["", f"Activation fit (`python -m bench.long --one fit N`, one packed row's forward and backward, peak RSS above the model, "
                f"gradients included): {pts}; `device_budget.ACTIVATION_BYTES` and `ACTIVATION_FIXED` are its two terms."]
    out += ["", f"![seconds and memory against completion length]({PLOT.name})", ""]
    return out


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    specs = [s for s in result["runs"] if s != "mix"]
    series = [(impl, phase) for impl in ("packed", "padded", "trl") for phase in ("update",)] + [(i, "rollout") for i in ROLLOUTS]
    for impl, phase in series:
        cell = lambda s: trl_row(result["runs"][s]) if impl == "trl" else result["runs"][s].get(impl, {})
        xs = sorted(int(s) for s in specs if phase in cell(s))
        panels = zip(axes[:2], ("cpu_s", "above_mb")) if phase == "update" else [(axes[2], "cpu_s")]
        for ax, key in panels:
            ax.plot(xs, [cell(str(x))[phase][key] for x in xs], marker="o", label=impl)
    rolled = any(ph == "rollout" and r.get(i, {}).get(ph) for r in result["runs"].values() for i, ph in series)
    if not rolled and result.get("fit"):  # no rollout measured: the third panel shows the activation fit and the estimate
        from pipeline.models import device_budget as dp

        ns = sorted(int(n) for n in result["fit"])
        head = lambda n: 2 * 4 * min(n, dp.CHUNK_TOKENS) * 49152 / 2**20
        est = [result["fit"][str(ns[0])]["grad_mb"] + (dp.ACTIVATION_BYTES * 576 * 30 * n + dp.ACTIVATION_FIXED) / 2**20 + head(n)
               for n in ns]
        axes[2].plot(ns, [result["fit"][str(n)]["backward"]["above_mb"] for n in ns], marker="o", label="measured (one packed row)")
        axes[2].plot(ns, est, linestyle="--", label="device_budget estimate + gradients")
    labels = ("update CPU seconds (one step, 8 rows)", "update peak MB above the model",
              "rollout CPU seconds (8 rows)" if rolled or not result.get("fit") else "backward peak MB above the model")
    for ax, label in zip(axes, labels):
        ax.set_xlabel("completion tokens per row")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.long", description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024,2048,4096,mix", help="completion lengths (and `mix`), comma-separated")
    ap.add_argument("--impls", default="packed,padded,trl,vllm,hf-generate",
                    help="which of packed, padded, trl (logprobs + update) and vllm, hf-generate (the rollout)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one measurement may take")
    ap.add_argument("--fresh", action="store_true", help="drop bench/long.json's cells (else a run replaces only the cells it measures)")
    ap.add_argument("--report", action="store_true", help="only redraw the plot and the results section from bench/long.json")
    ap.add_argument("--one", nargs=2, metavar=("IMPL", "LENGTH"),
                    help="measure one cell in this process and print its JSON (`--one fit 512`: the activation fit behind "
                         "device_budget's two terms)")
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(*args.one, args.out)
    if args.report:
        return report_only()
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    before = json.loads(OUT.read_text()) if OUT.exists() and not args.fresh else {}
    kept = {k: v for k, v in before.items() if k in ("notes", "fit")}  # written by hand and by the fit: a partial run keeps them
    result = {"machine": machine_info(), "uptime_before": uptime(), "loadavg_before": loadavg(), "runs": before.get("runs", {}),
              "threads": os.environ.get("OMP_NUM_THREADS", "default"), **kept}
    tmp = ROOT / ".long.tmp.json"
    for spec in args.lengths.split(","):
        for impl in args.impls.split(","):
            load = loadavg()
            try:
                subprocess.run([sys.executable, "-m", "bench.long", "--one", impl, spec, "--out", str(tmp)], check=True, timeout=args.timeout,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
                r = json.loads(tmp.read_text())
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
                r = {"error": type(err).__name__}
            result["runs"].setdefault(spec, {})[impl] = r | {"loadavg": load}
            print(f"[long {spec} {impl}] {r}", flush=True)
            OUT.write_text(json.dumps(result | {"uptime_after": uptime()}, indent=1))
    tmp.unlink(missing_ok=True)
    result["uptime_after"], result["loadavg_after"] = uptime(), loadavg()
    OUT.write_text(json.dumps(result, indent=1))
    report_only()


def report_only() -> None:
    """The plot and this bench's section from bench/long.json (`python -m bench.page` puts the section into bench/results.md)."""
    result = json.loads(OUT.read_text())
    plot(result)
    print("\n".join(section(result)))


if __name__ == "__main__":
    main()
