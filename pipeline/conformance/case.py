"""What a conformance case is, and how one runs.

A case is one silent GRPO bug that a peer shipped and documented (`source`: project and issue or pull
request), the behaviour that is right (`expect`: an equation or an exact expectation), and one
`experiment` that measures that behaviour on an implementation and returns `(holds, measured)`. The
same experiment runs on up to three implementations:

- `grpo`: this project's own functions and stages (the advantages, the objective, the schedule, the
  batch and logprob code, the trainer);
- `broken`: a deliberately broken variant (the peer's bug, rebuilt here), which the experiment must
  flag: a case whose broken variant passes proves nothing and is reported as vacuous;
- `trl`: TRL's GRPOTrainer through a small adapter (pipeline/conformance/trl_adapter.py), where the
  same experiment can run on it; otherwise `trl_na` says why (not applicable, needs a GPU, ...).

An implementation is any object the experiment knows how to ask (a function, a small namespace of
functions); each case module builds its own. Nothing here reads grpo's config or code to decide: the
verdicts are measurements.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Outcome:
    """One experiment on one implementation: whether the expectation held, and what was measured."""

    holds: bool | None  # None: not run (see `measured` for why)
    measured: str
    raised: bool = False  # the experiment crashed on it: a failure, but no measurement

    @property
    def word(self) -> str:
        return {True: "pass", False: "FAIL", None: "n/a"}[self.holds]


@dataclass(frozen=True)
class Case:
    id: str
    title: str
    source: str  # project and issue / pull request, confirmed in the peer's own thread
    expect: str  # the correct behaviour, as an equation or an exact expectation
    experiment: Callable[[Any], tuple[bool, str]]
    grpo: Callable[[], Any]  # builds grpo's implementation (lazily: it may load torch or a model)
    broken: Callable[[], Any]  # builds the deliberately broken variant
    trl: Callable[[], Any] | None = None  # builds TRL's implementation, when the experiment can run on it
    trl_na: str = ""  # why the TRL column is not measured, when `trl` is None
    slow: bool = False  # needs a real engine (DeepSpeed): the suite runs it under `-m slow`


def measure(case: Case, which: str) -> Outcome:
    """Run `case`'s experiment on implementation `which` (grpo, broken, trl); an exception is a
    failure of that implementation, reported with its last line (a crash is not a pass) and marked
    `raised`: for the broken variant it is no flag either, since a typo in a control raises too."""
    build = {"grpo": case.grpo, "broken": case.broken, "trl": case.trl}[which]
    if build is None:
        return Outcome(None, case.trl_na or "not measured")
    try:
        holds, measured = case.experiment(build())
    except ImportError as err:  # TRL not installed: the row says so rather than passing
        if which == "trl":
            return Outcome(None, f"not installable here: {err}")
        raise
    except Exception as err:  # noqa: BLE001 - the implementation failed the experiment
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        return Outcome(False, f"raised {last[:200]}", raised=True)
    return Outcome(bool(holds), measured)


@dataclass(frozen=True)
class Row:
    case: Case
    grpo: Outcome
    broken: Outcome
    trl: Outcome
    seconds: float

    @property
    def valid(self) -> bool:
        """grpo passes and the broken variant is flagged: the case is neither failed nor vacuous."""
        return self.grpo.holds is True and self.flagged

    @property
    def flagged(self) -> bool:
        """The broken variant was measured and failed the expectation (a control that raised was not measured)."""
        return self.broken.holds is False and not self.broken.raised

    @property
    def flag_word(self) -> str:
        return "yes" if self.flagged else ("NO (control raised)" if self.broken.raised else "NO (vacuous)")


def run_case(case: Case, with_trl: bool = True) -> Row:
    start = time.perf_counter()
    grpo, broken = measure(case, "grpo"), measure(case, "broken")
    trl = measure(case, "trl") if with_trl else Outcome(None, "not run (--no-trl)")
    return Row(case, grpo, broken, trl, time.perf_counter() - start)


def table(rows: list[Row], detail: bool = False) -> str:
    """The side-by-side table, Markdown: case, source, grpo, negative control, TRL."""
    lines = ["| case | source | grpo | broken variant flagged | TRL 1.16 |", "|---|---|---|---|---|"]
    for r in rows:
        trl = r.trl.word if not detail else f"{r.trl.word}: {r.trl.measured}"
        grpo = r.grpo.word if not detail else f"{r.grpo.word}: {r.grpo.measured}"
        cells = [r.case.id, r.case.source, grpo, r.flag_word, trl]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)
