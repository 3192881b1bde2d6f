"""Dataset columns shown beside an iteration's completions (`grpo inspect --column`): a column the
rollout carries from the dataset row, or a dotted path into one (`reward_model.ground_truth`), read
as everywhere else a column is named (pipeline.data.fields)."""

from __future__ import annotations

import polars as pl
import pyarrow.parquet as pq

from pipeline.data import fields
from pipeline.errors import GRPOError
from pipeline.store import stage_rel
from pipeline.run.run import Run
from schemas.artifacts import ROLLOUT


def data_columns(run: Run, k: int, shown: list[str]) -> list[str]:
    """The rollout's columns that `shown` names: each column, or the column a dotted path is inside."""
    if not shown:
        return []
    m = run.require(k, "inspect", "rollout")
    rel = f"{stage_rel(k, 'rollout')}/{min(n for n in m.outputs if n.endswith('.parquet'))}"
    with run.store.fs.open(run.store.path(rel), "rb") as f:
        have = [c for c in pq.ParquetFile(f).schema_arrow.names if c not in ROLLOUT.schema.names]  # the dataset's
    heads = list(dict.fromkeys(fields.split(name, have)[0] for name in shown))
    missing = [h for h in heads if h not in have]
    if missing:
        raise GRPOError(f"--column {missing[0]!r}: {run.store.display(rel)} has no such dataset column (dataset columns: {', '.join(have) or 'none'})")
    return heads


def shown_values(df: pl.DataFrame, shown: list[str]) -> dict[str, list]:
    """Each shown name -> its value in every row of `df` (GRPOError naming the option and the missing field)."""
    out = {}
    for name in shown:
        try:
            out[name] = fields.values({c: df[c].to_list() for c in df.columns}, name)
        except GRPOError as err:
            raise GRPOError(f"--column {name!r}: {err}") from None
    return out
