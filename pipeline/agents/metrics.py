"""The metrics of multi-turn episodes, from their records: logged to MLflow with the rollout's
(pipeline/report/) and, a few of them, in the eval's figures (pipeline/eval/metrics.py).

Metrics, over an iteration's episodes (none when it has none):
    episodes/turns_mean, episodes/turns_max        model turns per episode
    episodes/ending/<answered|malformed|max_turns|max_episode_tokens|length|tool_timeout>   share of episodes
    tools/call_frequency                           tool calls per episode (TRL's name)
    tools/used                                     share of episodes with at least one call
    tools/failure_frequency                        failed calls / calls (TRL's name)
    tools/calls/<tool>                             calls of each tool per episode
    tools/errors/<malformed|unknown_tool|bad_arguments|raised|timeout>   count (malformed: records written
                                                   before a malformed call ended its episode)
    tools/dropped                                  results run but cut by the token budget
    tokens/model_share                             sampled tokens / all completion tokens
"""

from __future__ import annotations

from collections import Counter

ENDINGS = ("answered", "malformed", "max_turns", "max_episode_tokens", "length", "tool_timeout")
ERRORS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")


def episode_metrics(records: list[dict]) -> dict[str, float]:
    if not records:
        return {}
    n = len(records)
    turns = [r["turns"] for r in records]
    endings = Counter(r["ending"] for r in records)
    calls, errors = Counter(), Counter()
    dropped = used = 0
    for r in records:
        used += any(msg["role"] == "tool" for msg in r["messages"])
        for msg in r["messages"]:
            if msg["role"] == "tool":
                calls[msg["name"] or "malformed"] += 1
                if msg.get("error"):
                    errors[msg["error"]] += 1
                dropped += bool(msg.get("dropped"))
    total_calls = sum(calls.values())
    model = sum(r["model_tokens"] for r in records)
    context = sum(r["context_tokens"] for r in records)
    out = {
        "episodes/turns_mean": sum(turns) / n,
        "episodes/turns_max": float(max(turns)),
        **{f"episodes/ending/{e}": endings[e] / n for e in ENDINGS},
        "tools/call_frequency": total_calls / n,
        "tools/used": used / n,
        "tools/failure_frequency": sum(errors.values()) / total_calls if total_calls else 0.0,
        **{f"tools/calls/{name}": c / n for name, c in sorted(calls.items())},
        **{f"tools/errors/{e}": float(errors[e]) for e in ERRORS},
        "tools/dropped": float(dropped),
        "tokens/model_share": model / (model + context) if model + context else float("nan"),
    }
    return out


EVAL_EPISODE_METRICS = ("episodes/turns_mean", "tools/call_frequency", "tools/used", "episodes/ending/answered")
"""What held-out episodes add to the eval's figures, as eval/<name>: how the policy uses its tools, how
often it ends with an answer (pipeline/eval/metrics.py)."""
