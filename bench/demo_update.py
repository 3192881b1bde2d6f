"""`python -m bench.demo_update` (`make bench-demo-update`): seconds per update of `make demo`'s
model, so a regression of the demo's update shows (issue 61 item 0).

The work is the demo's update of iteration 0, byte for byte: the demo's data and warm-started
model (`grpo demo`'s builders and defaults, kept in bench/work), a run from the shipped demo
config with eval and MLflow off, whose iteration 0 (rollout, score, logprobs) `grpo iterate`
makes once. Each row then starts a process of its own that builds the trainer on policy 0 and
times `train_iteration` (forward, backward and the 4 optimizer steps, what the manifest's
`train_s` holds less its data read) `--reps` times; the first is a warm-up. Rows:

    default        the update's own thread choice (pipeline/update/threads.py: one thread on a
                   CPU without OMP_NUM_THREADS)
    2 threads      OMP_NUM_THREADS=2 (torch's default on this 2-core machine, the update's
                   setting before that choice)
    ... + busy     the same beside one process that keeps a core busy (a Python spin loop), as on
                   a shared machine

Per row: median wall and CPU seconds of the measured reps, and the sha256 of the weights after
the first update (every row must give the same bytes). Results: bench/demo_update.json and the
"The demo's update" section of bench/results.md (`python -m bench.page`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.probes import loadavg, machine_info
from bench.workloads import ROOT, WORK, worker_env

OUT = ROOT / "demo_update.json"
DATA = WORK / "data-demo"
MODEL = WORK / "models" / "demo"
RUN = WORK / "runs" / "demo-update"
ROWS = {  # name: (OMP_NUM_THREADS or None for the update's own choice, a busy core beside it)
    "default": (None, False),
    "default + busy": (None, True),
    "2 threads": ("2", False),
    "2 threads + busy": ("2", True),
}
SPIN = "import time\nend = time.time() + 3600\nwhile time.time() < end: pass\n"


def prepare() -> Path:
    """The demo's data, model and a run holding iteration 0's rollout, score and logprobs."""
    from demo.commands import CONFIG
    from demo.task import SYSTEM_PROMPT, write_demo_data
    from demo.tinymodel import make_model
    from pipeline import config as config_mod
    from pipeline.loop.iterate import iterate
    from pipeline.run.run import Run, init_run

    train, eval_ = write_demo_data(DATA, seed=0)  # `grpo demo`'s defaults
    make_model(MODEL, size="tiny", seed=0, data_dir=DATA)
    if RUN.exists() and Run(str(RUN)).done(0, "logprobs"):  # made by an earlier call
        return RUN
    cfg = config_mod.load(CONFIG, [f"model={MODEL}", f"data.train={train}", f"data.eval={eval_}", "seed=0",
                                   "eval.every=0", "tracking.mlflow=false"])
    cfg.data.system_prompt = SYSTEM_PROMPT
    iterate(init_run(str(RUN), cfg), 1)
    return RUN


def worker(run_dir: str, reps: int) -> dict:
    """In this process: the trainer on policy 0, then `reps` updates of iteration 0 timed."""
    import torch

    from pipeline.run.run import Run
    from pipeline.update.data import UpdateData
    from pipeline.update.threads import threads_for
    from pipeline.update.trainer import Trainer

    run = Run(run_dir)
    trainer = Trainer(run.cfg, run.policy_dir(0), None, base_dir=run.policy_dir(0))
    out: dict = {"reps": [], "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    for rep in range(reps):
        data = UpdateData(run, 0, trainer.kl_ctl)
        t, c = time.perf_counter(), time.process_time()
        rows = trainer.train_iteration(data, 0)
        out["reps"].append({"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c, "steps": len(rows),
                            "tokens": sum(r["tokens"] for r in rows),
                            "threads": threads_for(trainer.engine.device) or torch.get_num_threads()})  # inside the update
        if rep == 0:  # the weights after one update from policy 0: equal on every row
            h = hashlib.sha256()
            for name, p in sorted(trainer.engine.module.state_dict().items()):
                h.update(name.encode())
                h.update(p.detach().contiguous().numpy().tobytes())
            out["weights_sha256"] = h.hexdigest()
    trainer.close()
    return out


def measure_row(name: str, reps: int, run: Path = RUN) -> dict:
    threads, busy = ROWS[name]
    env = worker_env(None)
    env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["OMP_NUM_THREADS"] = threads
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        load0 = loadavg()
        proc = subprocess.run([sys.executable, "-m", "bench.demo_update", "--worker", str(run), "--reps", str(reps)],
                              cwd=ROOT.parent, env=env, capture_output=True, text=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"bench.demo_update row {name!r} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    timed = r["reps"][1:] or r["reps"]
    r.update(name=name, busy=busy, loadavg_start=load0, loadavg_end=loadavg(),
             wall_s=statistics.median(x["wall_s"] for x in timed), cpu_s=statistics.median(x["cpu_s"] for x in timed))
    print(f"[{name}] {r['wall_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU per update ({timed[0]['threads']} threads, "
          f"{timed[0]['steps']} steps, {timed[0]['tokens']} tokens), load {load0[0]:.2f}", flush=True)
    return r


def section(result: dict) -> list[str]:
    """bench/results.md's "The demo's update" section."""
    m, rows = result["machine"], result["rows"]
    first = next(iter(rows.values()))
    t = first["reps"][0]
    head = (f"`make bench-demo-update`, started {result['started']}: `make demo`'s model and its update of iteration 0 "
            f"({t['steps']} optimizer steps over {t['tokens']} completion tokens), a process per row, the median of "
            f"{len(first['reps']) - 1} updates after a warm-up; {m['cores']} cores, load {m['loadavg'][0]:.2f} at start"
            + (" (**shared machine**: compare rows, not absolute seconds)" if m["loadavg"][0] > 0.5 else "") + ".")
    if result.get("run") and Path(result["run"]) != RUN:
        head += f" The run: {result['run']} (`--run`)."
    out = ["## The demo's update (bench/demo_update.py)", "", head, "",
           "| row | OMP_NUM_THREADS | s/update (wall) | CPU s/update | load at start | weights |", "|---|---|---|---|---|---|"]
    ref = first.get("weights_sha256")
    for name, r in rows.items():
        same = "same" if r.get("weights_sha256") == ref else f"**differ** ({r.get('weights_sha256', '')[:12]})"
        threads = r.get("omp_num_threads") or "unset (the update: 1)"
        out.append(f"| {name} | {threads} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['loadavg_start'][0]:.2f} | {same} |")
    notes = []
    for base in ("default", "2 threads"):
        if base in rows and f"{base} + busy" in rows:
            a, b = rows[base], rows[f"{base} + busy"]
            notes.append(f"- {base}: a busy core beside it costs {b['wall_s'] / a['wall_s']:.2f} x the update's wall time "
                         f"({b['cpu_s'] / a['cpu_s']:.2f} x its CPU time).")
    before = result.get("before")  # the same rows from an earlier commit, kept beside this run's
    if before:
        notes.append(f"- Before ({before['label']}): " + "; ".join(
            f"{n} {b['wall_s']:.2f} s wall, {b['cpu_s']:.2f} CPU s, weights "
            + ("same" if b.get("weights_sha256") == ref else "**differ**") for n, b in before["rows"].items()) + ".")
    notes.append("- Goal (issue 61): under a second per update on a quiet machine, and a busy core not halving it. The "
                 "work is ~8.4k tokens forwarded and backpropagated (the prompts' ~5.8k among them), ~200 GFLOP: see "
                 "docs/performance.md.")
    return [*out, "", *notes, ""]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.demo_update", description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4, help="updates per row; the first is a warm-up (default 4)")
    ap.add_argument("--rows", nargs="*", choices=list(ROWS), default=list(ROWS), help="rows to run (default all)")
    ap.add_argument("--run", type=Path, help="an existing run of the demo whose iteration 0 has its logprobs (e.g. `make demo`'s "
                    "runs/demo/run) instead of the one made in bench/work")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.reps)))
        return
    os.environ.update({k: v for k, v in worker_env(None).items() if k in ("GRPO_CACHE_DIR", "TORCH_EXTENSIONS_DIR")})
    t0 = time.time()
    run = args.run or prepare()
    result = {"started": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(t0)), "machine": machine_info(), "run": str(run),
              "rows": {}}
    for name in args.rows:
        result["rows"][name] = measure_row(name, args.reps, run)
        OUT.write_text(json.dumps(result, indent=1, default=str))
    result["total_s"] = time.time() - t0
    OUT.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
