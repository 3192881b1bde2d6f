"""`grpo status RUN [--format table|json]`: where a run stands.

Per iteration: which stages are done (rows, seconds), mean reward, eval accuracy of policy k,
KL, the iteration's time; then the diagnostics' warnings (each names its iteration and metric).
"""

import json

from stages.options import FormatOpt, RunArg


def status(run: RunArg, format: FormatOpt = "table") -> None:
    """Show iterations x stages: done, rows, seconds, the headline metrics and warnings."""
    from pipeline.errors import GRPOError
    from pipeline.inspect_run import json_safe
    from pipeline.run import Run
    from pipeline.status import status_report

    if format not in ("table", "json"):
        raise GRPOError(f"--format {format!r}: expected table or json")
    report = status_report(Run(run))
    if format == "json":
        print(json.dumps(json_safe(report), indent=2, default=str))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"{report['run']}  (config {report['config_hash'][:12]}, {report['completed']} iterations done)")
    for col in ("iter", "rollout", "score", "logprobs", "update", "reward", "eval acc", "KL", "seconds"):
        t.add_column(col, justify="right")
    for row in report["iterations"]:
        cells = [str(row["iteration"])]
        for stage in ("rollout", "score", "logprobs", "update"):
            s = row["stages"][stage]
            cells.append(f"{s['rows']} rows {s['seconds']:.1f}s" if s else "-")
        for key, spec in (("reward/mean", ".3f"), ("eval/accuracy", ".3f"), ("kl/mean", ".4f"), ("seconds", ".1f")):
            cells.append(_fmt(row.get(key), spec))
        t.add_row(*cells)
    console = Console(width=140)
    console.print(t)
    if report["mlflow"]:
        m = report["mlflow"]
        console.print(f"MLflow: run {m['run_id']} (experiment {m['experiment_id']}) at {escape(m['tracking_uri'])}", soft_wrap=True)
    for w in report["warnings"]:
        console.print(f"[yellow]warning[/yellow] {escape(w['text'])}", soft_wrap=True)


def _fmt(v, spec: str) -> str:
    return "-" if v is None or v != v else format(v, spec)
