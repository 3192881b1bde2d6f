"""`make bench-endpoint`: issue 62's learning check on the CPU, and the endpoint's cost per turn.

    python -m bench.endpoint [--iters 2] [--threads 1] [--reuse] [--report]

The task is the agent demo's (`make demo-agent`: SmolLM2-135M-Instruct, examples/calc_problems.py's
multiplications, the `multiply` tool, examples/rewards.py:final_answer_correct), run on its two
routes: `tools` (examples/agent.yaml, grpo's own tool episodes) and `endpoint`
(examples/endpoint_agent.yaml: examples/endpoint_agent.py, an OpenAI-SDK program started once per
episode and talking to the endpoint grpo serves over its warm engine). The two configs differ in
the route alone (tests/test_examples.py checks it).

1. Learning: `examples/demo_real.py --iters N` for each route, one after the other, into
   bench/work/endpoint/<route>: held-out greedy accuracy and tool use of policy 0 and policy N (the
   demo's own eval), and per iteration the rollout's reward mean, the share of episodes that called
   the tool, rollout seconds, turns and seconds per turn (from the parts' records and manifests).
2. Cost per turn, back to back: iteration 0's rollout of each route into a fresh run, one process,
   one warm vLLM engine shared by both (policy 0 is the base model for both), the engine's own seconds
   timed around each `generate` call; the process's CPU seconds and its children's (the agents)
   beside the wall seconds; and one agent's start alone (the interpreter with `import openai` and a
   client: what each endpoint episode pays before its first request).

Load average is sampled every 5 s through each step. Writes bench/endpoint.json; `python -m
bench.page` renders it into bench/results.md ("Endpoint agents").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.workloads import ROOT, WORK

OUT = ROOT / "endpoint.json"
REPO = ROOT.parent
ROUTES = {"tools": "examples/agent.yaml", "endpoint": "examples/endpoint_agent.yaml"}


class Load:
    """os.getloadavg()'s 1-minute figure every 5 s while it is open: (min, max, at start, at end)."""

    def __enter__(self):
        self.samples, self.stop = [os.getloadavg()[0]], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict:
        s = self.samples
        return {"start": round(s[0], 2), "end": round(s[-1], 2), "min": round(min(s), 2), "max": round(max(s), 2),
                "mean": round(sum(s) / len(s), 2)}


def cpu(who) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def env(threads: int) -> dict:
    e = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    if threads:
        e["OMP_NUM_THREADS"] = str(threads)
    return e


def run_demo(route: str, iters: int, threads: int) -> dict:
    out = WORK / "endpoint" / route
    log = WORK / "endpoint" / f"{route}.log"
    cmd = [sys.executable, str(REPO / "examples/demo_real.py"), "--dir", str(out), "--iters", str(iters), "--config", ROUTES[route]]
    print(f"== {route}: {' '.join(cmd[1:])} (log {log})", flush=True)
    t, c = time.time(), cpu(resource.RUSAGE_CHILDREN)
    with Load() as load, log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(threads), cwd=REPO).returncode
    if rc != 0:
        raise SystemExit(f"bench.endpoint: the {route} demo exited {rc}; see {log}")
    return {"wall_s": round(time.time() - t, 1), "cpu_s": round(cpu(resource.RUSAGE_CHILDREN) - c, 1), "load": load.summary()}


def rows(run_dir: Path, k: int, stage: str) -> list[dict]:
    import pyarrow.parquet as pq

    return [r for p in sorted((run_dir / f"iter-{k:04d}/{stage}").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]


def iteration(run_dir: Path, k: int) -> dict:
    """Iteration k's rollout: reward mean, accuracy (final_answer_correct), tool share, turns, seconds."""
    from pipeline.run.run import Run

    got, scored = rows(run_dir, k, "rollout"), rows(run_dir, k, "score")
    recs = [json.loads(r["episode"]) for r in got]
    seconds = Run(str(run_dir)).manifest(k, "rollout").timings["seconds"]
    turns = sum(r["turns"] for r in recs)
    return {"iteration": k, "episodes": len(recs), "turns": turns,
            "reward": sum(r["reward"] for r in scored) / len(scored),
            "accuracy": sum(r["reward_final_answer_correct"] for r in scored) / len(scored),
            "tool_share": sum(any(m["role"] == "tool" for m in r["messages"]) for r in recs) / len(recs),
            "rollout_s": round(seconds, 2), "s_per_turn": round(seconds / turns, 3)}


def learning(route: str, demo: dict, iters: int) -> dict:
    from pipeline.run.run import Run

    run_dir = WORK / "endpoint" / route / "run"
    summary = json.loads((WORK / "endpoint" / route / "summary.json").read_text())
    held = {side: {n: summary[side].get(f"eval/{n}") for n in ("accuracy", "tools/used", "reward")} for side in ("first", "final")}
    return {**demo, "iterations": [iteration(run_dir, k) for k in range(iters)], "held_out": held,
            "grpo_s": round(summary["grpo_s"], 1), "eval_s": round(summary["eval_s"], 1),
            "policy_hash": Run(str(run_dir)).policy_hash(iters)}


def same_episodes(iters: int) -> list[int]:
    """Per iteration, how many episodes the two routes sampled identically (prompt ids, completion ids, mask)."""
    key = ("prompt_id", "sample_idx", "prompt_ids", "completion_ids", "completion_mask")
    runs = [WORK / "endpoint" / route / "run" for route in ROUTES]
    return [sum(x == y for x, y in zip(*([[tuple(map(str, (r[c] for c in key))) for r in rows(d, k, "rollout")] for d in runs])))
            for k in range(iters)]


class Timed:
    """The engine, its generate calls timed (the real engine runs every call)."""

    def __init__(self, engine):
        self.engine, self.seconds, self.calls = engine, 0.0, 0

    def generate(self, *args, **kwargs):
        t = time.time()
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            self.seconds += time.time() - t
            self.calls += 1

    def __getattr__(self, name):
        return getattr(self.engine, name)


def agent_start(threads: int, n: int = 3) -> dict:
    """One agent's start alone: the interpreter, `import openai`, a client (what examples/endpoint_agent.py does first)."""
    code = "import openai; openai.OpenAI(api_key='k', base_url='http://127.0.0.1:9/v1', max_retries=0)"
    walls, c = [], cpu(resource.RUSAGE_CHILDREN)
    for _ in range(n):
        t = time.time()
        subprocess.run([sys.executable, "-c", code], check=True, env=env(threads))
        walls.append(time.time() - t)
    return {"wall_s": round(sum(walls) / n, 3), "cpu_s": round((cpu(resource.RUSAGE_CHILDREN) - c) / n, 3)}


def cost(threads: int) -> dict:
    """Iteration 0's rollout of each route, back to back on one warm engine."""
    import shutil

    os.chdir(REPO)  # the configs name their code relative to the repository
    from pipeline.models.engines import cpu_env

    cpu_env()
    from pipeline.rollout import policy_engine, run_rollout
    from pipeline.run.run import Run, init_run

    out, base = {}, WORK / "endpoint" / "cost"
    shutil.rmtree(base, ignore_errors=True)
    src = {route: Run(str(WORK / "endpoint" / route / "run")) for route in ROUTES}
    fresh = {}
    for route in ROUTES:
        init_run(str(base / route), src[route].cfg)
        fresh[route] = Run(str(base / route))
    t = time.time()
    engine = policy_engine(fresh["tools"], 0)
    start_s = time.time() - t
    with Load() as load:
        try:
            for route in ROUTES:
                timed = Timed(engine)
                t, me, kids = time.time(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
                run_rollout(fresh[route], 0, engine=timed)
                wall = time.time() - t
                recs = [json.loads(r["episode"]) for r in rows(base / route, 0, "rollout")]
                turns = sum(r["turns"] for r in recs)
                requests = sum(len(r.get("requests", [])) for r in recs)
                out[route] = {"wall_s": round(wall, 2), "engine_s": round(timed.seconds, 2), "engine_calls": timed.calls,
                              "cpu_self_s": round(cpu(resource.RUSAGE_SELF) - me, 2),
                              "cpu_agents_s": round(cpu(resource.RUSAGE_CHILDREN) - kids, 2),
                              "episodes": len(recs), "turns": turns, "requests": requests,
                              "tool_share": sum(any(m["role"] == "tool" for m in r["messages"]) for r in recs) / len(recs),
                              "s_per_turn": round(wall / turns, 3), "engine_s_per_turn": round(timed.seconds / turns, 3)}
                print(f"   {route}: {out[route]}", flush=True)
        finally:
            engine.close()
    ids = {route: {(r["prompt_id"], r["sample_idx"]): r["prompt_ids"] for r in rows(base / route, 0, "rollout")} for route in ROUTES}
    same = ids["tools"] == ids["endpoint"]  # the same task: every episode's prompt the same tokens on both routes
    return {"engine_start_s": round(start_s, 1), "routes": out, "same_prompt_ids": same, "agent_start": agent_start(threads), "load": load.summary()}


def section(res: dict) -> list[str]:
    """bench/results.md's "Endpoint agents" section."""
    out = ["## Endpoint agents (bench/endpoint.py)", "",
           f"`python -m bench.endpoint --iters {res['iters']} --threads {res['threads']}`, started {res['started']}: issue 62's learning "
           "check. The agent demo's task (SmolLM2-135M-Instruct, examples/calc_problems.py's multiplications, the `multiply` tool, "
           "reward final_answer_correct; 8 prompts x 8 episodes of at most 2 turns an iteration) on its two routes: `tools` "
           "(examples/agent.yaml, grpo's tool episodes) and `endpoint` (examples/endpoint_agent.yaml: the OpenAI-SDK program "
           "examples/endpoint_agent.py started once per episode, talking to grpo's endpoint over the warm vLLM engine). "
           f"2 cores shared with other sessions; OMP_NUM_THREADS={res['threads']}.", "",
           "| route | iteration | reward mean | tool-call share | rollout s | turns | s/turn | load (1 min) |", "|---|---|---|---|---|---|---|---|"]
    for route, r in res["learning"].items():
        ld = r["load"]
        for it in r["iterations"]:
            out.append(f"| {route} | {it['iteration']} | {it['reward']:.3f} | {it['tool_share']:.2f} | {it['rollout_s']:.1f} | "
                       f"{it['turns']} | {it['s_per_turn']:.2f} | {ld['min']:.1f}-{ld['max']:.1f} |")
    if "same_episodes" in res:
        n = res["learning"]["tools"]["iterations"][0]["episodes"]
        out += ["", "Episodes sampled identically by the two routes (prompt ids, completion ids, mask), per iteration: "
                + ", ".join(f"{s} of {n}" for s in res["same_episodes"])
                + (f"; policy {res['iters']} the same bytes on both (its hash)" if len({r.get("policy_hash") for r in res["learning"].values()}) == 1 else "")
                + ". The held-out evals differ only in their parts (the endpoint's 25 prompts a part, to bound the agents alive at once): "
                "vLLM on the CPU is not batch-invariant, so a greedy answer may differ."]
    out += ["", "Held-out (100 problems, greedy, the demo's own eval of policy 0 and the last policy):", "",
            "| route | accuracy | tool use | GRPO s (eval s of it) | CPU s (all processes) |", "|---|---|---|---|---|"]
    for route, r in res["learning"].items():
        a, b = r["held_out"]["first"], r["held_out"]["final"]
        out.append(f"| {route} | {a['accuracy']:.3f} -> {b['accuracy']:.3f} | {a['tools/used']:.2f} -> {b['tools/used']:.2f} | "
                   f"{r['grpo_s']:.0f} ({r['eval_s']:.0f}) | {r['cpu_s']:.0f} |")
    c = res["cost"]
    out += ["", f"Cost per turn, back to back (iteration 0's rollout of each route into a fresh run, one process, one warm engine; "
            f"load {c['load']['min']:.1f}-{c['load']['max']:.1f}):", "",
            "| route | episodes | turns | requests | rollout s | engine s | s/turn | engine s/turn | CPU s (grpo) | CPU s (agents) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for route, r in c["routes"].items():
        out.append(f"| {route} | {r['episodes']} | {r['turns']} | {r['requests'] or '-'} | {r['wall_s']:.1f} | {r['engine_s']:.1f} | "
                   f"{r['s_per_turn']:.3f} | {r['engine_s_per_turn']:.3f} | {r['cpu_self_s']:.1f} | {r['cpu_agents_s']:.1f} |")
    t, e, a = c["routes"]["tools"], c["routes"]["endpoint"], c["agent_start"]
    extra = e["wall_s"] - t["wall_s"]
    cpu_t, cpu_e = ((r["cpu_self_s"] + r["cpu_agents_s"]) / r["turns"] for r in (t, e))
    out += ["", f"- endpoint / tools per turn: **{e['s_per_turn'] / t['s_per_turn']:.2f} x** in wall seconds ({e['s_per_turn']:.3f} against "
            f"{t['s_per_turn']:.3f} s/turn; noisy on the shared machine: see the engine's own seconds), **{cpu_e / cpu_t:.2f} x** in "
            f"CPU seconds, grpo's process and the agents together ({cpu_e:.2f} against {cpu_t:.2f} CPU s/turn).",
            f"- Where the endpoint's extra {extra:.1f} s go: the engine's own seconds differ by {e['engine_s'] - t['engine_s']:+.1f} s; "
            f"the {e['episodes']} agents took {e['cpu_agents_s']:.1f} CPU s ({e['cpu_agents_s'] / max(e['episodes'], 1):.2f} a process; "
            f"one agent's interpreter + `import openai` + client alone: {a['wall_s']:.2f} s wall, {a['cpu_s']:.2f} CPU s), "
            f"which on 2 cores delays the first engine call (it waits for every live episode's request); grpo's own process spent "
            f"{e['cpu_self_s'] - t['cpu_self_s']:+.1f} CPU s more (the server, {e['requests']} HTTP round trips, rendering).", ""]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.endpoint", description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS (0 leaves it unset)")
    ap.add_argument("--reuse", action="store_true", help="keep a route's demo run from before (its summary.json)")
    ap.add_argument("--report", action="store_true", help="only print the section from bench/endpoint.json")
    args = ap.parse_args(argv)
    if not args.report:
        if args.threads:
            os.environ["OMP_NUM_THREADS"] = str(args.threads)
        (WORK / "endpoint").mkdir(parents=True, exist_ok=True)
        old = json.loads(OUT.read_text()) if args.reuse and OUT.exists() else {}
        res = {"iters": args.iters, "threads": args.threads, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "learning": {}}
        for route in ("endpoint", "tools"):
            done = (WORK / "endpoint" / route / "summary.json").exists() and route in old.get("learning", {})
            demo = old["learning"][route] if done else run_demo(route, args.iters, args.threads)
            res["learning"][route] = learning(route, {k: demo[k] for k in ("wall_s", "cpu_s", "load")}, args.iters)
            OUT.write_text(json.dumps(res, indent=1))
        res["same_episodes"] = same_episodes(args.iters)
        res["cost"] = cost(args.threads)
        OUT.write_text(json.dumps(res, indent=1))
    print("\n".join(section(json.loads(OUT.read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
