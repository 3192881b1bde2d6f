"""`grpo eval RUN [--iter K]`: evaluate policy K on data.eval.

policy/iter-K + data.eval -> iter-K/eval/part-00000.parquet + MANIFEST.json
"""

from stages.options import IterOpt, RunArg


def evaluate(run: RunArg, iter: IterOpt = None) -> None:
    """Held-out accuracy and reward of policy K (default: the newest policy)."""
    from pipeline.errors import GRPOError
    from pipeline.evaluate import eval_summary, run_eval
    from pipeline.store.run import Run
    from pipeline.report.tracking import reporting

    r = Run(run)
    k = r.completed_iters() if iter is None else iter
    if r.cfg.data.eval is None:
        raise GRPOError("eval: data.eval is not set in the run's config")
    with reporting(r, k, "eval"):
        run_eval(r, k)
    s = eval_summary(r, k)
    print(f"eval policy {k}: accuracy {s['eval/accuracy']:.3f}, reward {s['eval/reward']:.3f}, mean length {s['eval/mean_length']:.1f}")
