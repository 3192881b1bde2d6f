"""verl's custom reward contract, grpo's own (verl cannot be installed beside grpo):

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **reward_kwargs)
        -> a number, or a dict whose "score" is the reward

Called once per completion, as verl's reward manager calls it: `solution_str` the completion's final
assistant text, `ground_truth` the row's `reward_model["ground_truth"]`, `data_source` and `extra_info`
those columns (extra_info {} where the data has none, as verl passes it). Only the names the function
declares are passed, so verl's own scorers (gsm8k.compute_score(solution_str, ground_truth, ...)) run
unchanged; grpo's `kwargs` are verl's reward_kwargs (they win over the four names, as in verl). An
`async def` one is awaited, all rows together (verl's reward loop awaits it). A dict's other numeric
keys (booleans as 0/1, numpy and torch scalars as their value) are logged per completion as
`extra_<key>`; non-numeric values (strings such as math_dapo's "pred") are not logged.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any

from pipeline.errors import GRPOError
from pipeline.rewards.builtins import final_text

ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")

TEXT = final_text
"""A completion's text as `score` gets it (its `texts`): the final assistant message, tool results left out."""


def _declared(fn) -> set[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set(ARGS)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return set(ARGS)
    return {p.name for p in params if p.name in ARGS}


def _truth(row: Any, i: int, where: str) -> Any:
    if isinstance(row, dict) and "ground_truth" in row:
        return row["ground_truth"]
    raise GRPOError(f"{where} row {i}: column 'reward_model' holds no 'ground_truth'")


def _scalar(v: Any) -> Any:
    """A numpy or torch scalar (np.bool_, a 0-d tensor) as the Python number it holds; anything else as it is."""
    if not isinstance(v, numbers.Real) and hasattr(v, "item"):
        try:
            return v.item()
        except (ValueError, RuntimeError):  # more than one element
            return v
    return v


def _args(names: set[str], options: dict, text: str, columns: dict[str, list], i: int, where: str) -> dict:
    """Row i's call. As verl's reward managers: extra_info is {} where the data has none (a copy of the
    row's otherwise: scorers add to it), and reward_kwargs win over the four names (verl's _call_with_kwargs)."""
    args: dict[str, Any] = {"solution_str": text}
    if "ground_truth" in names and "ground_truth" not in options:
        args["ground_truth"] = _truth(columns.get("reward_model", [None] * (i + 1))[i], i, where)
    if "data_source" in names:
        args["data_source"] = columns["data_source"][i] if "data_source" in columns else None
    if "extra_info" in names:
        info = columns["extra_info"][i] if "extra_info" in columns else None
        args["extra_info"] = {} if info is None else dict(info) if isinstance(info, dict) else info
    return {k: v for k, v in args.items() if k in names} | options


def _settle(results: list) -> list:
    """An async compute_score's coroutines (verl's reward loop awaits them), awaited together."""
    import asyncio

    async def main() -> list:
        async def one(x):
            return await x if inspect.isawaitable(x) else x

        return await asyncio.gather(*(one(x) for x in results), return_exceptions=True)

    return asyncio.run(main())


def _raised(err: BaseException, i: int, where: str) -> GRPOError:
    lines = str(err).strip().splitlines()
    return GRPOError(f"{where} row {i}: raised {type(err).__name__}: {lines[0] if lines else ''}")


def score(fn, options: dict, prompts: list, rendered: list[str] | None, texts: list[str], columns: dict[str, list],
          log, where: str) -> list:
    """Each completion's reward; a dict result's other numeric keys go to `log` (a RewardLog). verl's
    scorers see the completion alone: the prompts (`prompts`, `rendered`) are not theirs."""
    names = _declared(fn)
    n = len(texts)
    results: list = []
    for i, text in enumerate(texts):
        try:
            results.append(fn(**_args(names, options, text, columns, i, where)))
        except GRPOError:
            raise
        except Exception as err:
            raise _raised(err, i, where) from err
    if any(inspect.isawaitable(r) for r in results):
        results = _settle(results)
    out: list = []
    extra: dict[str, list] = {}
    for i, got in enumerate(results):
        if isinstance(got, BaseException):
            raise _raised(got, i, where) from got
        if isinstance(got, dict):
            if "score" not in got:
                raise GRPOError(f"{where} row {i}: returned a dict without 'score' (keys: {', '.join(map(str, got))})")
            for k, v in got.items():
                if k != "score" and isinstance(v := _scalar(v), numbers.Real):
                    extra.setdefault(str(k), [None] * n)[i] = float(v)
            got = got["score"]
        if isinstance(got, list | tuple):  # verl's default_compute_score takes res[0]
            got = got[0] if got else None
        got = _scalar(got)
        if not isinstance(got, numbers.Real):
            raise GRPOError(f"{where} row {i}: returned {type(got).__name__}, expected a number or a dict with 'score'")
        out.append(float(got))
    for name, values in extra.items():
        log.extra_logger(where, range(n))(name, values)
    return out


def check_signature(fn, label: str, target: str, train_columns: list[str], data: str) -> None:
    """At `grpo init`: the function can be called as the stages call it (its declared names and the
    config's kwargs), and the columns those names need exist in the training data."""
    names = _declared(fn.func)
    where = f"{label}.fn {target!r}"
    if "solution_str" not in names:
        raise GRPOError(f"{where}: does not take 'solution_str', which verl's contract passes")
    call = {k: None for k in names} | fn.keywords  # what _args passes: the declared names, then the kwargs
    try:
        inspect.signature(fn.func).bind(**call)
    except ValueError:  # a callable without a signature to read: nothing to check
        pass
    except TypeError as err:
        raise GRPOError(f"{where}: cannot be called as verl calls it, compute_score("
                        f"{', '.join(f'{k}=...' for k in call)}): {err}") from None
    if "ground_truth" in names and "ground_truth" not in fn.keywords and "reward_model" not in train_columns:
        raise GRPOError(f"{label}: data.train {data} has no column 'reward_model' (verl's ground_truth; columns: {', '.join(train_columns)})")
    if "data_source" in names and "data_source" not in fn.keywords and "data_source" not in train_columns:
        raise GRPOError(f"{label}: data.train {data} has no column 'data_source' (columns: {', '.join(train_columns)})")
