"""`grpo logprobs RUN [--iter K] [--shard i/N]`: old-policy and reference per-token logprobs.

iter-K/rollout + policy/iter-K + ref_model -> iter-K/logprobs/part-*.parquet + MANIFEST.json
"""

from stages.options import IterOpt, RunArg, ShardOpt


def logprobs(run: RunArg, iter: IterOpt = None, shard: ShardOpt = None) -> None:
    """Stage 3: teacher-forced logprobs of every completion."""
    from pipeline.logprobs import run_logprobs
    from pipeline.run.parts import Shard
    from pipeline.run.run import Run
    from pipeline.report.tracking import reporting
    from stages.report import stage_done

    r = Run(run)
    k = r.next_iter("logprobs") if iter is None else iter
    with reporting(r, k, "logprobs"):
        manifest = run_logprobs(r, k, Shard.parse(shard))
    stage_done(r, k, "logprobs", manifest)
