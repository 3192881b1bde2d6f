"""`grpo audit`'s check of an endpoint episode row: its record replayed through the endpoint's own
code (runner.EndpointRunner), with the recorded answers in place of the engine.

Each recorded turn's request is rebuilt from the record (the messages it added, canonical, after the
assistant message grpo answered before; the first request's tools) and handed to the runner as a
live request would be: its prompt must re-render with the run's chat template and tool format to the
row's prompt ids (the first) or to the recorded prompt delta (a later one), at the row's place, with
the recorded seed and token cap; the recorded completion ids, re-parsed with grpo's parsers, must
give the recorded answer message; and the ids, mask and sampler logprobs the replay builds must be
the row's: the turns' ids exactly where the mask is 1, the glue where it is 0. So a forged token (an
id of the row that is not its turn's recorded one), a forged answer (a message that is not what its
ids parse to) and a forged prompt each name the row. Side calls are in no token of the row and are
not replayed. A verifiers episode's trace must agree with the record as vf_trace.py checks it, and
its recorded `agent.trace_problem` must be what that check gives."""

from __future__ import annotations

import json

from pipeline.agents.endpoint import chat, tokens, vf_trace
from pipeline.agents.endpoint.runner import MODEL, EndpointEpisode, EndpointRunner
from pipeline.models.engine_base import Sample


class _Recorded:
    """A request rebuilt from the record: answered into nothing."""

    def __init__(self, body: dict):
        self.key, self.body, self.raw_error, self.route = "audit", body, None, "chat"
        self.digest = chat.body_hash(body)  # as server.Request's

    def answer(self, *args) -> None:
        pass


def openai_shape(m: dict) -> dict:
    """A canonical message (chat.canonical_message) in OpenAI's shape again: canonical_message of it is `m`."""
    out = {"role": m["role"], "content": m["content"]}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(c["arguments"], str)
                                           else json.dumps(c["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]
    if m["role"] == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
    return out


def row_problems(runner: EndpointRunner, row: dict, seed: int | None = None) -> list[str]:
    """What is wrong with an endpoint episode row (empty: its record replays to it). `seed`: the
    group's seed (derive_seed(run seed, iteration, prompt id)); None leaves the recorded seeds unchecked.
    A verifiers episode's trace is then checked against the record (vf_trace.py: its trace_problem)."""
    rec = json.loads(row["episode"])
    return _token_problems(runner, row, rec, seed) or [p for p in [vf_trace.row_problem(rec)] if p]


def _token_problems(runner: EndpointRunner, row: dict, rec: dict, seed: int | None) -> list[str]:
    if any(q.get("route") == tokens.ROUTE for q in rec["requests"]):  # the client's own token ids: no template replay
        return tokens.row_problems(runner, row, rec, seed)
    turns = [q for q in rec["requests"] if q["kind"] == "turn"]
    said = [m for m in rec["messages"] if m["role"] == "assistant"]
    if len(said) != len(turns) or rec["turns"] != len(turns):
        return [f"its record holds {len(turns)} turn request(s), {len(said)} assistant message(s) and turns {rec['turns']}"]
    ids, mask = list(row["completion_ids"]), list(row["completion_mask"] or [])
    e = EndpointEpisode(None, row["group_idx"], row["sample_idx"], 0 if seed is None else seed)  # type: ignore[arg-type]
    msgs: list[dict] = []
    for j, (q, m) in enumerate(zip(turns, said)):
        if j:
            msgs.append(turns[j - 1]["message"])
        msgs += [openai_shape(n) for n in q["new_messages"]]
        tools = json.loads(rec["tool_schemas_json"])  # in the order sent: the record's own keys are sorted
        body = {"model": MODEL, "messages": msgs, **({"tools": tools} if tools else {})}
        at = len(e.ids)
        job = runner._request(e, _Recorded(body))
        if job is None:
            return [f"turn {j + 1}: its recorded request does not replay ({e.ending}: {e.detail})"]
        if j == 0 and job.prompt != list(row["prompt_ids"]):
            return ["prompt_ids are not its first request's messages rendered with the run's chat template and tools"]
        if j and (job.entry.get("prompt_delta") != q.get("prompt_delta") or ids[at:len(e.ids)] != q["prompt_delta"]):
            return [f"completion_ids at token {at} are not the glue of turn {j + 1}'s new messages as the run's template renders them"]
        if seed is not None and job.seed != q["seed"] or job.cap != q["sampling"]["max_tokens"]:
            return [f"turn {j + 1}: its recorded seed or token cap is not the one the run derives"]
        got = ids[len(e.ids):len(e.ids) + len(q["completion_ids"])]
        if got != q["completion_ids"]:
            return [f"completion_ids at token {len(e.ids)} are not turn {j + 1}'s recorded completion ids"]
        runner._answer(job, Sample(m["text"], list(q["completion_ids"]), list(q["logprobs"]), m["finish_reason"]))
        if job.entry["message"] != q["message"] or _turn(e.messages[-1]) != _turn(m):
            return [f"turn {j + 1}: its recorded answer is not what its completion ids parse to"]
    if e.ids != ids or e.mask != mask:
        return [f"its ids and mask are not its {len(turns)} recorded turn(s) and their glue (mask 1 on the sampled ids alone)"]
    if "sampler_logprobs" in row and list(row["sampler_logprobs"]) != e.logprobs:
        return ["sampler_logprobs are not its turns' recorded logprobs (0 on the glue)"]
    if row.get("completion") is not None and row["completion"] != "".join(e.texts):
        return ["completion is not its turns' recorded text and their glue"]
    return []


def _turn(m: dict) -> tuple:
    return m.get("content"), m.get("tool_calls")
