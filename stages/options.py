"""Option types shared by the commands, declared once."""

from pathlib import Path
from typing import Annotated, Optional

import typer

RunArg = Annotated[str, typer.Argument(help="Run directory: a local path or an fsspec URI (s3://bucket/run).", show_default=False)]
IterOpt = Annotated[Optional[int], typer.Option("--iter", min=0, help="Iteration; default: the first one this stage has not done.")]
ShardOpt = Annotated[Optional[str], typer.Option("--shard", help="i/N: this worker writes every N-th part (0-based i).")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override a config key: dotted.key=value (repeatable).")]
ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="YAML config file.", exists=False, dir_okay=False)]
FormatOpt = Annotated[str, typer.Option("--format", help="table or json.")]
