"""`grpo audit RUN` | `grpo audit --compare RUN_A RUN_B`: verify a run's record, or find where two runs part.

RUN/**/MANIFEST.json + every file they list -> one line per problem and exit 1, or a one-line
summary and exit 0. With --compare: the config key and the first artifact (in lineage order)
where the two runs differ, exit 1; or one line saying they agree, exit 0.
"""

from typing import Annotated

import typer

RunsArg = Annotated[list[str], typer.Argument(help="RUN, or RUN_A RUN_B with --compare.", show_default=False)]
CompareOpt = Annotated[bool, typer.Option("--compare", help="Compare two runs artifact by artifact instead of auditing one.")]
WeightsOpt = Annotated[bool, typer.Option("--without-weights", help="A record copied without its policies' weight files "
                                          "(the GPU proof's tarball): those may be absent; every other file, hash and link is checked.")]


def audit(runs: RunsArg, compare: CompareOpt = False, without_weights: WeightsOpt = False) -> None:
    """Check every manifest, file hash and lineage link of a run (or compare two runs)."""
    from pipeline.report.audit import audit_run
    from pipeline.report.compare import compare_runs
    from pipeline.errors import GRPOError
    from pipeline.run.run import Run

    if compare:
        if len(runs) != 2:
            raise GRPOError("audit --compare: give two runs, RUN_A RUN_B")
        result = compare_runs(Run(runs[0]), Run(runs[1]))
        print("\n".join(result.lines()))
        if not result.same:
            raise typer.Exit(1)
        return
    if len(runs) != 1:
        raise GRPOError("audit: give one run (or --compare RUN_A RUN_B)")
    report = audit_run(Run(runs[0]), weights=not without_weights)
    for line in report.problems:
        print(line)
    print(report.summary())
    if not report.ok:
        raise typer.Exit(1)
