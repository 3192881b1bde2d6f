"""Issue 55 end to end: data made by verl's own preprocessing script and reward files copied unchanged
from verl and OpenRLHF (tests/fixtures/, with their source commits) on one real `grpo iterate` run.

- verl's examples/data_preprocess/gsm8k.py, run unchanged on a local copy of gsm8k's layout, writes
  a parquet that `grpo init` takes with the built-ins `correct` (on `reward_model.ground_truth`) and
  `format` and no user code, and `grpo iterate` trains on it (a tiny policy warm-started on those
  prompts: the demo's never saw verl's instruction);
- verl's gsm8k and math_dapo scorers (`contract: verl`) and OpenRLHF's example reward_func
  (`contract: openrlhf`) score that run's recorded completions as calling them directly does;
- `grpo replay` of the score re-scores every deterministic column exactly. OpenRLHF's example draws
  its rewards from torch's global generator (torch.randint), so its values cannot match across two
  processes: the run shows it was called as OpenRLHF calls it (its printed queries, rewards in {0, 1},
  extra_logs per completion), and a replay under a seed the test sets equals calling it directly
  under that seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import base_config, grpo, write_config
from test_replay import audit, content
from test_reproduce import manifest

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures"
PREPROCESS = FIXTURES / "verl" / "preprocess_gsm8k.py"
GSM8K = f"{FIXTURES / 'verl' / 'gsm8k.py'}:compute_score"
MATH_DAPO = f"{FIXTURES / 'verl' / 'math_dapo.py'}:compute_score"
REWARD_FUNC = f"{FIXTURES / 'openrlhf' / 'reward_func.py'}:reward_func"

# The one module verl's script imports besides `datasets` (verl/utils/hdfs_io.py): verl itself cannot
# be installed beside grpo. Local paths only, as verl's own functions treat a non-hdfs path.
HDFS_IO = '''import json
import os
import shutil


def makedirs(name, mode=0o777, exist_ok=False, **kwargs):
    if name.startswith("hdfs://"):
        raise NotImplementedError("no HDFS in the test")
    os.makedirs(name, mode=mode, exist_ok=exist_ok)


def copy(src, dst, **kwargs):
    if src.startswith("hdfs://") or dst.startswith("hdfs://"):
        raise NotImplementedError("no HDFS in the test")
    return shutil.copytree(src, dst) if os.path.isdir(src) else shutil.copy(src, dst)
'''

# openai/gsm8k's layout on the hub: config `main`, its splits as parquet files
GSM8K_CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
"""


def verl_parquet(root: Path) -> Path:
    """train.parquet and test.parquet as verl's own script writes them, from the demo's GSM8K-style
    problems (`question`, `answer` = working then `#### N`, gsm8k's columns)."""
    from demo.task import make_problems

    stub = root / "stub" / "verl" / "utils"
    stub.mkdir(parents=True)
    for init in (root / "stub" / "verl" / "__init__.py", stub / "__init__.py"):
        init.write_text("")
    (stub / "hdfs_io.py").write_text(HDFS_IO)
    src = root / "gsm8k"
    (src / "main").mkdir(parents=True)
    (src / "README.md").write_text(GSM8K_CARD)
    for split, n in (("train", 400), ("test", 4)):
        rows = make_problems(n, 0, "train" if split == "train" else "eval")
        pq.write_table(pa.table({"question": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]}),
                       src / "main" / f"{split}-00000-of-00001.parquet")
    out = root / "verl-data"
    env = {**os.environ, "PYTHONPATH": str(root / "stub"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(root / "hf")}
    subprocess.run([sys.executable, str(PREPROCESS), "--local_dataset_path", str(src), "--local_save_dir", str(out)],
                   cwd=root, env=env, check=True, capture_output=True, timeout=300)
    return out


def verl_policy(root: Path, train: Path) -> Path:
    """A tiny policy warm-started on the prompts verl's script wrote: the demo model never saw verl's
    instruction ('Let's think step by step and output the final answer after "####".') and answers
    it with noise that no reward tells apart."""
    from demo.tinymodel import make_model

    sft = root / "sft"
    sft.mkdir()
    rows = pq.read_table(train).to_pylist()
    (sft / "train.jsonl").write_text("".join(
        json.dumps({"prompt": r["prompt"][0]["content"], "answer": r["extra_info"]["answer"]}) + "\n" for r in rows))
    make_model(root / "model", size="tiny", seed=0, data_dir=sft, sft_steps=40)
    return root / "model"


REWARDS = [
    # the demo's built-in pair (base_config), `correct` on verl's nested ground truth
    {"fn": "correct", "kwargs": {"answer_column": "reward_model.ground_truth"}},
    {"fn": "format", "weight": 0.5},
    # verl's scorers and OpenRLHF's random example are measured, not trained on
    {"fn": GSM8K, "contract": "verl", "name": "gsm8k", "kwargs": {"method": "flexible"}, "weight": 0.0},
    {"fn": MATH_DAPO, "contract": "verl", "name": "math_dapo", "weight": 0.0},
    {"fn": REWARD_FUNC, "contract": "openrlhf", "weight": 0.0},
]


@pytest.fixture(scope="module")
def verl_run(assets, tmp_path_factory):
    """One iteration on verl's parquet with the four rewards; the iterate command's output."""
    root = tmp_path_factory.mktemp("verl-run")
    data = verl_parquet(root)
    cfg = base_config(assets, model=str(verl_policy(root, data / "train.parquet")), rewards=REWARDS,
                      data={"train": str(data / "train.parquet"), "eval": str(data / "test.parquet")},
                      rollout={"prompts_per_iter": 8})
    run = root / "run"
    grpo("init", str(run), "--config", str(write_config(root / "config.yaml", cfg)))
    out = grpo("iterate", str(run), "--iters", "1")
    return run, data, out.stdout


def test_verls_own_preprocessing_makes_a_parquet_that_trains_with_correct_and_no_code(verl_run):
    from pipeline.rewards.builtins import correct

    run, data, _ = verl_run
    train = pq.read_table(data / "train.parquet")
    assert train.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert pa.types.is_struct(train.schema.field("reward_model").type)
    rollout, score = content(run, "iter-0000/rollout"), content(run, "iter-0000/score")
    assert score.num_rows == 32 and rollout.column("reward_model").to_pylist()[0]["style"] == "rule"
    # `correct` on the dotted path equals `correct` on gsm8k's own answer text ("... #### N"), which
    # verl's script keeps in extra_info.answer: the same gold reached by two paths
    completions = [[{"role": "assistant", "content": t}] for t in rollout.column("completion").to_pylist()]
    raw = [e["answer"] for e in rollout.column("extra_info").to_pylist()]
    assert score.column("reward_correct").to_pylist() == correct(None, completions, answer=raw)
    # it trained: the rewards told the samples apart, the update ran and wrote a new policy
    assert any(a != 0.0 for a in score.column("advantage").to_pylist())
    assert manifest(run, "policy/iter-0001")["policy_hash"] != manifest(run, "policy/iter-0000")["policy_hash"]
    assert pq.read_table(run / "iter-0000/update/metrics.parquet").num_rows > 0


def test_verls_scorers_score_the_run_as_calling_them_directly(verl_run):
    from pipeline.rewards.contract import resolve

    run, _, _ = verl_run
    rollout, score = content(run, "iter-0000/rollout"), content(run, "iter-0000/score")
    texts = rollout.column("completion").to_pylist()
    truths = [r["ground_truth"] for r in rollout.column("reward_model").to_pylist()]
    gsm8k, dapo = resolve(GSM8K), resolve(MATH_DAPO)
    assert score.column("reward_gsm8k").to_pylist() == [float(gsm8k(t, g, method="flexible")) for t, g in zip(texts, truths)]
    direct = [dapo(t, g) for t, g in zip(texts, truths)]
    assert score.column("reward_math_dapo").to_pylist() == [d["score"] for d in direct]
    assert score.column("extra_acc").to_pylist() == [float(d["acc"]) for d in direct]  # a bool, logged as 0/1
    assert "extra_pred" not in score.column_names  # a string: not logged


def test_openrlhfs_example_is_called_as_openrlhf_calls_it(verl_run):
    run, _, stdout = verl_run
    rollout, score = content(run, "iter-0000/rollout"), content(run, "iter-0000/score")
    for p, c in zip(rollout.column("prompt").to_pylist(), rollout.column("completion").to_pylist()):
        assert repr([p + c]) in stdout  # it prints its queries: the rendered prompt, then the completion
    rewards = score.column("reward_reward_func").to_pylist()
    assert set(rewards) <= {0.0, 1.0} and score.column("extra_dummy_scores").to_pylist() == rewards


def test_replay_rescores_every_file_exactly(verl_run, tmp_path):
    import torch

    from pipeline.loop.replay import replay
    from pipeline.rewards.contract import resolve

    run, _, _ = verl_run
    torch.manual_seed(55)
    replay(str(run), 0, str(tmp_path / "again"), None, until="score")
    old, new = content(run, "iter-0000/score"), content(tmp_path / "again", "iter-0000/score")
    assert new.column_names == old.column_names and audit(tmp_path / "again").ok
    random = {"reward_reward_func", "extra_dummy_scores"}
    for name in old.column_names:
        if name not in random:
            assert new.column(name).equals(old.column(name)), name
    # OpenRLHF's example under the seed set above: as calling it directly, row by row, under that seed
    rollout = content(run, "iter-0000/rollout")
    fn = resolve(REWARD_FUNC)
    torch.manual_seed(55)
    direct = [fn([p + c], [p], [None])["rewards"].item()
              for p, c in zip(rollout.column("prompt").to_pylist(), rollout.column("completion").to_pylist())]
    assert new.column("reward_reward_func").to_pylist() == direct
    assert new.column("extra_dummy_scores").to_pylist() == direct
