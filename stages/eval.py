"""`grpo eval`: evaluate a policy on data.eval, a model that is no run's policy, or compare two evals.

    grpo eval RUN [--iter K]                      policy/iter-K + data.eval -> iter-K/eval/part-*.parquet + MANIFEST.json
    grpo eval RECORD --model M --config FILE [--data EVAL]
        a model (HF directory or .gguf: the base, another run's export) evaluated into RECORD, a run
        whose policy 0 is M: the same record as that run's policy 0 eval, byte for byte
    grpo eval --compare A B [--iter K]            the difference of every figure, paired over prompts
    grpo eval NEW --replay SRC [--iter K] --set 'rewards=[...]'
        SRC's eval of policy K scored anew into NEW, with other rewards, never sampled again

Prints every figure with its 95 % interval (pipeline/eval/metrics.py, docs/tracking.md).
"""

from typing import Annotated, Optional

import typer

from stages.options import ConfigOpt, IterOpt, SetOpt

RecordArg = Annotated[Optional[str], typer.Argument(help="Run directory (or, with --model, the record to write).", show_default=False)]
ModelOpt = Annotated[Optional[str], typer.Option("--model", help="Evaluate this model (HF directory or .gguf) instead of a run's policy; needs --config.", show_default=False)]
DataOpt = Annotated[Optional[str], typer.Option("--data", help="With --model: data.eval, the held-out prompts.", show_default=False)]
ReplayOpt = Annotated[Optional[str], typer.Option("--replay", help="Re-score this run's eval (policy --iter K, default the newest evaluated) into RUN with --set overrides.", show_default=False)]
CompareOpt = Annotated[Optional[tuple[str, str]], typer.Option("--compare", help="Two runs or eval records: A B.", show_default=False)]


def evaluate(run: RecordArg = None, iter: IterOpt = None, model: ModelOpt = None, data: DataOpt = None,
             config: ConfigOpt = None, set: SetOpt = None, compare: CompareOpt = None, replay: ReplayOpt = None) -> None:
    """Held-out accuracy, pass@k, maj@k and rewards of policy K (default: the newest policy), with intervals."""
    from pipeline.errors import GRPOError
    from pipeline.eval.run import eval_figures, eval_notes, run_eval
    from pipeline.run.run import Run
    from pipeline.report.tracking import reporting

    if compare is not None:
        if run is not None or model is not None:
            raise GRPOError("--compare A B takes no RUN and no --model")
        return _compare(*compare, iter)
    if run is None:
        raise GRPOError("eval: give RUN (or --compare A B)")
    if model is not None:
        r, k = _record(run, model, data, config, set, iter), 0
    elif replay is not None:
        from pipeline.loop.replay_eval import replay_eval

        r, _ = replay_eval(replay, iter, run, set)
        k = 0
    else:
        if data is not None or config is not None or set:
            raise GRPOError("--data, --config and --set go with --model or --replay (a run evaluates with its own config)")
        r = Run(run)
        k = r.completed_iters() if iter is None else iter
    if r.cfg.data.eval is None:
        raise GRPOError("eval: data.eval is not set in the run's config")
    with reporting(r, k, "eval"):
        run_eval(r, k)
    figs = eval_figures(r, k)
    a, rw, ln = figs["accuracy"], figs["reward"], figs["mean_length"]
    print(f"eval policy {k}: accuracy {a[0]:.3f}, reward {rw[0]:.3f}, mean length {ln[0]:.1f}")
    notes = eval_notes(r, k)
    for name, (v, lo, hi) in figs.items():
        interval = f"no interval ({notes[name]})" if name in notes else f"[{lo:.3f}, {hi:.3f}]"
        print(f"  {name:<32} {v:8.3f}  {interval}")


def _record(run: str, model: str, data, config, sets, iter):
    """RECORD as a run of `config` whose policy 0 is `model` (made once; the same config reuses it)."""
    from pipeline import preflight
    from pipeline.errors import GRPOError
    from pipeline.config.options import from_command_line
    from pipeline.run.run import init_run

    if config is None:
        raise GRPOError("--model needs --config FILE (the rewards, data and eval settings to evaluate with)")
    if iter not in (None, 0):
        raise GRPOError(f"--iter {iter}: a model given with --model is the record's policy 0")
    cfg = from_command_line(config, {"--model": model, "--eval-data": data}, sets)
    preflight.check(cfg)
    return init_run(run, cfg)


def _compare(a: str, b: str, iter) -> None:
    from pipeline.eval.compare import compare, lines, record
    from pipeline.run.run import Run

    ra, rb = Run(a), Run(b)
    (ka, ta), (kb, tb) = record(ra, iter), record(rb, iter)
    print("\n".join(lines(compare(ra, ka, ta, rb, kb, tb))))
