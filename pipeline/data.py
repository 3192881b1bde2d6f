"""Prompts: load a dataset, pick an iteration's prompts, render them with the chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from pipeline.config import DataConfig
from pipeline.errors import GRPOError


def load_dataset_frame(path: str) -> pl.DataFrame:
    """Read .jsonl / .json / .parquet (local or fsspec URI); a one-line error for a missing,
    empty or unreadable file."""
    suffix = "".join(Path(path.split("?")[0]).suffixes[-1:]).lower()
    local = "://" not in path
    if local and not Path(path).is_file():
        raise GRPOError(f"{path}: dataset file not found")
    if local and Path(path).stat().st_size == 0:
        raise GRPOError(f"{path}: dataset is empty")  # polars' own message for this is about type inference
    try:
        if suffix in (".jsonl", ".ndjson"):
            df = pl.read_ndjson(path)
        elif suffix == ".json":
            df = pl.read_json(path)
        elif suffix == ".parquet":
            df = pl.read_parquet(path)
        else:
            raise GRPOError(f"{path}: unsupported dataset format {suffix or '(none)'}; use .jsonl, .json or .parquet")
    except GRPOError:
        raise
    except Exception as err:  # polars raises several types for malformed input
        raise GRPOError(f"{path}: cannot read dataset ({str(err).splitlines()[0]})") from None
    if df.height == 0:
        raise GRPOError(f"{path}: dataset is empty")
    return df


def load_dataset(path: str, prompt_column: str) -> pl.DataFrame:
    """load_dataset_frame, then check the prompt column."""
    df = load_dataset_frame(path)
    if prompt_column not in df.columns:
        raise GRPOError(f"{path}: no prompt column {prompt_column!r} (columns: {', '.join(df.columns)}); set data.prompt_column")
    nulls = df.get_column(prompt_column).is_null()
    if nulls.any():
        row = int(nulls.arg_true()[0])
        raise GRPOError(f"{path} row {row}: prompt column {prompt_column!r} is empty")
    return df


def dataset_columns(path: str) -> list[str]:
    """The column names of a dataset, read from its header where the format has one (Parquet
    schema; JSON lines: the first rows polars infers from) without loading it all."""
    suffix = "".join(Path(path.split("?")[0]).suffixes[-1:]).lower()
    local = "://" not in path
    if local and not Path(path).is_file():
        raise GRPOError(f"{path}: dataset file not found")
    if local and Path(path).stat().st_size == 0:
        raise GRPOError(f"{path}: dataset is empty")
    try:
        if suffix in (".jsonl", ".ndjson"):
            return pl.scan_ndjson(path).collect_schema().names()
        if suffix == ".json":
            return pl.read_json(path).columns
        if suffix == ".parquet":
            import fsspec
            import pyarrow.parquet as pq

            with fsspec.open(path, "rb") as f:
                return pq.read_schema(f).names
    except Exception as err:  # polars / pyarrow raise several types for malformed input
        raise GRPOError(f"{path}: cannot read dataset ({str(err).splitlines()[0]})") from None
    raise GRPOError(f"{path}: unsupported dataset format {suffix or '(none)'}; use .jsonl, .json or .parquet")


def dataset_num_rows(path: str) -> int:
    """Rows of a dataset (reads it)."""
    return load_dataset_frame(path).height


def prompt_columns(data: DataConfig) -> list[str]:
    """The dataset columns a prompt is built from."""
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
