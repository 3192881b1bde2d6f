"""`judge`'s requests (options.py): the rubric filled in for each completion, sent as one chat
completion, the verdict read from its text (verdict.py). `served_rewards` (this package) asks them."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pipeline.errors import GRPOError
from pipeline.rewards.judge.client import Answer, chat_answer, endpoint, request_body
from pipeline.rewards.judge.verdict import read_verdict

if TYPE_CHECKING:
    from pipeline.config.judge import JudgeOptions


def prompt_text(prompt: Any) -> str:
    """A prompt as the judge reads it: the string, or its messages' contents but the system prompt."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(str(m.get("content") or "") for m in prompt if isinstance(m, dict) and m.get("role") != "system")


def completion_text(completion: Any) -> str:
    """A completion as the judge reads it: the string, or the assistant turns' text (an episode's
    tool results and observations are not the model's words)."""
    if isinstance(completion, str):
        return completion
    return "\n\n".join(str(m.get("content") or "") for m in completion
                       if isinstance(m, dict) and m.get("role") == "assistant" and m.get("content"))


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)


def render(o: JudgeOptions, prompt: Any, completion: Any, row: dict[str, Any]) -> str:
    """The rubric filled in for one completion."""
    values = {c: _value(row.get(c)) for c in o.columns()}
    return o.rubric.format_map({"prompt": prompt_text(prompt), "completion": completion_text(completion), **values})


class ChatJudge:
    """How `judge` asks (options.py): one chat completion per completion, the verdict read from its text."""

    kind = "chat completion"

    def __init__(self, o: JudgeOptions):
        self.o = o
        self.url = endpoint(o)
        self.what = f"judge {o.model} at {o.base_url}"

    def bodies(self, prompts: list, completions: list, columns: dict[str, list], where: str,
               rendered: list[str] | None = None) -> list[str]:
        o = self.o
        missing = [c for c in o.columns() if c not in columns]
        if missing:
            raise GRPOError(f"{where}: the rubric names {{{missing[0]}}}, which is no dataset column")
        return [request_body(o, render(o, prompts[i], completions[i], {c: columns[c][i] for c in o.columns()}))
                for i in range(len(completions))]

    @staticmethod
    def parse(data: dict) -> Answer:
        return chat_answer(data)

    async def prepare(self, client, hdrs: dict, spec) -> None:
        """Nothing to check before asking (a served reward model checks its server: served_model.py)."""

    def read(self, answer: str | None, finish_reason: str | None = None) -> tuple[float | None, str | None]:
        return read_verdict(answer, self.o.verdict, finish_reason)
