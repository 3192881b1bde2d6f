"""`openrlhf_server`: a reward server speaking OpenRLHF's protocol (`openrlhf.cli.serve_rm`, or any
server written for OpenRLHF's `--remote_rm_url http://...`), asked with the judge's machinery.

    python -m openrlhf.cli.serve_rm --reward.model_name_or_path RM --port 5000

    rewards:
      - fn: openrlhf_server
        max_concurrency: 8
        kwargs: {url: http://127.0.0.1:5000/get_reward, label_key: answer}

Each completion is one POST of `{"query": [q], "prompts": [p], "labels": [l]}` to `url`, as
OpenRLHF's own client (commit 3c3be623, openrlhf/utils/agent.py `_fetch_rewards_via_http`) sends
one per sample: q, p and l are what the file contract passes (pipeline/rewards/openrlhf.py `inputs`:
the rendered prompt followed by the completion, the rendered prompt, the `label_key` column). The
answer `{"rewards": [r], "scores": [...], "extra_logs": {...}}` is stored whole (canonical JSON);
`rewards[0]` is the reward, each `extra_logs` entry an `extra_<name>` column as the file contract
logs it, `scores` (OpenRLHF's dynamic-filtering score) is not used.

The server reports nothing of what it serves (no `/models`): a known answer is reused when the
request and the URL are the same (`server`, part of every answer's record, is the URL).
"""

from __future__ import annotations

import json
import math
import numbers

from pipeline.errors import GRPOError
from pipeline.rewards.builtins import completion_text
from pipeline.rewards.judge.client import Answer
from pipeline.rewards.openrlhf import inputs, log_value


def request_body(query: str, prompt: str, label) -> str:
    """One completion's request, canonical JSON: what is sent, stored and hashed."""
    return json.dumps({"query": [query], "prompts": [prompt], "labels": [label]}, sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"))


def reward_answer(data: dict) -> Answer:
    """The whole answer as canonical JSON; a body without `rewards` is no answer (retried as a failed attempt)."""
    if not isinstance(data, dict) or "rewards" not in data:
        raise KeyError("rewards")
    return Answer(text=json.dumps(data, sort_keys=True, ensure_ascii=False, separators=(",", ":")), latency_s=0.0,
                  prompt_tokens=None, completion_tokens=None, server_model=None, attempts=0)


def read_reward(answer: str | None) -> tuple[float | None, str | None]:
    """`rewards[0]` of a stored answer, or None and why not: "not a reward answer", "not one reward",
    "not a number", "not finite"."""
    try:
        data = json.loads(answer or "")
    except (ValueError, TypeError):
        return None, "not a reward answer"
    rewards = data.get("rewards") if isinstance(data, dict) else None
    if isinstance(rewards, numbers.Real):  # a server answering the number itself
        rewards = [rewards]
    if not isinstance(rewards, list):
        return None, "not a reward answer"
    if len(rewards) != 1:
        return None, f"not one reward ({len(rewards)})"
    value = rewards[0]
    if value is None:  # does not apply: as a reward function's None
        return None, None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None, "not a number"
    if not math.isfinite(value):
        return None, "not finite"
    return float(value), None


class OpenRLHFServer:
    """How `openrlhf_server` asks: one POST per completion to `url`, the reward read from `rewards`."""

    kind = "reward answer"
    lists_models = False
    """No OpenAI /models route: what it serves is known by its URL alone."""

    def __init__(self, o):
        self.o = o
        self.url = o.url
        self.what = f"reward server {o.url}"

    @property
    def identity(self) -> str:
        return self.url

    def bodies(self, prompts: list, completions: list, columns: dict[str, list], where: str,
               rendered: list[str] | None = None) -> list[str]:
        texts = [completion_text(c) for c in completions]
        queries, rendered_, labels = inputs(prompts, rendered, texts, columns, self.o.label_key, where)
        out = []
        for i, (q, p, label) in enumerate(zip(queries, rendered_, labels)):
            try:
                out.append(request_body(q, p, label))
            except (TypeError, ValueError) as err:
                raise GRPOError(f"{where} row {i}: its label ({type(label).__name__}) cannot be sent as JSON: {err}") from None
        return out

    @staticmethod
    def parse(data: dict) -> Answer:
        return reward_answer(data)

    async def prepare(self, client, hdrs: dict, spec) -> None:
        """Nothing to check before asking."""

    def read(self, answer: str | None, finish_reason: str | None = None) -> tuple[float | None, str | None]:
        return read_reward(answer)

    def logs(self, answer: str | None) -> dict:
        """The answer's `extra_logs`, one value each (as the file contract logs them); {} when it has none."""
        try:
            data = json.loads(answer or "")
        except (ValueError, TypeError):
            return {}
        extra = data.get("extra_logs") if isinstance(data, dict) else None
        if not isinstance(extra, dict):
            return {}
        out = {}
        for name, v in extra.items():
            try:
                out[str(name)] = log_value(v)
            except GRPOError:
                out[str(name)] = json.dumps(v)
        return out
