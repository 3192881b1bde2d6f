"""`python -m bench [--quick]`: run every workload, write bench/results.md and bench/results.json.

Per workload, one after the other on the same machine:
    1. `grpo iterate` (pipeline.loop.iterate, warm engines) with probes, the bare engines between
       its iterations (bench/ours.py)
    2. the four separate commands for the next iteration(s), one process each (bench/commands.py)
    3. TRL's GRPOTrainer on the same work (bench/trl_run.py)
Each runs in its own process, so no engine's memory or threads leak into another's numbers.
`--quick` runs one small workload (for developing the harness); `--report` re-renders the
markdown from an existing results.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import commands, report
from bench.page import side_sections
from bench.probes import loadavg, machine_info
from bench.workloads import ROOT, WORK, build_assets, hf_workloads, worker_env, workloads
from pipeline.store import code_version


def run_worker(module: str, workload, out: Path, env: dict) -> dict:
    t = time.time()
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", module, json.dumps(workload.as_dict()), str(out)],
                              cwd=ROOT.parent, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"{module} {workload.name} failed ({proc.returncode}); log {log}:\n{tail}")
    for line in log.read_text().splitlines():
        if line.startswith(f"[{workload.name}]") or line.startswith(f"[trl {workload.name}]"):
            print("  " + line, flush=True)
    result = json.loads(out.read_text())
    result["process_wall_s"] = time.time() - t
    return result


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one tiny workload, fewer iterations (harness development)")
    ap.add_argument("--only", nargs="*", help="workload names to run (tiny-e1, tiny-e2, small-e1, small-e2, real-full, real-lora, real-lora-e2, real-full-hf, real-full-hf-t512)")
    ap.add_argument("--threads", type=int, default=1,
                    help="OMP_NUM_THREADS for every process (default 1: robust when other processes share the cores; 0 leaves it unset)")
    ap.add_argument("--skip-trl", action="store_true", help="leave TRL out")
    ap.add_argument("--trl-bf16", choices=("auto", "always", "never", "only"), default="auto",
                    help="also run TRL with bf16=True (auto: where the CPU has AVX512-bf16 or AMX; without them "
                         "bf16 is emulated in fp32 and slower, as real-full measured); only: TRL at bf16 alone")
    ap.add_argument("--merge", type=Path, nargs="*", default=[],
                    help="results JSON files of earlier runs whose workloads (those not run now) join this table")
    ap.add_argument("--out", type=Path, default=None, help="markdown results, the JSON next to it (default bench/results.md; --quick: bench/work/results-quick.md)")
    ap.add_argument("--report", action="store_true", help="only re-render the markdown from the existing JSON")
    args = ap.parse_args()
    args.out = args.out or (WORK / "results-quick.md" if args.quick else ROOT / "results.md")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    json_path = args.out.with_suffix(".json")
    if args.report:
        args.out.write_text(report.render(json.loads(json_path.read_text()), side_sections()))
        print(f"wrote {args.out}")
        return

    t0 = time.time()
    # the HF-engine workloads run when named (`make bench-hf`, bench/hf_engine.py), not in a full `make bench`
    chosen = [w for w in workloads(args.quick) + (hf_workloads() if args.only else []) if not args.only or w.name in args.only]
    env = worker_env(args.threads)
    os.environ.update({k: v for k, v in env.items() if k in ("GRPO_CACHE_DIR", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR")})
    results: dict = {
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": machine_info(),
        "threads_setting": args.threads,
        "code_version": code_version(),
        "workloads": {},
    }
    scratch = WORK / "results"
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"bench: {len(chosen)} workload(s) on {results['machine']['cores']} cores, load {results['machine']['loadavg']}", flush=True)
    t = time.time()
    results["assets"] = build_assets(sorted({w.size for w in chosen}, key=["tiny", "small", "real"].index))
    results["assets_s"] = time.time() - t
    print(f"assets ready in {results['assets_s']:.0f}s", flush=True)
    from pipeline.models.tokens import resolve_precision

    for w in chosen:
        entry: dict = {"workload": w.as_dict(), "loadavg_start": loadavg()}
        # the workloads keep train.precision auto; the bare engines follow what it resolves to
        entry["workload"]["precision"] = resolve_precision("auto")
        print(f"== {w.name}: grpo iterate x{w.iters} + bare engines", flush=True)
        entry["iterate"] = run_worker("bench.ours", w, scratch / f"{w.name}-iterate.json", env)
        if w.commands:
            print(f"== {w.name}: separate commands x{w.commands}", flush=True)
            run = WORK / "runs" / w.name
            first = w.iters + (1 if w.profile else 0)  # after the iterations `grpo iterate` did
            entry["commands"] = [commands.run_iteration(run, k, env) for k in range(first, first + w.commands)]
        if w.size == "real" and w.epochs == 1:  # the peak RSS targets: a plain `grpo iterate` process
            entry["iterate_process"] = commands.iterate_process(WORK / "runs" / w.name, env)
        if not args.skip_trl:
            # TRL at its fastest setting on this CPU: bf16 off and, where the CPU computes in bf16
            # (as ours then does: train.precision auto), on; the faster counts
            bf16 = args.trl_bf16 in ("always", "only") or (args.trl_bf16 == "auto" and {"avx512_bf16", "amx_tile"} & set(results["machine"]["isa"]))
            precisions = ["bf16"] if args.trl_bf16 == "only" else ["fp32", "bf16"] if bf16 else ["fp32"]
            runs = {}
            for prec in precisions:
                print(f"== {w.name}: TRL GRPOTrainer x{w.trl_steps} ({prec})", flush=True)
                suffix = "" if prec == "fp32" else f"-{prec}"
                runs[prec] = run_worker("bench.trl_run", w, scratch / f"{w.name}-trl{suffix}.json", {**env, "BENCH_TRL_PRECISION": prec})
                runs[prec]["precision"] = prec
            entry["trl"] = min(runs.values(), key=report.trl_cycle_s)
            entry["trl_runs"] = runs
        entry["loadavg_end"] = loadavg()
        results["workloads"][w.name] = entry
        json_path.write_text(json.dumps(results, indent=1, default=str))  # partial results survive a crash
    tiny = WORK / "runs" / "tiny-e1"
    if tiny.is_dir():  # the engine-free commands, cold, on a demo-task run (tiny-e1's, of this or an earlier run)
        from bench import cold

        print("== cold start of the commands that need no engine (tiny-e1's run)", flush=True)
        results["cold"] = cold.measure(tiny, runs=3 if args.quick else 5, env=env)
    results["total_s"] = time.time() - t0
    for earlier in args.merge:  # workloads measured by an earlier run, kept with where they came from
        old = json.loads(earlier.read_text())
        # an entry that file had merged itself keeps its own origin, and that run's record comes along
        records = [{"file": earlier.name, "started": old["started"], "total_s": old.get("total_s"),
                    "code_version": old.get("code_version")}, *old.get("merged", [])]
        used = set()
        for name, entry in old["workloads"].items():
            if name not in results["workloads"]:
                origin = entry.get("from_run") or {"file": earlier.name, "started": old["started"], "total_s": old.get("total_s")}
                results["workloads"][name] = {**entry, "from_run": origin}
                used.add(origin["file"])
        known = {mg["file"] for mg in results.get("merged", [])}
        results.setdefault("merged", []).extend(r for r in records if r["file"] in used and r["file"] not in known)
    order = [w.name for w in workloads(False)]
    results["workloads"] = dict(sorted(results["workloads"].items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    results["loadavg_end"] = loadavg()
    json_path.write_text(json.dumps(results, indent=1, default=str))
    args.out.write_text(report.render(results, side_sections()))
    print(f"wrote {args.out} and {json_path} in {results['total_s'] / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
