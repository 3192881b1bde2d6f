"""Prompts: load a dataset, pick an iteration's prompts, render them with the chat template."""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from pipeline.data import fields
from pipeline.data import sources as data_sources
from pipeline.config.data import DataConfig
from pipeline.errors import GRPOError


def load_dataset_frame(path: str) -> pl.DataFrame:
    """Every row of a dataset (a file, Parquet shards or a save_to_disk directory; see
    pipeline.data.sources); a one-line error for a missing, empty or unreadable one."""
    df = data_sources.read(path)
    if df.height == 0:
        raise GRPOError(f"{path}: dataset is empty")
    return df


def template_fields(template: str) -> list[str]:
    """The column names a `data.prompt_template` such as "{question}" refers to."""
    try:
        return [name for _, name, _, _ in string.Formatter().parse(template) if name]
    except ValueError as err:
        raise GRPOError(f"data.prompt_template {template!r}: {err}") from None


def load_dataset(path: str, prompt_column: str, prompt_template: str | None = None, environment: bool = False) -> pl.DataFrame:
    """load_dataset_frame, then the prompt column: built with `prompt_template` from the other
    columns for rows that have none, and checked. `environment` (rollout.environment is set): a
    dataset with no prompt column is the environment's data, TRL's way: each row's prompt is an
    empty user message that reset's observation fills (pipeline/agents/environment.py)."""
    df = load_dataset_frame(path)
    if prompt_column not in df.columns and fields.split(prompt_column, df.columns)[0] in df.columns:  # `extra.question`
        try:
            df = df.with_columns(fields.column(df, prompt_column))
        except GRPOError as err:
            raise GRPOError(f"{path}: data.prompt_column: {err}") from None
    if environment and prompt_template is None and prompt_column not in df.columns:
        return df.with_columns(pl.lit("", dtype=pl.String).alias(prompt_column))
    if prompt_template is not None:
        names = template_fields(prompt_template)  # columns, or dotted paths into them (pipeline.data.fields)
        missing = [f for f in names if fields.split(f, df.columns)[0] not in df.columns]
        if missing:
            raise GRPOError(f"{path}: no column {missing[0]!r} for data.prompt_template (columns: {', '.join(df.columns)})")
        rows = {c: df.get_column(c).to_list() for c in dict.fromkeys(fields.split(f, df.columns)[0] for f in names)}
        try:
            named = {f: fields.values(rows, f) for f in names}
        except GRPOError as err:
            raise GRPOError(f"{path}: data.prompt_template: {err}") from None
        built = [fields.fill(prompt_template, {f: v[i] for f, v in named.items()}) for i in range(df.height)]
        column = pl.Series(prompt_column, built, dtype=pl.String)
        if prompt_column in df.columns:
            column = df.get_column(prompt_column).fill_null(column) if df.schema[prompt_column] == pl.String else df.get_column(prompt_column)
        df = df.with_columns(column.alias(prompt_column))
    if prompt_column not in df.columns:
        raise GRPOError(f"{path}: no prompt column {prompt_column!r} (columns: {', '.join(df.columns)}); set data.prompt_column")
    nulls = df.get_column(prompt_column).is_null()
    if nulls.any():
        row = int(nulls.arg_true()[0])
        raise GRPOError(f"{path} row {row}: prompt column {prompt_column!r} is empty")
    return df


def prompt_made_up(path: str, data: DataConfig, environment: bool) -> bool:
    """Whether load_dataset makes the prompt column up (environment-owned data, no prompt column):
    reset then gets no prompt argument, as TRL passes none."""
    have = dataset_columns(path)
    return environment and data.prompt_template is None and fields.split(data.prompt_column, have)[0] not in have


def dataset_columns(path: str) -> list[str]:
    """The column names of a dataset, read from its header(s) without loading it all; shards
    that disagree on columns are an error naming the file."""
    return data_sources.columns(path)


def dataset_num_rows(path: str) -> int:
    """Rows of a dataset (reads it)."""
    return load_dataset_frame(path).height


def prompt_columns(data: DataConfig, have: list[str] | None = None, environment: bool = False) -> list[str]:
    """The dataset columns a prompt needs: the prompt column, or, with data.prompt_template and
    no prompt column in `have`, the columns the template names; none when an environment
    supplies the prompt (`environment` and no prompt column: see load_dataset)."""
    if data.prompt_template is not None and (have is None or data.prompt_column not in have):
        return template_fields(data.prompt_template)
    if environment and have is not None and data.prompt_column not in have:
        return []
    return [data.prompt_column]


def iteration_prompt_ids(n_rows: int, per_iter: int, seed: int, k: int) -> list[int]:
    """Rows of iteration k: epoch-wise shuffles seeded by (seed, epoch), drop-last.

    A prompt appears at most once per iteration and once per epoch; the same run and k
    always give the same prompts.
    """
    per_epoch = n_rows // per_iter
    if per_epoch == 0:
        raise GRPOError(f"rollout.prompts_per_iter ({per_iter}) exceeds the dataset's {n_rows} rows")
    epoch, pos = divmod(k, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n_rows)
    return [int(i) for i in perm[pos * per_iter : (pos + 1) * per_iter]]


def derive_seed(*parts: int) -> int:
    """A 31-bit seed derived from integers (seed, iteration, prompt id, ...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


@dataclass
class Prompt:
    prompt_id: int
    raw: object  # the dataset's prompt value (a string or a list of messages)
    text: str  # rendered
    ids: list[int]
    columns: dict  # the dataset's other columns


def as_messages(raw, system_prompt: str | None) -> list[dict]:
    if isinstance(raw, str):
        msgs = [{"role": "user", "content": raw}]
    else:
        msgs = [dict(m) for m in raw]
    if system_prompt and not any(m.get("role") == "system" for m in msgs):
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    return msgs


def render(tokenizer, raw, data: DataConfig, where: str) -> str:
    if not data.chat_template:
        if not isinstance(raw, str):
            raise GRPOError(f"{where}: data.chat_template is false but the prompt is a message list")
        return (data.system_prompt + "\n" if data.system_prompt else "") + raw
    if not getattr(tokenizer, "chat_template", None):
        raise GRPOError(f"{where}: the tokenizer has no chat template; set data.chat_template: false for plain text prompts")
    try:
        return tokenizer.apply_chat_template(as_messages(raw, data.system_prompt), tokenize=False, add_generation_prompt=True)
    except Exception as err:
        raise GRPOError(f"{where}: chat template failed ({str(err).splitlines()[0]})") from None


def make_prompts(df: pl.DataFrame, ids: list[int], tokenizer, data: DataConfig, source: str, max_prompt_len: int) -> list[Prompt]:
    out = []
    rows = df[ids].to_dicts()
    for pid, row in zip(ids, rows):
        raw = row.pop(data.prompt_column)
        where = f"{source} row {pid}"
        text = render(tokenizer, raw, data, where)
        tok = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # the length check is ours, below
        if len(tok) > max_prompt_len:
            raise GRPOError(f"{where}: prompt has {len(tok)} tokens, more than the {max_prompt_len} the model's context leaves for it")
        out.append(Prompt(prompt_id=pid, raw=raw, text=text, ids=list(tok), columns=row))
    return out


def raw_to_json(raw) -> str:
    return json.dumps(raw, ensure_ascii=False)


def raw_from_json(text: str):
    return json.loads(text)
