"""`grpo rollout RUN [--iter K] [--shard i/N]`: sample G completions per prompt with vLLM.

policy/iter-K + data.train -> iter-K/rollout/part-*.parquet + MANIFEST.json
"""

from stages.options import IterOpt, RunArg, ShardOpt


def rollout(run: RunArg, iter: IterOpt = None, shard: ShardOpt = None) -> None:
    """Stage 1: generate completions for iteration K's prompts."""
    from pipeline.run.parts import Shard
    from pipeline.rollout import run_rollout
    from pipeline.run.run import Run
    from pipeline.report.tracking import reporting
    from stages.report import stage_done

    r = Run(run)
    k = r.next_iter("rollout") if iter is None else iter
    with reporting(r, k, "rollout"):
        manifest = run_rollout(r, k, Shard.parse(shard))
    stage_done(r, k, "rollout", manifest)
