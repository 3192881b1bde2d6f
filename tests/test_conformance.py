"""The conformance suite (pipeline/conformance/) as acceptance tests of grpo: every case passes on grpo
and flags its deliberately broken variant; the table in docs/conformance.md is what the cases measure,
TRL's column included (slow: it builds TRL's GRPOTrainer on the session's tiny model).

The engine cases run where an engine is already started: zero-keeps-every-micro-step in
tests/test_uneven_batches.py on that module's rows, sampler-gets-new-weights in tests/test_engines.py on
its sleeping vLLM engine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.conformance import all_cases
from pipeline.conformance.case import Outcome, run_case

DOC = Path(__file__).resolve().parent.parent / "docs" / "conformance.md"
FAST = all_cases(slow=False)


def test_at_least_15_cases_each_with_a_source_an_expectation_and_a_negative_control():
    cases = all_cases()
    assert len(cases) >= 15, len(cases)
    for c in cases:
        assert re.search(r"#\d+", c.source), (c.id, c.source)  # an issue or pull request number
        assert c.expect and c.broken is not c.grpo, c.id
        assert c.trl is not None or c.trl_na, f"{c.id}: the TRL column says why it is not measured"


@pytest.mark.parametrize("case", FAST, ids=[c.id for c in FAST])
def test_grpo_passes_and_the_broken_variant_is_flagged(case):
    row = run_case(case, with_trl=False)
    assert row.grpo.holds is True, f"grpo fails {case.id}: {row.grpo.measured}"
    assert not row.broken.raised, f"{case.id}: its broken variant raised instead of being measured ({row.broken.measured})"
    assert row.broken.holds is False, f"{case.id} is vacuous: its broken variant passes ({row.broken.measured})"
    assert row.valid


def test_a_broken_variant_that_raises_is_not_counted_as_flagged():
    # a typo in a control raises; that is no measurement of the bug, so the row is invalid and says so
    from dataclasses import replace

    from pipeline.conformance.case import table

    def typo():
        raise NameError("name 'nansum_scorr' is not defined")

    row = run_case(replace(FAST[0], broken=lambda: typo()), with_trl=False)
    assert row.grpo.holds is True and row.broken.raised and not row.flagged and not row.valid
    assert "NO (control raised)" in table([row])


def test_a_case_whose_experiment_cannot_tell_is_reported_vacuous():
    # the suite's own negative control: an experiment that holds for anything makes the row invalid
    from dataclasses import replace

    row = run_case(replace(FAST[0], experiment=lambda impl: (True, "always")), with_trl=False)
    assert row.grpo.holds is True and row.broken.holds is True and not row.valid


def _doc_rows() -> dict[str, list[str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) == 5 and cells[0] in {c.id for c in all_cases()}:
            rows[cells[0]] = cells
    return rows


def test_the_docs_table_lists_every_case_with_its_source():
    rows = _doc_rows()
    assert set(rows) == {c.id for c in all_cases()}, sorted(set(c.id for c in all_cases()) ^ set(rows))
    for c in all_cases():
        assert rows[c.id][1] == c.source, c.id
        assert rows[c.id][2].startswith("pass") and rows[c.id][3] == "yes", rows[c.id]


@pytest.mark.slow
def test_the_trl_column_is_what_trl_measures(assets):
    """TRL 1.16's GRPOTrainer on the session's tiny model: every case with a TRL adapter gives the verdict
    the docs table records; the others record why they are not measured."""
    from pipeline.conformance import trl_adapter
    from pipeline.conformance.case import measure

    trl_adapter.use_model(assets["model"])
    rows = _doc_rows()
    for c in all_cases():
        doc = rows[c.id][4]
        if c.trl is None:
            assert doc.startswith("n/a"), (c.id, doc)
            continue
        got: Outcome = measure(c, "trl")
        assert got.holds is not None, (c.id, got.measured)
        assert doc.split(":")[0] == got.word, (c.id, doc, got)


def test_an_unknown_case_is_a_one_line_error(capsys):
    from stages.cli import run_cli

    assert run_cli(["conformance", "--no-trl", "--case", "no-such-case"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --case 'no-such-case': no such case (known: all-none-rewards")


def test_a_correct_gdpo_passes_one_none_of_several():
    # the case asks what ms-swift #8123 is about (finite, normalised among the rows that have values),
    # not grpo's own sum-then-normalise: a NaN-aware normalise-each-function-then-sum must pass too
    import numpy as np

    from pipeline.conformance.impls import Scorer
    from pipeline.conformance.rewards import EPS, one_nan_experiment

    def gdpo(per_fn, w, G):
        parts = []
        for j in range(per_fn.shape[1]):
            g = per_fn[:, j].reshape(-1, G)
            z = (g - np.nanmean(g, 1, keepdims=True)) / (np.nanstd(g, 1, ddof=1, keepdims=True) + EPS)
            parts.append(w[j] * np.nan_to_num(z, nan=0.0).reshape(-1))  # a function that does not apply adds 0
        return np.sum(parts, axis=0)

    holds, measured = one_nan_experiment(Scorer(gdpo, lambda v: np.asarray(v, dtype=float)))
    assert holds, measured


def test_stale_samples_checks_clipping_and_the_correction_each_on_its_own():
    # SkyRL #1315's bug has two halves: old = current (clipping never binds) and no reweighing of the
    # sampler's samples; each half alone is caught
    from dataclasses import replace

    from pipeline.conformance import loss

    grpo, broken = loss.grpo_objective(), loss.uncorrected_objective()
    assert loss._clip_binds(grpo)[0] and not loss._clip_binds(broken)[0]

    def no_correction(logp, old, adv, mask, loss_type, **kw):  # keeps old, drops the sampler weight
        kw.pop("sampler_logprobs", None)
        return grpo.loss(logp, old, adv, mask, loss_type, **kw)

    holds, measured = loss.stale_samples_experiment(replace(grpo, loss=no_correction))
    assert not holds and "8 of 12" in measured, measured
