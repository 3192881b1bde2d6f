"""`grpo status RUN [--format table|json]`: where a run stands.

Per iteration: which stages are done (rows, seconds; a rollout sampled from an older policy under
train.max_staleness says which, and how stale), mean reward, eval accuracy [95 % interval] of the policy
the iteration produced (k+1, as `grpo iterate` prints it; `--format json` keeps policy k's eval on
row k, as MLflow logs it), KL, the share of completions whose rollout-correction weight was truncated
or masked (cut), the iteration's time; then the diagnostics' warnings (each names its iteration and metric).
"""

import json

from stages.options import FormatOpt, RunArg


def status(run: RunArg, format: FormatOpt = "table") -> None:
    """Show iterations x stages: done, rows, seconds, the headline metrics and warnings."""
    from pipeline.errors import GRPOError
    from pipeline.report.inspect import json_safe
    from pipeline.run.run import Run
    from pipeline.report.status import status_report

    if format not in ("table", "json"):
        raise GRPOError(f"--format {format!r}: expected table or json")
    report = status_report(Run(run))
    if format == "json":
        print(json.dumps(json_safe(report), indent=2, default=str))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"{report['run']}  (config {report['config_hash'][:12]}, {report['completed']} iterations done)",
              caption="eval acc: of the policy the iteration produced, as `grpo iterate` prints it, [95 % interval]")
    for col in ("iter", "rollout", "score", "logprobs", "update", "reward", "eval acc", "KL", "cut", "seconds"):
        t.add_column(col, justify="right")
    acc = {row["iteration"]: _acc(row) for row in report["iterations"]}  # of policy k
    if acc.get(0) is not None:
        t.add_row("start", *["-"] * 5, acc[0], "-", "-", "-")
    for row in report["iterations"]:
        k = row["iteration"]
        if not any(row["stages"].values()):
            continue  # only the eval of the newest policy: shown on the row that produced it
        cells = [str(k)]
        for stage in ("rollout", "score", "logprobs", "update"):
            s = row["stages"][stage]
            cells.append(f"{s['rows']} rows {s['seconds']:.1f}s" if s else "-")
            if stage == "rollout" and s and row.get("rollout/staleness"):  # sampled from policy k - staleness
                cells[-1] += f" (policy {k - int(row['rollout/staleness'])}, stale {int(row['rollout/staleness'])})"
        cells.append(_fmt(row.get("reward/mean"), ".3f"))
        cells.append(acc.get(k + 1) or "-")  # policy k+1, the one this iteration's update wrote
        cells += [_fmt(row.get("kl/mean"), ".4f"), _fmt(row.get("rollout_correction/clipped_seq_frac"), ".0%"),
                  _fmt(row.get("seconds"), ".1f")]
        t.add_row(*cells)
    console = Console(width=140)
    console.print(t)
    if report["mlflow"]:
        m = report["mlflow"]
        console.print(f"MLflow: run {m['run_id']} (experiment {m['experiment_id']}) at {escape(m['tracking_uri'])}", soft_wrap=True)
    d = (report.get("cluster") or {}).get("driver") or {}
    if d.get("alive") is False:  # SIGKILLed (or lost): its record stayed behind, nothing is in flight
        console.print(f"Ray: the driver of this run (pid {d['pid']} on {escape(d['host'])}) is gone; nothing is in flight "
                      f"(last seen: {report['cluster']['stage']} iteration {report['cluster']['iteration']}); the same "
                      "`grpo iterate` command resumes the run", soft_wrap=True)
    elif c := report.get("cluster"):  # a Ray driver is running: its rollout parts in flight, by node
        if d.get("alive") is None and d:
            console.print(f"Ray: the driver runs on another host ({escape(d['host'])}, pid {d['pid']}): whether it is still "
                          "alive is unknown here", soft_wrap=True)
        nodes: dict[str, list[str]] = {}
        for part, node in sorted(c["in_flight"].items(), key=lambda item: int(item[0])):
            nodes.setdefault(node, []).append(part)
        console.print(f"Ray: {c['stage']} iteration {c['iteration']}, in flight: "
                      + ("; ".join(f"node {n} parts {', '.join(ps)}" for n, ps in sorted(nodes.items())) or "none")
                      + f"; {c['queued']} queued" + (f"; waiting: {escape(c['waiting'])}" if c.get("waiting") else ""), soft_wrap=True)
    for w in report["warnings"]:
        console.print(f"[yellow]warning[/yellow] {escape(w['text'])}", soft_wrap=True)


def _acc(row: dict) -> str | None:
    """Eval accuracy with its 95 % interval, `0.450 [0.38, 0.52]` (None when not evaluated)."""
    v = row.get("eval/accuracy")
    if v is None:
        return None
    lo, hi = row.get("eval/accuracy_lo"), row.get("eval/accuracy_hi")
    return _fmt(v, ".3f") + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None and lo == lo else "")


def _fmt(v, spec: str) -> str:
    return "-" if v is None or v != v else format(v, spec)
