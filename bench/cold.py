"""Cold start of the commands that need no engine: each a fresh `grpo` process, timed from outside.

    python -m bench.cold RUN [--runs 5] [--out OUT_JSON]

For `grpo --help`, `status`, `inspect`, `audit` and `score` on RUN: one warm-up process (page
cache), then RUNS processes; wall seconds (min / median / max) and whether the process imported
vLLM or DeepSpeed at all (from `python -X importtime`, every nested import included). `score`
re-scores RUN's newest scored iteration: its score directory is set aside before and put back
after, so each process does the whole stage (a finished stage would be skipped) and RUN is left
as it was.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.workloads import ROOT

ENGINES = ("vllm", "deepspeed")


def engines_imported(stderr: str) -> list[str]:
    found = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            found |= {e for e in ENGINES if name == e or name.startswith(e + ".")}
    return sorted(found)


def time_command(args: list[str], runs: int, env: dict | None = None, before=None) -> dict:
    walls, imported = [], set()
    for i in range(runs + 1):  # the first is the warm-up
        if before:
            before()
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "stages.cli", *args], cwd=ROOT.parent,
                              capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            tail = "\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:"))[-2000:]
            raise RuntimeError(f"grpo {' '.join(args)} failed ({proc.returncode}):\n{tail}")
        imported |= set(engines_imported(proc.stderr))
        if i:
            walls.append(wall)
    return {"min_s": min(walls), "median_s": statistics.median(walls), "max_s": max(walls), "runs": runs,
            "engines_imported": sorted(imported)}


def newest_scored(run: Path) -> int:
    done = sorted(int(p.parent.parent.name.split("-")[1]) for p in run.glob("iter-*/score/MANIFEST.json"))
    if not done:
        raise SystemExit(f"{run}: no scored iteration to re-score")
    return done[-1]


def measure(run: Path, runs: int = 5, env: dict | None = None) -> dict:
    k = newest_scored(run)
    score_dir = run / f"iter-{k:04d}" / "score"
    kept = score_dir.with_name("score.bench-kept")
    results = {}
    for name, args in [("--help", ["--help"]), ("status", ["status", str(run)]),
                       ("inspect", ["inspect", str(run), "--iter", str(k)]), ("audit", ["audit", str(run)])]:
        results[name] = time_command(args, runs, env)
    shutil.move(score_dir, kept)
    try:
        results["score"] = time_command(["score", str(run), "--iter", str(k)], runs, env,
                                        before=lambda: shutil.rmtree(score_dir, ignore_errors=True))
    finally:
        shutil.rmtree(score_dir, ignore_errors=True)
        shutil.move(kept, score_dir)
    for name, r in results.items():
        print(f"[cold] grpo {name}: median {r['median_s']:.2f}s (min {r['min_s']:.2f}, max {r['max_s']:.2f}); "
              f"engines imported: {', '.join(r['engines_imported']) or 'none'}", flush=True)
    return {"run": str(run), "iteration": k, "commands": results}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cold", description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    result = measure(a.run.resolve(), a.runs)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
