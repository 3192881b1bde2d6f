"""Where a dataset's rows come from: one file, a directory or glob of Parquet shards, or a
`datasets` save_to_disk directory; local paths or fsspec URIs (s3://...).

    data.train: train.jsonl                      # .jsonl / .ndjson, .json, .parquet
    data.train: gsm8k/main                       # Hub layout: main/train-00000-of-00002.parquet ...
    data.train: "gsm8k/main/train-*.parquet"     # a glob of shards
    data.train: gsm8k_saved                      # Dataset.save_to_disk(...): state.json + data-*.arrow

Shards are read in the order of their paths sorted by name (the Hub's -00000-of-00002
numbering), a save_to_disk directory in the order its state.json lists its files; rows keep
their order within a file, so the same rows give the same dataset however they are split.
Every shard must have the same columns as the first: otherwise a one-line error names the file.
`datasets` itself is not needed: its Arrow files are read with pyarrow.

A URL's secret (a signed URL's `X-Amz-Signature`, `sig`, `token`, a user:password) is written as
`${NAME}` and read from the environment where the data is read (pipeline/config/urls.py, as a served
reward's URL): `data.train: "https://host/train.jsonl?sig=${TRAIN_SIG}"`. Every function here takes
the path as the config holds it and says it that way in its errors; the value is never written.
"""

from __future__ import annotations

import functools
import io
import json
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import polars as pl
import pyarrow as pa

from pipeline.errors import GRPOError

FILE_FORMATS = (".jsonl", ".ndjson", ".json", ".parquet")
STATE = "state.json"  # written by datasets' save_to_disk


def _fs(path: str):
    import fsspec

    return fsspec.core.url_to_fs(path)


def _secret_safe(fn):
    """`fn(path)` on the path with its `${NAME}` references expanded (urls.expand), every error line saying the
    path as the config holds it, with any value read for it masked (a library's error quoting the URL)."""
    @functools.wraps(fn)
    def wrapper(path: str):
        from pipeline.config.urls import REF, expand, scrub

        if not REF.search(path):
            return fn(path)
        sent = expand(path, path)
        try:
            return fn(sent)
        except GRPOError as err:
            raise GRPOError(scrub(str(err).replace(sent, path))) from None
        except Exception as err:
            raise GRPOError(scrub(f"{path}: cannot read dataset ({type(err).__name__}: {err})".replace(sent, path))) from None

    return wrapper


def _display(fs, p: str, original: str) -> str:
    """A file's name as the user would write it (with the URI scheme for remote ones)."""
    if "://" not in original or "://" in p:  # an http(s) filesystem's paths are the URLs themselves
        return p
    protocol = fs.protocol[0] if isinstance(fs.protocol, tuple | list) else fs.protocol
    return f"{protocol}://{p}"


@_secret_safe
def resolve(path: str) -> tuple[object, list[str], str]:
    """(filesystem, files in reading order, kind) where kind is a file suffix, "parquet-shards"
    or "arrow" (save_to_disk); one-line GRPOError when nothing is there."""
    fs, root = _fs(path)
    if any(c in (urlsplit(root).path if "://" in root else root) for c in "*?["):  # a URL's ?query is no glob
        files = sorted(f for f in fs.glob(root) if fs.isfile(f))
        if not files:
            raise GRPOError(f"{path}: no files match")
        bad = [f for f in files if not f.endswith(".parquet")]
        if bad:
            raise GRPOError(f"{_display(fs, bad[0], path)}: a glob of shards must match only .parquet files")
        return fs, files, "parquet-shards"
    if fs.isdir(root):
        if fs.exists(f"{root}/{STATE}"):
            try:
                state = json.loads(fs.cat_file(f"{root}/{STATE}"))
                files = [f"{root}/{f['filename']}" for f in state["_data_files"]]
            except (ValueError, KeyError, TypeError) as err:
                raise GRPOError(f"{path}/{STATE}: not a datasets save_to_disk state ({type(err).__name__}: {err})") from None
            return fs, files, "arrow"
        files = sorted((f for f in fs.find(root) if f.endswith(".parquet")), key=lambda f: PurePosixPath(f).relative_to(root).as_posix())
        if not files:
            raise GRPOError(f"{path}: directory holds no .parquet shards and no datasets {STATE}")
        return fs, files, "parquet-shards"
    if not fs.exists(root):
        raise GRPOError(f"{path}: dataset file not found")
    suffix = PurePosixPath(root.split("?")[0]).suffix.lower()
    if suffix not in FILE_FORMATS:
        raise GRPOError(f"{path}: unsupported dataset format {suffix or '(none)'}; use .jsonl, .json, .parquet, "
                        "a directory of Parquet shards or a datasets save_to_disk directory")
    if fs.size(root) == 0:
        raise GRPOError(f"{path}: dataset is empty")  # polars' own message for this is about type inference
    return fs, [root], suffix


def _polars_source(fs, files: list[str], path: str):
    """What polars reads for a one-file dataset: its path (local files, and the object stores polars reads
    itself), or an http(s) file's bytes fetched through fsspec: polars' own http reader asks for byte ranges,
    which a plain web server (or a signed URL's) need not serve."""
    if urlsplit(path).scheme in ("http", "https"):
        return io.BytesIO(fs.cat_file(files[0]))
    return path


def _ndjson_schema(source):
    return pl.scan_ndjson(source).collect_schema() if isinstance(source, str) else pl.read_ndjson(source).schema


def _schema(fs, f: str, kind: str) -> pa.Schema:
    import pyarrow.parquet as pq

    with fs.open(f, "rb") as fh:
        if kind == "arrow":
            return pa.ipc.open_stream(fh).schema
        return pq.read_schema(fh)


def _read_table(fs, f: str, kind: str) -> pa.Table:
    import pyarrow.parquet as pq

    with fs.open(f, "rb") as fh:
        if kind == "arrow":
            return pa.ipc.open_stream(fh).read_all()
        return pq.read_table(fh)


def _check_same_columns(path: str, fs, files: list[str], schemas: list[pa.Schema]) -> list[str]:
    first = schemas[0].names
    for f, schema in zip(files[1:], schemas[1:]):
        if schema.names != first:
            extra = [c for c in schema.names if c not in first]
            missing = [c for c in first if c not in schema.names]
            what = f"has column {extra[0]!r}" if extra else f"lacks column {missing[0]!r}" if missing else "orders its columns differently"
            raise GRPOError(f"{_display(fs, f, path)}: {what}, unlike {_display(fs, files[0], path)} (columns: {', '.join(first)})")
    return first


@_secret_safe
def columns(path: str) -> list[str]:
    """The dataset's column names from its header(s): Parquet / Arrow schemas, or the first
    rows polars infers a JSON lines schema from. Shards that disagree are an error."""
    fs, files, kind = resolve(path)
    try:
        if kind in (".jsonl", ".ndjson"):
            return list(_ndjson_schema(_polars_source(fs, files, path)).names())
        if kind == ".json":
            return pl.read_json(_polars_source(fs, files, path)).columns
        schemas = []
        for f in files:
            where = _display(fs, f, path)
            try:
                schemas.append(_schema(fs, f, "arrow" if kind == "arrow" else "parquet"))
            except Exception as err:
                raise GRPOError(f"{where}: cannot read dataset ({(str(err).splitlines() or [''])[0]})") from None
        return _check_same_columns(path, fs, files, schemas)
    except GRPOError:
        raise
    except Exception as err:  # polars / pyarrow raise several types for malformed input
        raise GRPOError(f"{path}: cannot read dataset ({(str(err).splitlines() or [''])[0]})") from None


@_secret_safe
def schema(path: str) -> pa.Schema:
    """The dataset's Arrow schema (its nested types): the first file's Parquet / Arrow schema, or
    the one polars infers from a JSON file's rows (a nested object is a struct of its keys)."""
    fs, files, kind = resolve(path)
    try:
        if kind in (".jsonl", ".ndjson", ".json"):
            source = _polars_source(fs, files, path)
            inferred = _ndjson_schema(source) if kind != ".json" else pl.read_json(source).schema
            return pl.DataFrame(schema=inferred).to_arrow().schema
        return _schema(fs, files[0], "arrow" if kind == "arrow" else "parquet")
    except Exception as err:  # polars / pyarrow raise several types for malformed input
        raise GRPOError(f"{_display(fs, files[0], path)}: cannot read dataset ({(str(err).splitlines() or [''])[0]})") from None


@_secret_safe
def read(path: str) -> pl.DataFrame:
    """All rows, in order (see the module docstring)."""
    fs, files, kind = resolve(path)
    try:
        if kind in (".jsonl", ".ndjson"):
            return pl.read_ndjson(_polars_source(fs, files, path))
        if kind == ".json":
            return pl.read_json(_polars_source(fs, files, path))
        if kind == ".parquet":
            return pl.read_parquet(_polars_source(fs, files, path))
    except Exception as err:  # polars raises several types for malformed input
        raise GRPOError(f"{path}: cannot read dataset ({(str(err).splitlines() or [''])[0]})") from None
    tables = []
    for f in files:
        try:
            tables.append(_read_table(fs, f, "arrow" if kind == "arrow" else "parquet"))
        except Exception as err:
            raise GRPOError(f"{_display(fs, f, path)}: cannot read dataset ({(str(err).splitlines() or [''])[0]})") from None
    _check_same_columns(path, fs, files, [t.schema for t in tables])
    try:
        table = pa.concat_tables([t.replace_schema_metadata(None) for t in tables], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise GRPOError(f"{path}: shards disagree on column types ({(str(err).splitlines() or [''])[0]})") from None
    return pl.from_arrow(table)
