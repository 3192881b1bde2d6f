"""`python -m bench.overlap` (`make bench-overlap`): asynchronous `iterate` (train.max_staleness 1)
against synchronous `iterate` on the same work, on this machine's cores shared and split.

Four runs of `grpo iterate --iters N`, each from a fresh `grpo init` of the same workload:

    sync         max_staleness 0, both cores for whichever stage runs
    async        max_staleness 1, the sampler process and the trainer share both cores
    sync-split   max_staleness 0 on one core (taskset -c 1, one thread): each stage runs on a
                 device of its own while the other waits, as on a GPU machine whose engine and
                 trainer sit on separate GPUs and take turns
    async-split  max_staleness 1, the sampler pinned to core 0 (GRPO_SAMPLER_CPUS), the trainer
                 to core 1, one thread each: the split a GPU machine makes, with overlap

Per run: seconds per iteration in the steady state (between the manifests of policy 1 and policy
N, so the engines' start is not counted) and the stages' own seconds from the manifests. The
results go to bench/overlap.json and into bench/results.md's "Asynchronous iterate" section.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import yaml

from bench.probes import machine_info
from bench.workloads import ROOT, WORK, Workload, build_assets, config_tree

OUT = ROOT / "overlap.json"
VARIANTS = {  # name: (max_staleness, trainer CPUs or None, sampler CPUs or None)
    "sync": (0, None, None),
    "async": (1, None, None),
    "sync-split": (0, "1", None),
    "async-split": (1, "1", "0"),
}
STAGES = ("rollout", "score", "logprobs", "update")


def workload(size: str) -> Workload:
    if size == "real":
        return Workload("real", 1, iters=0, commands=0, trl_steps=0, num_generations=8, prompts_per_iter=8,
                        max_new_tokens=128, mini_batch_size=64, lr=1e-5)
    return Workload(size, 1, iters=0, commands=0, trl_steps=0)


def run_variant(name: str, w: Workload, iters: int, env: dict) -> dict:
    staleness, trainer_cpus, sampler_cpus = VARIANTS[name]
    root = WORK / "overlap" / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    tree = config_tree(w)
    tree["train"]["max_staleness"] = staleness
    tree["tracking"] = {"mlflow": False}
    (root / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    run = root / "run"
    env = dict(env)
    prefix: list[str] = []
    if trainer_cpus is not None:
        env["OMP_NUM_THREADS"] = "1"
        prefix = ["taskset", "-c", trainer_cpus]
    if sampler_cpus is not None:
        env["GRPO_SAMPLER_CPUS"] = sampler_cpus
    grpo = [sys.executable, "-m", "stages.cli"]
    subprocess.run([*grpo, "init", str(run), "--config", str(root / "config.yaml")], check=True, env=env,
                   cwd=ROOT.parent, capture_output=True)
    t = time.time()
    with open(root / "iterate.log", "w") as log:
        proc = subprocess.run([*prefix, *grpo, "iterate", str(run), "--iters", str(iters)], env=env, cwd=ROOT.parent,
                              stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.time() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: grpo iterate failed ({proc.returncode}); log {root / 'iterate.log'}")
    done = [(run / f"policy/iter-{k:04d}/MANIFEST.json").stat().st_mtime for k in range(1, iters + 1)]
    stages = {s: [json.loads((run / f"iter-{k:04d}/{s}/MANIFEST.json").read_text())["timings"]["seconds"]
                  for k in range(1, iters)] for s in STAGES}
    return {
        "name": name, "max_staleness": staleness, "trainer_cpus": trainer_cpus, "sampler_cpus": sampler_cpus,
        "iters": iters, "wall_s": wall,
        "steady_s_per_iter": (done[-1] - done[0]) / (iters - 1),
        "stage_s": {s: sum(v) / len(v) for s, v in stages.items()},
    }


def estimate(rows: dict[str, dict]) -> dict:
    """What overlap buys where the engine and the trainer have devices of their own: the split
    runs' measured ratio, and the bound from their stage times (sync = rollout + the rest, async
    at best the longer of the two)."""
    s = rows["sync-split"]["stage_s"]
    roll, rest = s["rollout"], s["score"] + s["logprobs"] + s["update"]
    return {
        "rollout_share": roll / (roll + rest),
        "bound_speedup": (roll + rest) / max(roll, rest),
        "split_speedup": rows["sync-split"]["steady_s_per_iter"] / rows["async-split"]["steady_s_per_iter"],
        "shared_speedup": rows["sync"]["steady_s_per_iter"] / rows["async"]["steady_s_per_iter"],
    }


def section(result: dict) -> list[str]:
    """bench/results.md's "Asynchronous iterate" section."""
    w, e, m = result["workload"], result["estimate"], result["machine"]
    iters = next(iter(result["runs"].values()))["iters"]
    head = (f"`make bench-overlap`, started {result['started']}: workload {w['name']} ({w['prompts_per_iter']} prompts x "
            f"{w['num_generations']} completions, up to {w['max_new_tokens']} new tokens), `grpo iterate --iters {iters}` "
            f"per row from a fresh `grpo init`; {m['cores']} cores, load {m['loadavg'][0]:.2f} at start. Seconds per "
            "iteration between policy 1 and the last (engine starts not counted); stage seconds are the manifests' "
            "(the rollout's include waiting for its part's engine).")
    out = ["## Asynchronous iterate (train.max_staleness)", "", head, "",
           "| run | cores | s/iteration | rollout s | score s | logprobs s | update s |", "|---|---|---|---|---|---|---|"]
    cores = {"sync": "both, in turn", "async": "both, shared by sampler and trainer",
             "sync-split": "one core, each stage in turn", "async-split": "sampler core 0, trainer core 1"}
    for name, r in result["runs"].items():
        st = r["stage_s"]
        out.append(f"| {name} | {cores[name]} | {r['steady_s_per_iter']:.2f} | {st['rollout']:.2f} | {st['score']:.2f} | "
                   f"{st['logprobs']:.2f} | {st['update']:.2f} |")
    shared = (f"- Shared cores: async is {e['shared_speedup']:.2f} x sync's speed. Both stages compete for the same two "
              "cores: each stage alone uses both, and two processes of two threads each oversubscribe them.")
    split = (f"- Split cores (one device each, the way a GPU machine splits engine and trainer): async is "
             f"{e['split_speedup']:.2f} x sync's speed; the rollout is {e['rollout_share']:.0%} of a synchronous iteration, "
             f"so perfect overlap would give at most {e['bound_speedup']:.2f} x.")
    gpu = ("- On a GPU machine with the engine and the trainer on separate GPUs, expect the split figure: "
            "(rollout + rest) / max(rollout, rest) at best, the larger the closer the two stages' times are. Sharing one "
            "GPU, overlap buys little (the shared-cores figure), and vLLM's sleep mode between rollouts is the better use "
            "of its memory. Not measured on a GPU (no GPU was lent to this project's sessions).")
    return [*out, "", shared, split, gpu, ""]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=["tiny", "small", "real"], help="the workload's model")
    ap.add_argument("--iters", type=int, default=6, help="iterations per run (the first is the warm-up)")
    args = ap.parse_args()
    if (os.cpu_count() or 1) < 2 or shutil.which("taskset") is None:
        sys.exit("error: bench.overlap needs two CPUs and taskset (util-linux) for its split runs")
    w = workload(args.size)
    build_assets([args.size])
    env = dict(os.environ, GRPO_CACHE_DIR=str(WORK / "cache"), TORCH_EXTENSIONS_DIR=str(WORK / "torch_extensions"))
    env.pop("MLFLOW_TRACKING_URI", None)
    rows = {}
    for name in VARIANTS:
        rows[name] = run_variant(name, w, args.iters, env)
        print(f"[overlap {name}] {rows[name]['steady_s_per_iter']:.2f} s/iteration "
              f"(stages {', '.join(f'{s} {v:.2f}' for s, v in rows[name]['stage_s'].items())})", flush=True)
    result = {"workload": w.as_dict() | {"name": f"{args.size}-e1"}, "machine": machine_info(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": rows, "estimate": estimate(rows)}
    OUT.write_text(json.dumps(result, indent=1))
    print("\n".join(section(result)))


if __name__ == "__main__":
    main()
