"""`python -m bench.hf_engine` (`make bench-hf`): grpo's HF engine (`rollout.engine: hf`, the engine a
GPU proof without vLLM runs) against TRL 1.16's GRPOTrainer with HF `generate`, identical work, per
phase: the CPU stand-in for the GPU claim (issue 61 item 1: the iteration at most 1.0 x TRL's, the
rollout at most TRL's generation of the same rows).

The work is bench/workloads.py's `hf_workloads()`: real-full's rows (SmolLM2-135M-Instruct full
fine-tuning, 8 prompts x G=8, up to 128 new tokens, bf16 where the CPU has it), run by the main
bench's own workers (`python -m bench --only ...`: bench/ours.py, bench/trl_run.py), TRL at bf16
(`--trl-bf16 only`: the faster on a CPU with AVX512-bf16 or AMX). Results: bench/hf_engine.json
(the main bench's format) and the "HF engine against TRL's generate" section of bench/results.md.

    python -m bench.hf_engine [--only real-full-hf real-full-hf-t512]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

from bench.workloads import ROOT, WORK, hf_workloads

OUT = ROOT / "hf_engine.json"


def section(results: dict) -> list[str]:
    """bench/results.md's section: per workload, the targets and where each side's seconds go."""
    from bench import report

    m = results["machine"]
    out = ["## HF engine against TRL's generate (bench/hf_engine.py)", "",
           f"`make bench-hf`, started {results['started']}, code {results.get('code_version')}: "
           f"{m['cores']} cores ({m['cpu']}; {', '.join(m['isa'])}), OMP_NUM_THREADS={results.get('threads_setting')}, "
           f"load (1 min) {m['loadavg'][0]:.2f} at start. grpo's warm `grpo iterate` on `rollout.engine: hf` "
           "(`rollout.hf_sampler: batched`, the default) against TRL 1.16's GRPOTrainer (HF `generate`, bf16) on the "
           "same model, prompts, rewards, G, tokens and optimizer step; one warm-up iteration (cycle) each, then the "
           "measured one.", ""]
    for name, e in results["workloads"].items():
        if e.get("spliced"):
            sp = e["spliced"]
            out += [f"{name}: `grpo iterate` from the run started {sp['ours_from']['started']} (code "
                    f"{sp['ours_from']['code_version']}), after a fix to how the loop timed a rollout that followed a "
                    f"shown row; TRL from the run started {sp['trl_from']['started']} (code {sp['trl_from']['code_version']}).", ""]
    out += ["| workload | grpo s/iteration | TRL s/cycle | ratio (target <= 1.0) | grpo rollout s | TRL generation s | ratio (target <= 1.0) | "
            "grpo logprobs + update + outside s | TRL training s | completion tokens grpo / TRL |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in results["workloads"].items():
        s = report.summarize(e)
        t, st = s["trl"], s["stages"]
        rest = s["iter_s"] - st["rollout"]["seconds"] - st["score"]["seconds"]
        trl_tokens = report.mean(c["tokens"] for c in report.measured(e["trl"]["cycles"]))
        out.append(f"| {name} | {s['iter_s']:.1f} | {t['cycle_s']:.1f} | {t['ratio']:.2f} x {report._ok(t['ratio'], 1.0)} | "
                   f"{st['rollout']['seconds']:.1f} | {t['generate_s']:.1f} | {st['rollout']['seconds'] / t['generate_s']:.2f} x "
                   f"{report._ok(st['rollout']['seconds'] / t['generate_s'], 1.0)} | {rest:.1f} (update {st['update']['seconds']:.1f}, "
                   f"outside the stages {s['iter_s'] - sum(x['seconds'] for x in st.values()):.1f}) | {t['cycle_s'] - t['generate_s']:.1f} | "
                   f"{s['tokens']:.0f} / {trl_tokens:.0f} |")
    out += ["", "TRL's generation is its `_generate_and_score_completions` (HF `generate`, the rewards; no old-logprob pass "
            "at one optimizer step per generation). grpo's rollout samples every group of the part in one `generate` batch, "
            "each group from its own seed (docs/performance.md, \"The HF engine's time is its forward, and its batch\"); "
            "at one optimizer step per epoch its update takes the old logprobs from its own forward, so its logprobs stage "
            "makes no pass, as TRL's does not.", ""]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.hf_engine", description=__doc__.splitlines()[0])
    names = [w.name for w in hf_workloads()]
    ap.add_argument("--only", nargs="*", default=names[:1], help=f"workloads ({', '.join(names)}; default {names[0]})")
    args = ap.parse_args()
    md = WORK / "hf-engine.md"
    subprocess.run([sys.executable, "-m", "bench", "--only", *args.only, "--trl-bf16", "only", "--out", str(md)], check=True)
    shutil.copy(md.with_suffix(".json"), OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
