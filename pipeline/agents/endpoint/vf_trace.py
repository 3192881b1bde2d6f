"""The verifiers trace checked against grpo's record of the same episode (`rollout.agent.verifiers`).

The trace (vf_episode.py's canonical one, `episode.agent.result.verifiers.trace`) is what verifiers
scored; the record's requests are what grpo sampled and trained on. They must tell one story: the
trace has a single branch, its assistant messages are the record's turns in order (on the chat route
each is the answer grpo sent and the messages before it are the ones the turn's request added; on the
tokens route, where the trace carries the sampled ids of each assistant node, those ids are the turn's
completion ids). A harness (or a taskset's `@vf.intercept` hook, rewriting grpo's answer before the harness
sees it) that rewrote the history after grpo answered (so its reward read another
conversation than the one trained on) gives `problem` one line, recorded at rollout as
`episode.agent.trace_problem` (null when they agree); `grpo audit` recomputes it from the record and
names a row whose recorded trace_problem is not the recomputed one (a forged trace, a second branch,
a fake or hidden trace_problem).
"""

from __future__ import annotations

from pipeline.agents.endpoint import chat


def _calls(m: dict) -> list:
    out = []
    for c in m.get("tool_calls") or []:
        f = c.get("function") or c
        out.append((f.get("name"), chat._arguments(f.get("arguments"))))
    return out


def shape(m: dict) -> tuple:
    """What a message says, in either form (verifiers' message, grpo's canonical one)."""
    role = "system" if m.get("role") == "developer" else m.get("role")
    return role, (chat.text_of(m.get("content")) or "").strip(), _calls(m)


def problem(requests: list[dict], vf: dict | None) -> str | None:
    """One line on how the trace disagrees with the record's turns, or None where it agrees (or has no trace)."""
    trace = (vf or {}).get("trace")
    if trace is None:
        return None
    if trace.get("branches", 1) > 1:  # none: no turn was answered (a first request refused), as the record holds none
        return f"the verifiers trace has {trace['branches']} branches; grpo's record holds one conversation"
    turns = [q for q in requests if q["kind"] == "turn"]
    msgs = trace.get("messages") or []
    said = [m for m in msgs if m.get("role") == "assistant"]
    if len(said) != len(turns):
        return f"the verifiers trace holds {len(said)} assistant message(s), grpo's record {len(turns)} turn(s)"
    if "sampled_ids" in trace:  # the tokens route: verifiers' own ids of each sampled node
        for j, (ids, q) in enumerate(zip(trace["sampled_ids"], turns)):
            if list(ids) != list(q["completion_ids"]):
                return f"the verifiers trace's assistant message {j + 1} is not turn {j + 1}'s sampled ids: the harness or a taskset hook (@vf.intercept) rewrote the history"
        return None
    if any(q.get("route") == "tokens" for q in turns):
        want = [("assistant", (q["message"].get("content") or "").strip(), []) for q in turns]
        got = [shape(m)[:2] + ([],) for m in said]
    else:
        want = [shape(m) for q in turns for m in [*q.get("new_messages", []), q["message"]]]
        got = [shape(m) for m in msgs]
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"the verifiers trace's message {i + 1} ({a[0]}) is not the one grpo's record holds there: the harness or a taskset hook (@vf.intercept) rewrote the history"
    if len(got) != len(want):
        return f"the verifiers trace holds {len(got)} message(s), grpo's record {len(want)}: the harness or a taskset hook (@vf.intercept) rewrote the history"
    return None


def errors(vf: dict | None) -> str | None:
    """One line naming what verifiers recorded as going wrong in the episode (a harness that crashed, a
    reward or a tool server that raised: the trace's and the episode's errors), or None: for the log,
    as a crashed agent's output is (the row is trained at the rewards that did run, None left out)."""
    errs = [*(vf or {}).get("episode_errors", []), *(((vf or {}).get("trace") or {}).get("errors") or [])]
    said = [f"{e.get('type')}: {next((ln for ln in str(e.get('message')).splitlines() if ln.strip()), '')[:200]}" for e in errs]
    return "; ".join(said) or None


def row_problem(rec: dict) -> str | None:
    """`grpo audit`'s line for a verifiers episode whose recorded trace_problem is not the one its record gives."""
    agent = rec.get("agent") or {}
    vf = (agent.get("result") or {}).get("verifiers")
    if vf is None:
        return None
    got, said = problem(rec["requests"], vf), agent.get("trace_problem")
    if got == said:
        return None
    if said is None:
        return f"its verifiers trace disagrees with its record and no trace_problem says so ({got})"
    if got is None:
        return f"its trace_problem ({said!r}) is not what its trace and record give (they agree)"
    return f"its trace_problem ({said!r}) is not what its trace and record give ({got})"
