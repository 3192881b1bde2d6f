"""`grpo replay SRC --iter K --to NEW [--set key=value ...] [--until score|logprobs|update]`.

SRC/policy/iter-K + SRC/iter-K/rollout (copied, linked by hash) -> NEW/policy/iter-0000 +
NEW/iter-0000/rollout, then NEW/iter-0000/{score, logprobs, update} computed with NEW's settings.
NEW's iteration 0 is SRC's iteration K (see pipeline/loop/replay.py).
"""

from typing import Annotated

import typer

from stages.options import RunArg, SetOpt

ReplayIterOpt = Annotated[int, typer.Option("--iter", min=0, help="The iteration of SRC whose completions are replayed.", show_default=False)]
ToOpt = Annotated[str, typer.Option("--to", help="The new run directory (local path or fsspec URI).", show_default=False)]
UntilOpt = Annotated[str, typer.Option("--until", help="Last stage run in NEW: score, logprobs or update.")]


def replay(src: RunArg, iter: ReplayIterOpt, to: ToOpt, set: SetOpt = None, until: UntilOpt = "update") -> None:
    """Re-run score/logprobs/update of a past iteration on its stored completions, with new settings."""
    from pipeline.loop.replay import UNTIL, replay as run_replay

    new = run_replay(src, iter, to, set, until)
    from pipeline.rewards.judge.record import summary_lines

    for line in summary_lines(new.manifest(0, "score").judge):  # reused verdicts, and the calls a changed judge made
        print(line)
    done = ", ".join(UNTIL[: UNTIL.index(until) + 1])
    print(f"replay of {src} iteration {iter} -> {new.store.display()} iteration 0 (rollout linked; {done} done); check it with: grpo audit {to}")
