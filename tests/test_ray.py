"""`grpo iterate` on a Ray cluster: two Ray nodes on this machine (pipeline/cluster/local.py:
`ray.cluster_utils.Cluster`, one CPU each, at the machine's own address), one cluster for the whole
test session.

The Ray run must write the bytes of a local `grpo iterate` of the same config (rollout and score
parts, the manifests' contents bar their times; logprobs, update and policies through `grpo audit
--compare`) when a rollout actor is SIGKILLed mid-part, a score task's process dies, the driver is
killed (a rerun resumes, writing no part twice) and a node is removed before, during and after each stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import base_config, grpo, write_config
from judge_server import Judge
from test_judge import RUBRIC, judge_entry
from pipeline.cluster.local import add_worker_node, lose_node, starting_nodes, two_nodes
from pipeline.store import part_name

ITERS = 2
PARTS = 4
MARKER = "hf_MARKER7d1f0c"  # a planted secret: never in Ray's session directory, the run or any output
SECRETS = {"HF_TOKEN": MARKER, "GRPO_JUDGE_API_KEY": MARKER + "k"}
BREV = ("def brev(completions, **kwargs):  # the user's reward, in the directory `grpo init` ran in\n"
        "    return [1.0 / (1 + len(c[0]['content'] if isinstance(c, list) else c)) for c in completions]\n")
DECOY = "def brev(completions, **kwargs):  # an old copy where the driver and workers run\n    return [0.0 for c in completions]\n"
THREADS = {"OMP_NUM_THREADS": "1"}  # every process samples on one thread, so they agree bit for bit
# when, by which commit, on which worker; stats are compared by token count; the judge's record says
# how its verdicts were got (latency, calls, cache hits: a re-run part reads its verdicts from the cache)
VOLATILE = {"created", "code_version", "timings", "stats", "workers", "judge"}


def ray_config(assets: dict, judge: str | None = None, **cluster) -> dict:
    """The module's config: built-in rewards, the user's file reward and, given a judge's url, an LLM
    judge (tests/judge_server.py) whose verdicts are read from two nodes."""
    rewards = [{"fn": "correct"}, {"fn": "format", "weight": 0.5}, {"fn": "brev.py:brev", "name": "brev", "weight": 0.5}]
    if judge:
        rewards.append({**judge_entry(judge, "ok", kwargs={"rubric": RUBRIC + "\nReference: {answer}"}), "weight": 0.5})
    return base_config(assets, rollout={"engine": "hf", "prompts_per_iter": PARTS, "groups_per_part": 1, "max_new_tokens": 16},
                       rewards=rewards,
                       cluster={"executor": "ray", "rollout_workers": 2, "rollout_cpus": 0.5, "score_cpus": 0.5, **cluster})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Where `grpo init` runs (the user's brev.py) and where every `grpo iterate` runs (an old brev.py):
    Ray's workers run in neither (issue 43 case 1); and the judge every run of the module asks."""
    root = tmp_path_factory.mktemp("ray-dirs")
    (root / "user").mkdir()
    (root / "user" / "brev.py").write_text(BREV)
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "brev.py").write_text(DECOY)
    judge = Judge(delay=0.0, lifetime=3600.0).start()
    yield {"user": root / "user", "elsewhere": root / "elsewhere", "judge": judge}
    judge.stop()


@pytest.fixture(scope="module")
def ray_cluster():
    """Two Ray nodes, one CPU each, on this machine; worker processes run on one thread. A node that
    fails to start (see ahead_of_other_jobs) is tried 3 times. Every test that needs it is in this
    module: the one cluster of a test run, stopped before the next module's tests start."""
    cluster = two_nodes(attempts=3)
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def local_run(assets, dirs, tmp_path_factory) -> Path:
    """The reference: the same config's 2 iterations in one local `grpo iterate` (in another
    directory than `grpo init`'s, beside an old copy of the reward file)."""
    tmp = tmp_path_factory.mktemp("ray-local")
    run = tmp / "run"
    grpo("init", str(run), "--config", str(write_config(tmp / "cfg.yaml", ray_config(assets, dirs["judge"].url))), cwd=dirs["user"])
    dirs["judge"].reset()
    grpo("iterate", str(run), "--iters", str(ITERS), "--executor", "local", env=THREADS, cwd=dirs["elsewhere"])
    (tmp / "asked").write_text(str(sum(dirs["judge"].chats.values())))  # the judge requests of the whole run
    return run


def new_run(tmp_path: Path, assets: dict, dirs: dict, name: str = "run", **cluster) -> Path:
    run = tmp_path / name
    grpo("init", str(run), "--config", str(write_config(tmp_path / f"{name}.yaml", ray_config(assets, dirs["judge"].url, **cluster))),
         cwd=dirs["user"])
    return run


def assert_scored_with_the_users_code(run: Path) -> None:
    """Every score part's brev column is the user's function of its completion, not the old copy's 0."""
    import pyarrow.parquet as pq

    for k in range(ITERS):
        for part in sorted((run / f"iter-{k:04d}" / "rollout").glob("part-*.parquet")):
            rollout = pq.read_table(part).to_pylist()
            scored = pq.read_table(run / f"iter-{k:04d}" / "score" / part.name).column("reward_brev").to_pylist()
            assert scored == [1.0 / (1 + len(r["completion"])) for r in rollout] and min(scored) > 0


def assert_no_secret_anywhere(cluster, *places) -> None:
    """The planted values are in no file under the cluster's session directory (Ray's logs, its GCS
    and runtime-env records) or the run directory, and in no output (case 5)."""
    session = Path(cluster.head_node.get_session_dir_path())
    for root in (session, *[p for p in places if isinstance(p, Path)]):
        hits = [str(f) for f in root.rglob("*") if f.is_file() and any(v.encode() in f.read_bytes() for v in SECRETS.values())]
        assert not hits, hits
    for text in (p for p in places if isinstance(p, str)):
        assert not any(v in text for v in SECRETS.values())


def iterate_args(run: Path, cluster) -> list[str]:
    return ["iterate", str(run), "--iters", str(ITERS), "--executor", "ray", "--address", cluster.address]


def manifest(run: Path, k: int, stage: str) -> dict:
    return json.loads((run / f"iter-{k:04d}" / stage / "MANIFEST.json").read_text())


def assert_same_as(run: Path, ref: Path, resumed: bool = False) -> None:
    """Rollout and score of every iteration as the reference wrote them, no leftovers; audit clean,
    and `grpo audit --compare` finds every artifact (logprobs, update, policies too) identical.
    A manifest's stats count the work of the command that wrote it: after a resume, only the parts
    that command made (RESUMED: their token counts are not compared)."""
    for k in range(ITERS):
        for stage in ("rollout", "score"):
            a, b = manifest(run, k, stage), manifest(ref, k, stage)
            assert len(a["outputs"]) == PARTS and a["outputs"] == b["outputs"], (k, stage)  # byte for byte (sha256)
            same = lambda m: {key: v for key, v in m.items() if key not in VOLATILE and key != "inputs"}
            assert same(a) == same(b)
            # an upstream manifest's sha256 covers its times: compared by what the inputs name, as the input hash is
            assert a["input_hash"] == b["input_hash"]
            assert set(a.get("stats") or {}) == set(b.get("stats") or {})
            if not resumed:
                assert (a.get("stats") or {}).get("tokens") == (b.get("stats") or {}).get("tokens")
            on_disk = sorted(n for n in os.listdir(run / f"iter-{k:04d}" / stage) if not n.startswith(".lock"))
            assert on_disk == sorted([*a["outputs"], "MANIFEST.json"])  # no half-written part, no leftover
    assert not (run / ".cluster").exists()  # the driver's probe files are gone
    audit = grpo("audit", str(run), check=False)
    assert audit.returncode == 0, audit.stdout
    compare = grpo("audit", "--compare", str(ref), str(run), check=False)
    assert compare.returncode == 0 and "agree" in compare.stdout, compare.stdout


def test_cluster_settings_are_not_in_the_config_hash(assets):
    """Where the stages run is not what they compute: a Ray run's config hashes as a local one's."""
    from pipeline import config as config_mod

    local = config_mod.resolve({key: v for key, v in ray_config(assets).items() if key != "cluster"})
    on_ray = config_mod.resolve(ray_config(assets, address="127.0.0.1:6379"))
    assert on_ray.cluster.executor == "ray" and config_mod.config_hash(on_ray) == config_mod.config_hash(local)


@pytest.mark.slow
@pytest.mark.ray_cluster
def test_ray_run_writes_the_local_runs_bytes_through_a_killed_actor_and_score_task(assets, dirs, ray_cluster, local_run, tmp_path):
    """Two rollout actors on two nodes; the actor holding part 1 of iteration 0 is SIGKILLed before
    it writes it, the process scoring part 2 of iteration 1 too: both parts are re-run. The driver
    runs in another directory than `grpo init` did, beside an old copy of the reward file, the
    workers in yet another: every part is scored with the run's copy of the user's file. Secrets
    set on the driver (HF_TOKEN, ...) are named, never sent: no value of theirs anywhere.
    Issue 43 case 11, the Ray leg: the judge is asked from both nodes, the killed score task after
    it asked (the re-run reads those verdicts from the cache, asking nothing twice), and the score
    parts are still the local run's bytes: latency, attempts and cache hits are not in them."""
    run = new_run(tmp_path, assets, dirs)
    env = {**THREADS, **SECRETS, "GRPO_CLUSTER_FAULT": "rollout:0:1,score:1:2", "GRPO_CLUSTER_FAULT_ONCE": str(tmp_path / "fired")}
    dirs["judge"].reset()
    out = grpo(*iterate_args(run, ray_cluster), env=env, cwd=dirs["elsewhere"])
    assert (tmp_path / "fired.0").exists() and (tmp_path / "fired.1").exists()  # both faults happened
    assert sum(dirs["judge"].chats.values()) == int((local_run.parent / "asked").read_text())  # the re-run part asked nothing twice
    for k in range(ITERS):
        j = manifest(run, k, "score")["judge"]["judge"]
        assert j["requests"] == 16 and j["unreadable"] == 0 and (j["from_cache"] >= 1) == (k == 1), (k, j)
    assert "rollout iteration 0 part 1: its worker" in out.stderr and "the part is re-run" in out.stderr
    assert "rollout iteration 1: 4 parts on " in out.stderr and "straggler part" in out.stderr
    assert_same_as(run, local_run)
    assert_worker_records(run)
    assert_scored_with_the_users_code(local_run)
    assert_scored_with_the_users_code(run)
    assert "cluster: HF_TOKEN is set here but not on node" in out.stderr  # named, its value left to each node
    assert_no_secret_anywhere(ray_cluster, run, out.stdout, out.stderr)


def assert_worker_records(run: Path) -> None:
    """Each rollout and score manifest names the worker of every part, and MLflow's metrics of the
    stage (pipeline.report.inspect.stage_metrics, what the tracker logs) carry them."""
    from pipeline.report.inspect import stage_metrics
    from pipeline.run.run import Run

    r = Run(str(run))
    for k in range(ITERS):
        for stage in ("rollout", "score"):
            m = manifest(run, k, stage)
            w = m["workers"]
            assert sorted(w["parts"]) == sorted(m["outputs"]) and set(w["seconds"]) == set(w["parts"].values())
            assert w["parts"][part_name(w["straggler"]["part"])] == w["straggler"]["worker"]
            assert m["timings"]["seconds"] >= w["straggler"]["seconds"]  # the stage's time counts its workers'
            metrics = stage_metrics(r, k, stage)
            assert metrics[f"cluster/{stage}/workers"] == len(w["seconds"])
            assert metrics[f"cluster/{stage}/straggler_s"] == w["straggler"]["seconds"]
            for worker, seconds in w["seconds"].items():
                assert metrics[f"cluster/{stage}/worker_s/{worker.replace('/', '-')}"] == seconds


def test_a_worker_record_names_each_part_its_worker_and_the_straggler():
    """What the executor keeps of its workers' reports: only the parts written (a part an earlier
    attempt left in place is not this command's work), seconds summed per worker, the slowest part;
    the stage's metrics carry it."""
    from pipeline.cluster.executor import row_figures, worker_record
    from pipeline.report.inspect import worker_metrics

    reports = [{"part": 2, "node": "aa", "pid": 1, "seconds": 1.5, "written": True},
               {"part": 0, "node": "bb", "pid": 7, "seconds": 4.0, "written": True},
               {"part": 1, "node": "aa", "pid": 1, "seconds": 2.25, "written": True},
               {"part": 3, "node": "bb", "pid": 7, "seconds": 0.01, "written": False}]
    record = worker_record("rollout", 5, reports, 6.0)
    assert record == {"parts": {"part-00000.parquet": "bb/7", "part-00001.parquet": "aa/1", "part-00002.parquet": "aa/1"},
                      "seconds": {"aa/1": 3.75, "bb/7": 4.0}, "straggler": {"part": 0, "worker": "bb/7", "seconds": 4.0}}
    assert row_figures("rollout", record) == {"rollout_straggler_s": 4.0, "rollout_workers": 2}
    assert worker_metrics("score", record) == {"cluster/score/workers": 2.0, "cluster/score/straggler_s": 4.0,
                                               "cluster/score/worker_s/aa-1": 3.75, "cluster/score/worker_s/bb-7": 4.0}
    assert worker_record("score", 5, reports[3:], 1.0) is None and row_figures("score", None) == {}


@pytest.mark.slow
@pytest.mark.ray_cluster
def test_driver_killed_then_rerun_resumes_writing_no_part_twice(assets, dirs, ray_cluster, local_run, tmp_path):
    """The driver dies (SIGKILL) in iteration 1 once the first rollout part is in, its actors with it;
    the same command again finishes the run from the manifests and parts on storage: every part
    that was in place is kept as it was (same inode, same mtime), and the bytes are the local run's."""
    run = new_run(tmp_path, assets, dirs)
    died = grpo(*iterate_args(run, ray_cluster), env={**THREADS, "GRPO_FAULT": "rollout:part:1"}, check=False, cwd=dirs["elsewhere"])
    assert died.returncode == -9, died.stderr[-2000:]
    assert (run / "iter-0000/update/MANIFEST.json").exists() and not (run / "iter-0001/rollout/MANIFEST.json").exists()
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in run.glob("iter-*/*/part-*.parquet")}
    assert any("iter-0001/rollout" in str(p) for p in before)
    assert not [p for p in run.rglob(".tmp-*")]  # nothing half-written is visible
    status = grpo("status", str(run))  # its in-flight record stayed behind: the driver it names is gone
    assert f"Ray: the driver of this run (pid " in status.stdout and ") is gone; nothing is in flight" in status.stdout
    assert "in flight: node" not in status.stdout

    again = grpo(*iterate_args(run, ray_cluster), env=THREADS, cwd=dirs["elsewhere"])
    assert "rollout iteration 1:" in again.stderr
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in before} == before  # no part written twice
    assert_same_as(run, local_run, resumed=True)


def stalled_iterate(run: Path, cluster, dirs: dict, specs: list[str], release: Path) -> subprocess.Popen:
    """`grpo iterate` on the cluster, held at each GRPO_CLUSTER_STALL point of `specs` until released."""
    env = {**os.environ, **THREADS, "GRPO_CLUSTER_STALL": ",".join(specs), "GRPO_CLUSTER_STALL_RELEASE": str(release)}
    return subprocess.Popen([sys.executable, "-m", "stages.cli", *iterate_args(run, cluster)], cwd=dirs["elsewhere"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def held_at(proc: subprocess.Popen, release: Path, n: int, holding: int, what: str) -> None:
    """Wait until `holding` processes hold at stall point n (the run still running)."""
    held = lambda: len(list(release.parent.glob(f"{release.name}.{n}.held-*")))
    deadline = time.time() + 600
    while held() < holding and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, (what, proc.communicate()[1][-3000:])
    assert held() >= holding, what


def end_run(proc: subprocess.Popen, cluster) -> None:
    """A run still going is killed; the cluster gets its second node back for the next test."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if len(cluster.list_all_nodes()) < 2:
        with starting_nodes():
            add_worker_node(cluster)


# where the second node is removed in one run (a spec of the GRPO_CLUSTER_STALL hook, how many hold there
# before it goes): during rollout 0 (both actors hold a part), during score 0 (two tasks hold theirs: the
# head has room for one, so one is on the second node), after the update of 0 (before rollout 1), after
# rollout 1 (before score 1), after score 1 (before update 1; the update runs in the driver). The node is
# added again after each removal.
REMOVALS = [("rollout:0", 2), ("score:0", 2), ("driver-rollout:1", 1), ("driver-score:1", 1), ("driver-update:1", 1)]


def worker_node(cluster):
    return next(n for n in cluster.list_all_nodes() if n is not cluster.head_node)


@pytest.mark.slow
@pytest.mark.ray_cluster
def test_a_node_removed_before_during_and_after_each_stage_loses_nothing(assets, dirs, ray_cluster, local_run, tmp_path):
    """Before the run, the second node gone: one line says what cannot be placed, nothing is written.
    Then in one run the second node goes away (its raylet and workers killed) at each point of
    REMOVALS and comes back: a part its actor or task held is re-run on the head node (a task by Ray,
    a rollout part by the pool), and the run ends with the local run's bytes; never a silent wait."""
    run = new_run(tmp_path, assets, dirs)
    ray_cluster.remove_node(worker_node(ray_cluster))
    ray_cluster.wait_for_nodes(timeout=120)  # the cluster's own record: one node alive
    try:
        out = grpo(*iterate_args(run, ray_cluster), env=THREADS, check=False, cwd=dirs["elsewhere"], timeout=300)
    finally:
        with starting_nodes():  # as the fixture started it
            add_worker_node(ray_cluster)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 1 and errors == ["error: cluster: 1 CPUs, but cluster.rollout_workers (2) x cluster.rollout_cpus "
                                              "(0.5) plus a score task's cluster.score_cpus (0.5) need 1.5"], out.stderr[-2000:]
    assert not list(run.glob("iter-*/*/part-*.parquet")) and "Traceback" not in out.stderr

    release = tmp_path / "release"
    proc = stalled_iterate(run, ray_cluster, dirs, [spec for spec, _ in REMOVALS], release)
    try:
        for n, (spec, holding) in enumerate(REMOVALS):
            held_at(proc, release, n, holding, spec)
            if spec == "rollout:0":
                assert not list(run.glob("iter-0000/rollout/part-*.parquet"))
            ray_cluster.remove_node(worker_node(ray_cluster))
            ray_cluster.wait_for_nodes(timeout=120)
            with starting_nodes():
                add_worker_node(ray_cluster)
            Path(f"{release}.{n}").touch()
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
    finally:
        end_run(proc, ray_cluster)
    assert "rollout iteration 0 part" in err and "died" in err and "the part is re-run" in err
    assert "raylet" not in out and "marked dead" not in out.lower()  # Ray's notices of the node's loss: on stderr, off the table
    assert_same_as(run, local_run)


@pytest.mark.slow
def held_first_run(first, ray_cluster, dirs, release, stall: str) -> subprocess.Popen:
    """The first of two runs on the cluster: `grpo iterate` held at `stall` until `release`.0 exists."""
    return subprocess.Popen([sys.executable, "-m", "stages.cli", "iterate", str(first), "--iters", "1", "--executor", "ray",
                             "--address", ray_cluster.address], cwd=dirs["elsewhere"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **THREADS, "GRPO_CLUSTER_STALL": stall, "GRPO_CLUSTER_STALL_RELEASE": str(release)})


@pytest.mark.ray_cluster
def test_a_second_run_on_the_same_cluster_says_what_it_waits_for_and_stops_at_place_timeout_s(assets, dirs, ray_cluster, tmp_path):
    """Two runs sharing the two one-CPU nodes: the first holds its warm actors (0.5 CPU on each node) from
    its first iteration to its last, so the second's actors and a score task fit in the nodes' totals but
    not in what is free. The second says so in one line, what it waits for and what is free, and stops at
    cluster.place_timeout_s with one line, writing nothing (it no longer waits start_timeout_s for Ray to
    place its actors, silently); the first finishes. Ray's own notices stay off both runs' stdout."""
    import re

    from stages.report import IterationTable

    first, second = new_run(tmp_path, assets, dirs, "first"), new_run(tmp_path, assets, dirs, "second", place_timeout_s=2)
    release = tmp_path / "release"
    proc = held_first_run(first, ray_cluster, dirs, release, "driver-rollout:0")
    try:
        held_at(proc, release, 0, 1, "the first run, its actors placed")
        out = grpo(*iterate_args(second, ray_cluster), env=THREADS, check=False, cwd=dirs["elsewhere"], timeout=300)
        Path(f"{release}.0").touch()
        first_out, first_err = proc.communicate(timeout=900)
        assert proc.returncode == 0, first_err[-3000:]
    finally:
        end_run(proc, ray_cluster)
    node, free = r"node [0-9a-f]{8}", r"node [0-9a-f]{8} 0\.5 CPU, node [0-9a-f]{8} 0\.5 CPU"
    waits = (r"cluster: waiting for room: other work on the cluster \(another run\?\) holds what this run's 2 rollout workers "
             rf"\(0\.5 CPUs each\) and a score task \(0\.5 CPUs\) need; free now: {free} \(of {node} 1 CPU, {node} 1 CPU\)")
    lines = [line for line in out.stderr.splitlines() if line.startswith(("cluster: waiting", "error: "))]
    assert out.returncode == 1 and len(lines) == 2, out.stderr[-3000:]
    assert re.fullmatch(waits + r"; waiting up to 2 s \(cluster\.place_timeout_s\)", lines[0]), lines[0]
    assert re.fullmatch("error: " + waits + r", for 2 s \(cluster\.place_timeout_s\); once it is done, the same `grpo iterate` "
                        r"command resumes the run from the parts written", lines[1]), lines[1]
    assert "Traceback" not in out.stderr and not list(second.glob("iter-*/*/part-*.parquet"))
    assert out.stdout.splitlines() == [IterationTable.HEAD]  # the table's head, then nothing: no Ray line on stdout
    assert "raylet" not in first_out and "marked dead" not in first_out.lower()
    assert (first / "iter-0000/update/MANIFEST.json").exists()


@pytest.mark.slow
@pytest.mark.ray_cluster
def test_two_runs_at_once_both_finish_when_a_score_task_needs_a_node_the_other_run_half_holds(assets, dirs, ray_cluster, tmp_path):
    """Two runs on the two one-CPU nodes at once: the first's one actor (0.5 CPU) stays on its node for
    its whole run (held before its score stage); the second's actor (0.5) and score task (a whole CPU)
    fit beside it. The second's score task can only go to the node the first run does not touch: where
    Ray put the second's own actor there, the stage stops that idle actor (counting what is free now,
    not the nodes' totals, by which the other node "had room"), scores, and the run finishes; then
    the first finishes too. Ray's own lines stay off both runs' stdout."""
    first = new_run(tmp_path, assets, dirs, "first", rollout_workers=1)
    second = new_run(tmp_path, assets, dirs, "second", rollout_workers=1, score_cpus=1.0, place_timeout_s=60)
    release = tmp_path / "release"
    proc = held_first_run(first, ray_cluster, dirs, release, "driver-score:0")
    try:
        held_at(proc, release, 0, 1, "the first run, its actor placed and idle")
        out = grpo("iterate", str(second), "--iters", "1", "--executor", "ray", "--address", ray_cluster.address, env=THREADS,
                   check=False, cwd=dirs["elsewhere"], timeout=600)
        Path(f"{release}.0").touch()
        first_out, first_err = proc.communicate(timeout=900)
    finally:
        end_run(proc, ray_cluster)
    assert out.returncode == 0, out.stderr[-3000:]
    assert proc.returncode == 0, first_err[-3000:]
    for run in (first, second):
        assert (run / "iter-0000/update/MANIFEST.json").exists()
        assert grpo("audit", str(run), check=False).returncode == 0
    for stdout, stderr in ((out.stdout, out.stderr), (first_out, first_err)):
        assert "Traceback" not in stderr and "raylet" not in stdout and "marked dead" not in stdout.lower()


# where the second node goes for good (issue 54 case 2): a GRPO_CLUSTER_STALL point. One rollout actor of
# the whole CPU of a node, score tasks of one CPU: whichever node holds the actor, the head alone then has no
# room for a score task beside it. "logprobs" is the point after iteration 0's logprobs, before its update
# (both in the driver: what the node's loss there can touch is the idle actor).
LOST = {"rollout": "rollout:0", "score": "score:0", "logprobs": "driver-update:0"}


@pytest.mark.slow
@pytest.mark.ray_cluster
@pytest.mark.parametrize("stage", sorted(LOST))
def test_a_node_lost_for_good_at_each_stage_ends_with_the_local_runs_bytes(stage, assets, dirs, ray_cluster, local_run, tmp_path):
    """Two one-CPU nodes; the worker node is killed (its daemons and workers) while the run is at `stage` of
    iteration 0 and never comes back: the run finishes on the head alone, an idle actor stopped to
    make room for the score tasks and started again for the next rollout, and writes the local run's
    bytes (issue 54: iteration 2's score stage waited in silence)."""
    run = new_run(tmp_path, assets, dirs, rollout_workers=1, rollout_cpus=1.0, score_cpus=1.0, place_timeout_s=60)
    release = tmp_path / "release"
    proc = stalled_iterate(run, ray_cluster, dirs, [LOST[stage]], release)
    try:
        held_at(proc, release, 0, 1, LOST[stage])
        lose_node(ray_cluster, worker_node(ray_cluster))
        Path(f"{release}.0").touch()
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
    finally:
        end_run(proc, ray_cluster)
    assert "is stopped to make room" in err, err[-3000:]
    assert_same_as(run, local_run)


@pytest.mark.slow
@pytest.mark.ray_cluster
def test_the_update_on_two_ray_placed_processes_agrees_with_the_local_one(assets, dirs, ray_cluster, local_run, tmp_path):
    """cluster.update_workers 2: iteration 0's update runs as two `grpo update` ranks that Ray places
    (gloo between the two nodes), and gives the single process's policy within the tolerance of
    tests/test_multiprocess_update.py; rollout and score stay the local run's bytes."""
    from safetensors.torch import load_file

    from test_multiprocess_update import WEIGHT_ATOL

    run = new_run(tmp_path, assets, dirs, update_workers=2, update_cpus=0.5)
    out = grpo("iterate", str(run), "--iters", "1", "--executor", "ray", "--address", ray_cluster.address, env=THREADS,
               cwd=dirs["elsewhere"])
    assert "update iteration 0: 2 processes in " in out.stderr, out.stderr[-3000:]
    for stage in ("rollout", "score"):
        assert manifest(run, 0, stage)["outputs"] == manifest(local_run, 0, stage)["outputs"]
    mine, ref = manifest(run, 0, "update"), manifest(local_run, 0, "update")
    assert (mine["world_size"], ref["world_size"]) == (2, 1)
    assert mine["optimizer_steps"] == ref["optimizer_steps"] and mine["rows"] == ref["rows"]
    w = {k: load_file(r / "policy" / f"iter-{k:04d}" / "model.safetensors") for k, r in ((0, local_run), (1, run))}
    w_ref = load_file(local_run / "policy" / "iter-0001" / "model.safetensors")
    assert w[1].keys() == w_ref.keys()
    assert max(float((w[1][n] - w_ref[n]).abs().max()) for n in w_ref) <= WEIGHT_ATOL
    assert max(float((w_ref[n] - w[0][n]).abs().max()) for n in w_ref) > 10 * WEIGHT_ATOL  # the update moved them
    audit = grpo("audit", str(run), check=False)
    assert audit.returncode == 0, audit.stdout


HOLDER = """import sys, time
from pipeline.cluster.executor import driver_record
from pipeline.store import IN_FLIGHT
from pipeline.run.run import Run
Run(sys.argv[1]).store.write_json(IN_FLIGHT, {"stage": "rollout", "iteration": 0, "in_flight": {"1": "abcd1234"}, "queued": 2,
                                              "waiting": "score iteration 0: 1 x 1 CPU fit on no node alive", "driver": driver_record()})
print("written", flush=True)
time.sleep(600)
"""


def test_status_knows_a_dead_driver(assets, dirs, tmp_path):
    """A Ray driver's in-flight record names its pid, host and start time: while that process runs,
    `grpo status` shows the parts in flight; once it is SIGKILLed (the record stays behind), it says
    the driver is gone and shows nothing in flight; a driver on another host is said to be unknown."""
    run = new_run(tmp_path, assets, dirs)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        assert holder.stdout.readline().strip() == "written"
        alive = grpo("status", str(run))
        assert ("Ray: rollout iteration 0, in flight: node abcd1234 parts 1; 2 queued; waiting: score iteration 0: 1 x 1 CPU fit on "
                "no node alive") in alive.stdout and "gone" not in alive.stdout
        record = json.loads(grpo("status", str(run), "--format", "json").stdout)["cluster"]["driver"]
        assert record["pid"] == holder.pid and record["alive"] is True
    finally:
        holder.kill()
        holder.wait()
    dead = grpo("status", str(run))
    assert (f"Ray: the driver of this run (pid {holder.pid} on {record['host']}) is gone; nothing is in flight (last seen: "
            "rollout iteration 0); the same `grpo iterate` command resumes the run") in dead.stdout
    assert "in flight: node" not in dead.stdout
    assert json.loads(grpo("status", str(run), "--format", "json").stdout)["cluster"]["driver"]["alive"] is False
    in_flight = run / ".cluster" / "in_flight.json"
    body = json.loads(in_flight.read_text())
    in_flight.write_text(json.dumps({**body, "driver": {**body["driver"], "pid": os.getpid()}}))  # a live pid, not the driver's start
    assert "is gone" in grpo("status", str(run)).stdout
    in_flight.write_text(json.dumps({**body, "driver": {**body["driver"], "host": "node-elsewhere"}}))
    other = grpo("status", str(run))
    assert "Ray: the driver runs on another host (node-elsewhere, pid " in other.stdout and "is unknown here" in other.stdout
    assert "in flight: node abcd1234 parts 1" in other.stdout


def test_an_unreachable_cluster_is_one_line_before_any_work(assets, dirs, tmp_path):
    run = new_run(tmp_path, assets, dirs)
    out = grpo("iterate", str(run), "--iters", "1", "--executor", "ray", "--address", "127.0.0.1:9", check=False, timeout=300)
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]] and "cluster.address 127.0.0.1:9: no Ray cluster answers there" in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not (run / "iter-0000").exists()


# ------------------------------------------------------------------ decisions, without a cluster


def cluster_cfg(**kw):
    from pipeline.config.cluster import ClusterConfig

    return ClusterConfig(executor="ray", **kw)


def test_placement_is_checked_per_node_not_on_the_clusters_totals():
    """Two one-CPU nodes hold 2 CPUs, enough for two actors of 0.6 and a score task of 0.6 by the
    totals (1.8); spread one a node, each node keeps 0.4: no score task could ever be placed (the
    silent wait of issue 43 case 4). 0.5 each leaves 0.5 a node: it fits."""
    from pipeline.cluster.placement import spread_problem

    nodes = {"a" * 16: {"CPU": 1.0, "GPU": 0.0}, "b" * 16: {"CPU": 1.0, "GPU": 0.0}}
    line = spread_problem(nodes, cluster_cfg(rollout_workers=2, rollout_cpus=0.6, score_cpus=0.6))
    assert line == ("cluster: with the 2 warm rollout workers placed (0.6 CPUs each), no node has the 0.6 CPUs of a score "
                    "task (cluster.score_cpus) left (CPUs left: node aaaaaaaa 0.4, node bbbbbbbb 0.4); lower "
                    "cluster.rollout_cpus or score_cpus, or add a node")
    assert spread_problem(nodes, cluster_cfg(rollout_workers=2, rollout_cpus=0.5, score_cpus=0.5)) is None
    assert "rollout worker 3 of 3" in spread_problem(nodes, cluster_cfg(rollout_workers=3, rollout_cpus=0.6, score_cpus=0.1))
    gpu = {"a" * 16: {"CPU": 8.0, "GPU": 1.0}}
    assert "fits on no node" in spread_problem(gpu, cluster_cfg(rollout_workers=2, rollout_gpus=1.0))
    # a feasible placement is found whatever the nodes' ids: a head of 0 CPUs, a node of 2 and one of 1, a 1-CPU actor and
    # a 2-CPU score task (the actor on the 1-CPU node). It was refused when the 2-CPU node's id sorted first (a rerun
    # after a node was lost and another joined: "no node has the 2 CPUs of a score task left")
    one = cluster_cfg(rollout_workers=1, rollout_cpus=1.0, score_cpus=2.0)
    for ids in (("a", "b", "c"), ("a", "c", "b"), ("c", "b", "a")):
        mixed = {ids[0] * 16: {"CPU": 0.0, "GPU": 0.0}, ids[1] * 16: {"CPU": 2.0, "GPU": 0.0}, ids[2] * 16: {"CPU": 1.0, "GPU": 0.0}}
        assert spread_problem(mixed, one) is None, ids
    assert "no node has the 2 CPUs" in spread_problem({"b" * 16: {"CPU": 2.0, "GPU": 0.0}, "c" * 16: {"CPU": 0.5, "GPU": 0.0}}, one)


def test_the_room_check_counts_what_is_free_not_the_nodes_totals():
    """Another run's warm actors hold half of each one-CPU node: the totals hold this run (2 actors of 0.5
    and a score task of 0.5), what is free does not, and the line says what the run waits for; all free,
    it fits. A unit all in use is absent from Ray's per-node view (0), a dead node's record is no room."""
    from pipeline.cluster.placement import alive_nodes, free_nodes, held_elsewhere

    a, b, dead = "a" * 16, "b" * 16, "c" * 16
    ray_nodes = [{"NodeID": a, "Alive": True, "Resources": {"CPU": 1.0}}, {"NodeID": b, "Alive": True, "Resources": {"CPU": 1.0}},
                 {"NodeID": dead, "Alive": False, "Resources": {"CPU": 4.0}}]
    cc = cluster_cfg(rollout_workers=2, rollout_cpus=0.5, score_cpus=0.5)
    totals = alive_nodes(ray_nodes)
    assert held_elsewhere(free_nodes(ray_nodes, {a: {"CPU": 1.0}, b: {"CPU": 1.0}}), totals, cc) is None
    half = free_nodes(ray_nodes, {a: {"CPU": 0.5}, b: {"CPU": 0.5}, dead: {"CPU": 4.0}})
    assert half == {a: {"CPU": 0.5, "GPU": 0.0}, b: {"CPU": 0.5, "GPU": 0.0}}
    assert held_elsewhere(half, totals, cc) == (
        "cluster: waiting for room: other work on the cluster (another run?) holds what this run's 2 rollout workers (0.5 CPUs "
        "each) and a score task (0.5 CPUs) need; free now: node aaaaaaaa 0.5 CPU, node bbbbbbbb 0.5 CPU (of node aaaaaaaa "
        "1 CPU, node bbbbbbbb 1 CPU)")
    assert free_nodes(ray_nodes, {a: {"CPU": 1.0}})[b] == {"CPU": 0.0, "GPU": 0.0}
    assert held_elsewhere(free_nodes(ray_nodes, {a: {"CPU": 1.0}}), totals, cc) is not None  # 2 actors and a task in 1 CPU: no


def test_a_lost_node_makes_the_score_and_update_stages_stop_idle_actors_instead_of_waiting_for_ever():
    """The head's one CPU held by its warm actor (rollout_cpus 1), the other node gone: the actor on
    the head is stopped so that a score task fits; with room left, nothing is stopped; two update
    processes of 0.5 CPU stop both 0.5-CPU actors of a one-CPU node; work no node can hold even
    with every actor stopped is None (the stage then waits cluster.place_timeout_s, and stops)."""
    from pipeline.cluster.placement import actors_to_stop

    head, other = "h" * 16, "o" * 16
    cc = cluster_cfg(rollout_workers=2, rollout_cpus=1.0, score_cpus=1.0)
    task = [{"CPU": 1.0}]
    assert actors_to_stop({head: {"CPU": 1.0, "GPU": 0.0}}, {head: 1}, cc, task) == [head]
    assert actors_to_stop({head: {"CPU": 2.0, "GPU": 0.0}}, {head: 1}, cc, task) == []
    assert actors_to_stop({head: {"CPU": 0.5, "GPU": 0.0}}, {head: 1}, cc, task) is None  # no node could take one
    half = cluster_cfg(rollout_workers=2, rollout_cpus=0.5, update_workers=2, update_cpus=0.5)
    update = [{"CPU": 0.5}] * 2
    assert actors_to_stop({head: {"CPU": 1.0, "GPU": 0.0}}, {head: 2}, half, update) == [head, head]
    # the freed room goes where most is left: one actor stopped on the node with 0.5 CPU free already
    nodes = {head: {"CPU": 1.0, "GPU": 0.0}, other: {"CPU": 1.5, "GPU": 0.0}}
    assert actors_to_stop(nodes, {head: 2, other: 2}, half, update) == [other]
    assert actors_to_stop({head: {"CPU": 1.0, "GPU": 0.0}}, {head: 1}, half, [{"CPU": 0.5}] * 3) is None


def test_the_score_stage_counts_what_is_free_now_and_its_own_idle_actors():
    """Another run's actor holds half of node a for its whole run; this run's idle actor holds half of
    b; a score task wants a whole CPU. Counted on the totals less this run's actors (as before), node a
    has room: nothing is stopped, and the task waits for the other run's actor until start_timeout_s
    + part_timeout_s. Counted on what is free plus this run's own, only b can hold it: this run's actor
    there is stopped. Where the other run holds b's other half too, stopping is no help, and the line
    says what the stage waits for (the totals hold it); work no node could hold says that."""
    from pipeline.cluster.placement import actors_to_stop, room_for

    a, b = "a" * 16, "b" * 16
    cc = cluster_cfg(rollout_workers=1, rollout_cpus=0.5, score_cpus=1.0)
    nodes = {a: {"CPU": 1.0, "GPU": 0.0}, b: {"CPU": 1.0, "GPU": 0.0}}
    task = [{"CPU": 1.0}]
    assert actors_to_stop(nodes, {b: 1}, cc, task) == []  # the old count: "it fits" (on a, which the other run holds)
    assert room_for({a: {"CPU": 0.5}, b: {"CPU": 0.5}}, nodes, {b: 1}, cc, task) == [b]
    assert room_for({a: {"CPU": 1.0}, b: {"CPU": 0.5}}, nodes, {b: 1}, cc, task) == []  # a is free: nothing stopped
    assert room_for({a: {"CPU": 0.5}, b: {"CPU": 0.0}}, nodes, {b: 1}, cc, task) == (
        "cluster: waiting for room: other work on the cluster (another run?) holds what 1 x 1 CPU need beside this run's idle "
        "rollout workers; free now: node aaaaaaaa 0.5 CPU, node bbbbbbbb 0 CPU (of node aaaaaaaa 1 CPU, node bbbbbbbb 1 CPU)")
    assert room_for({a: {"CPU": 0.5}}, {a: {"CPU": 0.5, "GPU": 0.0}}, {}, cc, task).endswith("even with every idle rollout worker stopped")


def test_work_that_fits_nowhere_stops_the_run_within_place_timeout_s(tmp_path):
    """pool.Room: the first look that finds no room says so in the log and in `grpo status`'s record;
    once cluster.place_timeout_s has passed with still no room, one line says what cannot be placed
    and how to resume; room found again clears the record. (The pool is a stand-in here: what it
    would find on a cluster is actors_to_stop's, tested above.)"""
    from pipeline.cluster.pool import Room
    from pipeline.errors import GRPOError

    class Pool:
        cc = cluster_cfg(place_timeout_s=0.2)
        problem: str | None = "score iteration 3: 1 x 1 CPU fit on no node alive (node hhhhhhhh 0.5 CPU), even with every idle rollout worker stopped"
        lines: list = []

        def make_room(self, bundles, what, free_now=False):
            return self.problem

        def log(self, line):
            self.lines.append(line)

    shown = []
    pool = Pool()
    room = Room(pool, [{"CPU": 1.0}], "score iteration 3", shown.append)
    room.check()
    assert shown == [pool.problem] and pool.lines == [pool.problem + "; waiting up to 0.2 s (cluster.place_timeout_s) for a node with room"]
    pool.problem = None
    room.check()
    assert shown[-1] is None and room.since is None
    pool.problem = shown[0]
    room.check()
    time.sleep(0.25)
    with pytest.raises(GRPOError) as err:
        room.check()
    assert str(err.value) == (shown[0] + " for 0.2 s (cluster.place_timeout_s); add a node with room: the same `grpo iterate` "
                              "command resumes the run from the parts written")


def test_each_start_and_each_part_has_its_own_deadline():
    """cluster.part_timeout_s bounds a part, cluster.start_timeout_s a start (issue 43 case 9: a part
    longer than the start timeout failed, and so did every rerun)."""
    from pipeline.cluster.placement import Deadlines

    now = [100.0]
    d = Deadlines(clock=lambda: now[0])
    d.start("actor", 600.0, "start")
    d.start("part", 3600.0, "part 3")
    assert d.wait_s() == 600.0 and d.overdue() is None
    d.done("actor")
    now[0] += 700.0  # past the start timeout: the part is still within its own
    assert d.overdue() is None and d.wait_s() == 2900.0
    now[0] += 2900.0
    assert d.overdue() == "part 3"
    assert cluster_cfg().part_timeout_s == 3600.0 and cluster_cfg().start_timeout_s == 600.0


def test_secrets_are_never_in_the_runtime_env_and_a_jobs_runtime_env_is_merged_not_clashed():
    """Case 5: names such as HF_TOKEN stay out of runtime_env (Ray logs it on every node); case 6:
    under `ray job submit` the job's runtime_env names the same variable, and Ray's own merge (the
    one ray.init runs) refused the driver's: the job's value is left to the job."""
    from ray.runtime_env.runtime_env import _merge_runtime_env

    from pipeline.cluster.executor import init_kwargs
    from pipeline.cluster.secrets import redact, runtime_env, secrets_left_out

    env = {"HF_TOKEN": "hf_marker123", "HF_HOME": "/h", "GRPO_JUDGE_API_KEY": "sk-marker", "GRPO_CACHE_DIR": "/c",
           "GRPO_FAULT": "x", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", "PATH": "/bin"}
    assert runtime_env(env) == {"env_vars": {"HF_HOME": "/h", "GRPO_CACHE_DIR": "/c", "VLLM_CPU_KVCACHE_SPACE": "1",
                                             "TOKENIZERS_PARALLELISM": "false"}}
    assert secrets_left_out(env) == ["GRPO_JUDGE_API_KEY", "HF_TOKEN"]
    job = {"runtime_env": {"env_vars": {"GRPO_CACHE_DIR": "/c", "A": "1"}, "working_dir": "/w"}}
    in_job = {**env, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)}
    ours = runtime_env(in_job)
    assert ours == {"env_vars": {"HF_HOME": "/h", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}}
    merged = _merge_runtime_env(job["runtime_env"], ours)
    assert merged == {"working_dir": "/w", "env_vars": {"GRPO_CACHE_DIR": "/c", "A": "1", "HF_HOME": "/h",
                                                        "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}}
    assert _merge_runtime_env(job["runtime_env"], {"env_vars": {"GRPO_CACHE_DIR": "/c"}}) is None  # what the driver sent before
    assert redact("refused {'HF_TOKEN': 'hf_marker123'}", env) == "refused {'HF_TOKEN': '***'}"
    # a variable a served reward's URL references is a secret whatever its name: checked on each node, never sent
    from types import SimpleNamespace

    from pipeline.cluster.secrets import key_names, url_secrets
    from pipeline.config.errors import reward_spec

    cfg = SimpleNamespace(rewards=[reward_spec({"fn": "openrlhf_server", "kwargs": {
        "url": "http://127.0.0.1:5000/get_reward?sv=${GRPO_RM_SV}&sig=${GRPO_RM_SIG}", "api_key_env": "GRPO_RM_KEY"}}, 0),
        reward_spec({"fn": "judge", "kwargs": {"base_url": "http://${GRPO_JUDGE_USER}:${GRPO_JUDGE_PW}@127.0.0.1:8000/v1",
                                               "model": "m", "rubric": "{completion}"}}, 1)],
        # and a data URL's, a data.eval set's and cluster.address's (issue 64): each node that reads them has its own
        data=SimpleNamespace(train="https://h/t.jsonl?sig=${GRPO_DATA_SIG}"), cluster=SimpleNamespace(address="ray://${GRPO_RAY_USER}:${GRPO_RAY_PW}@h:10001"),
        eval_sets=lambda: [SimpleNamespace(path="s3://b/e.jsonl"), SimpleNamespace(path="https://h/e.jsonl?X-Amz-Signature=${GRPO_EVAL_SIG}")])
    assert key_names(cfg) == ["GRPO_RM_KEY", "GRPO_RM_SV", "GRPO_RM_SIG", "GRPO_JUDGE_USER", "GRPO_JUDGE_PW"]
    signed = {**env, "GRPO_RM_SIG": "sig-marker", "GRPO_RM_SV": "2020", "GRPO_JUDGE_USER": "me", "GRPO_DATA_SIG": "d-marker",
              "GRPO_RAY_USER": "me", "GRPO_EVAL_SIG": "e-marker"}
    assert not {"GRPO_RM_SIG", "GRPO_RM_SV", "GRPO_JUDGE_USER", "GRPO_DATA_SIG", "GRPO_RAY_USER", "GRPO_EVAL_SIG"} & set(
        runtime_env(signed, url_secrets(cfg))["env_vars"])
    assert {"GRPO_DATA_SIG", "GRPO_RAY_USER", "GRPO_EVAL_SIG"} <= set(runtime_env(signed)["env_vars"])  # names that say nothing
    assert "GRPO_RM_SIG" in runtime_env(signed)["env_vars"]  # what the driver sent before: a name that says nothing
    # without an address: a Ray instance of the run's own, not whatever cluster this machine runs (case 12)
    assert init_kwargs(None)["address"] == "local" and init_kwargs("10.0.0.1:6379")["address"] == "10.0.0.1:6379"


def test_a_cluster_address_reads_its_secret_from_the_environment_and_says_it_by_name(monkeypatch):
    """cluster.address's `${NAME}` is expanded where the driver joins (an unset one named in one line), and the
    lines that name the address say it as written; a password in RAY_ADDRESS is said redacted."""
    import socket

    from pipeline.cluster.executor import connect
    from pipeline.errors import GRPOError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("GRPO_RAY_HEAD", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(GRPOError, match=r"^cluster.address: the environment variable GRPO_RAY_HEAD is not set"):
        connect(cluster_cfg(address="${GRPO_RAY_HEAD}"), None)
    monkeypatch.setenv("GRPO_RAY_HEAD", f"127.0.0.1:{port}")
    with pytest.raises(GRPOError) as info:
        connect(cluster_cfg(address="${GRPO_RAY_HEAD}"), None)
    assert str(info.value).startswith("cluster.address ${GRPO_RAY_HEAD}: no Ray cluster answers there")


@pytest.mark.slow
def test_a_password_in_ray_address_is_said_redacted(monkeypatch):
    """RAY_ADDRESS (the environment's, not stored) with a password: Ray's client gives up on a port nothing
    listens on after about 30 s, and the line says the address redacted."""
    from pipeline.cluster.executor import connect
    from pipeline.errors import GRPOError

    monkeypatch.setenv("RAY_ADDRESS", "ray://me:pw-marker@127.0.0.1:1")
    with pytest.raises(GRPOError) as info:
        connect(cluster_cfg(), None)
    assert str(info.value).startswith("cluster.address ray://me:***@127.0.0.1:1: no Ray cluster answers there")


def test_the_drivers_gpu_is_reserved_on_a_gpu_cluster():
    """Case 12: with rollout actors on GPUs and Ray GPUs on the driver's node, one is held for the
    driver (else the first actor there gets the GPU the driver trains on); a CPU cluster, or a driver
    on a node without Ray GPUs, reserves nothing."""
    from pipeline.cluster.placement import reserve_driver_gpu

    assert reserve_driver_gpu(8.0, cluster_cfg(rollout_workers=15, rollout_gpus=1.0))
    assert reserve_driver_gpu(1.0, cluster_cfg(update_workers=2, update_gpus=1.0))
    assert not reserve_driver_gpu(0.0, cluster_cfg(rollout_gpus=1.0))
    assert not reserve_driver_gpu(2.0, cluster_cfg())  # a CPU run on a machine with GPUs
