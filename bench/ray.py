"""`python -m bench.ray` (`make bench-ray`): the Ray executor on this machine.

Three runs of `grpo iterate --iters N` on the same workload, each from a fresh `grpo init`, every
process on one thread:

    local     in-process `grpo iterate` (the reference)
    ray-1     `--executor ray`, one rollout actor
    ray-2     `--executor ray`, two rollout actors, one on each node

on a two-node Ray cluster started here (pipeline/cluster/local.py, as the tests start it: one CPU each), the
rollout parts spread over the actors (groups_per_part: a quarter of the prompts). Per run: seconds
per iteration in the steady state (between the manifests of policy 1 and policy N: engine and actor
starts not counted) and the stages' seconds from the manifests. Two figures: ray-1 / ray-2 rollout
seconds (what a second actor buys) and (ray-1 - local) seconds per iteration as a share of local's
(the executor's own cost). The results go to bench/ray.json and bench/results.md's "Ray executor"
section; every run's rollout and score parts are checked byte-identical to the local run's.
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
from pipeline.cluster.local import two_nodes
from bench.workloads import ROOT, WORK, Workload, build_assets, config_tree, real_workloads

OUT = ROOT / "ray.json"
STAGES = ("rollout", "score", "logprobs", "update")
VARIANTS = {"local": None, "ray-1": 1, "ray-2": 2}  # name: rollout actors (None: no Ray)


def run_variant(name: str, w: Workload, iters: int, env: dict, address: str | None) -> dict:
    root = WORK / "ray" / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    tree = config_tree(w)
    tree["rollout"]["groups_per_part"] = max(1, w.prompts_per_iter // 4)
    tree["tracking"] = {"mlflow": False}
    actors = VARIANTS[name]
    if actors:
        tree["cluster"] = {"executor": "ray", "rollout_workers": actors, "rollout_cpus": 0.5, "score_cpus": 0.5}
    (root / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    run = root / "run"
    grpo = [sys.executable, "-m", "stages.cli"]
    subprocess.run([*grpo, "init", str(run), "--config", str(root / "config.yaml")], check=True, env=env, cwd=ROOT.parent,
                   capture_output=True)
    extra = ["--address", address] if actors else []
    t = time.time()
    with open(root / "iterate.log", "w") as log:
        proc = subprocess.run([*grpo, "iterate", str(run), "--iters", str(iters), *extra], env=env, cwd=ROOT.parent,
                              stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.time() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: grpo iterate failed ({proc.returncode}); log {root / 'iterate.log'}")
    audit = subprocess.run([*grpo, "audit", str(run)], env=env, cwd=ROOT.parent, capture_output=True, text=True, check=False)
    done = [(run / f"policy/iter-{k:04d}/MANIFEST.json").stat().st_mtime for k in range(1, iters + 1)]
    manifests = {(k, s): json.loads((run / f"iter-{k:04d}/{s}/MANIFEST.json").read_text()) for k in range(iters) for s in STAGES}
    return {
        "name": name, "actors": actors, "iters": iters, "wall_s": wall, "steady_s_per_iter": (done[-1] - done[0]) / (iters - 1),
        "stage_s": {s: sum(manifests[k, s]["timings"]["seconds"] for k in range(1, iters)) / (iters - 1) for s in STAGES},
        "outputs": {f"{k}/{s}": manifests[k, s]["outputs"] for k in range(iters) for s in ("rollout", "score")},
        "audit_clean": audit.returncode == 0,
    }


def results() -> dict:
    """bench/ray.json: one result per workload name (tiny-e1, real-lora)."""
    if not OUT.exists():
        return {}
    data = json.loads(OUT.read_text())
    return {data["workload"]["name"]: data} if "runs" in data else data


def section(by_workload: dict) -> list[str]:
    """bench/results.md's "Ray executor" section: a table per workload."""
    out = ["## Ray executor (cluster.executor ray)", ""]
    for result in by_workload.values():
        out += workload_table(result)
    return out


def workload_table(result: dict) -> list[str]:
    w, m, runs = result["workload"], result["machine"], result["runs"]
    iters = runs["local"]["iters"]
    model = "SmolLM2-135M-Instruct with LoRA r=16, " if w["size"] == "real" else ""
    cmd = "`make bench-ray`" + (f" (`python -m bench.ray --size {w['size']}`)" if w["size"] != "tiny" else "")
    head = (f"**{w['name']}**: {cmd}, started {result['started']}: {model}{w['prompts_per_iter']} prompts x "
            f"{w['num_generations']} completions in 4 parts, up to {w['max_new_tokens']} new tokens, `grpo iterate --iters "
            f"{iters}` per row from a fresh `grpo init`, every process on one thread; a two-node Ray cluster on this "
            f"machine (one CPU each); {m['cores']} cores, load {m['loadavg'][0]:.2f} at start. Seconds per iteration between "
            "policy 1 and the last (engine and actor starts not counted); stage seconds from the manifests.")
    out = [head, "",
           "| run | rollout actors | s/iteration | rollout s | score s | logprobs s | update s | parts = local's | audit |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        st = r["stage_s"]
        same = "yes" if r["outputs"] == runs["local"]["outputs"] else "NO"
        out.append(f"| {name} | {r['actors'] or 'none (in process)'} | {r['steady_s_per_iter']:.2f} | {st['rollout']:.2f} | "
                   f"{st['score']:.2f} | {st['logprobs']:.2f} | {st['update']:.2f} | {same} | "
                   + {True: "clean", False: "NOT CLEAN", None: "not run"}[r.get("audit_clean")] + " |")
    one, two, local = runs["ray-1"], runs["ray-2"], runs["local"]
    out += ["", f"- Two rollout actors against one: rollout {one['stage_s']['rollout'] / two['stage_s']['rollout']:.2f} x as fast "
            f"(iteration {one['steady_s_per_iter'] / two['steady_s_per_iter']:.2f} x).",
            f"- The executor's own cost: ray-1 takes {one['steady_s_per_iter'] - local['steady_s_per_iter']:+.2f} s per iteration "
            f"against in-process iterate ({(one['steady_s_per_iter'] - local['steady_s_per_iter']) / local['steady_s_per_iter']:+.1%}; "
            "the goal is at most +5 % on the real-model workload).",
            ""]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ray", description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "small", "real"],
                    help="the workload's model (real: SmolLM2-135M-Instruct with LoRA, bench's real-lora workload)")
    ap.add_argument("--iters", type=int, default=4, help="iterations per run (the first is the warm-up)")
    args = ap.parse_args()
    if args.size == "real":
        w = next(w for w in real_workloads() if w.name == "real-lora")
    else:
        w = Workload(args.size, 1, iters=0, commands=0, trl_steps=0)
    build_assets([args.size])
    env = dict(os.environ, GRPO_CACHE_DIR=str(WORK / "cache"), TORCH_EXTENSIONS_DIR=str(WORK / "torch_extensions"),
               OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("MLFLOW_TRACKING_URI", None)
    os.environ["OMP_NUM_THREADS"] = "1"  # the cluster's processes inherit it
    cluster = two_nodes()
    rows = {}
    try:
        for name in VARIANTS:
            rows[name] = run_variant(name, w, args.iters, env, cluster.address)
            print(f"[ray {name}] {rows[name]['steady_s_per_iter']:.2f} s/iteration "
                  f"(stages {', '.join(f'{s} {v:.2f}' for s, v in rows[name]['stage_s'].items())})", flush=True)
    finally:
        cluster.shutdown()
    result = {"workload": w.as_dict(), "machine": machine_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": rows}
    OUT.write_text(json.dumps({**results(), w.name: result}, indent=1))
    print("\n".join(workload_table(result)))


if __name__ == "__main__":
    main()
