"""`grpo conformance [--case ID] [--no-trl] [--fast] [--out FILE.md]`: the field's silent GRPO bugs, each
an experiment run on grpo, on a deliberately broken variant (the peer's bug, which the experiment must
flag) and on TRL where it can run there; prints the table (case, source, grpo, broken variant flagged,
TRL) and exits 1 when grpo fails a case or a case flags nothing. docs/conformance.md says what each
case checks. The TRL column runs TRL's GRPOTrainer on a tiny model built once (the demo's, untrained,
kept in the cache directory); --no-trl skips it.
"""

from pathlib import Path
from typing import Annotated, Optional

import typer

CaseOpt = Annotated[Optional[list[str]], typer.Option("--case", help="Run only this case (repeatable); default: all.")]


def conformance(case: CaseOpt = None,
                no_trl: Annotated[bool, typer.Option("--no-trl", help="Skip the TRL column.")] = False,
                fast: Annotated[bool, typer.Option("--fast", help="Skip the cases that need an engine (DeepSpeed, vLLM).")] = False,
                out: Annotated[Optional[Path], typer.Option("--out", help="Also write the Markdown report here.", dir_okay=False)] = None) -> None:
    """Run the conformance cases: grpo, the broken variant each must flag, and TRL side by side."""
    from pipeline.conformance import suite

    cases = suite.select(case, slow=not fast)
    needs_rows = any(c.slow and c.id != "sampler-gets-new-weights" for c in cases)
    needs_sampler = any(c.id == "sampler-gets-new-weights" for c in cases)
    model = None if no_trl and not (needs_rows or needs_sampler) else _tiny_model()
    if needs_rows:
        _engine_rows(model)
    sampler = _sampler(model) if needs_sampler else None

    def show(row) -> None:
        flagged = "flagged" if row.flagged else ("RAISED" if row.broken.raised else "NOT flagged")
        print(f"{row.case.id:34s} grpo {row.grpo.word:4s}  broken {flagged:11s}  TRL {row.trl.word:4s}  ({row.seconds:.1f} s)", flush=True)

    try:
        rows = suite.run(cases, with_trl=not no_trl, model=model, on_row=show)
    finally:
        if sampler is not None:
            sampler.close()
    text = suite.report(rows)
    print()
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    if not suite.verdict(rows):
        raise typer.Exit(1)


def _tiny_model() -> str:
    """The demo's tiny policy, untrained (TRL's experiments need its tokenizer and chat template, not its skill)."""
    from demo.tinymodel import make_model
    from pipeline.store import cache_dir

    path = cache_dir() / "conformance" / "tiny-model"
    make_model(path, size="tiny", seed=0, sft_steps=0)
    return str(path)


def _engine_rows(model: str) -> None:
    """One iteration's training rows for the engine cases (a rollout of the tiny model on demo prompts)."""
    import tempfile

    from demo.task import SYSTEM_PROMPT, write_demo_data
    from pipeline.conformance import engine

    work = Path(tempfile.mkdtemp(prefix="grpo-conformance-"))
    train, _ = write_demo_data(work / "data", n_train=40, n_eval=4, seed=0)
    engine.make_rows(model, str(train), str(work / "run"), SYSTEM_PROMPT)


def _sampler(model: str):
    """A vLLM engine and two policies (the tiny model, and a perturbed copy) for the weight-sync case."""
    import tempfile

    from pipeline.conformance import engine

    return engine.make_sampler(model, tempfile.mkdtemp(prefix="grpo-conformance-sampler-"))
