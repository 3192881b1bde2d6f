"""The date a chat template reads, pinned for a run (`data.template_date`).

Some vendors' templates write today's date into every prompt through transformers'
`strftime_now` (gpt-oss's "Current date:", Llama 3.x's "Today Date:"): rendered on another day,
the same conversation is other bytes, so a resume, a replay or a rerun of the same config would
sample from other prompts. `grpo init` records the day it ran when the model's template reads the
date; every tokenizer that renders for the run is `dated` with it, and a template's `strftime_now`
then formats that day (midnight UTC) whenever it runs."""

from __future__ import annotations

import datetime
import functools
from pathlib import Path

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def today() -> str:
    """The day `grpo init` records (UTC)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def reads_date(model_dir: str | Path) -> bool:
    """Whether the model's chat templates (any of them, in any of the files transformers reads them
    from) call `strftime_now`."""
    folder = Path(model_dir)
    files = [folder / name for name in TEMPLATE_FILES] + sorted((folder / "additional_chat_templates").glob("*.jinja"))
    return any("strftime_now" in f.read_text(errors="replace") for f in files if f.is_file())


def with_template_date(cfg, model_dir: str | Path, stored=None):
    """`cfg` with `data.template_date` filled where it is unset: an existing run's `stored` config
    keeps its day (none if it has none); a new run records today if the model's template reads it."""
    data = cfg.data
    if data.template_date is not None or not data.chat_template:
        return cfg
    if stored is not None:
        day = stored.data.template_date
    else:
        day = today() if reads_date(model_dir) else None
    return cfg if day is None else cfg.model_copy(update={"data": data.model_copy(update={"template_date": day})})


def dated(tokenizer, day: str | None):
    """`tokenizer`, whose chat templates read `day` as today (unchanged for None)."""
    if day is not None:
        when = datetime.datetime.fromisoformat(day).replace(tzinfo=datetime.timezone.utc)
        tokenizer.apply_chat_template = functools.partial(tokenizer.apply_chat_template, strftime_now=when.strftime)
    return tokenizer
