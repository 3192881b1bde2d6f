"""`vf_episode.py --score`: re-score recorded verifiers traces through verifiers' own
`Task.score(trace, runtime=None)`, as its `vf-replay` does (verifiers/v1/cli/replay.py), with no
harness, no runtime, no interception server and no model: what `grpo replay` runs once per score part
(pipeline/agents/endpoint/vf_run.py, `rescore`).

Standalone on purpose, as vf_episode.py: verifiers and the standard library only.

stdin: one JSON object a line, {"vf_task": the taskset's index of the task, "trace": the canonical
trace vf_episode.py recorded (its messages, its recorded rewards)}, or {"vf_task": ..., "trace": null}.
stdout: one JSON object a line, in the same order, {"rewards": {name: {score, weight}} as re-scored,
"not_replayable": [names of the recorded rewards verifiers did not re-score without a runtime]}, with
"skipped": why, its recorded scores kept, for a trace verifiers' replay does not re-score (its
rollout errored: `ok` false) or whose scoring raises (verifiers' replay records that trace's error).

The trace is rebuilt as verifiers' replay reads a saved one: the recorded messages in order as one
branch of message nodes (an assistant message is a sampled node), the task from the taskset (its
data, key and hash), its recorded scores cleared. A reward (or judge) whose `runtime` parameter has
no default reads the runtime's state: `Task.score` skips it when the runtime is None (verifiers'
own `requires_runtime`), so its recorded score is the one kept (`not_replayable`).
"""

from __future__ import annotations

import asyncio
import json
import sys


def rebuild(task, trace: dict):
    """verifiers' Trace of the recorded canonical `trace`, its scores cleared."""
    from verifiers.v1.trace import WireTrace

    nodes = [{"parent": i - 1 if i else None, "message": m, "sampled": m.get("role") == "assistant", "timestamp": 0.0}
             for i, m in enumerate(trace["messages"])]
    return WireTrace.model_validate({
        "task": {"type": type(task).__name__, "data": task.data.model_dump(mode="json"), "key": task.key, "hash": task.hash},
        "agent": {"config": {}}, "nodes": nodes, "stop_condition": trace.get("stop_condition"),
        "ok": bool(trace.get("ok")), "is_completed": bool(trace.get("is_completed")), "id": "replay"})


async def rescore(env, line: dict, nth_task) -> dict:
    recorded = (line.get("trace") or {}).get("rewards") or {}
    if line.get("trace") is None:
        return {"rewards": {}, "not_replayable": []}
    if not line["trace"].get("ok", True):  # verifiers' replay skips a trace whose rollout errored (cli/replay.py)
        return {"rewards": {}, "not_replayable": [], "skipped": "its rollout errored (verifiers' replay skips it)"}
    task = nth_task(env, int(line["vf_task"]))
    trace = rebuild(task, line["trace"])
    try:
        await task.score(trace, runtime=None)
    except Exception as err:  # noqa: BLE001 - as verifiers' replay: that trace's error, never the whole replay's
        return {"rewards": {}, "not_replayable": [], "skipped": f"scoring raised {type(err).__name__}: {str(err).splitlines()[0]}"}
    rewards = {k: None if r is None else {"score": r.score, "weight": r.weight} for k, r in sorted(trace.rewards.items())}
    return {"rewards": rewards, "not_replayable": sorted(set(recorded) - set(rewards))}


def main(cfg: dict, load, nth_task) -> int:
    """Reads stdin, writes stdout (one line per trace); `load`, `nth_task`: vf_episode.py's."""
    env = load(cfg)

    async def run() -> None:
        for raw in sys.stdin:
            if raw.strip():
                print(json.dumps(await rescore(env, json.loads(raw), nth_task), sort_keys=True), flush=True)

    asyncio.run(run())
    return 0
