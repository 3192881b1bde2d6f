"""The run store: every read and write of a run directory goes through here.

A run directory is a local path or any fsspec URI (s3://...). Writes are atomic: on a local
disk a file is written to a temporary name and renamed into place; on an object store a PUT is
atomic by itself. A stage's MANIFEST.json is written last and is the only proof that the stage
happened: parts without a manifest are leftovers and are never counted.

    RUN/config.yaml
    RUN/policy/iter-0000/ (HF model dir + MANIFEST.json)
    RUN/iter-0000/{rollout,score,logprobs}/part-00000.parquet ... MANIFEST.json
    RUN/iter-0000/update/metrics.parquet MANIFEST.json state/
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import io
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import GRPOError
from schemas.artifacts import ArtifactSchema, SchemaError
from schemas.manifests import Manifest, ManifestError, dump_manifest, parse_manifest

STAGES = ("rollout", "score", "logprobs", "update")
MANIFEST = "MANIFEST.json"
TMP_MARK = ".tmp-"
IN_FLIGHT = ".cluster/in_flight.json"  # what a Ray driver has in flight: written by it, read by `grpo status`


def iter_name(k: int) -> str:
    return f"iter-{k:04d}"


def stage_rel(k: int, stage: str) -> str:
    return f"{iter_name(k)}/{stage}"


def policy_rel(k: int) -> str:
    return f"policy/{iter_name(k)}"


def part_name(i: int) -> str:
    return f"part-{i:05d}.parquet"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write(path, chunks, sync_dir: bool = False) -> None:
    """`chunks` (bytes-like) written to the local file `path` under a temporary name in its
    directory, synced, and renamed into place: whole or absent, never half-written. `sync_dir`:
    the directory's entries too (the rename itself on disk, before a record names the file)."""
    path = str(path)
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f"{TMP_MARK}{uuid.uuid4().hex}-{os.path.basename(path)}")
    try:
        with open(tmp, "wb") as f:
            for data in chunks:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if sync_dir:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def canonical_hash(obj) -> str:
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def code_version() -> str:
    """Package version plus the git commit of the source tree when there is one."""
    from pipeline import __version__

    here = Path(__file__).resolve().parents[2]  # the source tree: pipeline/store/__init__.py
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True, text=True, timeout=5,
        )
        if out.returncode == 0 and out.stdout.strip():
            return f"{__version__}+{out.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    return __version__


@dataclass(frozen=True)
class FileInfo:
    sha256: str
    rows: int | None = None
    bytes: int = 0

    def as_dict(self) -> dict:
        d = {"sha256": self.sha256, "bytes": self.bytes}
        if self.rows is not None:
            d["rows"] = self.rows
        return d


class RunStore:
    """A run directory on a local disk or behind fsspec."""

    def __init__(self, uri: str | os.PathLike):
        self.uri = str(uri).rstrip("/")
        # no directory-listing cache: other machines write into the same run (shards, stages),
        # and a cached listing would hide their parts and manifests from this process
        self.fs, root = fsspec.core.url_to_fs(self.uri, use_listings_cache=False)
        self.root = root.rstrip("/")
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    # -- paths ---------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}".rstrip("/") if rel else self.root

    def display(self, rel: str = "") -> str:
        """How a user names this file: the run URI plus the relative path."""
        return f"{self.uri}/{rel}" if rel else self.uri

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def listdir(self, rel: str) -> list[str]:
        """Names directly under `rel` (empty when it does not exist)."""
        try:
            entries = self.fs.ls(self.path(rel), detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    # -- bytes ---------------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        try:
            with self.fs.open(self.path(rel), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise GRPOError(f"{self.display(rel)}: not found") from None

    def write_bytes(self, rel: str, data: bytes) -> FileInfo:
        """Atomically write `data` to `rel` (temporary name + rename on local disks)."""
        target = self.path(rel)
        try:
            if self.local:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                atomic_write(target, (data,))
            else:
                self.fs.makedirs(self.fs._parent(target), exist_ok=True)
                with self.fs.open(target, "wb") as f:  # an object store PUT is atomic
                    f.write(data)
        except OSError as err:
            raise GRPOError(f"{self.display(rel)}: write failed: {err.strerror or err}") from None
        return FileInfo(sha256=sha256_bytes(data), bytes=len(data))

    def read_json(self, rel: str) -> dict:
        data = self.read_bytes(rel)
        try:
            return json.loads(data)
        except json.JSONDecodeError:
            raise GRPOError(f"{self.display(rel)}: not valid JSON") from None

    def write_json(self, rel: str, obj) -> FileInfo:
        return self.write_bytes(rel, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())

    def remove(self, rel: str, recursive: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(rel), recursive=recursive)

    # -- tables --------------------------------------------------------------------------
    def write_table(self, rel: str, table: pa.Table, schema: ArtifactSchema, meta: dict | None = None) -> FileInfo:
        """Cast to the kind's schema, stamp the version, and write atomically. Bytes are
        deterministic for the same table, so equal inputs give equal hashes."""
        try:
            table = schema.conform(table, meta)
        except SchemaError as err:
            raise GRPOError(f"{self.display(rel)}: {err}") from None
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd", write_statistics=False, store_schema=True)
        info = self.write_bytes(rel, buf.getvalue())
        return FileInfo(sha256=info.sha256, rows=table.num_rows, bytes=info.bytes)

    def read_table(self, rel: str, schema: ArtifactSchema, sha256: str | None = None) -> pa.Table:
        """Read a part and check its kind, version and columns (and its sha256 against the
        manifest's when given: a changed byte can still parse); errors name the file."""
        where = self.display(rel)
        data = self.read_bytes(rel)
        if sha256 is not None and sha256_bytes(data) != sha256:
            raise GRPOError(f"{where}: sha256 differs from its manifest (changed or replaced since it was written; see `grpo audit`)")
        try:
            table = pq.read_table(io.BytesIO(data))
        except (pa.ArrowInvalid, OSError) as err:
            raise GRPOError(f"{where}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
        try:
            schema.check(table.schema, where)
        except SchemaError as err:
            raise GRPOError(str(err)) from None
        return schema.upgrade(table)

    def table_meta(self, rel: str) -> dict[str, str]:
        """The `grpo.*` key/values stamped into a part's Parquet metadata ({} if unreadable)."""
        try:
            with self.fs.open(self.path(rel), "rb") as f:
                meta = pq.read_schema(f).metadata or {}
        except Exception:  # a torn or foreign file is simply not ours
            return {}
        return {k.decode()[5:]: v.decode() for k, v in meta.items() if k.startswith(b"grpo.")}

    # -- manifests -----------------------------------------------------------------------
    def manifest_rel(self, stage_dir: str) -> str:
        return f"{stage_dir}/{MANIFEST}"

    def manifest(self, stage_dir: str) -> "Manifest | None":
        """The stage's (or policy's) manifest, validated, or None when it has not happened."""
        rel = self.manifest_rel(stage_dir)
        if not self.exists(rel):
            return None
        try:
            return parse_manifest(self.read_bytes(rel), self.display(rel))
        except ManifestError as err:
            raise GRPOError(str(err)) from None

    def manifest_hash(self, stage_dir: str) -> str | None:
        rel = self.manifest_rel(stage_dir)
        return sha256_bytes(self.read_bytes(rel)) if self.exists(rel) else None

    def write_manifest(self, stage_dir: str, manifest: "Manifest") -> "Manifest":
        """Write a manifest last, stamped with the time and the code version."""
        manifest = manifest.model_copy(update={"created": now(), "code_version": code_version()})
        self.write_bytes(self.manifest_rel(stage_dir), dump_manifest(manifest))
        return manifest

    # -- locks ---------------------------------------------------------------------------
    def lock(self, rel: str, what: str, wait: float = 0.0):
        """Exclusive lock on `rel` (see `pipeline.store.lock`); a second holder fails with a clear
        message, or waits up to `wait` seconds."""
        from pipeline.store.lock import lock

        return lock(self, rel, what, wait)

    # -- directories (models) ------------------------------------------------------------
    def local_dir(self, rel: str) -> Path:
        """A local directory holding `rel`: itself on a local disk, else a cached download."""
        if self.local:
            return Path(self.path(rel))
        import filelock

        # keyed by the directory's MANIFEST.json too: a run re-created at the same URI must
        # not be served the old run's weights from the cache
        manifest = self.manifest_hash(rel) or ""
        dest = cache_dir() / "runs" / hashlib.sha256(f"{self.display(rel)}\n{manifest}".encode()).hexdigest()[:24]
        done = dest / ".complete"
        if done.exists():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(f"{dest}.lock"):  # shards and ranks of one machine download once
            if not done.exists():
                tmp = dest.parent / f"{TMP_MARK}{uuid.uuid4().hex}-{dest.name}"
                tmp.mkdir()
                self.fs.get(self.path(rel) + "/", str(tmp) + "/", recursive=True)
                (tmp / ".complete").write_text(self.display(rel))
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(tmp, dest)
        return dest

    def put_dir(self, local: Path, rel: str, move: bool = False) -> None:
        """Copy a local directory into the run (atomic: staged under a temporary name). `move`:
        LOCAL is scratch the caller drops afterwards, so on the run's own filesystem it is renamed
        into place instead of copied (a full policy and its optimizer state are gigabytes)."""
        if self.local:
            target = Path(self.path(rel))
            target.parent.mkdir(parents=True, exist_ok=True)
            for stale in target.parent.glob(f"{TMP_MARK}*-{target.name}"):  # a copy killed midway
                shutil.rmtree(stale, ignore_errors=True)
            tmp = target.parent / f"{TMP_MARK}{uuid.uuid4().hex}-{target.name}"
            try:
                try:
                    if not move:
                        raise OSError
                    os.rename(local, tmp)  # same filesystem: no bytes copied
                except OSError:
                    shutil.copytree(local, tmp)
                if target.exists():
                    shutil.rmtree(target)
                os.replace(tmp, target)
            except OSError as err:
                shutil.rmtree(tmp, ignore_errors=True)
                raise GRPOError(f"{self.display(rel)}: write failed: {err.strerror or err}") from None
        else:
            for p in sorted(Path(local).rglob("*")):
                if p.is_file():
                    self.write_bytes(f"{rel}/{p.relative_to(local).as_posix()}", p.read_bytes())


def cache_dir() -> Path:
    return Path(os.environ.get("GRPO_CACHE_DIR", Path.home() / ".cache" / "grpo"))


def hash_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_dir(path: Path, skip: set[str] = frozenset()) -> dict[str, str]:
    """sha256 of every file under `path` except manifests (and the relative paths in `skip`),
    keyed by relative path."""
    return {
        rel: hash_file(p)
        for p in sorted(Path(path).rglob("*"))
        if p.is_file() and p.name != MANIFEST and TMP_MARK not in p.name and p.name != ".complete"
        and (rel := p.relative_to(path).as_posix()) not in skip
    }


def stage_tempdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"grpo-{prefix}-"))
