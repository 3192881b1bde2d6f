"""The house rules on the code's shape, read from the source (nothing is imported but bench/, last):

- no import cycle among the project's modules (pipeline, stages, schemas, demo), an import inside
  a function counting as an arrow like one at the top (it is a cycle that a late import only
  hides until the call);
- no module in pipeline/, stages/, schemas/ over 350 lines;
- imports flow stages -> pipeline -> schemas: pipeline/ and schemas/ never import typer, schemas/
  never imports pipeline or stages, pipeline/ never imports stages;
- a folder per concept: at most ten modules flat in pipeline/, the config (pipeline/config/) imports
  nothing of the pipeline above it, and its sections share the one base (pipeline/config/base.py);
- what a run is (pipeline/run/: the run, its parts, its policy kinds and files) stands on one floor above
  the storage (pipeline/store/) and the models and engines (pipeline/models/): run imports both, store and
  models import neither run nor each other;
- every import of the project's own code, inside functions too, names a module or a name it defines;
- every module under bench/ imports (one process, all of them), and the loop's samplers declare the one Sampler.

An arrow is an `import` / `from ... import` statement anywhere in a module, except under
`if TYPE_CHECKING:` (never executed: annotations only). `from pipeline.store import RunStore` is an
arrow to pipeline.store, `from pipeline.store import lock` one to pipeline.store.lock; the parent
packages that Python loads first are not counted (a package's own imports are its arrows).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "stages", "schemas", "demo", "bench")
SIZED = ("pipeline", "stages", "schemas")
MAX_LINES = 350

# Cycles that exist on purpose until the branch that breaks them is merged; each entry is the exact
# set of modules of one cycle (a strongly connected component), so a cycle that grows is reported.
# test_allowlists_are_current fails once an entry no longer is a cycle: delete it then.
KNOWN_CYCLES: set[frozenset[str]] = set()
# Modules over MAX_LINES that another branch is splitting; delete an entry once it fits.
LONG_MODULES: set[str] = set()


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, type_checking: bool = False) -> list[tuple[str, int]]:
    """(imported dotted name, line) for every import statement the module executes, at any depth;
    with `type_checking`, those under `if TYPE_CHECKING:` too."""
    is_pkg = path.name == "__init__.py"
    out = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            for other in node.orelse:  # the else branch runs
                visit(other)
            return
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            out.extend((f"{base}.{alias.name}", node.lineno) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return out


def _graph() -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    """Modules, and module -> {project module it imports: line of the first such import}."""
    mods = _modules()
    edges: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges[name] = {}
        for target, line in _imports(name, path):
            while target and target not in mods:  # `pkg.mod.attr` -> pkg.mod; outside modules -> ""
                target = target.rpartition(".")[0]
            if target and target != name:
                edges[name].setdefault(target, line)
    return mods, edges


def _cycles(edges: dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


def _describe(comp: set[str], mods: dict[str, Path], edges: dict[str, dict[str, int]]) -> str:
    """The shortest way round from the component's first module back to itself, each arrow with
    the file and line that makes it; the whole component when it holds more modules than that."""
    first = min(comp)
    prev: dict[str, str | None] = {first: None}
    queue, end = [first], None
    for here in queue:  # breadth first; in a component some member imports `first`
        if here != first and first in edges[here]:
            end = here
            break
        for w in sorted(edges[here]):
            if w in comp and w not in prev:
                prev[w] = here
                queue.append(w)
    path = [end]
    while prev[path[-1]] is not None:
        path.append(prev[path[-1]])
    path = path[::-1] + [first]
    arrows = " -> ".join(f"{a} ({mods[a].relative_to(ROOT)}:{edges[a][b]})" for a, b in zip(path, path[1:]))
    rest = f"  [the cycle's component: {', '.join(sorted(comp))}]" if len(comp) > len(path) - 1 else ""
    return f"{arrows} -> {first}{rest}"


def _line_counts() -> dict[str, int]:
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
            for pkg in SIZED for p in sorted((ROOT / pkg).rglob("*.py"))}


def test_no_import_cycle():
    mods, edges = _graph()
    new = [c for c in _cycles(edges) if frozenset(c) not in KNOWN_CYCLES]
    assert not new, "import cycle(s):\n  " + "\n  ".join(_describe(c, mods, edges) for c in new)


def test_no_module_over_350_lines():
    long = {rel: n for rel, n in _line_counts().items() if n > MAX_LINES and rel not in LONG_MODULES}
    assert not long, f"over {MAX_LINES} lines (split by responsibility): " + ", ".join(f"{rel} ({n})" for rel, n in sorted(long.items()))


def test_allowlists_are_current():
    mods, edges = _graph()
    cycles = {frozenset(c) for c in _cycles(edges)}
    counts = _line_counts()
    stale = [f"KNOWN_CYCLES: {' <-> '.join(sorted(c))} is no longer a cycle" for c in KNOWN_CYCLES if c not in cycles]
    stale += [f"LONG_MODULES: {rel} has {counts.get(rel, 'no')} lines" for rel in sorted(LONG_MODULES) if counts.get(rel, 0) <= MAX_LINES]
    assert not stale, "delete the allowlist entries that no longer apply: " + "; ".join(stale)


def test_imports_flow_stages_pipeline_schemas():
    mods, _ = _graph()
    bad = []
    for name, path in mods.items():
        top = name.split(".")[0]
        forbidden = {"pipeline": ("typer", "stages"), "schemas": ("typer", "pipeline", "stages")}.get(top, ())
        for target, line in _imports(name, path, type_checking=True):  # a wrong-way annotation too
            if target.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target.split('.')[0]}")
    assert not bad, "imports against stages -> pipeline -> schemas (pipeline and schemas never import typer): " + "; ".join(bad)


def test_at_most_ten_modules_flat_in_pipeline():
    flat = sorted(p.name for p in (ROOT / "pipeline").glob("*.py") if p.name != "__init__.py")
    assert len(flat) <= 10, f"{len(flat)} modules flat in pipeline/ (group them by concept): {', '.join(flat)}"


def test_config_imports_nothing_above_it():
    """Reading a run's config never loads the pipeline's machinery (torch among it): the config
    folder imports only itself and pipeline.errors, annotations included."""
    mods, _ = _graph()
    bad = [f"{path.relative_to(ROOT)}:{line} imports {target}"
           for name, path in mods.items() if name.startswith("pipeline.config")
           for target, line in _imports(name, path, type_checking=True)
           if target.startswith("pipeline.") and not target.startswith(("pipeline.config", "pipeline.errors"))]
    assert not bad, "the config imports above itself: " + "; ".join(bad)


FLOORS = {"pipeline.store": ("pipeline.run", "pipeline.models"), "pipeline.models": ("pipeline.run", "pipeline.store")}


def test_store_and_models_stand_below_the_run():
    """The run (pipeline/run/) builds on the store and the models; neither imports it, nor each other, annotations
    and imports inside functions included: no late import hides a dependency that runs the wrong way."""
    mods, _ = _graph()
    bad = [f"{path.relative_to(ROOT)}:{line} imports {target}"
           for name, path in mods.items() for floor, above in FLOORS.items()
           if name == floor or name.startswith(floor + ".")
           for target, line in _imports(name, path, type_checking=True)
           if any(target == a or target.startswith(a + ".") for a in above)]
    assert not bad, "pipeline/store/ and pipeline/models/ import what stands beside or above them: " + "; ".join(bad)


def test_one_base_section():
    """Every config section derives from pipeline.config.base.Section: the pydantic settings
    (extra keys refused, docstrings as docs, assignments validated) are written once."""
    defined = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "pipeline").rglob("*.py")) if "ConfigDict(" in p.read_text()]
    assert defined == ["pipeline/config/base.py"], f"a pydantic model_config written outside the base: {defined}"


def _defines(path: Path) -> set[str] | None:
    """The names a module binds at its top level; None when it can bind any (`__getattr__`, `import *`)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        for n in ([node] + list(node.body) + list(node.orelse) if isinstance(node, (ast.If, ast.Try)) else [node]):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                if any(a.name == "*" for a in n.names):
                    return None
                names.update((a.asname or a.name).split(".")[0] for a in n.names)
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    names.update(e.id for e in ast.walk(t) if isinstance(e, ast.Name))
    return None if "__getattr__" in names else names


def test_every_project_import_resolves():
    """An import of the project's own code names a module or a name it defines, the imports inside functions
    too: a late import of a module a renovation removed fails only when its function runs (bench/long.py's
    `from pipeline import grpo` did, in the bench behind the memory estimate)."""
    mods = _modules()
    bad = []
    for name, path in mods.items():
        for target, line in _imports(name, path, type_checking=True):
            if target.split(".")[0] not in PACKAGES or target in mods:
                continue
            owner, _, attr = target.rpartition(".")
            defined = _defines(mods[owner]) if owner in mods else set()
            if defined is not None and attr not in defined:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, "imports of the project's code that name nothing: " + "; ".join(bad)


def test_every_bench_module_imports():
    """Every module under bench/ (bench/gpu/ included) imports, in this one process: a bench whose top-level
    import broke fails the suite, not the next person to run it."""
    import importlib
    import pkgutil

    import bench

    names = [m.name for m in pkgutil.walk_packages(bench.__path__, "bench.")]
    assert {"bench.long", "bench.gpu.proof"} <= set(names), names
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - every failure is reported, not only the first
            failed.append(f"{name}: {type(err).__name__}: {err}")
    assert not failed, "bench modules that do not import: " + "; ".join(failed)


def test_every_sampler_declares_the_one_interface():
    """The loop's three samplers declare pipeline.loop.sampler.Sampler and define all of it (abstract methods
    left out would make them impossible to build), so the interface is written in one place."""
    from pipeline.cluster.executor import RaySampler
    from pipeline.loop.iterate import InlineSampler
    from pipeline.loop.overlap import ProcessSampler
    from pipeline.loop.sampler import Sampler

    for cls in (InlineSampler, ProcessSampler, RaySampler):
        assert Sampler in cls.__mro__ and not cls.__abstractmethods__, (cls.__name__, sorted(cls.__abstractmethods__))
