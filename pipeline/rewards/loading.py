"""Loading a reward function the config names: a built-in with its options bound, or a
`module:function` / `path/file.py:function` of yours, imported from the run's copy (pipeline/store/
code.py) inside `run_code` (every stage) and `code_as_held` (`grpo init`, before anything is
written), else from the current directory. pipeline.rewards.contract calls what this returns.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from pipeline.errors import GRPOError
from pipeline.rewards.builtins import BUILTINS, RewardFn
from pipeline.config.rewards import CustomReward, RewardSpec


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else ""


class _MissingBelow(GRPOError):
    """A module that something the reward imports imports is missing (not the reward's own import)."""


def _missing_import(module: str, err: BaseException) -> str | None:
    """For a module missing while `module` (the reward's own module name) ran: who imports it, in
    one line, where that is another module than `module` (an installed package it imports, whose
    own import fails: openrlhf.utils -> math_utils -> pylatexenc); None where `module` imports it itself."""
    if not isinstance(err, ModuleNotFoundError) or not err.name:
        return None
    chain: list[tuple[str, str]] = []  # (module name, file) of each module frame from `module` on
    tb = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        name, file = frame.f_globals.get("__name__"), frame.f_code.co_filename
        if name == module or chain:
            if frame.f_code.co_name == "<module>" and not file.startswith("<") and (not chain or chain[-1][0] != name):
                chain.append((name, file))
        tb = tb.tb_next
    if len(chain) < 2:
        return None
    return (f"it imports {chain[1][0]}, whose {chain[-1][0]} ({chain[-1][1]}) imports {err.name!r}, which is not installed "
            f"here; install it (what {chain[1][0].split('.')[0]} needs), or import from {chain[1][0]} only what works without it")


def _import_file(path: str) -> Any:
    file = Path(path).expanduser()
    file = file if file.is_absolute() else Path.cwd() / file
    if not file.is_file():
        raise GRPOError(f"no file {path} (looked for {file})")
    # named by its content, not its path: the run's copy (RUN/code/) of one file is then the same
    # module in every run directory and on every worker, so what a record names after it (an
    # environment's class) is the same bytes whichever run directory it was imported from
    name = f"_grpo_reward_{file.stem}_{hashlib.sha1(file.read_bytes()).hexdigest()[:8]}"
    if name in sys.modules:  # the same code, already imported (from another copy of the file)
        _check_siblings(path, file)
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it, so dataclasses and pickling inside it work
    # its directory on the path while it runs: `import helpers` finds the helpers.py beside it, the
    # user's at `grpo init`, the run's copy of it (pipeline/store/code.py) in every stage
    folder = str(file.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
        from pipeline.store.code import local_imports

        for sibling in local_imports(file):  # one imported only inside a function finds its directory now, too
            importlib.import_module(sibling.removesuffix(".py"))
    except Exception as err:
        sys.modules.pop(name, None)
        if (why := _missing_import(name, err)) is not None:
            raise _MissingBelow(f"importing {path}: {why}") from err
        raise GRPOError(f"importing {path} raised {type(err).__name__}: {_first_line(err)}") from err
    finally:
        if added:
            sys.path.remove(folder)
    _check_siblings(path, file)
    return module


def _check_siblings(path: str, file: Path) -> None:
    """Each local import of `file` is the file beside it (by content: the run's copy of it counts). Python
    keeps one module per name, so a `helpers` another reward file imported first from its own directory,
    or a standard or installed module of that name, is what `import helpers` gets: refused, not scored wrong."""
    from pipeline.store.code import local_imports

    for sibling, want in local_imports(file).items():
        stem = sibling.removesuffix(".py")
        if stem in sys.stdlib_module_names:  # whether it is the file depends on what imported the standard one first
            raise GRPOError(f"importing {path}: `import {stem}` names the standard module {stem} as well as the {sibling} "
                            f"beside it, and which one a stage gets depends on what it imported first; rename {sibling}")
        got = getattr(sys.modules.get(stem), "__file__", None)
        if got is not None and (Path(got) == want or Path(got).is_file() and Path(got).read_bytes() == want.read_bytes()):
            continue
        raise GRPOError(f"importing {path}: its `import {stem}` gets {got or 'a built-in module'}, "
                        f"not the {sibling} beside it (Python keeps one module per name); rename {sibling}")


def _import_module(name: str) -> Any:
    """Import `name` as Python would from the current directory (the `grpo` console script
    does not put it on sys.path, `python train.py` does: users expect the latter)."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and (name == err.name or name.startswith(err.name + ".")):
            raise GRPOError(f"no module {name!r} (looked in the current directory and the environment)") from err
        if (why := _missing_import(name, err)) is not None:
            raise _MissingBelow(f"importing {name}: {why}") from err
        raise GRPOError(f"importing {name} raised ModuleNotFoundError: {_first_line(err)}") from err
    except Exception as err:
        raise GRPOError(f"importing {name} raised {type(err).__name__}: {_first_line(err)}") from err
    finally:
        if added:
            sys.path.remove(cwd)


_COPIES: dict[str, str] = {}
"""While a stage computes for a run (`run_code`): a file or module the config names -> the run's copy."""


def copy_of(where: str) -> str:
    """Inside `run_code`: the run's copy of the file `where` (a script of rollout.agent.command), else `where`."""
    return _COPIES.get(where, where)


@contextlib.contextmanager
def run_code(run, here: str = "here"):
    """Within it, the config's reward, tool and environment targets import the run's copies
    (pipeline/store/code.py) instead of the current directory's files; an installed module the
    run names is checked to be the version recorded at `grpo init` (a GRPOError naming `here`)."""
    from pipeline.store import code

    copies = None
    if run.code:
        copies = {where: str(path) for where, path in code.local_copies(run.store, run.code).items()}
        code.check_modules(run.code, here)
    with _importing(copies):
        yield


@contextlib.contextmanager
def code_as_held(cfg):
    """`grpo init`: within it, the config's targets import the copies the run will hold (written to
    a temporary directory as RUN/code/ lays them out), as every stage will import them: an import
    or a file that works from the current directory but not from the copy fails here, before a
    rollout. Nothing of them stays (files, modules)."""
    from pipeline.store import code

    try:
        with code.staged(cfg) as copies, _importing(copies):
            yield
    finally:
        _resolve.cache_clear()  # functions of the staged copies: gone with them


@contextlib.contextmanager
def _importing(copies: dict[str, str] | None):
    saved = dict(_COPIES)
    if copies is not None:
        _COPIES.clear()
        _COPIES.update(copies)
    try:
        yield
    finally:
        _COPIES.clear()
        _COPIES.update(saved)


@contextlib.contextmanager
def _without_cwd():
    """sys.path without the current directory (`python -m` puts it first): a stage imports the run's
    copy from its own directory alone, whatever directory the process started in."""
    cwd = os.path.realpath(os.getcwd())
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != cwd]
    try:
        yield
    finally:
        sys.path[:] = saved


def resolve(target: str) -> RewardFn:
    """`module:function` or `path/file.py:function` -> the function, from the run's copy inside
    `run_code` (or `code_as_held`), else from the current directory."""
    where, _, attr = target.rpartition(":")
    if where in _COPIES:
        try:
            with _without_cwd():
                return _resolve(f"{_COPIES[where]}:{attr}", os.getcwd())
        except GRPOError as err:  # named as the config names it, not by the copy's path (its siblings' beside it)
            folder, beside = Path(_COPIES[where]).parent, os.path.dirname(where)
            said = str(err).replace(_COPIES[where], where).replace(f"{folder}{os.sep}", os.path.join(beside, "") if beside else "")
            raise GRPOError(_not_carried(where, folder, err) or
                            (said if said != str(err) else f"{err} (the run's copy of {where})")) from err.__cause__
    return _resolve(target, os.getcwd())


def _not_carried(where: str, folder: Path, err: GRPOError) -> str | None:
    """Why a copy that imported from the current directory cannot import by itself, in one line
    (None where the copy is not at fault: a module an installed package imports is missing, say)."""
    cause = err.__cause__
    if isinstance(cause, ModuleNotFoundError) and cause.name and not isinstance(err, _MissingBelow):
        return (f"{where} imports {cause.name!r}, which the run's copy cannot find: grpo carries the files beside {where} "
                f"that its import statements name, not a module named at run time; write `import {cause.name}`, or install it")
    name = getattr(cause, "filename", None)
    if isinstance(cause, FileNotFoundError) and name and Path(name).resolve().is_relative_to(folder.resolve()):
        return (f"{where} opens {str(Path(name).resolve().relative_to(folder.resolve()))!r} beside it, which the run's "
                f"copy does not hold: grpo carries Python files only; read it from an absolute path or an installed package")
    return None


@functools.lru_cache(maxsize=None)
def _resolve(target: str, cwd: str) -> RewardFn:
    """`module:function` or `path/file.py:function` -> the function (cached per current dir)."""
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise GRPOError("expected a built-in name, module:function or path/to/file.py:function")
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    obj = _import_file(where) if is_file else _import_module(where)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise GRPOError(f"no function {attr!r} in {where}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise GRPOError(f"{attr!r} in {where} is not callable")
    return obj


def load_reward(spec: RewardSpec, index: int | None = None) -> functools.partial:
    """The reward function named by `spec.fn`, with its options bound (for a built-in: all of
    them, validated by the config, defaults filled in). `index` (its place in `rewards`) only
    makes error messages point at the config line: `rewards[1].fn 'foo.py:bar': no function 'bar' in foo.py`.
    """
    label = f"rewards[{index}]" if index is not None else "rewards"
    if spec.served:  # a judge, a served reward model, an OpenRLHF server: through pipeline.rewards.judge.served_rewards (see compute_rewards)
        from pipeline.rewards import judge

        return functools.partial(judge.served_rewards, spec)
    if not isinstance(spec, CustomReward):
        return functools.partial(BUILTINS[spec.fn], **spec.options())
    try:
        fn = resolve(spec.fn)
    except GRPOError as err:
        raise GRPOError(f"{label}.fn {spec.fn!r}: {err}") from err.__cause__
    return functools.partial(fn, **spec.options())
