"""Reward functions: TRL's contract, the built-ins, and the checks on what they return.

Every reward function, built-in or yours, is called the way TRL's GRPOTrainer calls it, so a
TRL reward function works here unchanged:

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **dataset_columns, **kwargs)
        -> list[float | None]

One entry per completion (N = groups x G). For a chat prompt, prompts[i] is its list of
{role, content} messages and completions[i] is [{"role": "assistant", "content": text}];
for a plain prompt both are strings. completion_ids[i] are the sampled token ids. Every other
column of the prompt's dataset row is passed under its own name, one value per completion;
`kwargs` come from the config's `rewards[j].kwargs` and win over a column of the same name.
None (or float NaN) means "does not apply to this completion": it is stored as NaN and left
out of the weighted total.

In the config, `fn` is a built-in name, `module:function` (imported), or
`path/to/file.py:function` (loaded from the file; relative to the current directory at `grpo
init`, which copies it into the run: every stage then imports the run's copy, `run_code`):

    rewards:
      - {fn: correct}
      - {fn: format, weight: 0.2}
      - {fn: contains, kwargs: {keyword: important}}
      - {fn: my_rewards.py:brevity, name: brevity}

Built-ins live in pipeline.rewards.builtins; their options are typed in pipeline.config.rewards
and checked when the config is validated. Custom functions are imported and their signatures
checked at `grpo init` (pipeline.preflight).

A reward function that raises, returns the wrong number of values, or returns something that
is not a finite number or None (or one outside the entry's declared `range:`) stops the stage with
one line naming it, the iteration and the first bad row. TRL silently broadcast a wrong-length return (TRL#6533); here it is an error.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from pipeline.errors import GRPOError
from pipeline.rewards.calls import RewardLog, TrainerState, call_sync, is_async, run_async
from pipeline.rewards.builtins import BUILTINS, Reward, RewardFn, completion_text, extract_code, final_text, model_text  # noqa: F401 (re-exported)
from pipeline.config.rewards import CustomReward, RewardSpec
from pipeline.rewards.loading import _first_line, _resolve, code_as_held, load_reward, resolve, run_code  # noqa: F401 (re-exported)

TRL_ARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")
"""What TRL 1.16 passes every reward function besides the dataset columns."""
_RESERVED = TRL_ARGS

# ------------------------------------------------------------------------------------- scoring


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_rewards(values: Any, n: int, where: str, rows: range | None = None) -> np.ndarray:
    """One call's output -> float64 [n] with NaN for None; GRPOError at the first bad row.
    `rows`: the rows of the batch this call got (a slice, for async calls; errors name batch rows)."""
    rows = rows or range(n)
    call = where if rows == range(n) else \
        f"{where} row {rows.start}" if len(rows) == 1 else f"{where} rows {rows.start}-{rows.stop - 1}"
    if getattr(values, "ndim", None) == 1 and hasattr(values, "tolist"):  # numpy / torch vectors
        values = values.tolist()
    if not isinstance(values, list | tuple):
        raise GRPOError(f"{call}: returned {type(values).__name__}, expected a list of {n} numbers or None")
    if len(values) != n:
        raise GRPOError(f"{call}: returned {len(values)} values for {n} completions")
    out = np.full(n, np.nan)  # [N]
    for i, v in enumerate(values):
        if v is None:
            continue
        # bool is a number (True == 1): `return [ok for ...]` is a common, meaningful reward.
        if not isinstance(v, numbers.Real):
            raise GRPOError(f"{where} row {rows.start + i}: returned {_short(v)}, expected a number or None")
        x = float(v)
        if math.isinf(x):
            raise GRPOError(f"{where} row {rows.start + i}: returned {x}, expected a finite number or None")
        out[i] = x  # NaN stays NaN: "does not apply", like None
    return out


def model_tokens(completion_ids: list[list[int]] | None, masks: list[list[int] | None] | None) -> list[list[int]] | None:
    """Each completion's tokens the model sampled: those where its mask is 1 (all, without a mask)."""
    if completion_ids is None or masks is None:
        return completion_ids
    if len(masks) != len(completion_ids):
        raise GRPOError(f"rewards: {len(masks)} completion masks for {len(completion_ids)} completions")
    return [ids if m is None else [t for t, keep in zip(ids, m) if keep] for ids, m in zip(completion_ids, masks)]


def other_contract(spec) -> Any:
    """The module speaking a custom reward's non-TRL contract (`contract: openrlhf | verl`), each with
    `check_signature` (at init) and `score` (in the stages), or None for TRL's own."""
    name = getattr(spec, "contract", "trl")
    if name == "openrlhf":
        from pipeline.rewards import openrlhf as module
    elif name == "verl":
        from pipeline.rewards import verl as module
    else:
        return None
    return module


def compute_rewards(
    specs: list[RewardSpec],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]] | None,
    columns: dict[str, list],
    iteration: int,
    trainer_state: TrainerState | None = None,
    log: RewardLog | None = None,
    completion_masks: list[list[int] | None] | None = None,
    rendered: list[str] | None = None,
    recorded: list[str] | None = None,
) -> np.ndarray:
    """Every reward function on every completion: float64 [N, F], NaN where one returned None.

    prompts / completions in TRL's shapes (a string completion of a chat prompt is wrapped as
    [{"role": "assistant", "content": text}]); columns: the other dataset columns, N values each.
    completion_masks: the rollout's completion_mask (1 where the model sampled the token; None
    for a single completion). Your functions get completion_ids as TRL passes them, every token of
    an episode; the built-ins get the model's tokens only, so their lengths count what it wrote.
    rendered: the rollout's rendered prompts (after the chat template), for OpenRLHF's contract;
    recorded: the rollout's completion texts as recorded (an episode's with the template between its turns), its queries.
    trainer_state is passed to every function (default: global_step = iteration); what they
    log with log_metric / log_extra lands in `log`. Async functions run concurrently after the
    synchronous ones (pipeline.rewards.calls).
    """
    n = len(completions)
    lengths = {"prompts": len(prompts)} | ({} if completion_ids is None else {"completion_ids": len(completion_ids)})
    lengths |= {f"column {k!r}": len(v) for k, v in columns.items()}
    for what, length in lengths.items():
        if length != n:
            raise GRPOError(f"rewards (iteration {iteration}): {length} {what} for {n} completions")
    clash = [k for k in columns if k in _RESERVED]
    if clash:
        raise GRPOError(f"rewards: dataset column {clash[0]!r} clashes with the reward-function argument of that name; rename it")
    completions = [
        [{"role": "assistant", "content": c}] if isinstance(p, list) and isinstance(c, str) else c
        for p, c in zip(prompts, completions)
    ]
    state = trainer_state or TrainerState(global_step=iteration, epoch=0.0, max_steps=0)
    log = log if log is not None else RewardLog(n)
    model_ids = model_tokens(completion_ids, completion_masks)

    out = np.full((n, len(specs)), np.nan)  # [N, F]
    pending = []
    for j, spec in enumerate(specs):
        fn = load_reward(spec, index=j)
        where = f"reward {spec.column!r} (iteration {iteration})"
        log.names[where] = spec.column
        if spec.served:  # its requests, their concurrency and the record of its answers
            try:
                values = fn(prompts, completions, columns, log, where, rendered=rendered, recorded=recorded)
            except GRPOError as err:
                raise GRPOError(err.args[0] if str(err).startswith(where) else f"{where}: {err}") from err
            out[:, j] = _check_rewards(values, n, where)  # [N]
            continue
        if (other := other_contract(spec)) is not None:  # pipeline/rewards/openrlhf.py, verl.py
            texts = other.texts(completions, recorded)
            values = other.score(fn.func, fn.keywords, prompts, rendered, texts, columns, log, where)
            out[:, j] = _check_rewards(values, n, where)  # [N]
            continue
        passed = {k: v for k, v in columns.items() if k not in fn.keywords}  # config options win
        ids = completion_ids if isinstance(spec, CustomReward) else model_ids
        args = dict(prompts=prompts, completions=completions, completion_ids=ids, **passed)
        if is_async(fn):
            pending.append((j, fn, spec, args, where))
            continue
        try:
            values = call_sync(fn, args, log, where, state)
        except GRPOError as err:
            raise GRPOError(err.args[0] if str(err).startswith(where) else f"{where}: {err}") from err
        except Exception as err:
            raise GRPOError(f"{where}: raised {type(err).__name__}: {_first_line(err)}") from err
        out[:, j] = _check_rewards(values, n, where)  # [N]
    if pending:
        for j, values in run_async(pending, n, log, state, _check_rewards).items():
            out[:, j] = np.asarray(values, dtype=np.float64)  # [N], already checked per call
    for j, spec in enumerate(specs):
        _check_range(spec, j, out[:, j], iteration)
    return out


def _check_range(spec, j: int, values: np.ndarray, iteration: int) -> None:
    """A value outside the entry's declared `range:` stops the stage, naming the reward and the first such row:
    the eval's intervals take that range as what the function can give (pipeline/eval/metrics.py: declared), so
    a value past it is a bug in the function or in the declaration, not data to record."""
    if spec.range is None:
        return
    lo, hi = spec.range
    bad = np.flatnonzero(~np.isnan(values) & ((values < lo) | (values > hi)))
    if bad.size:
        i = int(bad[0])
        raise GRPOError(f"reward {spec.column!r} (iteration {iteration}) row {i}: returned {values[i]:g}, outside its "
                        f"declared range [{lo:g}, {hi:g}] (rewards.{j}.range)")
