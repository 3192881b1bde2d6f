"""Reward code travels with the run (pipeline/store/code.py): `grpo init` copies the files a config
names into the run and hashes them into the run's config hash; a stage imports the run's copy
(`run_code`), whatever file its current directory holds; an installed module is recorded by version
and checked where it is imported. The Ray side (workers in another directory score with the copy,
bytes equal to the local run's) is in tests/test_ray.py."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys

import pytest

from conftest import base_config
from pipeline import config as config_mod
from pipeline.errors import GRPOError

BREV = "def brev(completions, **kwargs):\n    return [1.0 / (1 + len(c)) for c in completions]\n"
DECOY = "def brev(completions, **kwargs):\n    return [0.0 for c in completions]\n"  # an old copy elsewhere


def make_run(assets, tmp_path, monkeypatch, name: str, code: str, rewards: list[dict] | None = None):
    from pipeline.run.run import init_run

    user = tmp_path / f"{name}-src"
    user.mkdir(exist_ok=True)
    (user / "brev.py").write_text(code)
    monkeypatch.chdir(user)
    cfg = config_mod.resolve(base_config(assets, rewards=rewards or [{"fn": "brev.py:brev"}]))
    return init_run(str(tmp_path / name), cfg), cfg


def scores(run, completions):
    from pipeline.rewards.contract import compute_rewards, run_code

    with run_code(run):
        return compute_rewards(run.cfg.rewards, ["p"] * len(completions), completions, None, {}, iteration=0)[:, 0].tolist()


def test_a_reward_file_is_copied_hashed_and_imported_from_the_run_not_the_current_directory(assets, tmp_path, monkeypatch):
    from pipeline.rewards.contract import compute_rewards
    from pipeline.run.run import Run

    run, cfg = make_run(assets, tmp_path, monkeypatch, "run", BREV)
    record = json.loads((tmp_path / "run" / "code" / "CODE.json").read_text())
    import hashlib

    sha = hashlib.sha256(BREV.encode()).hexdigest()
    assert record == {"brev.py": {"copy": f"code/{sha[:12]}/brev.py", "sha256": sha}}
    assert (tmp_path / "run" / record["brev.py"]["copy"]).read_text() == BREV

    elsewhere = tmp_path / "elsewhere"  # another directory, with an old copy of the file
    elsewhere.mkdir()
    (elsewhere / "brev.py").write_text(DECOY)
    monkeypatch.chdir(elsewhere)
    # 1 / (1 + len): "ab" -> 1/3, "abcde" -> 1/6; the decoy in this directory would give 0, 0
    assert scores(Run(run.uri), ["ab", "abcde"]) == pytest.approx([1 / 3, 1 / 6], abs=1e-12)
    outside = compute_rewards(cfg.rewards, ["p", "p"], ["ab", "abcde"], None, {}, iteration=0)[:, 0].tolist()
    assert outside == [0.0, 0.0]  # without the run, the current directory's file: what a worker used to import

    # the code is in the run's config hash: the same config with other code is another run
    other, _ = make_run(assets, tmp_path, monkeypatch, "other", BREV.replace("1.0", "2.0"))
    plain = config_mod.config_hash(cfg)
    assert len({plain, Run(run.uri).cfg_hash, Run(other.uri).cfg_hash}) == 3
    again, _ = make_run(assets, tmp_path, monkeypatch, "again", BREV)
    assert Run(again.uri).cfg_hash == Run(run.uri).cfg_hash  # where the file was is not in the hash

    # `grpo init` of the same run with changed code is refused, not silently reused
    from pipeline.run.run import init_run

    (tmp_path / "run-src" / "brev.py").write_text(DECOY)
    monkeypatch.chdir(tmp_path / "run-src")
    with pytest.raises(GRPOError, match="code differs from what the config names now"):
        init_run(run.uri, cfg)


def test_a_run_without_custom_code_keeps_its_hash(assets, tmp_path):
    from pipeline.run.run import Run, init_run

    cfg = config_mod.resolve(base_config(assets))  # built-ins only
    run = init_run(str(tmp_path / "run"), cfg)
    assert not (tmp_path / "run" / "code").exists()
    assert Run(run.uri).cfg_hash == config_mod.config_hash(cfg)


def test_a_module_of_the_current_directory_is_copied_and_an_installed_one_recorded_by_version(assets, tmp_path, monkeypatch):
    from pipeline.rewards.contract import run_code, resolve
    from pipeline.store import code
    from pipeline.run.run import Run

    src = tmp_path / "src"
    src.mkdir()
    (src / "brevmod.py").write_text(BREV)
    monkeypatch.chdir(src)
    cfg = config_mod.resolve(base_config(assets, rewards=[{"fn": "brevmod:brev"}, {"fn": "yaml:safe_dump"}]))
    from pipeline.run.run import init_run

    run = init_run(str(tmp_path / "run"), cfg)
    record = Run(run.uri).code
    assert record["brevmod"]["module"] == "brevmod" and "copy" in record["brevmod"]
    assert record["yaml"]["version"] == importlib.metadata.version("PyYAML") and "copy" not in record["yaml"]
    monkeypatch.chdir(tmp_path)  # brevmod is not importable from here: the run's copy is
    assert "brevmod" not in sys.modules  # `grpo init` found its file without running it: the copy is what runs
    with run_code(Run(run.uri)):
        assert resolve("brevmod:brev")(["abc"]) == [0.25]
    with pytest.raises(GRPOError, match="no module 'brevmod'"):
        resolve("brevmod:brev")

    # a worker whose installed module is another version fails before any work, naming it
    tampered = {**record, "yaml": {**record["yaml"], "version": "0.0.1"}}
    with pytest.raises(GRPOError, match=r"module yaml on node-x is version .* but the run was made with 0.0.1"):
        code.check_modules(tampered, "on node-x")


def test_a_worker_that_cannot_import_the_runs_code_fails_before_any_work(assets, tmp_path, monkeypatch):
    """What each Ray rollout actor runs in its ready() check (pipeline/cluster/workers.py)."""
    from pipeline.cluster.workers import check_environment
    from pipeline.run.run import Run

    run, _ = make_run(assets, tmp_path, monkeypatch, "run", BREV)
    monkeypatch.chdir(tmp_path)
    assert check_environment(Run(run.uri), ["GRPO_TEST_UNSET_TOKEN"]) == ["GRPO_TEST_UNSET_TOKEN"]
    copy = next((tmp_path / "run" / "code").glob("*/brev.py"))
    copy.write_text(DECOY)  # edited in the run after `grpo init`
    with pytest.raises(GRPOError, match="the run's copy of brev.py is not the file recorded at `grpo init`"):
        check_environment(Run(run.uri), [])
    from pipeline.report.audit import audit_run

    assert any("the run's copy of brev.py is not the file recorded" in p for p in audit_run(Run(run.uri)).problems)
    copy.unlink()
    with pytest.raises(GRPOError, match="the run's copy of brev.py is missing"):
        check_environment(Run(run.uri), [])


HELPERS = "SCALE = 3.0\n\ndef size(text):\n    from more import plus\n    return plus(len(text))\n"
MORE = "def plus(n):\n    return n + 1\n"
USES = "import helpers\n\ndef brev(completions, **kwargs):\n    return [helpers.SCALE / helpers.size(c) for c in completions]\n"


@pytest.mark.parametrize("fn", ["brev.py:brev", "brev:brev"])
def test_a_reward_importing_sibling_files_carries_them_with_the_run(assets, tmp_path, monkeypatch, fn):
    """The issue's trap: a reward whose module imports a file beside it passed init and failed in the
    score stage, the run holding a copy of the module alone. Its local imports (and theirs) travel with it."""
    from pipeline.run.run import Run

    src = tmp_path / "run-src"
    src.mkdir()
    (src / "helpers.py").write_text(HELPERS)
    (src / "more.py").write_text(MORE)  # imported inside a function of helpers: found by reading, not running
    run, _ = make_run(assets, tmp_path, monkeypatch, "run", USES, rewards=[{"fn": fn}])
    entry = Run(run.uri).code[fn.split(":")[0]]
    assert sorted(entry["imports"]) == ["helpers.py", "more.py"]
    folder = (tmp_path / "run" / entry["copy"]).parent
    assert (folder / "helpers.py").read_text() == HELPERS and (folder / "more.py").read_text() == MORE

    elsewhere = tmp_path / "elsewhere"  # the user's directory gone from view; a decoy helpers.py here
    elsewhere.mkdir()
    (elsewhere / "helpers.py").write_text("SCALE = 0.0\n\ndef size(text):\n    return 1\n")
    monkeypatch.chdir(elsewhere)
    from pipeline.rewards import contract

    for name in [m for m in sys.modules if m in ("helpers", "more", "brev") or m.startswith("_grpo_reward_brev_")]:
        monkeypatch.delitem(sys.modules, name)  # as a score process that never imported them
    contract._resolve.cache_clear()
    # 3 / (len + 1): "ab" -> 1.0, "abcde" -> 0.5
    assert scores(Run(run.uri), ["ab", "abcde"]) == pytest.approx([1.0, 0.5], abs=1e-12)

    # a changed sibling is other code: the same run directory is refused at init
    from pipeline.run.run import init_run

    (src / "more.py").write_text("def plus(n):\n    return n + 2\n")
    monkeypatch.chdir(src)
    with pytest.raises(GRPOError, match="code differs from what the config names now"):
        init_run(run.uri, config_mod.resolve(base_config(assets, rewards=[{"fn": fn}])))


def test_a_reward_importing_a_package_beside_it_is_refused_at_init_naming_the_file(assets, tmp_path, monkeypatch):
    src = tmp_path / "run-src"
    (src / "helpers").mkdir(parents=True)
    (src / "helpers" / "__init__.py").write_text("SCALE = 3.0\n")
    with pytest.raises(GRPOError, match=r"brev\.py: imports helpers/, a package directory beside it"):
        make_run(assets, tmp_path, monkeypatch, "run", "import helpers\n\ndef brev(completions, **kw):\n    return [1.0 for c in completions]\n")
    assert not (tmp_path / "run" / "config.yaml").exists()


# -- `grpo init` imports the copy the run will hold, as the stages do ---------------------------------
HIDDEN = ('import importlib\n\nhelper = importlib.import_module("hel" + "per")  # no import statement names it\n\n'
          'def brev(completions, **kwargs):\n    return [helper.SCALE for c in completions]\n')
BESIDE = ('from pathlib import Path\n\nSCALE = float((Path(__file__).parent / "scale.txt").read_text())\n\n'
          'def brev(completions, **kwargs):\n    return [SCALE for c in completions]\n')


def _init_line(capsys, assets, src, run_dir, fn: str) -> str:
    """`grpo init` in `src` (in process: `python -m pytest` has the current directory on sys.path, as
    `python -m stages.cli` does) -> its one error line; init_error_line asserts no run directory."""
    from conftest import init_error_line, write_config

    cfg = write_config(src / "cfg.yaml", base_config(assets, rewards=[{"fn": fn}]))
    return init_error_line(capsys, run_dir, "--config", cfg)


@pytest.mark.parametrize("fn", ["brev.py:brev", "brev:brev"])
def test_an_import_the_scan_cannot_see_works_from_the_directory_but_is_refused_at_init(assets, tmp_path, monkeypatch, capsys, fn):
    """It imports from the user's directory, so the old init (which imported from there) passed it and the
    score stage, importing the run's copy alone, failed after a rollout. Now init imports that copy."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "helper.py").write_text("SCALE = 2.0\n")
    (src / "brev.py").write_text(HIDDEN)
    monkeypatch.chdir(src)
    monkeypatch.syspath_prepend(str(src))
    assert importlib.import_module("helper").SCALE == 2.0  # it does work from here
    monkeypatch.delitem(sys.modules, "helper")
    line = _init_line(capsys, assets, src, tmp_path / "run", fn)
    where = fn.split(":")[0]
    assert line == (f"rewards[0].fn '{fn}': {where} imports 'helper', which the run's copy cannot find: grpo carries the "
                    f"files beside {where} that its import statements name, not a module named at run time; write "
                    "`import helper`, or install it")
    assert "helper" not in sys.modules and not any("grpo-init-code-" in str(getattr(m, "__file__", "")) for m in sys.modules.values())


@pytest.mark.parametrize("fn", ["brev.py:brev", "brev:brev", "rlhfreward:brev"])
def test_a_module_an_installed_package_imports_is_named_with_its_importer_not_blamed_on_the_reward(assets, tmp_path, monkeypatch, capsys, fn):
    """OpenRLHF's case: a reward importing `openrlhf.utils`, whose `math_utils` needs `pylatexenc`, which is
    not installed. The reward's own imports are fine: init names the missing module and the file importing it,
    and does not tell the reward to `import pylatexenc` itself. A small package on sys.path plays openrlhf."""
    assert importlib.util.find_spec("pylatexenc") is None  # the module really is missing here
    site = tmp_path / "site"
    (site / "rlhfpkg" / "utils").mkdir(parents=True)
    (site / "rlhfpkg" / "__init__.py").write_text("")
    (site / "rlhfpkg" / "utils" / "__init__.py").write_text("from .math_utils import grade\n")
    (site / "rlhfpkg" / "utils" / "math_utils.py").write_text(
        "from pylatexenc.latex2text import LatexNodes2Text\n\ndef grade(a, b):\n    return float(a == b)\n")
    src = tmp_path / "src"
    src.mkdir()
    code = "from rlhfpkg.utils import grade\n\ndef brev(completions, **kwargs):\n    return [grade(c, '1') for c in completions]\n"
    (src / "brev.py").write_text(code)  # a file of the user's, copied into the run
    (site / "rlhfreward.py").write_text(code)  # an installed module, recorded by version
    monkeypatch.chdir(src)
    monkeypatch.syspath_prepend(str(site))
    try:
        line = _init_line(capsys, assets, src, tmp_path / "run", fn)
    finally:
        for name in [m for m in sys.modules if m in ("rlhfpkg", "rlhfreward") or m.startswith("rlhfpkg.")]:
            del sys.modules[name]
    where = fn.split(":")[0]
    assert line == (f"rewards[0].fn '{fn}': importing {where}: it imports rlhfpkg.utils, whose rlhfpkg.utils.math_utils "
                    f"({site / 'rlhfpkg' / 'utils' / 'math_utils.py'}) imports 'pylatexenc', which is not installed here; install "
                    "it (what rlhfpkg needs), or import from rlhfpkg.utils only what works without it")


def test_a_data_file_read_beside_the_reward_is_refused_at_init_naming_it(assets, tmp_path, monkeypatch, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "scale.txt").write_text("2.0\n")
    (src / "brev.py").write_text(BESIDE)
    monkeypatch.chdir(src)
    assert _init_line(capsys, assets, src, tmp_path / "run", "brev.py:brev") == (
        "rewards[0].fn 'brev.py:brev': brev.py opens 'scale.txt' beside it, which the run's copy does not hold: grpo carries "
        "Python files only; read it from an absolute path or an installed package")


def test_a_package_relative_import_is_refused_at_init_naming_the_file(assets, tmp_path, monkeypatch, capsys):
    """`pkg/rewards.py` with `from .helper import SCALE`: named by its file, the copy lies in no package; named as
    the module `pkg.rewards`, the package is the current directory's and would not reach another machine."""
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("")
    (src / "pkg" / "helper.py").write_text("SCALE = 2.0\n")
    (src / "pkg" / "rewards.py").write_text("from .helper import SCALE\n\ndef brev(completions, **kwargs):\n    return [SCALE] * len(completions)\n")
    monkeypatch.chdir(src)
    assert _init_line(capsys, assets, src, tmp_path / "run", "pkg/rewards.py:brev") == (
        f"{src / 'pkg' / 'rewards.py'}: line 1 imports .helper relative to its package, which grpo does not carry with the "
        "run; import the file beside it by name (`import helper`) or install the package (pip install -e)")
    assert _init_line(capsys, assets, src, tmp_path / "run", "pkg.rewards:brev") == (
        f"pkg.rewards: {src / 'pkg' / 'rewards.py'} is a package in the current directory, not installed, which grpo does not "
        "carry with the run; install it (pip install -e) or make it a single file rewards.py")


def test_a_sibling_import_passes_init_from_the_copy_and_scores_there(assets, tmp_path, monkeypatch):
    """The carried case through `grpo init` itself: the copy (with helpers.py, more.py beside it) imports at init
    with the current directory off sys.path, and the run scores from its copy."""
    from conftest import grpo, write_config
    from pipeline.run.run import Run

    src = tmp_path / "src"
    src.mkdir()
    (src / "helpers.py").write_text(HELPERS)
    (src / "more.py").write_text(MORE)
    (src / "brev.py").write_text(USES)
    cfg = write_config(src / "cfg.yaml", base_config(assets, rewards=[{"fn": "brev.py:brev"}]))
    grpo("init", str(tmp_path / "run"), "--config", str(cfg), cwd=src)
    assert sorted(Run(str(tmp_path / "run")).code["brev.py"]["imports"]) == ["helpers.py", "more.py"]
    monkeypatch.chdir(tmp_path)
    from pipeline.rewards import contract

    for name in [m for m in sys.modules if m in ("helpers", "more") or m.startswith("_grpo_reward_brev_")]:
        monkeypatch.delitem(sys.modules, name)  # as a score process: nothing imported yet
    contract._resolve.cache_clear()
    assert scores(Run(str(tmp_path / "run")), ["ab", "abcde"]) == pytest.approx([1.0, 0.5], abs=1e-12)


def test_a_sibling_that_python_would_take_from_elsewhere_is_refused_not_scored_with(tmp_path, monkeypatch):
    """Python keeps one module per name: two reward files each importing their own `shared_r55` (one
    scale 1, one 2) both got the first one's, and a sibling named like a standard module (json.py) got
    the standard one. Refused with the file named, at init (which imports them) and in every stage."""
    from pipeline.rewards.contract import resolve

    uses = "import shared_r55\n\ndef f(completions, **kwargs):\n    return [shared_r55.K for c in completions]\n"
    for name, k in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "shared_r55.py").write_text(f"K = {k}\n")
        (tmp_path / name / "r.py").write_text(uses + f"# {name}\n")
    (tmp_path / "c").mkdir()  # the same content as a's, in another directory: the same module, fine
    (tmp_path / "c" / "shared_r55.py").write_text("K = 1.0\n")
    (tmp_path / "c" / "r.py").write_text(uses + "# a\n")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "json.py").write_text("K = 3.0\n")
    (tmp_path / "d" / "r.py").write_text("import json\n\ndef f(completions, **kwargs):\n    return [json.K for c in completions]\n")
    monkeypatch.delitem(sys.modules, "shared_r55", raising=False)
    monkeypatch.chdir(tmp_path)
    try:
        assert resolve("a/r.py:f")(["x"]) == [1.0] and resolve("c/r.py:f")(["x"]) == [1.0]
        with pytest.raises(GRPOError, match=r"importing b/r.py: its `import shared_r55` gets .*a/shared_r55.py, not the shared_r55.py beside it"):
            resolve("b/r.py:f")
        with pytest.raises(GRPOError, match=r"importing d/r.py: `import json` names the standard module json as well as the json.py beside it"):
            resolve("d/r.py:f")
    finally:
        sys.modules.pop("shared_r55", None)


def test_a_reward_in_a_local_package_is_refused_at_init_and_a_refused_init_leaves_nothing(assets, tmp_path, monkeypatch):
    """`mypkg.mod:f` (a package in the current directory, not installed) was recorded as an installed
    module: a stage in another directory (a Ray node, a --shard worker) failed after the rollout. And a
    reward refused by the code record (`brev:brev` importing a package beside it) had already copied
    the policy in: fixing the code and running `grpo init` again was refused, 'directory exists'."""
    from pipeline.run.run import init_run

    for name in [m for m in sys.modules if m in ("helpers", "brev") or m.startswith("mypkg_r55")]:
        monkeypatch.delitem(sys.modules, name)  # imported here from this test's directory, put back after it
    src = tmp_path / "run-src"
    (src / "mypkg_r55").mkdir(parents=True)
    (src / "mypkg_r55" / "__init__.py").write_text("")
    (src / "mypkg_r55" / "mod.py").write_text(BREV)
    monkeypatch.chdir(src)
    cfg = config_mod.resolve(base_config(assets, rewards=[{"fn": "mypkg_r55.mod:brev"}]))
    with pytest.raises(GRPOError, match=r"mypkg_r55.mod: .*mypkg_r55/mod.py is a package in the current directory, not installed"):
        init_run(str(tmp_path / "run"), cfg)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())

    (src / "helpers").mkdir()
    (src / "helpers" / "__init__.py").write_text("SCALE = 3.0\n")
    with pytest.raises(GRPOError, match=r"brev\.py: imports helpers/, a package directory beside it"):
        make_run(assets, tmp_path, monkeypatch, "run", "import helpers\n\ndef brev(completions, **kw):\n    return [1.0 for c in completions]\n",
                 rewards=[{"fn": "brev:brev"}])
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    run, _ = make_run(assets, tmp_path, monkeypatch, "run", BREV, rewards=[{"fn": "brev:brev"}])  # fixed: the same directory takes it
    assert (tmp_path / "run" / "config.yaml").is_file() and run.code["brev"]["copy"].endswith("brev.py")
    for name in [m for m in sys.modules if m in ("helpers", "brev") or m.startswith("mypkg_r55")]:
        del sys.modules[name]
