"""How reward functions are called: TRL 1.16's extra arguments, and async functions.

TRL's GRPOTrainer passes every reward function, besides prompts / completions / completion_ids
and the dataset columns:
    trainer_state   an object with global_step, epoch, max_steps (here: TrainerState below;
                    global_step = the iteration, epoch = iterations / iterations per data epoch,
                    max_steps = train.total_iters)
    log_metric(name, value)    a scalar; averaged over every call of the iteration
    log_extra(column, values)  one value per completion of the call: an extra column of the
                               score parts (`extra_<column>`) and of the MLflow completions table

An `async def` reward function (or a callable object with an async __call__) is awaited. All
async functions of a batch run concurrently on one event loop, as TRL does; in addition, with
`rewards[j].rows_per_call: n` a function is called on slices of n rows, up to
`rewards[j].max_concurrency` slices in flight. Each call has `rewards[j].timeout_s`; a call that
times out or raises a transient error (OSError, which covers connection errors, or TimeoutError)
is retried up to `rewards[j].retries` times; a failure after that stops the stage with one line
naming the function, the iteration and the rows.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Callable

from pipeline.errors import GRPOError

TRANSIENT = (OSError, TimeoutError, asyncio.TimeoutError)


@dataclass(frozen=True)
class TrainerState:
    """The part of transformers' TrainerState that TRL reward functions read."""

    global_step: int
    """The iteration being scored (TRL: optimizer steps so far; one iteration is one generation step)."""
    epoch: float
    """Passes over data.train so far, fractional (iteration / iterations per epoch)."""
    max_steps: int
    """train.total_iters: the planned number of iterations."""

    def to_dict(self) -> dict:
        return asdict(self)


def trainer_state_at(cfg, k: int, n_rows: int) -> TrainerState:
    """Iteration k's state: epoch counts whole passes the way the prompt order does
    (pipeline.data.iteration_prompt_ids: n_rows // prompts_per_iter iterations per epoch)."""
    per_epoch = max(1, n_rows // cfg.rollout.prompts_per_iter)
    return TrainerState(global_step=k, epoch=k / per_epoch, max_steps=cfg.train.total_iters)


class RewardLog:
    """What reward functions logged during one scoring call: metrics and extra columns."""

    def __init__(self, n: int):
        self.n = n
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.extra: dict[str, list[Any]] = {}
        self.names: dict[str, str] = {}  # where -> the reward's column name (contract.compute_rewards sets it)
        self._owner: dict[str, str] = {}  # extra column -> the `where` that first logged it

    def metric_logger(self, where: str) -> Callable[[str, float], None]:
        def log_metric(name: str, value: float) -> None:
            if not isinstance(name, str) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise GRPOError(f"{where}: log_metric({name!r}, {value!r}): expected a name and a finite number")
            self.metrics[name].append(float(value))

        return log_metric

    def extra_logger(self, where: str, rows: range) -> Callable[[str, list], None]:
        def log_extra(column: str, values: list) -> None:
            values = list(values)
            if not isinstance(column, str) or len(values) != len(rows):
                raise GRPOError(f"{where}: log_extra({column!r}, ...) got {len(values)} values for {len(rows)} completions")
            self._owner.setdefault(column, where)
            col = self.extra.setdefault(self.column(where, column), [None] * self.n)
            col[rows.start : rows.stop] = values

        return log_extra

    def column(self, where: str, name: str) -> str:
        """The column `where`'s log `name` lands in: `name`, or `<reward>_<name>` when another reward logged it
        first (verl's `acc` from two scorers), instead of overwriting the first one's values."""
        return f"{self.names[where]}_{name}" if self._owner.get(name, where) != where and where in self.names else name

    def metric_sums(self) -> dict[str, list[float]]:
        """{name: [sum, count]}: what parts store, so an iteration's mean can be taken over all of them."""
        return {k: [math.fsum(v), len(v)] for k, v in sorted(self.metrics.items())}


def is_async(fn) -> bool:
    """True when calling `fn` returns a coroutine (functions, partials of them, async __call__)."""
    target = getattr(fn, "func", fn)
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None))


def call_sync(fn, args: dict, log: RewardLog, where: str, state: TrainerState) -> Any:
    return fn(**args, trainer_state=state, log_metric=log.metric_logger(where), log_extra=log.extra_logger(where, range(log.n)))


def _slice(args: dict, rows: range) -> dict:
    return {k: (v[rows.start : rows.stop] if isinstance(v, list) else v) for k, v in args.items()}


async def _call(fn, spec, args, rows: range, log: RewardLog, where: str, state, sem, check) -> tuple[range, Any]:
    label = f"{where} row {rows.start}" if len(rows) == 1 else f"{where} rows {rows.start}-{rows.stop - 1}"
    async with sem:
        for attempt in range(spec.retries + 1):
            try:
                values = await asyncio.wait_for(
                    fn(**_slice(args, rows), trainer_state=state, log_metric=log.metric_logger(where),
                       log_extra=log.extra_logger(where, rows)),
                    timeout=spec.timeout_s,
                )
                return rows, check(values, len(rows), where, rows)
            except GRPOError:
                raise
            except TRANSIENT as err:
                if attempt == spec.retries:
                    what = f"timed out after {spec.timeout_s:g} s" if isinstance(err, TimeoutError | asyncio.TimeoutError) else \
                        f"raised {type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
                    raise GRPOError(f"{label}: {what} ({attempt + 1} attempts)") from None
                await asyncio.sleep(min(2.0, 0.05 * 2**attempt))
            except Exception as err:
                raise GRPOError(f"{label}: raised {type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}") from err
    raise AssertionError("unreachable")


def run_async(jobs: list[tuple[int, Any, Any, dict, str]], n: int, log: RewardLog, state: TrainerState, check) -> dict[int, list]:
    """jobs: (column index, fn, spec, args, where). Returns {index: values in row order}, every
    function's calls running concurrently (each function bounded by its max_concurrency)."""

    async def main() -> dict[int, list]:
        tasks, owners = [], []
        for j, fn, spec, args, where in jobs:
            sem = asyncio.Semaphore(spec.max_concurrency)
            step = spec.rows_per_call or n
            for start in range(0, n, step):
                tasks.append(asyncio.ensure_future(_call(fn, spec, args, range(start, min(n, start + step)), log, where, state, sem, check)))
                owners.append(j)
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        out: dict[int, list] = {j: [None] * n for j, *_ in jobs}
        for j, (rows, values) in zip(owners, results):
            out[j][rows.start : rows.stop] = list(values)
        return out

    return asyncio.run(main())
