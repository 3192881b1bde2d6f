"""`grpo update RUN [--iter K]`: train policy K into policy K+1 with DeepSpeed.

iter-K/{rollout,score,logprobs} + policy/iter-K -> policy/iter-(K+1) + iter-K/update/
Multi-process: `deepspeed --num_gpus 2 --no_local_rank --module stages.cli update RUN` or
`torchrun --nproc_per_node 2 -m stages.cli update RUN`.
"""

from stages.options import IterOpt, RunArg


def update(run: RunArg, iter: IterOpt = None) -> None:
    """Stage 4: the clipped-surrogate update over iteration K's completions."""
    from pipeline.run.run import Run
    from pipeline.report.tracking import reporting
    from pipeline.update.publish import run_update
    from stages.report import stage_done

    r = Run(run)
    k = r.next_iter("update") if iter is None else iter
    with reporting(r, k, "update"):
        manifest, trainer = run_update(r, k)
    if trainer is None or trainer.rank == 0:
        stage_done(r, k, "update", manifest)
    if trainer is not None:
        trainer.close()
