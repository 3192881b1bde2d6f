"""Issue 16's "done when": TRL users' reward functions, unchanged, through `grpo score` and
`grpo replay`. Seed 002's two functions (format match, answer check), one reading
trainer_state.global_step, one calling log_metric and log_extra, and an async judge asking a
real HTTP server on 127.0.0.1; the metrics and extra columns land in the score parts, the score
manifest and MLflow; a replay re-scores with the trainer_state the source iteration saw; a
judge that cannot be reached stops `grpo score` with one line and no score part."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import base_config, grpo, write_config
from judge_server import Judge
from pipeline.rewards.answers import extract_gold

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures" / "rewards"


@pytest.fixture(scope="module")
def judge():
    server = Judge(delay=0.05, lifetime=1200.0).start()
    yield server
    server.stop()


def parts(run: Path, rel: str) -> pa.Table:
    tables = [pq.read_table(p) for p in sorted((run / rel).glob("part-*.parquet"))]
    return pa.concat_tables(tables).replace_schema_metadata(None)


def manifest(run: Path, rel: str) -> dict:
    return json.loads((run / rel / "MANIFEST.json").read_text())


def test_trl_reward_functions_through_score_and_replay(assets, tmp_path, judge):
    # the data as the seed's tutorial prepares GSM8K: conversational prompts, the bare answer in `answer`
    rows = [json.loads(line) for line in Path(assets["train"]).read_text().splitlines()[:32]]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}], "answer": extract_gold(r["answer"])}) + "\n" for r in rows
    ))
    seed = FIXTURES / "seed002_rewards.py"
    rewards = [
        {"fn": f"{seed}:match_format_exactly"},
        {"fn": f"{seed}:check_answer"},
        {"fn": f"{seed}:curriculum", "weight": 0.5},
        {"fn": f"{seed}:length_judge", "weight": 0.1},
        {"fn": f"{FIXTURES / 'judge_rewards.py'}:slow", "name": "judge", "weight": 0.01, "rows_per_call": 1,
         "max_concurrency": 4, "timeout_s": 30, "retries": 2},
    ]
    cfg = base_config(assets, data={"train": str(data), "eval": None}, rewards=rewards, tracking={"mlflow": True},
                      rollout={"temperature": 0.3}, train={"mini_batch_size": 8, "lr": 1e-4, "total_iters": 4})
    run, new = tmp_path / "run", tmp_path / "replayed"
    env = {"GRPO_TEST_JUDGE": judge.url}
    grpo("init", str(run), "--config", str(write_config(tmp_path / "config.yaml", cfg)))
    grpo("iterate", str(run), "--iters", "1", env=env)
    grpo("rollout", str(run), "--iter", "1", env=env)

    # an unreachable judge: retried, then one line naming it, the iteration and the row; no part
    bad = grpo("score", str(run), "--iter", "1", check=False, env={"GRPO_TEST_JUDGE": "http://127.0.0.1:9"})
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error: ")]
    assert bad.returncode == 1 and len(errors) == 1, bad.stderr
    assert errors[0].startswith("error: reward 'judge' (iteration 1) row ") and errors[0].endswith("(3 attempts)"), errors[0]
    assert not list((run / "iter-0001" / "score").glob("*.parquet")) and not (run / "iter-0001/score/MANIFEST.json").exists()

    grpo("score", str(run), "--iter", "1", env=env)
    roll, score = parts(run, "iter-0001/rollout"), parts(run, "iter-0001/score")
    texts = roll.column("completion").to_pylist()
    assert score.column("prompt_id").to_pylist() == roll.column("prompt_id").to_pylist()
    chars = [len(t) for t in texts]
    state = manifest(run, "iter-0001/score")["trainer_state"]
    assert state == {"global_step": 1, "epoch": 1 / (32 // 4), "max_steps": 4}
    assert state == manifest(run, "iter-0001/rollout")["trainer_state"]
    # the functions' values, recomputed here from the completions
    assert set(score.column("reward_match_format_exactly").to_pylist()) <= {0.0, 3.0}
    assert set(score.column("reward_check_answer").to_pylist()) <= {0.0, 1.5, 3.0}
    np.testing.assert_allclose(score.column("reward_curriculum").to_numpy(), [1 / 4 * min(1.0, n / 40) for n in chars], atol=1e-12)
    assert score.column("reward_judge").to_pylist() == [float(n) for n in chars]  # the judge answers len(text)
    assert score.column("reward_length_judge").to_pylist() == [1.0 if n <= 30 else 0.0 for n in chars]
    # log_extra: extra columns in the score parts; log_metric: the iteration's mean in the manifest
    assert score.column("extra_verdict").to_pylist() == ["long" if n > 30 else "short" for n in chars]
    assert score.column("extra_chars").to_pylist() == [float(n) for n in chars]
    metrics = manifest(run, "iter-0001/score")["reward_metrics"]
    # two parts of 8 completions each, one call per part: the mean of the calls' means = the mean
    assert metrics == {"length_judge/mean_chars": pytest.approx(np.mean(chars), abs=1e-9)}

    # MLflow: the metric per iteration, the extra columns in the completions table
    from mlflow.tracking import MlflowClient

    info = json.loads((run / "tracking.json").read_text())["runs"]["embedded"]
    client = MlflowClient(tracking_uri=f"sqlite:///{run.resolve()}/mlflow.db")
    history = {m.step: m.value for m in client.get_metric_history(info["run_id"], "length_judge/mean_chars")}
    assert history[1] == pytest.approx(np.mean(chars), abs=1e-6) and 0 in history
    local = client.download_artifacts(info["run_id"], "completions/iter-0001.json", str(tmp_path / "artifacts"))
    table = json.loads(Path(local).read_text())
    assert "verdict" in table["columns"] and "chars" in table["columns"]

    # replay: the same functions on the same completions, with the source iteration's trainer_state
    grpo("replay", str(run), "--iter", "1", "--to", str(new), "--until", "score", env=env)
    assert manifest(new, "iter-0000/score")["trainer_state"] == state
    assert parts(new, "iter-0000/score").equals(score)
    assert manifest(new, "iter-0000/score")["reward_metrics"] == metrics
