"""The options of the `judge` built-in (`rewards[j].kwargs`), and what a rubric names.

    rewards:
      - fn: judge
        max_concurrency: 4          # requests in flight at once
        timeout_s: 30               # per request
        retries: 3                  # further attempts after a 408, 409, 429, 5xx, a timeout or a lost connection
        kwargs:
          base_url: http://127.0.0.1:8000/v1
          model: judge-model
          api_key_env: JUDGE_API_KEY        # the NAME of the variable; the key is never stored
          rubric: "Question: {prompt}\\nAnswer: {completion}\\nReference: {answer}\\nScore 0-10:"
          verdict: {read: number, min: 0, max: 10}
          temperature: 0.0
          seed: 0
"""

from __future__ import annotations

import string
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from pipeline.config.base import Section

FIELDS = ("prompt", "completion")
"""What a rubric names besides dataset columns: the prompt text and the completion text."""


class VerdictOptions(Section):
    """How a judge's answer is read into a reward (pipeline/rewards/judge/verdict.py): after its reasoning (`</think>`), never from an answer cut off."""

    read: Literal["number", "choice", "boxed", "json"] = "number"
    """number: a number in the answer ("7/10" reads 7); choice: one of `choices` it names; boxed: a `\\boxed{}`'s number (or choice, with `choices`); json: `field` of a JSON object in it."""
    pick: Literal["last", "first"] = "last"
    """Of several matches (numbers, choices, boxes, JSON objects) in the answer after its reasoning: the last (the judge's conclusion), or the first."""
    min: float = 0.0
    """number / boxed / json: the smallest valid value; one below is unreadable."""
    max: float = 10.0
    """number / boxed / json: the largest valid value; one above is unreadable."""
    normalize: bool = False
    """number / boxed / json: map [min, max] onto [0, 1]."""
    choices: dict[str, float] = {}
    """choice (and a json field or a box holding a word): each word the judge may answer, and its value (case-insensitive, whole words)."""
    field: str | None = None
    """json: the key of the verdict in the answer's JSON object (a dotted path for nested ones)."""

    @model_validator(mode="after")
    def _complete(self) -> VerdictOptions:
        if self.read == "choice" and not self.choices:
            raise ValueError("read: choice needs `choices` ({word: value, ...})")
        if self.read == "json" and not self.field:
            raise ValueError("read: json needs `field`")
        if self.min >= self.max:
            raise ValueError(f"need min < max, got min={self.min:g}, max={self.max:g}")
        return self


class JudgeOptions(Section):
    base_url: str = Field(min_length=1)
    """The OpenAI-compatible server, up to `/v1` (requests go to base_url + /chat/completions). A secret in it (`?key=`, a user:password) is written `${NAME}`, read from that environment variable where each request is sent and never stored."""
    model: str = Field(min_length=1)
    """The model name the server serves (`/v1/models`)."""
    api_key_env: str | None = None
    """The NAME of the environment variable holding the API key (sent as a Bearer token); None: no key. The key is never stored."""
    rubric: str = Field(min_length=1)
    """The user message, a template: {prompt}, {completion} (for episodes: the model's own turns) and {<dataset column>} (or a dotted path into one, {reward_model.ground_truth}); {{ and }} for braces."""
    system: str | None = None
    """An optional system message sent before the rubric."""
    verdict: VerdictOptions = VerdictOptions()
    """How the answer is read into a reward."""
    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature of the judge; 0 (greedy) with a `seed` gives repeatable verdicts."""
    max_tokens: int = Field(1024, ge=1)
    """Longest answer, reasoning included: an answer cut off there (finish_reason length) gives no verdict. 1024 lets a reasoning judge finish thinking; a judge that answers at once stops earlier and pays for what it wrote only."""
    seed: int | None = 0
    """Sent with every request (servers that honour it, like vLLM, then sample repeatably); None: not sent."""
    on_failure: Literal["error", "none"] = "error"
    """A request that fails (after its retries, or at once with an HTTP 4xx): stop the stage (answers so far are kept), or give that completion None."""

    @field_validator("base_url")
    @classmethod
    def _no_secret_written(cls, value: str, info: ValidationInfo) -> str:
        from pipeline.config.urls import checked

        return checked(value, info.context)

    @field_validator("rubric")
    @classmethod
    def _template(cls, value: str) -> str:
        try:
            names = rubric_fields(value)
        except ValueError as err:
            raise ValueError(f"not a valid template ({err}); write {{{{ and }}}} for literal braces") from None
        if "completion" not in names:
            raise ValueError("the rubric must name {completion}")
        return value

    def columns(self) -> list[str]:
        return [c for c in rubric_fields(self.rubric) if c not in FIELDS]

    @property
    def served(self) -> bool:
        """A judge is always asked over HTTP, its answers recorded (pipeline.rewards.judge.served_rewards)."""
        return True


def rubric_fields(template: str) -> list[str]:
    """The names a rubric template uses, in order, once each: a column, or a dotted path into one
    ({reward_model.ground_truth}: a field of a struct column or nested JSON object; {x[0]} names x)."""
    names: list[str] = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None:
            continue
        base = name.split("[")[0]
        if not base or base.split(".")[0].isdigit() or "" in base.split("."):
            raise ValueError("positional fields {} are not allowed; name a field")
        if base not in names:
            names.append(base)
    return names
