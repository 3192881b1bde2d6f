"""The built-in reward functions, each in TRL's reward contract (see pipeline.rewards.contract).

Their options are keyword-only arguments; the config validates them first (pipeline.config.rewards),
so a call here gets every option, typed, defaults filled in.

  correct       1 if the last <answer>...</answer> equals the gold answer (math-verify, pipeline.rewards.answers)
  format        1 for exactly <think>...</think><answer>...</answer>, 0.5 for only an answer block
  contains      `value` if `keyword` occurs in the completion
  length_range  `value` if the length (tokens or words) is within [min_tokens, max_tokens]
  overlong      DAPO's soft overlong punishment: 0, a linear ramp to -1 in the last `buffer` tokens
  reward_model  a frozen Hugging Face sequence-classification model's logit (or probability)
  code_tests    fraction of a row's assert-style tests the completion's code passes (sandboxed)

They read the model's own words. A multi-turn episode's completion (TRL's message list) also
holds tool results, which the model did not write: `correct`, `format` and `code_tests` read the
final assistant message (`final_text`), `contains` and `reward_model` every assistant message
(`model_text`), and the lengths count the tokens the model sampled (compute_rewards hands the
built-ins completion_ids without the tool-result and template tokens). A single completion is
its one assistant message: both readings are the whole completion, as before.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pipeline.rewards.answers import answers_match, extract_answer, extract_gold, follows_format
from pipeline.errors import GRPOError

RewardFn = Callable[..., list]
Reward = float | None

# ------------------------------------------------------------------------------------- helpers


def _content(message: dict) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def completion_text(completion: str | list[dict]) -> str:
    """The text of a completion in either shape (a string, or a list of messages), every message
    joined: tool results included. The built-ins read `final_text` or `model_text` instead."""
    return completion if isinstance(completion, str) else "".join(_content(m) for m in completion)


def _assistant(completion: list[dict]) -> list[dict]:
    return [m for m in completion if m.get("role", "assistant") == "assistant"]


def model_text(completion: str | list[dict]) -> str:
    """What the model wrote: a string completion, or its assistant messages' contents joined by
    newlines (tool results and environment observations left out)."""
    return completion if isinstance(completion, str) else "\n".join(_content(m) for m in _assistant(completion))


def final_text(completion: str | list[dict]) -> str:
    """The model's last word: a string completion, or its last assistant message's content
    ("" when it has none)."""
    if isinstance(completion, str):
        return completion
    said = _assistant(completion)
    return _content(said[-1]) if said else ""


def _prompt_text(prompt: str | list[dict]) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(_content(m) for m in prompt)


_TRL_EXTRAS = ("trainer_state", "log_metric", "log_extra")  # passed with the columns; not columns


def _column(columns: dict[str, list], name: str, option: str) -> list:
    """A dataset column, or a field inside a struct column by a dotted path (`reward_model.ground_truth`)."""
    head, *path = name.split(".") if name not in columns else (name,)
    if path and head in columns:
        values = []
        for i, v in enumerate(columns[head]):
            for k in path:  # a null struct holds no value: None, as a null in a plain column
                if v is not None and (not isinstance(v, dict) or k not in v):
                    raise GRPOError(f"row {i}: column {head!r} has no field {'.'.join(path)!r}; set the `{option}` option")
                v = None if v is None else v[k]
            values.append(v)
        return values
    if name not in columns:
        have = ", ".join(sorted(c for c in columns if c not in _TRL_EXTRAS)) or "none"
        raise GRPOError(f"no dataset column {name!r} (dataset columns: {have}); set the `{option}` option")
    return columns[name]


def _lengths(completions: list, completion_ids: list | None, unit: str) -> list[int]:
    """Model tokens (the built-ins' completion_ids hold only those) or the model's words."""
    if unit == "words":
        return [len(model_text(c).split()) for c in completions]
    if completion_ids is None:
        raise GRPOError("completion_ids are needed to count tokens")
    return [len(ids) for ids in completion_ids]


# ------------------------------------------------------------------------------------ built-ins


def correct(prompts, completions, completion_ids=None, *, answer_column: str = "answer", **columns) -> list[Reward]:
    """1.0 when the final assistant message's last <answer>...</answer> equals the gold answer, else 0.0.

    Gold: the text after `####` in the dataset's `answer_column` (GSM8K), or the whole value
    when it has no `####`. Both sides are parsed and compared by math-verify (numbers,
    fractions, percentages, thousands separators, \\boxed{}, LaTeX: "1,000" == "1000.0",
    "\\frac{1}{2}" == "0.5"); see pipeline.rewards.answers.answers_match for the fallback.
    None where the row has no gold answer.
    """
    golds = _column(columns, answer_column, "answer_column")
    rewards: list[Reward] = []
    for completion, gold in zip(completions, golds):
        if gold is None:
            rewards.append(None)
            continue
        reference = extract_gold(str(gold))
        reference = str(gold).strip() if reference is None else reference
        rewards.append(1.0 if answers_match(extract_answer(final_text(completion)), reference) else 0.0)
    return rewards


def format_reward(prompts, completions, completion_ids=None, **columns) -> list[Reward]:
    """1.0 when the final assistant message is exactly `<think>...</think><answer>...</answer>`
    (whitespace around the blocks allowed, nothing else); 0.5 when it only has an
    <answer>...</answer> block somewhere; 0.0 otherwise."""
    rewards: list[Reward] = []
    for completion in completions:
        text = final_text(completion)
        rewards.append(1.0 if follows_format(text) else 0.5 if extract_answer(text) is not None else 0.0)
    return rewards


def contains(
    prompts, completions, completion_ids=None, *, keyword: str, value: float = 1.0, case_sensitive: bool = False, **columns
) -> list[Reward]:
    """`value` if `keyword` occurs in what the model wrote (its assistant messages), else 0.0."""
    needle = keyword if case_sensitive else keyword.lower()
    texts = [model_text(c) if case_sensitive else model_text(c).lower() for c in completions]
    return [value if needle in text else 0.0 for text in texts]


def length_range(
    prompts,
    completions,
    completion_ids=None,
    *,
    min_tokens: int = 0,
    max_tokens: int | None = None,
    value: float = 1.0,
    unit: Literal["tokens", "words"] = "tokens",
    **columns,
) -> list[Reward]:
    """`value` if min_tokens <= length <= max_tokens (None: no upper bound), else 0.0.
    Length is the model's tokens for unit "tokens", the whitespace-separated words of its
    assistant messages for "words"."""
    upper = math.inf if max_tokens is None else max_tokens
    return [value if min_tokens <= n <= upper else 0.0 for n in _lengths(completions, completion_ids, unit)]


def overlong(prompts, completions, completion_ids=None, *, max_tokens: int, buffer: int, **columns) -> list[Reward]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) with L_max = max_tokens and
    L_cache = buffer, on the completion's length |y| in the model's tokens:

        0                                  if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
        -1                                 if |y| > L_max
    """
    # 0 < buffer <= max_tokens: checked by the config (OverlongOptions)
    start = max_tokens - buffer
    rewards: list[Reward] = []
    for n in _lengths(completions, completion_ids, "tokens"):
        rewards.append(0.0 if n <= start else (start - n) / buffer if n <= max_tokens else -1.0)
    return rewards


_REWARD_MODELS: dict[tuple[str, str], tuple[Any, Any]] = {}


def _load_reward_model(path: str, device: str) -> tuple[Any, Any]:
    """(model, tokenizer), loaded once per (path, device) in this process, frozen, in eval mode."""
    key = (path, device)
    if key not in _REWARD_MODELS:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if path.startswith((".", "/", "~")) and not Path(path).expanduser().exists():
            raise GRPOError(f"reward model {path}: no such directory")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
        except Exception as err:  # transformers raises OSError, ValueError, KeyError, ... for a bad directory
            raise GRPOError(f"reward model {path}: cannot load it ({str(err).strip().splitlines()[0]})") from err
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise GRPOError(f"reward model {path}: its tokenizer has neither a pad nor an eos token")
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            # Decoder classifiers score the last non-pad token; they need to know which id pads.
            model.config.pad_token_id = tokenizer.pad_token_id
        model.requires_grad_(False)
        _REWARD_MODELS[key] = (model.to(device).eval(), tokenizer)
    return _REWARD_MODELS[key]


def reward_model(
    prompts,
    completions,
    completion_ids=None,
    *,
    model: str,
    batch_size: int = 16,
    label: int | str = 0,
    sign: Literal[1, -1] = 1,
    use_prompt: bool = True,
    activation: Literal["none", "sigmoid", "softmax"] = "none",
    max_length: int = 512,
    device: str = "auto",
    **columns,
) -> list[Reward]:
    """sign * activation(logits)[label] of a frozen sequence-classification model on each text.

    The text is prompt + completion (as in the toxicity workflow: a classifier sees the whole
    exchange; an episode's completion is its assistant messages), or the completion alone with
    use_prompt false; chat prompts go through the
    reward tokenizer's chat template when it has one, else their contents are joined by
    newlines. `label` is a logit index or a name from the model's id2label. activation:
    none (the raw logit), sigmoid (of that logit), softmax (over all logits). sign -1 turns
    a "bad" score (toxicity) into a reward. Texts are truncated to max_length tokens.
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    net, tokenizer = _load_reward_model(model, device)
    if isinstance(label, str):
        id2label = {int(i): name for i, name in (net.config.id2label or {}).items()}
        ids = {name: i for i, name in id2label.items()}
        if label not in ids:
            names = ", ".join(id2label[i] for i in sorted(id2label)) or "none"
            raise GRPOError(f"reward model {model}: no label {label!r} (labels: {names})")
        label = ids[label]
    if not 0 <= label < net.config.num_labels:
        raise GRPOError(f"reward model {model}: label {label} out of range (the model has {net.config.num_labels} labels)")

    texts = []
    for prompt, completion in zip(prompts, completions):
        said = model_text(completion)  # an episode's assistant messages, not its tool results
        if not use_prompt:
            texts.append(said)
        elif isinstance(prompt, str):
            texts.append(prompt + said)
        elif tokenizer.chat_template:
            messages = list(prompt) + [{"role": "assistant", "content": said}]
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
        else:
            texts.append(_prompt_text(prompt) + "\n" + said)

    scores: list[Reward] = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[start : start + batch_size], return_tensors="pt", padding=True, truncation=True, max_length=max_length
            ).to(device)
            logits = net(**batch).logits.float()  # [B, num_labels]
            if activation == "softmax":
                logits = logits.softmax(dim=-1)
            elif activation == "sigmoid":
                logits = logits.sigmoid()
            scores.extend((sign * logits[:, label]).tolist())  # [B]
    return scores


_PYTHON_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.S | re.I)
_BARE_BLOCK = re.compile(r"```[ \t]*\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    """The last ```python (or ```py) fenced block; else the last untagged ``` block; else the text."""
    for pattern in (_PYTHON_BLOCK, _BARE_BLOCK):
        blocks = pattern.findall(text)
        if blocks:
            return blocks[-1]
    return text


def _tests_of(value: Any, row: int, column: str) -> list[str] | None:
    """A row's test cases: a list of assert strings, or a JSON string of one; None if absent."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, list | tuple) or not all(isinstance(t, str) for t in value):
        raise GRPOError(f"row {row}: column {column!r} is not a list of test strings (or a JSON string of one)")
    return list(value) or None


def code_tests(
    prompts,
    completions,
    completion_ids=None,
    *,
    tests_column: str = "tests",
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    workers: int | None = None,
    **columns,
) -> list[Reward]:
    """Fraction of the row's test cases the completion's code passes, run in pipeline.rewards.sandbox.

    The code is extract_code of the final assistant message; the tests are the `tests_column` value: assert
    statements, each run after the code in the same namespace. None where the row has no tests.
    `workers` sandboxes run at once (default: one per CPU core).
    """
    from pipeline.rewards.sandbox import run_python

    tests = [_tests_of(v, i, tests_column) for i, v in enumerate(_column(columns, tests_column, "tests_column"))]

    def score(i: int) -> Reward:
        if tests[i] is None:
            return None
        return run_python(extract_code(final_text(completions[i])), tests[i], timeout_s=timeout_s, memory_mb=memory_mb).score

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(score, range(len(completions))))


BUILTINS: dict[str, RewardFn] = {
    "correct": correct,
    "format": format_reward,
    "contains": contains,
    "length_range": length_range,
    "overlong": overlong,
    "reward_model": reward_model,
    "code_tests": code_tests,
}
