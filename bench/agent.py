"""`make bench-agent`: the agent workload, warm `grpo iterate` against TRL 1.16's GRPOTrainer with
the same tool on the same work.

    python -m bench.agent [--iters 4] [--trl-steps 2] [--trl-precision fastest|both|fp32|bf16]
                          [--threads 1] [--reuse-ours] [--skip-trl] [--report]

The work: the agent demo's task (examples/calc_problems.py, multiplications too large to know,
with the `multiply` tool of examples/calc_tools.py, a TRL-style function both sides load), 8
prompts x G=8 per iteration, episodes of at most 2 model turns (a call, then the answer) and 120
tokens after the prompt (TRL's max_completion_length; each turn may use what is left, as TRL's),
temperature 0.8, the reward examples/rewards.py:final_answer_correct, DAPO with clip 0.2 / 0.28
and no KL, LoRA r=16, 4 optimizer steps per iteration (mini-batch 16), lr 2e-4 (bench/workloads.py,
`agent-lora`).

The model: SmolLM2-135M-Instruct after `make demo-agent`'s two iterations (run here once into
bench/work/agent-demo and exported merged), so nearly every episode is a tool call and an answer:
the work of an agent run that has learned its tool, not of one whose samples rarely call it. It is
given Qwen 2.5's chat template (read from the installed TRL), because TRL refuses a template that
cannot render a tool exchange (SmolLM2's cannot) and parses calls only for templates it knows; the
pipeline, reading the same directory, renders the tools through that template too.

Ours: `grpo iterate --iters N` in its own process (warm engines, MLflow on); seconds per iteration
from the second on. TRL: seconds per generation cycle (one cycle = one of our iterations) from the
second on, HF generate (use_vllm=False: TRL's vLLM modes expect a GPU), at bf16 where the CPU
computes in bf16 (TRL's faster precision there in `make bench`'s real-* workloads), else fp32;
`--trl-precision both` runs both and counts the faster. Both also report turns and tool calls per episode,
so the comparison shows the two did the same kind of work. Writes bench/agent.json; bench/report.py
renders it into bench/results.md ("Agent workload").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.workloads import AGENT_MODEL_DIR, ROOT, WORK, Workload

REPO = ROOT.parent
OUT = ROOT / "agent.json"
DEMO_DIR = WORK / "agent-demo"
MODEL_DIR = AGENT_MODEL_DIR
DATA_DIR = WORK / "data-agent"
DEMO_ITERS = 2


def workload(iters: int = 4, trl_steps: int = 2) -> Workload:
    return Workload("agent", 1, iters=iters, commands=0, trl_steps=trl_steps, lora=True, num_generations=8, prompts_per_iter=8,
                    max_new_tokens=120, mini_batch_size=16, lr=2e-4, temperature=0.8)


def write_data() -> Path:
    sys.path.insert(0, str(REPO / "examples"))
    import calc_problems

    return calc_problems.write(DATA_DIR, seed=0)[0]


def model_dir() -> Path:
    """The demo-trained agent model with Qwen 2.5's chat template (built once per bench/work)."""
    if (MODEL_DIR / ".complete").exists():
        return MODEL_DIR
    return build_model()


def build_model() -> Path:
    import shutil

    from trl.chat_template_utils import qwen2_5_chat_template

    if not (DEMO_DIR / "summary.json").exists():
        print(f"agent model: make demo-agent's {DEMO_ITERS} iterations into {DEMO_DIR}", flush=True)
        subprocess.run([sys.executable, "examples/demo_real.py", "--dir", str(DEMO_DIR), "--iters", str(DEMO_ITERS),
                        "--config", "examples/agent.yaml"], cwd=REPO, check=True)
    shutil.rmtree(MODEL_DIR, ignore_errors=True)
    subprocess.run([str(Path(sys.executable).parent / "grpo"), "export", str(DEMO_DIR / "run"), str(MODEL_DIR), "--iter", str(DEMO_ITERS),
                    "--merged"], cwd=REPO, check=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    tok.chat_template = qwen2_5_chat_template
    tok.save_pretrained(MODEL_DIR)
    (MODEL_DIR / ".complete").touch()
    return MODEL_DIR


def ours_worker(w_json: str, out: str) -> None:
    """`grpo iterate` on the workload in this process; seconds per iteration and episode shape."""
    from bench.workloads import load_workload, resolved_config
    from pipeline.models.engines import cpu_env

    cpu_env()
    from pipeline.loop.iterate import iterate
    from pipeline.report.episodes import episode_metrics, episode_records
    from pipeline.run.run import init_run

    w = load_workload(w_json)
    path = WORK / "runs" / w.name
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    run = init_run(str(path), resolved_config(w))
    rows: list[dict] = []
    t0 = time.perf_counter()
    iterate(run, w.iters, on_iteration=rows.append)
    wall = time.perf_counter() - t0
    iters = []
    for k, r in enumerate(rows):  # turns and tool calls per episode: the rollout's own episode metrics
        m = episode_metrics(episode_records(run, k))
        iters.append({"iteration": k, "seconds": r["seconds"], "reward/mean": r.get("reward/mean"),
                      "turns_mean": m["episodes/turns_mean"], "calls_mean": m["tools/call_frequency"]})
    for it in iters:
        print(f"[ours {w.name}] iteration {it['iteration']}: {it['seconds']:.1f}s, {it['turns_mean']:.2f} turns, "
              f"{it['calls_mean']:.2f} calls an episode", flush=True)
    Path(out).write_text(json.dumps({"iterations": iters, "wall_s": wall}, indent=1))


def run(module_args: list[str], log: Path, env: dict) -> None:
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", *module_args], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
    for line in log.read_text().splitlines():
        if line.startswith(("[ours", "[trl")):
            print("  " + line, flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(module_args[:1])} failed ({proc.returncode}); log {log}:\n{log.read_text()[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.agent", description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=4, help="our iterations (the first is the cold start, not counted)")
    ap.add_argument("--trl-steps", type=int, default=2, help="TRL generation cycles (the first is not counted)")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--trl-precision", choices=("fastest", "both", "fp32", "bf16"), default="fastest",
                    help="fastest: bf16 where the CPU computes in bf16 (TRL's faster precision there in make bench), "
                         "else fp32; both: fp32 and bf16, the faster counts (a TRL fp32 cycle here takes over 15 minutes)")
    ap.add_argument("--reuse-ours", action="store_true", help="keep our side from the last run (bench/work/results/agent-ours.json)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for both sides (as `make bench`; 0 leaves it unset)")
    ap.add_argument("--report", action="store_true", help="only print the section from bench/agent.json (python -m bench.page redraws bench/results.md)")
    args = ap.parse_args(argv)
    from bench.workloads import worker_env
    from bench.probes import machine_info

    if not args.report:
        w = workload(args.iters, args.trl_steps)
        env = worker_env(args.threads)
        scratch = WORK / "results"
        scratch.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        write_data()
        model_dir()
        machine = machine_info()
        result: dict = {"workload": w.as_dict(), "machine": machine, "threads": args.threads, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if not (args.reuse_ours and (scratch / "agent-ours.json").exists()):
            print(f"== {w.name}: grpo iterate x{w.iters}", flush=True)
            run(["bench.agent", "--ours-worker", json.dumps(w.as_dict()), str(scratch / "agent-ours.json")], scratch / "agent-ours.log", env)
        result["ours"] = json.loads((scratch / "agent-ours.json").read_text())
        if not args.skip_trl:
            bf16 = {"avx512_bf16", "amx_tile"} & set(machine["isa"])
            result["trl_runs"] = {}
            chosen = {"fastest": ["bf16" if bf16 else "fp32"], "both": ["fp32", "bf16"] if bf16 else ["fp32"]}
            for prec in chosen.get(args.trl_precision, [args.trl_precision]):
                print(f"== {w.name}: TRL GRPOTrainer x{w.trl_steps} ({prec})", flush=True)
                out = scratch / f"agent-trl-{prec}.json"
                run(["bench.trl_run", json.dumps(w.as_dict()), str(out)], out.with_suffix(".log"), {**env, "BENCH_TRL_PRECISION": prec})
                result["trl_runs"][prec] = json.loads(out.read_text())
        result["total_s"] = time.time() - t0
        OUT.write_text(json.dumps(result, indent=1))
    result = json.loads(OUT.read_text())
    print("\n".join(section(result)))
    return 0


def warm_mean(values: list[float]) -> float:
    """The mean from the second value on (the first iteration or cycle starts engines and models)."""
    return statistics.mean(values[1:]) if len(values) > 1 else float("nan")


def summary(result: dict) -> dict:
    """Warm seconds per iteration, ours and TRL's (its faster precision), their ratio, and the episode shapes."""
    ours = result["ours"]["iterations"]
    out = {"ours_s": warm_mean([it["seconds"] for it in ours]), "ours_shape": episode_shape_mean(ours[1:] or ours)}
    trl = {prec: warm_mean([c["seconds"] for c in r["cycles"]]) for prec, r in result.get("trl_runs", {}).items()}
    if trl:
        best = min(trl, key=trl.get)
        cycles = result["trl_runs"][best]["cycles"]
        out |= {"trl_s": trl[best], "trl_precision": best, "trl_by_precision": trl, "ratio": out["ours_s"] / trl[best],
                "trl_shape": episode_shape_mean([c for c in cycles[1:] or cycles if "turns_mean" in c])}
    return out


def episode_shape_mean(rows: list[dict]) -> dict:
    if not rows:
        return {"turns_mean": float("nan"), "calls_mean": float("nan")}
    return {k: statistics.mean(r[k] for r in rows) for k in ("turns_mean", "calls_mean")}


def section(result: dict) -> list[str]:
    """bench/results.md's "Agent workload" section."""
    w, m, s = result["workload"], result["machine"], summary(result)
    head = (f"`make bench-agent`, started {result['started']}: workload {w['name']} (SmolLM2-135M-Instruct after `make "
            f"demo-agent`, Qwen 2.5's chat template; {w['prompts_per_iter']} prompts x {w['num_generations']} episodes of at "
            f"most 2 turns and {w['max_new_tokens']} tokens after the prompt, the `multiply` tool, LoRA r=16, "
            f"{w['prompts_per_iter'] * w['num_generations'] // w['mini_batch_size']} optimizer steps per iteration); "
            f"{m['cores']} cores, {result.get('threads', 1) or 'default'} thread(s) per process, load {m['loadavg'][0]:.2f} at start. "
            "Seconds per iteration (ours: `grpo iterate`, "
            "warm engines) or generation cycle (TRL 1.16 GRPOTrainer, `tools=[multiply]`, HF generate), the first of "
            "each not counted.")
    out = ["## Agent workload (tool episodes)", "", head, "",
           "| side | s/iteration | turns / episode | tool calls / episode |", "|---|---|---|---|",
           f"| grpo iterate | {s['ours_s']:.1f} | {s['ours_shape']['turns_mean']:.2f} | {s['ours_shape']['calls_mean']:.2f} |"]
    for prec, secs in s.get("trl_by_precision", {}).items():
        shape = s["trl_shape"] if prec == s["trl_precision"] else {}
        out.append(f"| TRL ({prec}) | {secs:.1f} | {shape.get('turns_mean', float('nan')):.2f} | {shape.get('calls_mean', float('nan')):.2f} |")
    if "ratio" in s:
        verdict = "met" if s["ratio"] <= 0.5 else "missed"
        which = "its faster" if len(s["trl_by_precision"]) > 1 else "the one precision run, `--trl-precision`"
        out += ["", f"- ours / TRL ({s['trl_precision']}, {which}): **{s['ratio']:.2f} x** (target <= 0.5 x: {verdict})."]
    return [*out, ""]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ours-worker":
        ours_worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
