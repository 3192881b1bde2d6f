"""`grpo status RUN [--format table|json]`: where a run stands.

Per iteration: which stages are done (rows, seconds), mean reward, eval accuracy, KL.
"""

import json

from stages.options import FormatOpt, RunArg


def status(run: RunArg, format: FormatOpt = "table") -> None:
    """Show iterations x stages: done, rows, seconds, and the headline metrics."""
    from pipeline.run import Run
    from pipeline.status import status_report

    report = status_report(Run(run))
    if format == "json":
        print(json.dumps(report, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{report['run']}  (config {report['config_hash'][:12]}, {report['completed']} iterations done)")
    for col in ("iter", "rollout", "score", "logprobs", "update", "eval acc", "reward", "KL"):
        t.add_column(col, justify="right")
    for row in report["iterations"]:
        cells = [str(row["iteration"])]
        for stage in ("rollout", "score", "logprobs", "update"):
            s = row["stages"][stage]
            cells.append(f"{s['rows']} rows {s['seconds']:.1f}s" if s else "-")
        for key, spec in (("eval/accuracy", ".3f"), ("reward/mean", ".3f"), ("kl/mean", ".4f")):
            v = row.get(key)
            cells.append("-" if v is None or v != v else format_(v, spec))
        t.add_row(*cells)
    console = Console(width=140)
    console.print(t)
    for w in report["warnings"]:
        console.print(f"[yellow]warning[/yellow] {w}")


def format_(v, spec):
    return format(v, spec)
