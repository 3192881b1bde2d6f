"""OpenRLHF's reward-function file contract (`--remote_rm_url file.py`), grpo's own (OpenRLHF cannot
be installed beside grpo):

    reward_func(queries, prompts, labels, **kwargs) -> {"rewards": [...], "scores": [...], "extra_logs": {...}}
                                                        or the rewards alone (a list or a 1-d tensor)

As OpenRLHF (commit 3c3be623, openrlhf/utils/agent.py) calls it: once per completion, with one-element
lists; `queries` the rendered prompt followed by the completion, `prompts` the rendered prompt,
`labels` the dataset column `kwargs.label_key` names (None for every row without one). The other
`kwargs` are passed on every call. `rewards` is the reward; each `extra_logs` entry becomes an
`extra_<name>` column (one number per completion: a tensor's first element, as OpenRLHF takes it,
booleans as 0/1); `scores` (OpenRLHF's dynamic-filtering score) is
not used: grpo filters on the rewards (`advantages.dynamic_sampling`).

Here a completion's text is the rollout's, decoded without special tokens; OpenRLHF decodes the
whole sequence with them (an EOS token's text ends its queries).
"""

from __future__ import annotations

import numbers
from typing import Any

from pipeline.errors import GRPOError
from pipeline.rewards.builtins import completion_text

TEXT = completion_text
"""A completion's text as `score` gets it (its `texts`): every message's content, tool results included."""

LABEL_KEY = "label_key"
"""The kwargs option naming the dataset column passed as `labels` (OpenRLHF's --label_key)."""


def _values(x: Any) -> list:
    if hasattr(x, "tolist"):  # a torch tensor or numpy array
        x = x.tolist()
    if isinstance(x, numbers.Real):
        return [x]
    if not isinstance(x, list | tuple):
        raise GRPOError(f"returned {type(x).__name__} as rewards, expected a list or tensor of numbers")
    return [v.tolist() if hasattr(v, "tolist") else v for v in x]  # [torch.tensor(1.0)]: OpenRLHF's torch.tensor takes it


def _logged(v: Any, where: str) -> float | None:
    """One extra_logs value as OpenRLHF logs it: a tensor's (or list's) first element, a number; booleans as 0/1."""
    if hasattr(v, "tolist"):  # a torch tensor or numpy array: OpenRLHF takes value.flatten()[0]
        v = v.tolist()
    while isinstance(v, list | tuple) and v:
        v = v[0]
    if v is None:
        return None
    if not isinstance(v, numbers.Real):
        raise GRPOError(f"{where} is {type(v).__name__} {str(v)[:40]!r}, expected a number (OpenRLHF logs numbers)")
    return float(v)


def inputs(prompts: list, rendered: list[str] | None, texts: list[str], columns: dict[str, list], key: str | None,
           where: str) -> tuple[list[str], list[str], list]:
    """What OpenRLHF sends for each completion: its query (the rendered prompt followed by the
    completion), its rendered prompt and its label (column `key`; None without one). Shared by the
    file contract (`score`) and the reward server (judge/openrlhf_server.py)."""
    if rendered is None and any(not isinstance(p, str) for p in prompts):
        raise GRPOError(f"{where}: OpenRLHF's contract needs the rendered prompts, which this stage does not pass")
    rendered = rendered or prompts
    if key is not None and key not in columns:
        raise GRPOError(f"kwargs.{LABEL_KEY}: no column {key!r} (columns: {', '.join(columns)})")
    labels = columns[key] if key is not None else [None] * len(texts)
    return [p + t for p, t in zip(rendered, texts)], list(rendered), list(labels)


def log_value(value: Any) -> float | None:
    """One completion's value of an `extra_logs` entry as the file contract logs it (`_logged`); a
    GRPOError for a value OpenRLHF could not log (the server's reader keeps it as JSON text instead)."""
    return _logged(value, "extra_logs value")


def score(fn, options: dict, prompts: list, rendered: list[str] | None, texts: list[str], columns: dict[str, list],
          log, where: str) -> list:
    """Each completion's reward; what extra_logs holds goes to `log` (a RewardLog). `rendered`: the
    prompts after the chat template (plain-text `prompts` are already that)."""
    opts = dict(options)
    queries, rendered, labels = inputs(prompts, rendered, texts, columns, opts.pop(LABEL_KEY, None), where)
    out: list = []
    extra: dict[str, list] = {}
    for i, (query, prompt, label) in enumerate(zip(queries, rendered, labels)):
        try:
            got = fn([query], [prompt], [label], **opts)
        except Exception as err:
            lines = str(err).strip().splitlines()
            raise GRPOError(f"{where} row {i}: raised {type(err).__name__}: {lines[0] if lines else ''}") from err
        logs = {}
        if isinstance(got, dict):
            if "rewards" not in got:
                raise GRPOError(f"{where} row {i}: returned a dict without 'rewards' (keys: {', '.join(map(str, got))})")
            logs = got.get("extra_logs") or {}
            got = got["rewards"]
        try:
            values = _values(got)
        except GRPOError as err:
            raise GRPOError(f"{where} row {i}: {err}") from None
        if len(values) != 1:
            raise GRPOError(f"{where} row {i}: returned {len(values)} rewards for 1 query")
        out.append(values[0])
        for name, v in logs.items():
            extra.setdefault(str(name), [None] * len(texts))[i] = _logged(v, f"{where} row {i}: extra_logs[{name!r}]")
    for name, values in extra.items():
        log.extra_logger(where, range(len(texts)))(name, values)
    return out


def check_label_key(key: str | None, label: str, train_columns: list[str], data: str) -> None:
    """At `grpo init`: kwargs.label_key names a column of the training data."""
    if key is not None and key not in train_columns:
        raise GRPOError(f"{label}.kwargs.{LABEL_KEY}: data.train {data} has no column {key!r} (columns: {', '.join(train_columns)})")


def check_signature(fn, label: str, target: str, train_columns: list[str], data: str) -> None:
    """At `grpo init`: `fn` (a partial with the config's kwargs bound) takes (queries, prompts,
    labels) and the other kwargs; kwargs.label_key names a column of the training data."""
    import inspect

    where = f"{label}.fn {target!r}"
    check_label_key(fn.keywords.get(LABEL_KEY), label, train_columns, data)
    try:
        sig = inspect.signature(fn.func)
    except (TypeError, ValueError):
        return
    opts = {k: v for k, v in fn.keywords.items() if k != LABEL_KEY}
    try:
        sig.bind([], [], [], **opts)
    except TypeError as err:
        raise GRPOError(f"{where}: cannot be called as OpenRLHF calls it, reward_func(queries, prompts, labels"
                        f"{''.join(f', {k}=...' for k in opts)}): {err}") from None
