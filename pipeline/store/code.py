"""The code a config names travels with the run: reward files, tool and environment files.

`grpo init` copies each file a config names (`rewards[i].fn: my_rewards.py:brevity`, `rollout.tools`,
`rollout.environment`, the `.py` scripts of `rollout.agent.command`; a `module:fn` whose module is a
single file in the current directory too)
into RUN/code/<sha256[:12]>/<name>.py and records it in RUN/code/CODE.json with its sha256; a module
imported from the environment (an installed package) is recorded by its version and its file's
sha256. A copied file's local imports (`import helpers` where helpers.py lies beside it, found by
reading its source, `local_imports`) are copied beside it and recorded under its "imports", so the
copy imports the same siblings wherever it runs; a local import that is a package directory, a
package-relative import (`from . import x`) and a `module:fn` inside a package of the current
directory that no distribution installs are refused at init, naming the file. `grpo init` imports
the code from these copies (`staged`, a temporary directory laid out as RUN/code/), as the stages
will, so an import or a data file only the current directory has fails there, before a rollout. The record is hashed into the run's config hash (`Run.cfg_hash`), so a run with other
reward code is another run, and every process that computes for the run (a local `grpo score`, a
Ray actor or score task on another node, a `--shard` worker elsewhere) imports the run's copy
(`pipeline.rewards.contract.run_code`), never whatever file its own current directory holds. A
run made before this record existed has none: its hash is unchanged and its targets are imported
as they were (from the current directory).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

from pipeline.errors import GRPOError
from pipeline.store import RunStore, cache_dir, canonical_hash, sha256_bytes

RECORD = "code/CODE.json"


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def targets(cfg) -> list[str]:
    """The `file.py:name` / `module:name` targets of a config's rewards, tools and environments."""
    from pipeline.config.agents import PYTHON_TOOL
    from pipeline.config.rewards import CustomReward

    out = [r.fn for r in cfg.rewards if isinstance(r, CustomReward)]
    out += [t for t in cfg.rollout.tools if t != PYTHON_TOOL]
    env = cfg.rollout.environment
    out += [env] if isinstance(env, str) else list((env or {}).values())
    return list(dict.fromkeys(out))


def _argv(agent) -> list[str]:
    from pipeline.config.agent_command import agent_argv

    return agent_argv(agent)


def sources(cfg) -> list[str]:
    """The files and modules those targets name (each once, in order), then the scripts an endpoint
    agent's command names (`rollout.agent.command: [python, agent.py]`: agent.py, which the rollout runs
    from the run's copy)."""
    agent = cfg.rollout.agent
    scripts = [a for a in _argv(agent)[1:] if a.endswith(".py")] if agent is not None else []
    return list(dict.fromkeys([w for t in targets(cfg) if (w := t.rpartition(":")[0])] + scripts))


@functools.cache
def _distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # scans every installed distribution: once a process


def _version(module) -> str | None:
    top = module.__name__.split(".")[0]
    for dist in _distributions().get(top, []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    v = getattr(sys.modules.get(top), "__version__", None)
    return str(v) if v is not None else None


def _module_file(name: str) -> tuple[Path | None, object]:
    """The file of module `name` and the module; a single file of the current directory is found
    without running it (None for the module): the run's copy of it is what runs, at init as in a stage."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        if "." not in name and (spec := importlib.util.find_spec(name)) is not None and spec.origin \
                and Path(spec.origin).parent == Path(cwd) and name not in sys.modules:
            return Path(spec.origin), None
        module = importlib.import_module(name)
    except Exception as err:  # preflight imported it already: this is a module that changed since
        raise GRPOError(f"module {name}: cannot be imported ({type(err).__name__})") from None
    finally:
        if added:
            sys.path.remove(cwd)
    file = getattr(module, "__file__", None)
    return (Path(file), module) if file else (None, module)


def local_imports(file: Path) -> dict[str, Path]:
    """The files under `file`'s directory that it imports, and those they import (by reading the
    source, not running it): name.py -> its path. A top-level `import x` / `from x import y` where
    x.py lies in the same directory is one; an installed module is not. GRPOError naming the file
    for a local import that cannot be carried (a package directory) or a file that does not parse."""
    root = file.parent
    found: dict[str, Path] = {}
    todo = [file]
    while todo:
        cur = todo.pop()
        try:
            tree = ast.parse(cur.read_bytes(), filename=str(cur))
        except SyntaxError as err:
            raise GRPOError(f"{cur}: does not parse (line {err.lineno}: {err.msg})") from None
        names = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names += [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.append(node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom):  # `from . import x`: the copy lies in no package
                raise GRPOError(f"{cur}: line {node.lineno} imports {'.' * node.level}{node.module or ''} relative to its "
                                "package, which grpo does not carry with the run; import the file beside it by name "
                                "(`import helper`) or install the package (pip install -e)")
        for name in names:
            pkg = root / name
            if pkg.is_dir() and ((pkg / "__init__.py").is_file() or (not (root / f"{name}.py").is_file() and any(pkg.glob("*.py")))):
                raise GRPOError(f"{cur}: imports {name}/, a package directory beside it, which grpo does not carry with the "
                                f"run; make it a single file {name}.py or install it (pip install -e)")
            sib = root / f"{name}.py"
            if sib.is_file() and sib != file and sib.name not in found:
                found[sib.name] = sib
                todo.append(sib)
    return dict(sorted(found.items()))


def collect(cfg, prior: dict[str, Path] | None = None, missing_ok: bool = False) -> tuple[dict, dict[str, bytes]]:
    """The record of what `cfg` names and the bytes of each copy ({} for a config that names no
    file or module). `prior`: where -> a local copy to take instead of the current directory's
    file (a replay takes its source run's copies). `missing_ok`: leave out a file or module that is
    not there (its loader then says so, naming the config key)."""
    record: dict = {}
    copies: dict[str, bytes] = {}
    for where in sources(cfg):
        local = (prior or {}).get(where)
        if local is None and _is_file(where):
            local = Path(where).expanduser()
            local = local if local.is_absolute() else Path.cwd() / local
        if local is None:
            try:
                file, module = _module_file(where)
            except GRPOError:
                if missing_ok:
                    continue
                raise
            if file is not None and file.is_relative_to(Path.cwd()) and file.parent != Path.cwd() \
                    and not _distributions().get(where.split(".")[0]):  # a stage elsewhere (a Ray node, a --shard worker) cannot import it
                raise GRPOError(f"{where}: {file} is a package in the current directory, not installed, which grpo does "
                                f"not carry with the run; install it (pip install -e) or make it a single file {file.name}")
            if file is None or file.name == "__init__.py" or file.parent != Path.cwd():  # installed: version and hash
                record[where] = {"module": where, "version": _version(module),
                                 "sha256": sha256_bytes(file.read_bytes()) if file and file.is_file() else None}
                continue
            local = file  # a module file of yours, in the current directory: copied as a file is
        if not local.is_file():
            if missing_ok:
                continue
            raise GRPOError(f"{where}: no such file (looked for {local})")
        data = local.read_bytes()
        sha = sha256_bytes(data)
        siblings = {name: path.read_bytes() for name, path in local_imports(local).items()}
        # the copy's directory is named by the file's hash (and its imports' hashes, when it has any):
        # one file with other siblings is another directory
        folder = sha[:12] if not siblings else \
            canonical_hash({"file": sha, "imports": {n: sha256_bytes(b) for n, b in siblings.items()}})[:12]
        record[where] = {"copy": f"code/{folder}/{local.name}", "sha256": sha, **({} if _is_file(where) else {"module": where})}
        copies[record[where]["copy"]] = data
        if siblings:
            record[where]["imports"] = {n: {"copy": f"code/{folder}/{n}", "sha256": sha256_bytes(b)} for n, b in siblings.items()}
            copies.update({f"code/{folder}/{n}": b for n, b in siblings.items()})
    return record, copies


@contextlib.contextmanager
def staged(cfg):
    """`grpo init`, before it writes the run: the copies `collect` would put into it, written to a
    temporary directory laid out as RUN/code/; yields where -> the copy's path. On the way out the
    directory and every module imported from it are gone."""
    record, copies = collect(cfg, missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="grpo-init-code-") as tmp:
        for rel, data in copies.items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / rel).write_bytes(data)
        try:
            yield {where: str(Path(tmp) / e["copy"]) for where, e in record.items() if "copy" in e}
        finally:
            for name, module in list(sys.modules.items()):
                if str(getattr(module, "__file__", None) or "").startswith(tmp):
                    del sys.modules[name]


def pack(store: RunStore, record: dict, copies: dict[str, bytes]) -> dict | None:
    """Write what `collect` gave into the run: the copies, then the record; None (nothing written)
    when the config names no file or module."""
    if not record:
        return None
    for rel, data in copies.items():
        store.write_bytes(rel, data)
    store.write_json(RECORD, record)
    return record


def read(store: RunStore) -> dict | None:
    return store.read_json(RECORD) if store.exists(RECORD) else None


def code_hash(record: dict) -> str:
    """What of the record names the code (not where a copy lies)."""
    def named(e: dict) -> dict:
        out = {k: v for k, v in e.items() if k not in ("copy", "imports")}
        return out | ({"imports": {n: i["sha256"] for n, i in e["imports"].items()}} if "imports" in e else {})

    return canonical_hash({w: named(e) for w, e in sorted(record.items())})


def local_copies(store: RunStore, record: dict) -> dict[str, Path]:
    """where -> a local file holding the run's copy (the run's own file on a local disk, else a
    download into the cache, keyed by its hash); checked against the record."""
    out = {}
    for where, e in record.items():
        if "copy" not in e:
            continue
        folder = e["sha256"] if "imports" not in e else Path(e["copy"]).parent.name  # a remote run's copies: in the cache
        path = _local_copy(store, e, where, folder)
        for sib in e.get("imports", {}).values():  # beside it, where its imports find them
            _local_copy(store, sib, where, folder)
        out[where] = path
    return out


def _local_copy(store: RunStore, e: dict, where: str, folder: str) -> Path:
    if store.local:
        path = Path(store.path(e["copy"]))
    else:
        path = cache_dir() / "code" / folder / Path(e["copy"]).name
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
            tmp.write_bytes(store.read_bytes(e["copy"]))
            os.replace(tmp, path)
    if not path.is_file():
        raise GRPOError(f"{store.display(e['copy'])}: the run's copy of {where} is missing")
    if hashlib.sha256(path.read_bytes()).hexdigest() != e["sha256"]:
        raise GRPOError(f"{store.display(e['copy'])}: the run's copy of {where} is not the file recorded at `grpo init` (edited?)")
    return path


def check_modules(record: dict, here: str) -> None:
    """Each installed module the run names is importable here and the one recorded at `grpo init`."""
    for where, e in record.items():
        if "copy" in e:
            continue
        file, module = _module_file(where)
        version = _version(module)
        sha = sha256_bytes(file.read_bytes()) if file and file.is_file() else None
        if (version, sha) != (e.get("version"), e.get("sha256")):
            raise GRPOError(f"module {where} {here} is version {version} ({(sha or '?')[:12]}), but the run was made with "
                            f"{e.get('version')} ({(e.get('sha256') or '?')[:12]}); install that one there")
