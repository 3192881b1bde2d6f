"""Run the cases and write the table: `grpo conformance` (stages/conformance.py) and the test suite
(tests/test_conformance.py) both come here."""

from __future__ import annotations

import datetime
import platform

from pipeline.conformance import all_cases
from pipeline.conformance.case import Row, run_case, table
from pipeline.errors import GRPOError


def select(ids: list[str] | None = None, slow: bool = True) -> list:
    cases = all_cases(slow=slow or bool(ids))
    if not ids:
        return cases
    known = {c.id: c for c in cases}
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise GRPOError(f"--case {unknown[0]!r}: no such case (known: {', '.join(known)})")
    return [known[i] for i in ids]


def run(cases: list, with_trl: bool = True, model: str | None = None, on_row=None) -> list[Row]:
    """Each case on grpo, on its broken variant and (with `with_trl` and a tiny `model` directory) on TRL."""
    if model is not None:
        from pipeline.conformance import trl_adapter

        trl_adapter.use_model(model)
    rows = []
    for case in cases:
        rows.append(run_case(case, with_trl=with_trl))
        if on_row is not None:
            on_row(rows[-1])
    return rows


def versions() -> str:
    """The libraries the table was measured with, one line."""
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"python {platform.python_version()}"]
    for pkg in ("torch", "transformers", "deepspeed", "trl"):
        try:
            parts.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            parts.append(f"{pkg} not installed")
    return ", ".join(parts)


def report(rows: list[Row], detail: bool = True) -> str:
    """The Markdown report: when, with what, the table, and the verdict line."""
    failed = [r.case.id for r in rows if r.grpo.holds is not True]
    vacuous = [r.case.id for r in rows if not r.flagged]
    trl = [r for r in rows if r.trl.holds is not None]
    lines = [f"measured {datetime.date.today().isoformat()} with {versions()}", "", table(rows, detail=detail), "",
             f"grpo: {len(rows) - len(failed)} of {len(rows)} pass" + (f" (failed: {', '.join(failed)})" if failed else "")
             + f"; broken variants flagged: {len(rows) - len(vacuous)} of {len(rows)}" + (f" (vacuous or raising: {', '.join(vacuous)})" if vacuous else "")
             + f"; TRL measured on {len(trl)}, passing {sum(r.trl.holds is True for r in trl)}"]
    return "\n".join(lines)


def verdict(rows: list[Row]) -> bool:
    """True when every case is valid: grpo passes it and its broken variant is flagged."""
    return all(r.valid for r in rows)
