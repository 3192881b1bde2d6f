"""The `data:` section: where prompts come from and how they are rendered."""

from __future__ import annotations

import datetime

from pydantic import ValidationInfo, field_validator

from pipeline.config.base import Section
from pipeline.config.eval import EvalSet


class DataConfig(Section):
    """Where prompts come from and how they are rendered."""

    train: str
    """Training prompts: a .jsonl, .json or .parquet file, a directory or glob of Parquet shards (Hub layout), or a `datasets` save_to_disk directory (local path or fsspec URI). A secret in a URL (a signed URL's `X-Amz-Signature`, `sig`, `token`, a user:password) is written `${NAME}`, read from that environment variable where the data is read and never stored."""
    eval: str | dict[str, str | EvalSet] | None = None
    """Held-out prompts for periodic evaluation (same forms as train), or a mapping of set names to
    files ({path, reward} for a set with its own accuracy reward), each reported under its name; None disables eval."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages ({role, content}); a dotted path names a field of a struct column or nested JSON object ("extra_info.question")."""
    prompt_template: str | None = None
    """Builds the prompt column from other columns where a row has none, e.g. "{question}" (Python str.format fields; a dotted path names a field of a struct column or nested JSON object, "{extra_info.question}")."""
    system_prompt: str | None = None
    """System message prepended to every prompt when the chat template is applied."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template; false feeds plain text prompts as they are."""
    template_date: str | None = None
    """The day (YYYY-MM-DD) a chat template that writes today's date reads (transformers' `strftime_now`:
    gpt-oss's "Current date", Llama 3.x's "Today Date"). Unset, `grpo init` records the day it runs when the
    model's template reads the date, so every stage, resume, replay and rerun of the run's config renders
    the same prompt bytes on any later day; a template that does not read it leaves this unset."""

    @field_validator("train")
    @classmethod
    def _no_secret_in_train(cls, value: str, info: ValidationInfo) -> str:
        from pipeline.config.urls import checked_location

        return checked_location(value, info.context)

    @field_validator("eval")
    @classmethod
    def _no_secret_in_eval(cls, value, info: ValidationInfo):
        from pipeline.config.urls import checked_location

        if isinstance(value, str):
            return checked_location(value, info.context)
        for name, v in (value or {}).items():
            try:
                checked_location(v if isinstance(v, str) else v.path, info.context)
            except ValueError as err:
                raise ValueError(f"set {name!r}: {err}") from None
        return value

    @field_validator("template_date", mode="before")
    @classmethod
    def _day(cls, v):
        if isinstance(v, datetime.date) and not isinstance(v, datetime.datetime):  # YAML reads 2026-11-27 as a date
            return v.isoformat()
        if v is not None:
            try:
                if not (isinstance(v, str) and len(v) == 10 and datetime.date.fromisoformat(v)):
                    raise ValueError
            except ValueError:
                raise ValueError(f"a day as YYYY-MM-DD, not {v!r}") from None
        return v
