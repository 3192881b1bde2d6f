"""`grpo inspect RUN [--iter K] [--top 5] [--format table|json]`: one iteration's completions.

iter-K/{rollout,score}/part-*.parquet -> the best and worst completions with their rewards and
advantages, the reward of each function, and the groups whose rewards have no spread.
"""

import json
from typing import Annotated, Optional

import typer

from stages.options import FormatOpt, RunArg

InspectIterOpt = Annotated[Optional[int], typer.Option("--iter", min=0, help="Iteration to show; default: the newest scored one.")]
TopOpt = Annotated[int, typer.Option("--top", min=1, help="Best and worst completions shown.")]


def inspect(run: RunArg, iter: InspectIterOpt = None, top: TopOpt = 5, format: FormatOpt = "table") -> None:
    """Best/worst completions, reward per function and zero-spread groups of iteration K (default: the newest scored)."""
    from pipeline.errors import GRPOError
    from pipeline.report.inspect import inspect_iteration, json_safe, latest_scored
    from pipeline.run.run import Run

    if format not in ("table", "json"):
        raise GRPOError(f"--format {format!r}: expected table or json")
    r = Run(run)
    k = latest_scored(r) if iter is None else iter
    report = inspect_iteration(r, k, top)
    if format == "json":
        print(json.dumps(json_safe(report), indent=2))
        return
    _print(report)


def _fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None or v != v else format(v, spec)


def _print(rep: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=140)
    zero = rep["zero_std_groups"]
    console.print(
        f"[bold]{escape(rep['run'])}[/bold] iteration {rep['iteration']}: {rep['completions']} completions in {rep['groups']} groups, "
        f"reward mean {_fmt(rep['reward']['mean'])} std {_fmt(rep['reward']['std'])}, "
        f"{len(zero)} of {rep['groups']} groups with zero spread ({_fmt(rep['frac_reward_zero_std'], '.0%')})",
        soft_wrap=True,
    )
    t = Table(title="reward per function")
    for col in ("function", "mean", "std", "null"):
        t.add_column(col, justify="right" if col != "function" else "left")
    for name, s in rep["rewards"].items():
        t.add_row(escape(name), _fmt(s["mean"]), _fmt(s["std"]), str(s["null"]))
    console.print(t)
    names = list(rep["rewards"])
    for title in ("best", "worst"):
        t = Table(title=f"{title} {len(rep[title])} completions", show_lines=True)
        t.add_column("prompt_id/sample", justify="right")
        t.add_column("prompt", max_width=36)
        t.add_column("completion", max_width=48)
        for col in ("reward", *names, "advantage", "len"):
            t.add_column(col, justify="right")
        for row in rep[title]:
            t.add_row(
                f"{row['prompt_id']}/{row['sample_idx']}", escape(row["prompt"]), escape(row["completion"]),
                _fmt(row["reward"]), *[_fmt(row["rewards"][n]) for n in names], _fmt(row["advantage"]),
                f"{row['completion_length']}{'+' if row['finish_reason'] == 'length' else ''}",
            )
        console.print(t)
        for row in rep[title]:  # a judge's answer beside each completion
            for n, v in row.get("judges", {}).items():
                said = escape(" ".join((v["answer"] or "").split())[:200]) if v["answer"] is not None else "(no answer)"
                console.print(f"  {row['prompt_id']}/{row['sample_idx']} judge {escape(n)}: {said}"
                              + (f" [dim]({escape(v['reason'])})[/dim]" if v["reason"] else ""), soft_wrap=True)
    if zero:
        t = Table(title="groups with zero spread (no learning signal)")
        for col in ("group", "prompt_id", "prompt", "reward"):
            t.add_column(col, justify="left" if col == "prompt" else "right")
        for g in zero:
            t.add_row(str(g["group_idx"]), str(g["prompt_id"]), escape(g["prompt"]), _fmt(g["reward"]))
        console.print(t)
