"""`python -m bench.record` (`make bench-record`, and the last step of `make bench`): what the record
costs a warm `grpo iterate` of SmolLM2-135M full fine-tuning (issue 53), at two shapes:

    gpu-shape   bf16 weights and arithmetic, ZeRO-2, 4 prompts x 4 completions x 32 new tokens
                (the GPU proof's shape, bench/gpu)
    fp32-8x8x64 fp32, ZeRO 0, 8 prompts x 8 completions x 64 new tokens

Each shape runs `grpo iterate` (rollout.weight_sync at its default, MLflow off) in a process of its own,
with the product probes of bench/probes.py, for 1 warm-up iteration (engine starts) and `--iters`
measured ones. Per measured iteration: its seconds; the stages' own compute, the wall seconds of
the probed calls that do the work: the engine's `generate` (rollout), the reward functions
(score), the logprob forwards (`sequence_logprobs`) and the trainer's `train_iteration` (forward,
backward and optimizer steps); the rest of the iteration, outside them, as a share of it (the
record: parts, manifests, hashing, the policy's and state's files, engine reloads and the
sampler proof, glue); and the bytes the process and its children (the engine's) wrote and read:
write_bytes / read_bytes (to and from storage) and wchar / rchar (through write and read calls,
the page cache included) from /proc/PID/io. Results: bench/record.json and the "The record's cost"
section of bench/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.probes import loadavg, machine_info
from bench.workloads import ROOT, WORK, Workload, build_assets, config_tree

OUT = ROOT / "record.json"
SHAPES = {  # name: (prompts, completions, new tokens, train settings)
    "gpu-shape": (4, 4, 32, {"bf16": True, "zero_stage": 2, "precision": "bf16"}),
    "fp32-8x8x64": (8, 8, 64, {"bf16": False, "zero_stage": 0, "precision": "fp32"}),
}
COMPUTE = ("generate", "rewards", "forward", "train")
"""The probe categories (bench/probes.py) that are the stages' own compute."""


def tree_of(name: str) -> dict:
    prompts, g, tokens, train = SHAPES[name]
    w = Workload("real", 1, iters=0, commands=0, trl_steps=0, num_generations=g, prompts_per_iter=prompts,
                 max_new_tokens=tokens, mini_batch_size=prompts * g, lr=1e-5)
    tree = config_tree(w)
    tree["train"].update(train)
    tree["tracking"] = {"mlflow": False}
    return tree


def io_now() -> dict[str, int]:
    """/proc/PID/io summed over this process and its children (the engine's workers)."""
    import psutil

    me = psutil.Process()
    total = {"read_bytes": 0, "write_bytes": 0, "rchar": 0, "wchar": 0}
    for p in [me, *me.children(recursive=True)]:
        try:
            io = p.io_counters()
        except (psutil.Error, OSError):
            continue
        for key, attr in (("read_bytes", "read_bytes"), ("write_bytes", "write_bytes"), ("rchar", "read_chars"), ("wchar", "write_chars")):
            total[key] += getattr(io, attr, 0)
    return total


def worker(name: str, iters: int, out: Path) -> None:
    """One shape's `grpo iterate`, measured per iteration (run in its own process)."""
    from bench.probes import Probes, by_phase, diff, install_product_probes
    from pipeline import config as config_mod
    from pipeline.loop.iterate import iterate
    from pipeline.models.engines import cpu_env
    from pipeline.run.run import init_run

    import pipeline.logprobs, pipeline.models.vllm_engine, pipeline.score  # noqa: F401,E401  (probed now: see below)

    cpu_env()
    path = WORK / "record" / name
    shutil.rmtree(path, ignore_errors=True)
    run = init_run(str(path), config_mod.resolve(tree_of(name), source=f"bench.record {name}"))
    probes = Probes()
    install_product_probes(probes)  # on the modules loaded above: generate, rewards, logprob forwards, train steps
    rows: list[dict] = []
    mark = {"snap": probes.snapshot(), "io": io_now()}

    def on_iteration(row: dict) -> None:
        snap, io = probes.snapshot(), io_now()
        cats = by_phase(diff(snap, mark["snap"]))
        compute = {c: sum(phase.get(c, 0.0) for phase in cats.values()) for c in COMPUTE}
        rows.append({"iteration": row["iteration"], "seconds": row["seconds"], "timings": row["timings"], "compute": compute,
                     "categories": cats,  # every probed category by stage (what the outside time is made of)
                     "io": {key: io[key] - mark["io"][key] for key in io}, "loadavg": loadavg()})
        print(f"[record {name}] iteration {row['iteration']}: {row['seconds']:.2f}s, compute "
              + " ".join(f"{c}={v:.2f}" for c, v in compute.items()), flush=True)
        mark.update(snap=snap, io=io)

    t = time.time()
    iterate(run, iters + 1, on_iteration=on_iteration)
    out.write_text(json.dumps({"name": name, "rows": rows, "wall_s": time.time() - t}, indent=1))


def summary(rows: list[dict]) -> dict:
    """Means over the measured iterations (the first row, the warm-up, left out)."""
    measured = rows[1:]
    n = len(measured)
    mean = lambda f: sum(f(r) for r in measured) / n  # noqa: E731
    seconds = mean(lambda r: r["seconds"])
    compute = {c: mean(lambda r, c=c: r["compute"][c]) for c in COMPUTE}
    outside = seconds - sum(compute.values())
    probed: dict[str, float] = {}  # the probed categories outside the compute, seconds per iteration
    for r in measured:
        for phase, cats in r.get("categories", {}).items():
            for c, v in cats.items():
                if c not in COMPUTE:
                    probed[f"{phase}/{c}"] = probed.get(f"{phase}/{c}", 0.0) + v / n
    return {"iterations": n, "seconds": seconds, "compute": compute, "outside_s": outside, "outside_share": outside / seconds,
            "io": {key: mean(lambda r, key=key: r["io"][key]) for key in measured[0]["io"]},
            "outside_probed": dict(sorted(probed.items(), key=lambda kv: -kv[1]))}


def engine_s(summary: dict) -> float:
    """Seconds per iteration the rollout's engine spent taking policy k+1 (bench/probes.py: its
    in-place reload with the sampler proof, and its wake)."""
    return sum(v for c, v in summary.get("outside_probed", {}).items() if c in ("rollout/engine_reload", "rollout/engine_wake"))


def section(result: dict) -> list[str]:
    """bench/results.md's "The record's cost" section."""
    m = result["machine"]
    loads = [r["loadavg"][0] for s in result["shapes"].values() for r in s["rows"]]
    head = (f"`make bench-record`, started {result['started']}, code {result['code_version']}: SmolLM2-135M-Instruct full "
            f"fine-tuning, warm `grpo iterate` (the defaults: rollout.weight_sync unset, auto, which is memory for full fine-tuning; MLflow off, vLLM engine), 1 warm-up iteration and "
            f"the mean of the next {next(iter(result['shapes'].values()))['summary']['iterations']}; {m['cores']} cores, "
            f"OMP_NUM_THREADS={result.get('threads', 'unset')}, load "
            f"(1 min) {min(loads):.2f}-{max(loads):.2f} during the run"
            + (". **The machine was shared with other jobs**: absolute seconds are inflated and noisy; the shares and bytes "
               "less so." if max(loads) > m["cores"] * 0.75 else " (nothing else ran)."))
    out = ["## The record's cost (bench/record.py)", "", head, "",
           "| shape | work | s/iteration | stages' own compute s (generate + rewards + logprob forwards + train) | outside them s | "
           "outside, % of an iteration (target <= 5 %) | of it, the engine taking policy k+1 (reload, proof, wake) s | "
           "written MB (storage / write calls) | read MB (storage / read calls) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name, shape in result["shapes"].items():
        s = shape["summary"]
        c, io = s["compute"], s["io"]
        prompts, g, tokens, train = SHAPES[name]
        work = f"{'bf16' if train['bf16'] else 'fp32'}, ZeRO-{train['zero_stage']}, {prompts} x {g} x {tokens} tokens"
        out.append(f"| {name} | {work} | {s['seconds']:.2f} | {sum(c.values()):.2f} ({c['generate']:.2f} + {c['rewards']:.2f} + "
                   f"{c['forward']:.2f} + {c['train']:.2f}) | {s['outside_s']:.2f} | {100 * s['outside_share']:.1f} % "
                   f"{'(met)' if s['outside_share'] <= 0.05 else '(**missed**)'} | {engine_s(s):.2f} | {io['write_bytes'] / 1e6:.0f} / "
                   f"{io['wchar'] / 1e6:.0f} | {io['read_bytes'] / 1e6:.0f} / {io['rchar'] / 1e6:.0f} |")
    note = ("The stages' own compute: the wall seconds of the calls that do each stage's work, as the product probes time "
            "them (bench/probes.py): the engine's `generate` in the rollout, the reward functions in the score, the logprob "
            "forwards (`sequence_logprobs`) and the trainer's `train_iteration` (forward, backward, optimizer steps) in the "
            "update. Everything else in the iteration is outside them: writing and hashing the parts and manifests, "
            "the policy's record (its sha256, update k's manifest, the sampler proof's reference and the weights file are "
            "computed and written on a thread while the next rollout runs: only what that rollout waits for counts), the "
            "trainer state (every `train.state_every` = 10 updates and at the end of the command, so in none of these "
            "iterations), the engine taking the new weights in memory and proving them (sampler proof), loading the batch, "
            "Python glue. Bytes are per iteration from /proc/PID/io of the "
            "process and its children: storage (write_bytes, read_bytes; reads served by the page cache are not counted) "
            "and through write/read calls (wchar, rchar: the page cache included, e.g. every file read again).")
    where = [f"- {name}: " + ", ".join(f"{c} {v:.2f} s" for c, v in list(shape["summary"]["outside_probed"].items())[:6])
             for name, shape in result["shapes"].items() if shape["summary"].get("outside_probed")]
    if where:  # the probes' view of the outside time ("other": unprobed glue within a stage)
        where.insert(0, "Outside the compute, the largest probed parts per iteration (stage/category, bench/probes.py):")
    earlier = [f"{name} was measured by the run started {shape['started']}." for name, shape in result["shapes"].items() if "started" in shape]
    return [*out, "", *earlier, *([""] if earlier else []), note, "", *where, *([""] if where else [])]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.record", description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=3, help="measured iterations per shape, after one warm-up")
    ap.add_argument("--only", nargs="*", choices=list(SHAPES), help="shapes to run (default: both)")
    ap.add_argument("--worker", nargs=2, metavar=("SHAPE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.iters, Path(args.worker[1]))
        return
    from pipeline.store import code_version

    build_assets(["real"])
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(WORK / "torch_extensions"))
    env.pop("MLFLOW_TRACKING_URI", None)
    result = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(), "code_version": code_version(),
              "threads": os.environ.get("OMP_NUM_THREADS", "unset"), "shapes": {}}
    if args.only and OUT.exists():  # the shapes not run now keep their figures, with when they were measured
        old = json.loads(OUT.read_text())
        result["shapes"] = {n: {"started": old["started"], **s} for n, s in old["shapes"].items() if n not in args.only}
    (WORK / "record").mkdir(parents=True, exist_ok=True)
    for name in args.only or SHAPES:
        out = WORK / "record" / f"{name}.json"
        log = out.with_suffix(".log")
        with open(log, "w") as f:
            proc = subprocess.run([sys.executable, "-m", "bench.record", "--iters", str(args.iters), "--worker", name, str(out)],
                                  cwd=ROOT.parent, env=env, stdout=f, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            sys.exit(f"error: bench.record {name} failed ({proc.returncode}); log {log}:\n{log.read_text()[-3000:]}")
        shape = json.loads(out.read_text())
        shape["summary"] = summary(shape["rows"])
        result["shapes"][name] = shape
        result["shapes"] = {n: result["shapes"][n] for n in SHAPES if n in result["shapes"]}
        s = shape["summary"]
        print(f"[record {name}] {s['seconds']:.2f} s/iteration, outside the stages' compute {100 * s['outside_share']:.1f} %", flush=True)
    OUT.write_text(json.dumps(result, indent=1))
    print("\n".join(section(result)))


if __name__ == "__main__":
    main()
