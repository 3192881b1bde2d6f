"""verl's custom reward contract, grpo's own (verl cannot be installed beside grpo):

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **reward_kwargs)
        -> a number, or a dict whose "score" is the reward

Called once per completion, as verl's reward manager calls it: `solution_str` the completion's text,
`ground_truth` the row's `reward_model["ground_truth"]`, `data_source` and `extra_info` those columns
(None where the data has none). Only the names the function declares are passed, so verl's own
scorers (gsm8k.compute_score(solution_str, ground_truth, ...)) run unchanged; grpo's `kwargs` are
verl's reward_kwargs. A dict's other numeric keys (booleans as 0/1) are logged per completion as
`extra_<key>`; non-numeric values (strings such as math_dapo's "pred") are not logged.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any

from pipeline.data import fields
from pipeline.errors import GRPOError

ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def _declared(fn) -> set[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set(ARGS)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return set(ARGS)
    return {p.name for p in params if p.name in ARGS}


def _truth(row: Any, i: int, where: str) -> Any:
    try:
        return fields.value(row, "reward_model", ["ground_truth"])
    except GRPOError as err:
        raise GRPOError(f"{where} row {i}: {err}") from None


def score(fn, options: dict, prompts: list, rendered: list[str] | None, texts: list[str], columns: dict[str, list],
          log, where: str) -> list:
    """Each completion's reward; a dict result's other numeric keys go to `log` (a RewardLog). verl's
    scorers see the completion alone: the prompts (`prompts`, `rendered`) are not theirs."""
    names = _declared(fn)
    n = len(texts)
    out: list = []
    extra: dict[str, list] = {}
    for i, text in enumerate(texts):
        args: dict[str, Any] = {"solution_str": text}
        if "ground_truth" in names:
            args["ground_truth"] = _truth(columns.get("reward_model", [None] * n)[i], i, where)
        for k in ("data_source", "extra_info"):
            if k in names:
                args[k] = columns[k][i] if k in columns else None
        args = {k: v for k, v in args.items() if k in names}
        try:
            got = fn(**args, **options)
        except Exception as err:
            lines = str(err).strip().splitlines()
            raise GRPOError(f"{where} row {i}: raised {type(err).__name__}: {lines[0] if lines else ''}") from err
        if isinstance(got, dict):
            if "score" not in got:
                raise GRPOError(f"{where} row {i}: returned a dict without 'score' (keys: {', '.join(map(str, got))})")
            for k, v in got.items():
                if k != "score" and isinstance(v, numbers.Real):
                    extra.setdefault(str(k), [None] * n)[i] = float(v)
            got = got["score"]
        if isinstance(got, list | tuple):  # verl's default_compute_score takes res[0]
            got = got[0] if got else None
        if not isinstance(got, numbers.Real):
            raise GRPOError(f"{where} row {i}: returned {type(got).__name__}, expected a number or a dict with 'score'")
        out.append(float(got))
    for name, values in extra.items():
        log.extra_logger(where, range(n))(name, values)
    return out


def check_signature(fn, label: str, target: str, train_columns: list[str], data: str) -> None:
    """At `grpo init`: the columns the function's declared names need exist in the training data."""
    names = _declared(fn.func)
    where = f"{label}.fn {target!r}"
    if "solution_str" not in names:
        raise GRPOError(f"{where}: does not take 'solution_str', which verl's contract passes")
    if "ground_truth" in names and "reward_model" not in train_columns:
        raise GRPOError(f"{label}: data.train {data} has no column 'reward_model' (verl's ground_truth; columns: {', '.join(train_columns)})")
    if "data_source" in names and "data_source" not in train_columns:
        raise GRPOError(f"{label}: data.train {data} has no column 'data_source' (columns: {', '.join(train_columns)})")
