"""Training templates: the chat template a tool run renders with where the model's own rewrites
earlier turns once more follow, as TRL 1.16 swaps one in (trl/chat_template_utils.py
`get_training_chat_template`; its `trl/chat_templates/*_training.jinja` are the reference).

Why: an episode keeps each turn's tokens as sampled and appends only the glue the template puts
after them (format.py's glue_text), so the template must render a turn the same with or without
the messages that follow it (prefix-preserving). Qwen3's does not: an assistant turn after the
last user query gets its `<think>` block while it is the last message or carries reasoning, and
loses an empty one (`<think>\\n\\n</think>\\n\\n`, what Qwen3 writes with thinking off) once the
tool's result follows. Its training template always renders the block, as TRL's
qwen3_training.jinja does.

The vendor's template is recognised by its text (sha256, trailing whitespace aside), as TRL
recognises it by equality, and changed here, not shipped as a copy: the position-dependent block
is replaced by its thinking branch. Anything else is used as the model ships it; a template that
still rewrites history is refused by `grpo init`'s probe (format.py) with the reason.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# Qwen3 (Qwen/Qwen3-*, TRL's qwen3.jinja): the assistant turn's opening, chosen by its position
_QWEN3_BY_POSITION = """\
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
"""
_QWEN3_ALWAYS_THINK = """\
        {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
"""

# {sha256 of the vendor's template: (name of the training template, [(old, new)] made to its text)}
TRAINING = {
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": ("qwen3_training", [(_QWEN3_BY_POSITION, _QWEN3_ALWAYS_THINK)]),
}


def template_sha256(text: str) -> str:
    return hashlib.sha256(text.rstrip().encode()).hexdigest()


@dataclass(frozen=True)
class ChatTemplate:
    """The template a tool run renders with: the model's own (`text` None) or a training template."""
    name: str
    """"model" (the model's own template) or the training template's name ("qwen3_training")."""
    text: str | None
    sha256: str
    """Of the template that runs."""

    def record(self) -> dict:
        """What the rollout manifest says about it."""
        return {"name": self.name, "sha256": self.sha256}


def for_tools(tokenizer) -> ChatTemplate:
    """The template a tool run of this tokenizer renders with (see the module docstring)."""
    own = tokenizer.chat_template
    if isinstance(own, dict):  # named variants: the one transformers renders when `tools=` is passed, as a tool run's is
        own = own.get("tool_use") or own.get("default")
    own = own or ""
    known = TRAINING.get(template_sha256(own))
    if known is None:
        return ChatTemplate("model", None, template_sha256(own))
    name, edits = known
    text = own
    for old, new in edits:
        assert text.count(old) == 1, f"{name}: the vendor's text changed under the same hash"
        text = text.replace(old, new)
    return ChatTemplate(name, text, template_sha256(text))
