"""Dotted column paths: `reward_model.ground_truth` names the key `ground_truth` inside the column
`reward_model` (a Parquet struct, a nested JSON object: verl's data), at any depth. A name that is
itself a column is that column, dots and all.

The one reading of such a name, wherever a column is named: `data.prompt_column` (`column`),
the built-ins' `*_column` options, OpenRLHF's `label_key`, the fields of a judge's rubric and of `data.prompt_template`
(`{reward_model.ground_truth}`), `grpo inspect --column` (`values` over rows, `fill` for a
template), and `grpo init`'s check of data.train and every eval set (`check`: the Parquet or Arrow
schema, or the schema polars infers from a JSON file's rows, walked the same way).
"""

from __future__ import annotations

import string
from typing import Any

from pipeline.errors import GRPOError


def split(name: str, have) -> tuple[str, list[str]]:
    """(the column, the keys inside it): `reward_model.ground_truth` -> ("reward_model", ["ground_truth"])."""
    if name in have or "." not in name:
        return name, []
    head, *path = name.split(".")
    return head, path


def value(v: Any, head: str, path: list[str]) -> Any:
    """The value at `path` inside one row's value `v` of column `head`; GRPOError naming the missing key."""
    for depth, k in enumerate(path):
        if v is None:  # a null struct holds no value: None, as a null in a plain column
            return None
        if not isinstance(v, dict) or k not in v:
            at = ".".join([head, *path[:depth]])
            keys = f"fields: {', '.join(map(str, v))}" if isinstance(v, dict) else f"it holds {type(v).__name__}"
            raise GRPOError(f"column {at!r} has no field {k!r} ({keys})")
        v = v[k]
    return v


def values(columns: dict[str, list], name: str, fix: str = "") -> list:
    """A column's values (one per row), or the values a dotted path names inside it. `fix`: how
    to name another column (appended to the error, e.g. "; set the `answer_column` option")."""
    head, path = split(name, columns)
    if head not in columns:
        have = ", ".join(sorted(columns)) or "none"
        raise GRPOError(f"no dataset column {name!r} (dataset columns: {have}){fix}")
    if not path:
        return columns[head]
    out = []
    for i, v in enumerate(columns[head]):
        try:
            out.append(value(v, head, path))
        except GRPOError as err:
            raise GRPOError(f"row {i}: {err}{fix}") from None
    return out


def column(df, name: str):
    """The polars Series a column name or a dotted path names in `df` (a struct field keeps its type:
    a list of chat messages stays one), named `name`; GRPOError naming the missing key."""
    import polars as pl

    head, path = split(name, df.columns)
    if head not in df.columns:
        raise GRPOError(f"no column {name!r} (columns: {', '.join(df.columns)})")
    s = df.get_column(head)
    for depth, k in enumerate(path):
        keys = [f.name for f in s.dtype.fields] if isinstance(s.dtype, pl.Struct) else []
        if k not in keys:
            at = ".".join([head, *path[:depth]])
            holds = f"fields: {', '.join(keys)}" if keys else f"it holds {s.dtype}, no nested object"
            raise GRPOError(f"no column {name!r}: {at!r} has no field {k!r} ({holds})")
        s = s.struct.field(k)
    return s.alias(name)


def check(data: str, have: list[str], name: str, where: str) -> None:
    """`grpo init`: the dataset `data` (its columns `have`) has the column or the dotted path `name`;
    a GRPOError `{where}: data {file} has no column ...` naming the missing key otherwise."""
    head, path = split(name, have)
    if head not in have:
        raise GRPOError(f"{where} {data} has no column {name!r} (columns: {', '.join(have)})")
    if not path:
        return
    import pyarrow as pa

    from pipeline.data.sources import schema

    kind = schema(data).field(head).type
    for depth, k in enumerate(path):
        keys = [kind.field(i).name for i in range(kind.num_fields)] if pa.types.is_struct(kind) else []
        if k not in keys:
            at = ".".join([head, *path[:depth]])
            holds = f"fields: {', '.join(keys)}" if keys else f"it holds {kind}, no nested object"
            raise GRPOError(f"{where} {data} has no column {name!r}: {at!r} has no field {k!r} ({holds})")
        kind = kind.field(k).type


class _Template(string.Formatter):
    """str.format, but a field named by a dotted path is the value given under that whole name,
    not an attribute of the column's value (a dict has none)."""

    def get_field(self, field_name, args, kwargs):
        if field_name in kwargs:
            return kwargs[field_name], field_name
        return super().get_field(field_name, args, kwargs)


def fill(template: str, named: dict[str, Any]) -> str:
    """`template` ("{reward_model.ground_truth}", "{question}") filled in from `named` (name -> value)."""
    return _Template().vformat(template, (), named)
