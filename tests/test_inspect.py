"""`grpo inspect`, `grpo status` and the diagnostics.

A run with hand-written parts checks the tables against hand-derived numbers (no engines);
a real run whose reward never varies checks that `status` names the zero-spread iterations.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import base_config, grpo

from pipeline.report.diagnostics import Finding, diagnose
from pipeline.report.inspect import history, inspect_iteration, prompt_text, stage_metrics
from pipeline.run.run import Run
from pipeline.store import part_name, stage_rel
from schemas.manifests import FileEntry, PartsManifest
from schemas.artifacts import ROLLOUT, SCORE

# -- a run with hand-written parts -------------------------------------------------------------
# Two groups of G=3, rewards correct (weight 1) and format (weight 0.5):
#   group 0, prompt 10: correct [1, 0, 0], format [1, 1, 1]      -> reward [1.5, 0.5, 0.5]
#       mean 5/6, deviations [2/3, -1/3, -1/3], sample var (4/9 + 1/9 + 1/9) / 2 = 1/3,
#       std 0.57735 -> advantages [1.1547, -0.57735, -0.57735]
#   group 1, prompt 20: correct [None, 0, 0], format [0.5, 0.5, 0.5] -> reward [0.25] * 3 (nansum)
#       zero spread, advantages 0
ADV = [2 / 3 / math.sqrt(1 / 3), -1 / 3 / math.sqrt(1 / 3), -1 / 3 / math.sqrt(1 / 3), 0.0, 0.0, 0.0]
REWARD = [1.5, 0.5, 0.5, 0.25, 0.25, 0.25]
LENGTHS = [4, 6, 8, 10, 12, 14]  # the last one truncated


def _write_stage(run: Run, k: int, stage: str, schema, table: pa.Table) -> None:
    info = run.store.write_table(f"{stage_rel(k, stage)}/{part_name(0)}", table, schema)
    run.store.write_manifest(stage_rel(k, stage), PartsManifest(
        stage=stage, iteration=k, schema_version=schema.version, config_hash=run.cfg_hash, seed=0, input_hash="constructed",
        inputs={}, outputs={part_name(0): FileEntry(**info.as_dict())}, rows=table.num_rows,
        timings={"seconds": 2.0}, stats={"tokens": sum(LENGTHS), "generate_s": 0.5},
    ))


def constructed_run(make_run, **data_columns) -> Run:
    """`data_columns`: dataset columns the rollout carries from each prompt's row."""
    run = Run(make_run("constructed", rollout={"num_generations": 3}))
    chat = json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}])
    prompt_ids, sample_idx = [10, 10, 10, 20, 20, 20], [0, 1, 2, 0, 1, 2]
    rollout = pa.table({
        "prompt_id": prompt_ids, "sample_idx": sample_idx, "group_idx": [0, 0, 0, 1, 1, 1],
        "prompt": ["<rendered>"] * 6, "prompt_raw": [chat] * 3 + [json.dumps("Say hi")] * 3,
        "prompt_ids": [[1, 2]] * 6, "completion": [f"c{i}" for i in range(6)],
        "completion_ids": [[5] * n for n in LENGTHS], "sampler_logprobs": [[-0.1] * n for n in LENGTHS],
        "finish_reason": ["stop"] * 5 + ["length"], "truncated": [False] * 5 + [True],
        "completion_length": LENGTHS, "policy_hash": ["p0"] * 6, "completion_mask": [None] * 6, "episode": [None] * 6,
        **data_columns,
    })
    group_std = [math.sqrt(1 / 3)] * 3 + [0.0] * 3
    score = pa.table({
        "prompt_id": prompt_ids, "sample_idx": sample_idx, "group_idx": [0, 0, 0, 1, 1, 1],
        "reward": REWARD, "advantage": pa.array(ADV, pa.float32()), "group_mean": [5 / 6] * 3 + [0.25] * 3,
        "group_std": group_std, "zero_std": [False] * 3 + [True] * 3, "train": [True] * 6,
        "reward_correct": pa.array([1.0, 0.0, 0.0, None, 0.0, 0.0], pa.float64()),
        "reward_format": [1.0, 1.0, 1.0, 0.5, 0.5, 0.5],
    })
    _write_stage(run, 0, "rollout", ROLLOUT, rollout)
    _write_stage(run, 0, "score", SCORE, score)
    return run


def test_inspect_iteration_best_worst_and_zero_spread(make_run):
    rep = inspect_iteration(constructed_run(make_run), 0, top=2)
    assert (rep["completions"], rep["groups"]) == (6, 2)
    # best: 1.5 first; the two 0.5s tie on reward and advantage, prompt/sample order breaks it
    assert [(r["prompt_id"], r["sample_idx"]) for r in rep["best"]] == [(10, 0), (10, 1)]
    assert rep["best"][0]["reward"] == 1.5
    assert rep["best"][0]["advantage"] == pytest.approx(1.1547005, abs=1e-6)
    assert rep["best"][0]["rewards"] == {"correct": 1.0, "format": 1.0}
    assert rep["best"][0]["prompt"] == "What is 2+2?"  # the last user message, not the rendered text
    assert [(r["prompt_id"], r["sample_idx"]) for r in rep["worst"]] == [(20, 0), (20, 1)]
    assert rep["worst"][0]["rewards"]["correct"] is None
    assert rep["worst"][0]["prompt"] == "Say hi"
    assert rep["frac_reward_zero_std"] == 0.5
    assert rep["zero_std_groups"] == [{"group_idx": 1, "prompt_id": 20, "prompt": "Say hi", "reward": 0.25}]
    # correct: [1, 0, 0, 0, 0] without the null -> 0.2; format: (3 * 1 + 3 * 0.5) / 6 = 0.75
    assert rep["rewards"]["correct"]["mean"] == pytest.approx(0.2)
    assert rep["rewards"]["correct"]["null"] == 1
    assert rep["rewards"]["format"]["mean"] == pytest.approx(0.75)
    assert rep["reward"]["mean"] == pytest.approx(3.25 / 6)


def test_stage_metrics_of_constructed_parts(make_run):
    run = constructed_run(make_run)
    roll = stage_metrics(run, 0, "rollout")
    assert roll["completions/mean_length"] == 9.0  # (4+6+8+10+12+14) / 6
    assert roll["completions/mean_terminated_length"] == 8.0  # the truncated 14 left out
    assert roll["completions/clipped_ratio"] == pytest.approx(1 / 6)
    assert (roll["completions/min_length"], roll["completions/max_length"]) == (4.0, 14.0)
    assert roll["tokens_per_s/rollout"] == 54 / 0.5  # stats.tokens / stats.generate_s
    assert roll["time/rollout_s"] == 2.0
    score = stage_metrics(run, 0, "score")
    assert score["reward/mean"] == pytest.approx(3.25 / 6)
    assert score["reward/std"] == pytest.approx(math.sqrt(1 / 3) / 2)  # mean of the group stds [0.577, 0]
    assert score["frac_reward_zero_std"] == 0.5
    assert score["rewards/correct/frac_null"] == pytest.approx(1 / 6)
    assert score["rewards/format/mean"] == pytest.approx(0.75)
    rows = history(run)
    assert rows[0]["done"] == ["rollout", "score"]
    assert rows[0]["seconds"] == 4.0  # two stages of 2 s
    assert stage_metrics(run, 0, "update") == {}


def test_a_kept_history_reads_a_done_stage_once_and_again_when_its_manifest_changes(make_run, monkeypatch):
    """`grpo iterate` reads the history after every update (its diagnostics): kept, each done stage's parts
    are read once for its manifest, so an iteration's cost does not grow with the iterations before it; a
    stage written anew (another manifest) is read again, and an unkept history always reads."""
    import pipeline.report.inspect as inspect_mod

    run = constructed_run(make_run)
    reads = []
    real = inspect_mod.read_columns
    monkeypatch.setattr(inspect_mod, "read_columns", lambda *a, **kw: reads.append(a[1:3]) or real(*a, **kw))
    first = history(run, kept=True)
    assert len(reads) == 2 and history(run, kept=True) == first and len(reads) == 2
    assert history(run) == first and len(reads) == 4
    m = run.manifest(0, "score")
    run.store.write_manifest(stage_rel(0, "score"), m.model_copy(update={"timings": {"seconds": 3.0}}))
    again = history(run, kept=True)
    assert reads[-1] == (0, "score") and len(reads) == 5 and again[0]["time/score_s"] == 3.0


def test_prompt_text_of_string_and_chat_prompts():
    assert prompt_text(json.dumps("plain")) == "plain"
    msgs = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "second"}]
    assert prompt_text(json.dumps(msgs)) == "second"


def test_inspect_and_status_commands_on_constructed_run(make_run):
    run = constructed_run(make_run)
    out = json.loads(grpo("inspect", run.uri, "--iter", "0", "--top", "1", "--format", "json").stdout)
    assert [(r["prompt_id"], r["sample_idx"]) for r in out["best"]] == [(10, 0)]
    assert out["zero_std_groups"][0]["prompt_id"] == 20
    table = grpo("inspect", run.uri, "--top", "1").stdout  # default: the newest scored iteration
    assert "reward per function" in table and "groups with zero spread" in table and "What is 2+2?" in table
    status = json.loads(grpo("status", run.uri, "--format", "json").stdout)
    assert status["iterations"][0]["stages"]["score"] == {"rows": 6, "seconds": 2.0}
    assert status["iterations"][0]["stages"]["update"] is None
    assert status["warnings"] == []  # half the groups have spread: below "most"
    bad = grpo("inspect", run.uri, "--iter", "3", check=False)
    assert bad.returncode == 1 and "iteration 3: score is not done" in bad.stderr


def test_inspect_shows_a_dataset_column_or_a_dotted_path_into_it(make_run):
    """verl's data: `--column reward_model.ground_truth` shows the gold beside each completion."""
    verl = [{"ground_truth": "gold-4", "style": "rule"}] * 3 + [{"ground_truth": "gold-hi", "style": "rule"}] * 3
    run = constructed_run(make_run, reward_model=verl, data_source=["gsm8k"] * 6)
    out = json.loads(grpo("inspect", run.uri, "--top", "1", "--column", "reward_model.ground_truth", "--column", "data_source",
                          "--column", "reward_model", "--format", "json").stdout)
    assert out["shown"] == ["reward_model.ground_truth", "data_source", "reward_model"]
    assert out["best"][0]["columns"] == {"reward_model.ground_truth": "gold-4", "data_source": "gsm8k", "reward_model": verl[0]}
    assert out["worst"][0]["columns"]["reward_model.ground_truth"] == "gold-hi"
    table = grpo("inspect", run.uri, "--top", "1", "--column", "reward_model.ground_truth").stdout
    assert "gold-4" in table and "gold-hi" in table  # the best one's gold, the worst one's
    bad = grpo("inspect", run.uri, "--column", "reward_model.gold", check=False)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].endswith(
        "--column 'reward_model.gold': row 0: column 'reward_model' has no field 'gold' (fields: ground_truth, style)")
    bad = grpo("inspect", run.uri, "--column", "answer.text", check=False)
    assert bad.returncode == 1 and "--column 'answer': " in bad.stderr and \
        "part-00000.parquet has no such dataset column (dataset columns: reward_model, data_source)" in bad.stderr


# -- diagnostics on hand-made histories -------------------------------------------------------------
def test_diagnose_names_iteration_and_metric():
    rows = [
        {"iteration": 0, "frac_reward_zero_std": 0.5, "kl/mean": 0.01, "completions/clipped_ratio": 0.1,
         "completions/mean_length": 20.0, "rewards/fmt/frac_null": 0.0},
        # zero-std 0.9 >= 0.8; fmt null everywhere; 60% truncated; KL 0.015 < 2 x 0.01 and under the floor
        {"iteration": 1, "frac_reward_zero_std": 0.9, "kl/mean": 0.015, "completions/clipped_ratio": 0.6,
         "completions/mean_length": 30.0, "rewards/fmt/frac_null": 1.0},
        # KL 0.05 > 2 x 0.015 and >= 0.02; length 12 < 0.5 x 30 (the longest earlier mean)
        {"iteration": 2, "frac_reward_zero_std": float("nan"), "kl/mean": 0.05, "completions/mean_length": 12.0},
    ]
    found = diagnose(rows)
    assert [(f.iteration, f.metric) for f in found] == [
        (1, "frac_reward_zero_std"), (1, "rewards/fmt/frac_null"), (1, "completions/clipped_ratio"),
        (2, "kl/mean"), (2, "completions/mean_length"),
    ]
    assert str(found[0]).startswith("iteration 1: frac_reward_zero_std = 0.9: ")
    assert "no learning signal, check the reward" in str(found[0])
    assert "'fmt'" in found[1].message
    assert found[3].value == 0.05


def test_diagnose_is_quiet_on_a_healthy_history():
    rows = [{"iteration": k, "frac_reward_zero_std": 0.5, "kl/mean": 0.001 * (k + 1), "completions/clipped_ratio": 0.1,
             "completions/mean_length": 20.0 - k} for k in range(5)]
    # KL doubles 0.001 -> 0.002 but stays under the floor; length 16 > 0.5 x 20
    assert diagnose(rows) == []
    assert Finding(3, "kl/mean", 0.5, "m").as_dict()["text"] == "iteration 3: kl/mean = 0.5: m"


# -- a real run with no reward spread -------------------------------------------------------------
@pytest.fixture(scope="module")
def zero_spread_run(assets, tmp_path_factory) -> dict:
    """Two real iterations whose total reward is always 0: `contains` a keyword the tiny model never
    writes, plus a user function that returns None for every completion."""
    from pipeline import config as config_mod
    from pipeline.run.run import init_run

    root = tmp_path_factory.mktemp("zero-spread")
    (root / "never.py").write_text("def never(completions, **kwargs):\n    return [None] * len(completions)\n")
    rewards = [{"fn": "contains", "kwargs": {"keyword": "@@never-written@@"}}, {"fn": f"{root / 'never.py'}:never"}]
    cfg = config_mod.resolve(base_config(assets, rewards=rewards, tracking={"mlflow": True}))
    path = root / "run"
    init_run(str(path), cfg)
    proc = grpo("iterate", str(path), "--iters", "2")
    return {"path": str(path), "iterate": proc}


@pytest.mark.slow
def test_status_warns_about_zero_spread(zero_spread_run):
    out = grpo("status", zero_spread_run["path"]).stdout
    for k in (0, 1):
        assert f"iteration {k}: frac_reward_zero_std = 1: 100% of groups have rewards with no spread" in out
        assert f"iteration {k}: rewards/never/frac_null = 1" in out
    assert "no learning signal, check the reward" in out
    report = json.loads(grpo("status", zero_spread_run["path"], "--format", "json").stdout)
    assert report["completed"] == 2
    assert [(w["iteration"], w["metric"]) for w in report["warnings"]] == [
        (0, "frac_reward_zero_std"), (0, "rewards/never/frac_null"), (1, "frac_reward_zero_std"), (1, "rewards/never/frac_null"),
    ]
    assert [row["reward/mean"] for row in report["iterations"][:2]] == [0.0, 0.0]
    # the same warnings were logged while the run was iterating
    assert "warning: iteration 1: frac_reward_zero_std = 1" in zero_spread_run["iterate"].stderr


@pytest.mark.slow
def test_inspect_zero_spread_run(zero_spread_run):
    path = zero_spread_run["path"]
    rep = json.loads(grpo("inspect", path, "--iter", "1", "--format", "json").stdout)
    assert (rep["completions"], rep["groups"]) == (16, 4)  # 4 prompts x 4 samples
    assert len(rep["zero_std_groups"]) == 4 and rep["frac_reward_zero_std"] == 1.0
    assert rep["rewards"]["never"]["null"] == 16 and rep["rewards"]["contains"]["mean"] == 0.0
    assert all(r["advantage"] == 0.0 and r["reward"] == 0.0 for r in rep["best"] + rep["worst"])
    # every row inspect shows is a row of the iteration's rollout
    run = Run(path)
    m = run.manifest(1, "rollout")
    rollout = pa.concat_tables([pq.read_table(f"{path}/{stage_rel(1, 'rollout')}/{n}") for n in sorted(m.outputs)])
    keys = set(zip(rollout.column("prompt_id").to_pylist(), rollout.column("sample_idx").to_pylist()))
    assert {(r["prompt_id"], r["sample_idx"]) for r in rep["best"] + rep["worst"]} <= keys


@pytest.mark.slow
def test_zero_spread_run_in_embedded_mlflow_store(zero_spread_run):
    from mlflow.tracking import MlflowClient

    path = zero_spread_run["path"]
    info = json.loads(Path(path, "tracking.json").read_text())["runs"]["embedded"]
    assert info["tracking_uri"] == f"sqlite:///{Path(path).resolve()}/mlflow.db"
    client = MlflowClient(info["tracking_uri"])
    hist = client.get_metric_history(info["run_id"], "frac_reward_zero_std")
    assert sorted((m.step, m.value) for m in hist) == [(0, 1.0), (1, 1.0)]
    dest = Path(path).parent / "downloaded"
    dest.mkdir(exist_ok=True)
    found = json.loads(Path(client.download_artifacts(info["run_id"], "diagnostics.json", str(dest))).read_text())
    assert {(f["iteration"], f["metric"]) for f in found} >= {(0, "frac_reward_zero_std"), (1, "frac_reward_zero_std")}
    run = Run(path)
    for k in (0, 1):  # the logged metric is what the score parts hold: every reward 0, every group flat
        parts = [pq.read_table(f"{path}/{stage_rel(k, 'score')}/{n}") for n in sorted(run.manifest(k, "score").outputs)]
        assert np.all(pa.concat_tables(parts).column("reward").to_numpy() == 0.0)
