"""Multi-turn episodes in the reports: their records read from a rollout, their metrics
(pipeline/agents/metrics.py, logged to MLflow with the rollout's) and an episode shown as a
conversation (`grpo inspect`).
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from pipeline.agents.metrics import EVAL_EPISODE_METRICS, episode_metrics  # noqa: F401 (read from here by the reports)
from pipeline.store import stage_rel
from pipeline.run.run import Run


def _episode_rows(run: Run, k: int, columns: list[str]) -> list[dict]:
    """`columns` of iteration k's rollout rows that are episodes (parts of schema v1 have none)."""
    m = run.manifest(k, "rollout")
    out = []
    for name in sorted(n for n in m.outputs if n.endswith(".parquet")):
        with run.store.fs.open(run.store.path(f"{stage_rel(k, 'rollout')}/{name}"), "rb") as f:
            pf = pq.ParquetFile(f)
            if "episode" in pf.schema_arrow.names:
                out += [r for r in pf.read(columns=[*columns, "episode"]).to_pylist() if r["episode"] is not None]
    return out


def episode_records(run: Run, k: int) -> list[dict]:
    """Iteration k's episode records."""
    return [json.loads(r["episode"]) for r in _episode_rows(run, k, [])]


def episode_texts(run: Run, k: int):
    """(prompt_id, sample_idx, conversation) of iteration k's episodes, for `grpo inspect`."""
    import polars as pl

    rows = [{"prompt_id": r["prompt_id"], "sample_idx": r["sample_idx"], "conversation": conversation(json.loads(r["episode"]))}
            for r in _episode_rows(run, k, ["prompt_id", "sample_idx"])]
    return pl.DataFrame(rows, schema={"prompt_id": pl.Int64, "sample_idx": pl.Int32, "conversation": pl.String})


def conversation(record: dict, width: int = 400) -> str:
    """An episode as a person reads it: one block per message, long texts shortened in the middle."""

    def short(text: str) -> str:
        return text if len(text) <= width else text[: width // 2] + " ... " + text[-width // 2:]

    if record.get("route") == "endpoint":
        return _requests(record, short)
    lines = []
    if record.get("observation"):
        lines.append(f"[observation] {short(record['observation'])}")
    for msg in record["messages"]:
        if msg["role"] == "assistant":
            lines.append(f"[assistant, {msg['tokens']} tokens{', cut' if msg['finish_reason'] == 'length' else ''}] {short(msg['text'])}")
            for c in msg.get("tool_calls", []):
                f = c["function"]
                lines.append(f"  -> call {f['name'] or '(malformed)'}({json.dumps(f['arguments'], ensure_ascii=False)})")
        elif msg["role"] == "user":  # an endpoint agent's own message between turns
            lines.append(f"[user] {short(msg['content'])}")
        else:
            tag = f"tool {msg['name'] or '?'}" + (f", {msg['error']}" if msg.get("error") else "") + \
                (", dropped: over the token budget" if msg.get("dropped") else "")
            lines.append(f"[{tag}] {short(msg['content'])}")
    if record.get("environment"):  # its state at the episode's end, as Python prints it (the record holds it exactly)
        from pipeline.agents.environment import describe

        lines.append(f"[environment] {short(describe(record['environment']))}")
    lines.append(f"[end: {record['ending']} after {record['turns']} turns; {record['model_tokens']} sampled + "
                 f"{record['context_tokens']} context tokens]")
    return "\n".join(lines)


def _requests(record: dict, short) -> str:
    """An endpoint episode (pipeline/agents/endpoint) as its requests: per request its new messages,
    the answer (its calls, finish reason, tokens), a side call's model, a refusal's reason; then the ending."""
    lines = []
    for i, q in enumerate(record["requests"], 1):
        kind = q["kind"]
        if kind not in ("turn", "side"):
            lines.append(f"[request {i}: {kind}] {q.get('why')}")
            continue
        asked = q.get("asked", {})
        head = f"side call to {asked.get('model')!r}" if kind == "side" else "turn"
        lines.append(f"[request {i}: {head}{', streamed' if asked.get('stream') else ''}]")
        if kind == "side":
            lines.append(f"  > its own prompt, {len(q['prompt_ids'])} tokens")
        for m in q.get("new_messages", []):
            tag = m["role"] + (f" {m['tool_call_id']}" if m.get("tool_call_id") else "")
            lines.append(f"  > [{tag}] {short(m.get('content') or '')}")
        msg = q["message"]
        lines.append(f"  < [answer, {q['finish_reason']}, {len(q['completion_ids'])} tokens"
                     f"{', not trained' if kind == 'side' else ''}] {short(msg.get('content') or '')}")
        for c in msg.get("tool_calls", []):
            lines.append(f"    -> call {c['id']} {c['function']['name']}({c['function']['arguments']})")
    detail = f" ({record['detail']})" if record.get("detail") else ""
    lines.append(f"[end: {record['ending']}{detail} after {record['turns']} turns; {record['model_tokens']} sampled + "
                 f"{record['context_tokens']} context tokens]")
    return "\n".join(lines)
