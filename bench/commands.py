"""The four separate commands, one process each, as a scheduler would run them:

    grpo rollout RUN --iter K; grpo score RUN --iter K; grpo logprobs RUN --iter K; grpo update RUN --iter K

They continue the run `grpo iterate` left (its MLflow store and trainer state are there), so
the per-iteration difference to the warm loop is what a process per stage costs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.probes import by_phase, loadavg
from bench.workloads import ROOT

STAGE_ORDER = ("rollout", "score", "logprobs", "update")


def top_imports(stderr: str) -> dict[str, float]:
    """Seconds per outermost import from `-X importtime` (nested imports are inside their parent)."""
    out: dict[str, float] = {}
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line[len("import time:"):].split("|", 2)
        if cumulative.strip().isdigit() and not name.startswith("  "):  # one leading space: top level
            out[name.strip()] = out.get(name.strip(), 0.0) + int(cumulative) / 1e6
    return out


def run_command(stage: str, run: Path, k: int, env: dict) -> dict:
    """One `grpo STAGE RUN --iter K` process: wall, peak RSS and the probe's breakdown."""
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
        out = Path(tmp) / "probe.json"
        err_path = Path(tmp) / "stderr.txt"
        cmd = [sys.executable, "-X", "importtime", "-m", "bench.cli_probe", str(out), stage, str(run), "--iter", str(k)]
        with open(err_path, "w") as err, open(Path(tmp) / "stdout.txt", "w") as so:
            t0 = time.time()
            proc = subprocess.Popen(cmd, cwd=ROOT.parent, env=env, stdout=so, stderr=err)
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.time() - t0
            proc.returncode = os.waitstatus_to_exitcode(status)
        stderr = err_path.read_text()
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(line for line in stderr.splitlines() if not line.startswith("import time:"))[-3000:]
            raise RuntimeError(f"grpo {stage} {run} --iter {k} failed ({proc.returncode}):\n{tail}")
        probe = json.loads(out.read_text())
    marks = probe["marks"]
    imports = top_imports(stderr)
    return {
        "stage": stage,
        "iteration": k,
        "wall_s": wall,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "startup_s": marks["enter"] - t0,  # interpreter + site + the bench shim's first line
        "cli_import_s": marks["main"] - marks["enter"],  # stages.cli and pipeline's modules
        "main_s": marks["done"] - marks["main"],
        "exit_s": t0 + wall - marks["done"],
        "import_total_s": sum(imports.values()),
        "top_imports": dict(sorted(imports.items(), key=lambda kv: -kv[1])[:8]),
        "categories": by_phase(probe["probes"]["seconds"]),
        "loadavg": loadavg(),
    }


def run_iteration(run: Path, k: int, env: dict) -> dict:
    stages = [run_command(s, run, k, env) for s in STAGE_ORDER]
    print(f"[commands] iteration {k}: " + " ".join(f"{s['stage']}={s['wall_s']:.1f}s" for s in stages), flush=True)
    return {"iteration": k, "stages": stages, "wall_s": sum(s["wall_s"] for s in stages)}


def iterate_process(run: Path, env: dict) -> dict:
    """`grpo iterate RUN --more 1` as its own process, no bare engines beside it: its peak RSS is
    what a user's `grpo iterate` needs (the iterate worker also holds the bare engines' models)."""
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "stages.cli", "iterate", str(run), "--more", "1"], cwd=ROOT.parent, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"grpo iterate {run} --more 1 failed:\n{stderr[-3000:]}")
    result = {"wall_s": time.time() - t0, "peak_rss_mb": usage.ru_maxrss / 1024}
    print(f"[iterate process] one iteration with engine start: {result['wall_s']:.1f}s, peak RSS {result['peak_rss_mb']:.0f} MB", flush=True)
    return result
