"""The field's silent GRPO bugs as a conformance suite: one case per documented failure class of a
peer (TRL, verl, SkyRL, prime-rl, AReaL, NeMo-RL, ms-swift, DeepSpeed), each an experiment run on
grpo, on a deliberately broken variant (which it must flag) and, where it can run there, on TRL.

    grpo conformance                # the table: case, source, grpo, broken variant flagged, TRL
    .venv/bin/python -m pytest tests/test_conformance.py -q

What each case checks and how to add one: docs/conformance.md. The cases live by topic in
rewards.py, loss.py, masking.py, schedule.py, tokens.py, episodes.py (and engine.py, the slow ones on a real DeepSpeed engine).
"""

from __future__ import annotations


def all_cases(slow: bool = True):
    """Every case, in the table's order; without `slow`, the ones that need no engine."""
    from pipeline.conformance import engine, episodes, loss, masking, rewards, schedule, tokens

    out = (rewards.cases() + loss.cases() + masking.cases() + schedule.cases() + tokens.cases() + episodes.cases()
           + engine.cases())
    ids = [c.id for c in out]
    assert len(set(ids)) == len(ids), f"duplicate case ids: {ids}"
    return [c for c in out if slow or not c.slow]
