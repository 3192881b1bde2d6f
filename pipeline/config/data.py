"""The `data:` section: where prompts come from and how they are rendered."""

from __future__ import annotations

from pipeline.config.base import Section
from pipeline.config.eval import EvalSet


class DataConfig(Section):
    """Where prompts come from and how they are rendered."""

    train: str
    """Training prompts: a .jsonl, .json or .parquet file, a directory or glob of Parquet shards (Hub layout), or a `datasets` save_to_disk directory (local path or fsspec URI)."""
    eval: str | dict[str, str | EvalSet] | None = None
    """Held-out prompts for periodic evaluation (same forms as train), or a mapping of set names to
    files ({path, reward} for a set with its own accuracy reward), each reported under its name; None disables eval."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages ({role, content})."""
    prompt_template: str | None = None
    """Builds the prompt column from other columns where a row has none, e.g. "{question}" (Python str.format fields)."""
    system_prompt: str | None = None
    """System message prepended to every prompt when the chat template is applied."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template; false feeds plain text prompts as they are."""
