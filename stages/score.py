"""`grpo score RUN [--iter K] [--shard i/N]`: reward functions and group advantages.

iter-K/rollout -> iter-K/score/part-*.parquet + MANIFEST.json
"""

from stages.options import IterOpt, RunArg, ShardOpt


def score(run: RunArg, iter: IterOpt = None, shard: ShardOpt = None) -> None:
    """Stage 2: score completions and compute advantages."""
    from pipeline.run.parts import Shard
    from pipeline.run.run import Run
    from pipeline.report.tracking import reporting
    from pipeline.score import run_score
    from stages.report import stage_done

    r = Run(run)
    k = r.next_iter("score") if iter is None else iter
    with reporting(r, k, "score"):
        manifest = run_score(r, k, Shard.parse(shard))
    stage_done(r, k, "score", manifest)
