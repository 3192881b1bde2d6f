"""Cases on the schedule: which policy samples an iteration, and which prompts an iteration (and a
resumed run) draws.

Two implementations are asked here. A `Versions`: `behaviour(k, s)` -> the policy version that samples
iteration k under bounded staleness s, asked in a fresh process after a recovery too. A `Loader`:
`start()` -> a state, `next(state)` -> (prompt ids, new state), with the state a JSON-able dict that a
resumed process is handed (grpo's is the iteration number its run records; the broken ones are the
stateful dataloaders of the peers' threads).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipeline.conformance.case import Case

N_ROWS, PER_ITER, SEED = 10, 3, 7  # 3 iterations an epoch (drop-last: one row left out per epoch)


@dataclass(frozen=True)
class Versions:
    behaviour: Callable[[int, int], int]


@dataclass(frozen=True)
class Loader:
    start: Callable[[], dict]
    next: Callable[[dict], tuple[list[int], dict]]


def grpo_versions() -> Versions:
    from pipeline.config.train import TrainConfig
    from pipeline.schedule import behaviour

    class _Cfg:  # schedule.behaviour asks only cfg.train
        def __init__(self, s):
            self.train = TrainConfig(max_staleness=s)

    return Versions(lambda k, s: behaviour(_Cfg(s), k))


def double_count_versions() -> Versions:
    """prime-rl #1764: the off-policy counter incremented twice per policy update."""
    return Versions(lambda k, s: max(0, k - 2 * s))


def off_by_one_versions() -> Versions:
    """prime-rl #1902: max_off_policy_steps = n admitting n + 1 policy versions."""
    return Versions(lambda k, s: max(0, k - s - 1) if s else k)


def grpo_loader() -> Loader:
    from pipeline.data.prompts import iteration_prompt_ids

    return Loader(lambda: {"k": 0},
                  lambda st: (iteration_prompt_ids(N_ROWS, PER_ITER, SEED, st["k"]), {"k": st["k"] + 1}))


class _Stateful:
    """A shuffling dataloader with a saved cursor, as the peers' threads describe theirs."""

    def __init__(self, exhausted_on_boundary=False, ahead=0, reseed_from_zero=False):
        self.exhausted_on_boundary, self.ahead, self.reseed_from_zero = exhausted_on_boundary, ahead, reseed_from_zero

    def order(self, epoch: int, resumed: bool) -> np.ndarray:
        e = 0 if (resumed and self.reseed_from_zero) else epoch
        return np.random.default_rng([SEED, e]).permutation(N_ROWS)

    def start(self) -> dict:
        return {"epoch": 0, "pos": 0, "resumed": False}

    def next(self, st: dict) -> tuple[list[int], dict]:
        per_epoch = N_ROWS // PER_ITER
        epoch, pos = st["epoch"], st["pos"]
        if pos == per_epoch:  # the epoch is done: the next one starts
            if self.exhausted_on_boundary and st["resumed"]:
                # verl #5725: the restored iterator is the exhausted one, applied to the new epoch's loop
                return [], {**st, "epoch": epoch + 1, "pos": 0}
            epoch, pos = epoch + 1, 0
        ids = self.order(epoch, st["resumed"])[pos * PER_ITER:(pos + 1) * PER_ITER]
        return [int(i) for i in ids], {**st, "epoch": epoch, "pos": pos + 1}

    def saved(self, st: dict) -> dict:
        # NeMo-RL #3599: the saved cursor runs ahead of what training consumed (prefetched, in flight)
        return {**st, "pos": st["pos"] + self.ahead, "resumed": True}


def _stateful_loader(**kw) -> Loader:
    s = _Stateful(**kw)
    return Loader(s.start, lambda st: s.next(s.saved(st) if st.pop("_resume", False) else st))


def epoch_boundary_loader() -> Loader:
    return _stateful_loader(exhausted_on_boundary=True)


def cursor_ahead_loader() -> Loader:
    return _stateful_loader(ahead=1)


def reseed_loader() -> Loader:
    return _stateful_loader(reseed_from_zero=True)


# --------------------------------------------------------------------------- experiments

def staleness_experiment(v: Versions) -> tuple[bool, str]:
    """Iteration k under max staleness s is sampled by policy b(k) = max(0, k - s): at most s versions
    behind, exactly s once k >= s, asked afresh (a recovered process) at every k: no counter to inflate."""
    bad = [(k, s, v.behaviour(k, s)) for s in (0, 1, 2, 3) for k in range(12) if v.behaviour(k, s) != max(0, k - s)]
    return not bad, "every (k, s) exact" if not bad else f"{len(bad)} wrong, e.g. k={bad[0][0]} s={bad[0][1]}: b={bad[0][2]}"


def _draws(loader: Loader, iters: int, resume_at: int | None) -> list[list[int]]:
    """`iters` iterations' prompts; with `resume_at`, the state is saved there, passed through JSON
    (what a checkpoint is) and handed to a fresh process's loader."""
    st, out = loader.start(), []
    for k in range(iters):
        if k == resume_at:
            st = {**json.loads(json.dumps(st)), "_resume": True}
        ids, st = loader.next(st)
        out.append(ids)
    return out


def _resume_experiment(loader: Loader, at: int) -> tuple[bool, str]:
    want, got = _draws(loader, 9, None), _draws(loader, 9, at)
    per_epoch = N_ROWS // PER_ITER
    epochs_ok = all(len(set(sum(want[e * per_epoch:(e + 1) * per_epoch], []))) == per_epoch * PER_ITER for e in range(3))
    diff = [k for k in range(9) if got[k] != want[k]]
    ok = epochs_ok and not diff and want[0] != want[per_epoch]
    return ok, ("resumed == uninterrupted, each epoch 9 distinct prompts" if ok else
                f"iterations differing after resume at {at}: {diff}, e.g. k={diff[0] if diff else '-'}: "
                f"{got[diff[0]] if diff else '-'} vs {want[diff[0]] if diff else '-'}")


def epoch_boundary_experiment(loader: Loader) -> tuple[bool, str]:
    return _resume_experiment(loader, 3)  # the first iteration of epoch 1: a checkpoint at the boundary


def mid_epoch_experiment(loader: Loader) -> tuple[bool, str]:
    return _resume_experiment(loader, 4)  # inside epoch 1


def cases() -> list[Case]:
    na = "not applicable: TRL's GRPOTrainer has no bounded-staleness schedule (AsyncGRPO is experimental, needs vLLM serve)"
    resume_na = "not measured: TRL resumes through transformers' Trainer (skip_first_batches), not run here"
    return [
        Case("staleness-counted-once", "a sample is at most s policy versions old, counted once",
             "prime-rl #1764 (counted twice); AReaL #1345's recovery path not rebuilt", "b(k) = max(0, k - s) for all k, s, each asked afresh",
             staleness_experiment, grpo_versions, double_count_versions, trl_na=na),
        Case("staleness-not-off-by-one", "max staleness s admits s versions, not s + 1",
             "prime-rl #1902", "k - b(k) = min(k, s); s = 0: b(k) = k",
             staleness_experiment, grpo_versions, off_by_one_versions, trl_na=na),
        Case("resume-at-epoch-boundary", "a resume at an epoch boundary trains the next epoch",
             "verl #5725", "prompts(k) after a resume at k = 3 (= steps per epoch) == uninterrupted, none empty (grpo: its loader, a pure function of k; no resumed trainer run)",
             epoch_boundary_experiment, grpo_loader, epoch_boundary_loader, trl_na=resume_na),
        Case("resume-skips-no-prompt", "a resume neither skips nor repeats prompts",
             "NeMo-RL #3599", "prompts(k) after a resume at k = 4 == uninterrupted: every prompt once per epoch",
             mid_epoch_experiment, grpo_loader, cursor_ahead_loader, trl_na=resume_na),
        Case("resume-keeps-epoch-seed", "a resume inside epoch e draws epoch e's order, not epoch 0's",
             "ms-swift #10050", "order(epoch 1) after a resume at k = 4 == uninterrupted order(epoch 1) != order(epoch 0)",
             mid_epoch_experiment, grpo_loader, reseed_loader, trl_na=resume_na),
    ]
