"""Reading a judge's answer into a reward: `(value, None)`, or `(None, reason)` when it cannot be read.

The reasons are short fixed phrases (no answer text in them), so that they can be counted:
"empty answer", "no number", "out of range", "no choice", "not JSON", "no field <f>", "field <f> not a number".
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: options.py picks its asker from these modules
    from pipeline.rewards.judge.options import VerdictOptions

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def read_verdict(answer: str | None, v: VerdictOptions) -> tuple[float | None, str | None]:
    """The reward `answer` gives under `v`, or None and why not. A reasoning model's
    <think>...</think> block is skipped."""
    text = _THINK.sub("", answer or "").strip()
    if not text:
        return None, "empty answer"
    if v.read == "number":
        match = _NUMBER.search(text)
        return _in_range(float(match.group()), v) if match else (None, "no number")
    if v.read == "choice":
        return _choice(text, v)
    obj = _json_object(text)
    if obj is None:
        return None, "not JSON"
    for key in v.field.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return None, f"no field {v.field}"
        obj = obj[key]
    if isinstance(obj, str) and v.choices:
        return _choice(obj, v)
    if isinstance(obj, bool):
        obj = float(obj)
    if isinstance(obj, str) and _NUMBER.fullmatch(obj.strip()):
        obj = float(obj)
    if not isinstance(obj, int | float):
        return None, f"field {v.field} not a number"
    return _in_range(float(obj), v)


def _in_range(x: float, v: VerdictOptions) -> tuple[float | None, str | None]:
    if not math.isfinite(x) or not v.min <= x <= v.max:
        return None, "out of range"
    return ((x - v.min) / (v.max - v.min) if v.normalize else x), None


def _choice(text: str, v: VerdictOptions) -> tuple[float | None, str | None]:
    """The choice named first in `text` (whole words, case-insensitive)."""
    best = None
    for word, value in v.choices.items():
        match = re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.IGNORECASE)
        if match and (best is None or match.start() < best[0]):
            best = (match.start(), value)
    return (best[1], None) if best else (None, "no choice")


def _json_object(text: str) -> dict | None:
    """The first JSON object in `text` (a bare one, or inside a ```json fence or prose)."""
    decoder = json.JSONDecoder()
    for start in [m.start() for m in re.finditer(r"\{", text)]:
        try:
            obj, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    return None
