"""Replay: a new run reuses a past iteration's stored completions (byte copies, linked by
hash) and recomputes score / logprobs / update with new settings; replayed artifacts record
where they came from and pass `grpo audit`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import grpo
from test_reproduce import copy_run, manifest, reference_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replays(assets, tmp_path_factory):
    """Iteration 1 of the reference run replayed twice, differing only in the loss type."""
    ref = reference_run(tmp_path_factory, assets)
    root = tmp_path_factory.mktemp("replays")
    out = grpo("replay", str(ref), "--iter", "1", "--to", str(root / "grpo"))
    assert out.stdout.strip().splitlines()[-1].startswith(f"replay of {ref} iteration 1 -> {root / 'grpo'} iteration 0")
    grpo("replay", str(ref), "--iter", "1", "--to", str(root / "dr_grpo"), "--set", "loss.type=dr_grpo")
    return ref, root / "grpo", root / "dr_grpo"


def audit(run: Path):
    from pipeline.report.audit import audit_run
    from pipeline.run.run import Run

    return audit_run(Run(str(run)))


def content(run: Path, rel: str) -> pa.Table:
    """A stage's rows without the Parquet metadata (whose stamp names the run's config)."""
    tables = [pq.read_table(p) for p in sorted((run / rel).glob("part-*.parquet"))]
    return pa.concat_tables(tables).replace_schema_metadata(None)


def sha(path: Path) -> str:
    from pipeline.store import sha256_bytes

    return sha256_bytes(path.read_bytes())


def test_replay_links_the_rollout_by_hash_and_records_its_source(replays):
    ref, *news = replays
    src = manifest(ref, "iter-0001/rollout")
    for new in news:
        m = manifest(new, "iter-0000/rollout")
        assert m["outputs"] == src["outputs"]
        for name in src["outputs"]:  # the same bytes, stored in the new run
            assert (new / "iter-0000/rollout" / name).read_bytes() == (ref / "iter-0001/rollout" / name).read_bytes()
        link = {"run": str(ref), "iteration": 1, "manifest_sha256": sha(ref / "iter-0001/rollout/MANIFEST.json")}
        assert m["replayed_from"] == {**link, "input_hash": src["input_hash"]}
        assert m["inputs"]["replayed_from"] == link
        # policy 0 of the replay is policy 1 of the source: the update starts from the same weights
        assert manifest(new, "policy/iter-0000")["policy_hash"] == manifest(ref, "policy/iter-0001")["policy_hash"]
        assert m["policy_hash"] == manifest(ref, "policy/iter-0001")["policy_hash"]
        assert f"model: {ref / 'policy/iter-0001'}\n" in (new / "config.yaml").read_text()
        report = audit(new)
        assert report.ok, report.problems
        assert report.iterations == 1


def test_loss_types_are_compared_on_identical_data(replays):
    from pipeline.report.compare import compare_runs
    from pipeline.run.run import Run

    ref, plain, dr = replays
    # identical inputs to both updates: completions, rewards/advantages and old logprobs
    for stage in ("rollout", "score", "logprobs"):
        assert content(plain, f"iter-0000/{stage}").equals(content(dr, f"iter-0000/{stage}")), stage
        assert content(plain, f"iter-0000/{stage}").equals(content(ref, f"iter-0001/{stage}")), stage
    result = compare_runs(Run(str(plain)), Run(str(dr)))
    assert result.config == 'config.yaml: differs at loss.type ("grpo" vs "dr_grpo")'
    assert result.compared == 3  # policy 0 and both rollout parts agree byte for byte
    # and the loss type made the difference in the weights
    assert manifest(plain, "policy/iter-0001")["policy_hash"] != manifest(dr, "policy/iter-0001")["policy_hash"]
    assert manifest(dr, "iter-0000/update")["inputs"]["rollout"] == sha(dr / "iter-0000/rollout/MANIFEST.json")


def test_rescore_old_completions_with_another_reward(replays, tmp_path):
    from pipeline.loop.replay import replay

    ref, *_ = replays
    new = tmp_path / "rescored"
    replay(str(ref), 0, str(new), ["rewards=[{fn: format}]"], until="score")
    score = content(new, "iter-0000/score")
    assert [c for c in score.column_names if c.startswith("reward_")] == ["reward_format"]
    assert score.column("reward_format").equals(content(ref, "iter-0000/score").column("reward_format"))
    assert not (new / "iter-0000/logprobs").exists() and not (new / "policy/iter-0001").exists()
    assert manifest(new, "iter-0000/rollout")["outputs"] == manifest(ref, "iter-0000/rollout")["outputs"]
    assert audit(new).ok

    # the same command again resumes: nothing is redone
    before = {p: p.stat().st_mtime_ns for p in new.rglob("*") if p.is_file()}
    replay(str(ref), 0, str(new), ["rewards=[{fn: format}]"], until="score")
    assert {p: p.stat().st_mtime_ns for p in new.rglob("*") if p.is_file()} == before


def test_kl_in_a_replay_is_measured_against_the_source_reference(replays, tmp_path):
    """Through the command line, as users replay: the logprob pass then runs in a fresh process as the
    source run's did, where in this worker an earlier test's torch state made it 1e-6 off (CI, 2026-12-01)."""
    from pipeline.run.run import Run

    ref, *_ = replays
    grpo("replay", str(ref), "--iter", "1", "--to", str(tmp_path / "kl"), "--set", "loss.kl_coef=0.05", "--until", "logprobs")
    new = Run(str(tmp_path / "kl"))
    assert new.cfg.ref_model == str(ref / "policy/iter-0000")
    lp = content(tmp_path / "kl", "iter-0000/logprobs")
    old, ref_lp = lp.column("old_logprobs").to_pylist(), lp.column("ref_logprobs").to_pylist()
    assert all(r is not None and len(r) == len(o) for o, r in zip(old, ref_lp))
    assert old != ref_lp  # policy 1 against the initial policy
    assert lp.column("old_logprobs").equals(content(ref, "iter-0001/logprobs").column("old_logprobs"))
    assert audit(tmp_path / "kl").ok
    assert Run(str(tmp_path / "kl")).completed_iters() == 0


def test_audit_follows_the_link_while_the_source_exists(replays, tmp_path):
    from pipeline.loop.replay import replay

    ref, *_ = replays
    src = copy_run(ref, tmp_path / "src")
    new = tmp_path / "new"
    replay(str(src), 1, str(new), None, until="score")
    assert audit(new).ok
    body = json.loads((src / "iter-0001/rollout/MANIFEST.json").read_text())
    body["timings"]["seconds"] += 1
    (src / "iter-0001/rollout/MANIFEST.json").write_text(json.dumps(body))
    report = audit(new)
    assert report.problems == [
        f"iter-0000/rollout/MANIFEST.json: replayed_from: {src}/iter-0001/rollout/MANIFEST.json has changed since the replay"
    ]
    shutil.rmtree(src)  # the replay holds its own copy: without the source it still verifies
    assert audit(new).ok


@pytest.mark.parametrize(
    "k, sets, until, message",
    [
        (1, ["rollout.temperature=0.5"], "update",
         "--set rollout.temperature: replay reuses the completions {ref} sampled with this setting; it cannot change"),
        (1, ["data.train=other.jsonl"], "update",
         "--set data.train: replay reuses the completions {ref} sampled with this setting; it cannot change"),
        (1, ["loss.bogus=1"], "update", "replay --set: loss.bogus: unknown key"),
        (5, None, "update", "{ref}/iter-0005/rollout: no manifest; --iter 5 must be an iteration whose rollout is done"),
        (1, None, "everything", "--until 'everything': expected one of score, logprobs, update"),
    ],
)
def test_replay_refuses_with_one_line_and_writes_nothing(replays, tmp_path, k, sets, until, message):
    from pipeline.errors import GRPOError
    from pipeline.loop.replay import replay

    ref, *_ = replays
    with pytest.raises(GRPOError) as err:
        replay(str(ref), k, str(tmp_path / "new"), sets, until=until)
    assert str(err.value) == message.format(ref=ref)
    assert not (tmp_path / "new").exists()


def test_replay_never_overwrites(replays, tmp_path):
    from pipeline.errors import GRPOError
    from pipeline.loop.replay import replay

    ref, plain, _ = replays
    with pytest.raises(GRPOError, match="the replay needs a new run directory, not the source run"):
        replay(str(ref), 1, str(ref), None)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(GRPOError, match="directory exists and is not empty; choose a new run directory"):
        replay(str(ref), 1, str(mine), None)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"
    before = (plain / "config.yaml").read_text()
    with pytest.raises(GRPOError, match="a run with a different config already exists"):
        replay(str(ref), 1, str(plain), ["loss.type=dapo"])
    assert (plain / "config.yaml").read_text() == before


def test_an_openrlhf_reward_func_rescores_real_completions_as_calling_it_directly(replays, tmp_path):
    """OpenRLHF's contract on a real run's recorded completions (pipeline/rewards/openrlhf.py): the
    score stage equals calling the file directly with queries = rendered prompt + completion and
    labels = the answer column; a replay of that re-scores it exactly."""
    from conftest import REPO
    from pipeline.loop.replay import replay
    from pipeline.rewards.contract import resolve

    ref, *_ = replays
    fn = f"{REPO}/examples/openrlhf_reward.py:reward_func"
    new = replay(str(ref), 0, str(tmp_path / "orl"), [f"rewards=[{{fn: '{fn}', contract: openrlhf, kwargs: {{label_key: answer}}}}]"], until="score")
    rollout, score = content(ref, "iter-0000/rollout"), content(tmp_path / "orl", "iter-0000/score")
    calls = [resolve(fn)([p + c], [p], [a]) for p, c, a in zip(
        rollout.column("prompt").to_pylist(), rollout.column("completion").to_pylist(), rollout.column("answer").to_pylist())]
    assert score.column("reward_reward_func").to_pylist() == [r["rewards"][0] for r in calls]
    assert score.column("extra_has_answer").to_pylist() == [r["extra_logs"]["has_answer"][0] for r in calls]
    again = replay(str(tmp_path / "orl"), 0, str(tmp_path / "again"), None, until="score")
    assert content(tmp_path / "again", "iter-0000/score").column("reward_reward_func").equals(score.column("reward_reward_func"))
    assert new is not None and again is not None
