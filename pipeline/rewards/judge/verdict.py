"""Reading a judge's answer into a reward: `(value, None)`, or `(None, reason)` when it cannot be read.

Only the judge's final answer is read, as the judge means it:
- an answer the server cut off (`finish_reason: length`) is no verdict ("cut off"): its last number
  is wherever the budget ran out, often inside the judge's reasoning;
- an answer the server stopped for another reason than its own end (vLLM's `abort`, `error`,
  `repetition`; a hosted API's `content_filter`) is no verdict either ("unfinished");
- a reasoning judge's `<think>...</think>` is never read: the text after the last `</think>` is the
  answer; an answer that opens a `<think>` there and never closes it (a judge that never finished
  thinking) is "unclosed think"; a `<think>` further in (a quoted completion's) is text;
- a range ("0-10", "1 to 10": the scale, not a verdict) is no number; a scale after a score
  ("7/10", "7 out of 10", "7 (out of 10)", "**7**/10") reads the score;
- a number right after a verdict label ("Score:", "Final score:", "Rating:", "Grade:", "Verdict:") is
  read before any other: "Score: 8. It gets 2 of 3 steps right" reads 8, not the explanation's 2;
  without a label, every number counts. A quoted completion's label counts too: ask for the label
  in the rubric, so the judge's own comes last;
- of several matches the LAST is read by default (`pick: last`): the judge's conclusion comes after
  its reasoning ("3 x 4 = 12, ... Final score: 10" reads 10), and a completion the judge quotes
  (where the policy could plant "Score: 10") comes before the judge's own verdict. A judge that ends
  its answer with the quoted completion is read there: ask for the verdict last, or in a `\\boxed{}`
  or a JSON object (`read: boxed`, `read: json`), and use `pick: first` only for a judge that states
  its verdict first.

The reasons are short fixed phrases (no answer text in them), so that they can be counted:
"empty answer", "cut off", "unfinished", "unclosed think", "no number", "out of range", "no choice", "no boxed",
"not JSON", "no field <f>", "field <f> not a number".
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from pipeline.config.judge import VerdictOptions

_NUM = r"[-+\u2212]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"  # \u2212: the typeset minus sign
# a score with its scale ("7/10", "7 out of 10", "7 (out of 10)", "**7**/10") is one match whose value is
# the first number; a range ("0-10", "1 to 10") is one match that is no number (`range`)
_SCORE = re.compile(rf"(?P<range>{_NUM}\s*(?:[-\u2013\u2014]|to)\s*{_NUM})"
                    rf"|(?P<n>{_NUM})(?:[*_]*\s*\(?\s*(?:/|(?:out\s+)?of)\s*[*_]*{_NUM}\)?)?", re.IGNORECASE)
# a verdict label ("Score:", "Final score =", "**Rating:**"): the number right after one is the verdict
_LABEL = re.compile(r"(?<!\w)(?:final\s+)?(?:score|rating|grade|verdict)[*_]*\s*[:=][*_]*\s*(?:[*_]+\s*)?", re.IGNORECASE)
_BOXED = "\\boxed{"
UNFINISHED = frozenset({"abort", "error", "repetition", "content_filter"})
"""Finish reasons of an answer the server stopped before the judge finished it (vLLM v1's abort,
error and repetition; OpenAI's content_filter): like `length`, no verdict."""


def read_verdict(answer: str | None, v: VerdictOptions, finish_reason: str | None = None) -> tuple[float | None, str | None]:
    """The reward `answer` gives under `v`, or None and why not (see the module docstring)."""
    if finish_reason == "length":
        return None, "cut off"
    if finish_reason in UNFINISHED:
        return None, "unfinished"
    text = answer or ""
    if "</think>" in text:
        text = text.rpartition("</think>")[2]  # the reasoning before it is not the verdict
    text = text.strip()
    if text.startswith("<think>"):
        return None, "unclosed think"
    if not text:
        return None, "empty answer"
    if v.read == "number":
        matches = _labelled(text) or _numbers(text)
        return _in_range(_pick(matches, v), v) if matches else (None, "no number")
    if v.read == "choice":
        return _choice(text, v)
    if v.read == "boxed":
        boxes = _boxed(text)
        if not boxes:
            return None, "no boxed"
        inner = _pick(boxes, v).strip()
        if v.choices:
            return _choice(inner, v)
        numbers = _numbers(inner)
        return _in_range(numbers[0], v) if numbers else (None, "no number")
    objects = _json_objects(text)
    if not objects:
        return None, "not JSON"
    obj = _pick(objects, v)
    for key in v.field.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return None, f"no field {v.field}"
        obj = obj[key]
    if isinstance(obj, str) and v.choices:
        return _choice(obj, v)
    if isinstance(obj, bool):
        obj = float(obj)
    if isinstance(obj, str) and _SCORE.fullmatch(obj.strip()) and _numbers(obj):  # "7", "7/10"
        obj = _numbers(obj)[0]
    if not isinstance(obj, int | float):
        return None, f"field {v.field} not a number"
    return _in_range(float(obj), v)


def _numbers(text: str) -> list[float]:
    """The numbers in `text` as read for a verdict: each score once ("7/10" is 7), no range."""
    return [float(m.group("n").replace("\u2212", "-")) for m in _SCORE.finditer(text) if m.group("n") is not None]


def _labelled(text: str) -> list[float]:
    """The numbers right after a verdict label, in order ("Score: 8 ... 2 of 3 steps" gives [8])."""
    out = []
    for label in _LABEL.finditer(text):
        m = _SCORE.match(text, label.end())
        if m is not None and m.group("n") is not None:
            out.append(float(m.group("n").replace("\u2212", "-")))
    return out


def _pick(matches: list, v: VerdictOptions):
    return matches[-1] if v.pick == "last" else matches[0]


def _in_range(x: float, v: VerdictOptions) -> tuple[float | None, str | None]:
    if not math.isfinite(x) or not v.min <= x <= v.max:
        return None, "out of range"
    return ((x - v.min) / (v.max - v.min) if v.normalize else x), None


def _choice(text: str, v: VerdictOptions) -> tuple[float | None, str | None]:
    """The choice named last (pick: last) or first in `text` (whole words, case-insensitive)."""
    found = []  # (start, end, value)
    for word, value in v.choices.items():
        for match in re.finditer(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.IGNORECASE):
            found.append((match.start(), match.end(), value))
    # a choice inside a longer one is that one's ("partially correct" is not "correct")
    found = [f for f in found if not any(g[0] <= f[0] and f[1] <= g[1] and g[1] - g[0] > f[1] - f[0] for g in found)]
    if not found:
        return None, "no choice"
    return _pick(sorted(found, key=lambda f: f[0]), v)[2], None


def _boxed(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` (braces balanced), in order."""
    out, start = [], text.find(_BOXED)
    while start >= 0:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[start + len(_BOXED): i - 1])
        start = text.find(_BOXED, i)
    return out


def _json_objects(text: str) -> list[dict]:
    """The top-level JSON objects in `text` (bare, inside a ```json fence or prose), in order."""
    decoder = json.JSONDecoder()
    out, i = [], text.find("{")
    while i >= 0:
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict):
            out.append(obj)
        i = text.find("{", end)
    return out
