"""verl's reward contract (pipeline/rewards/verl.py): verl's own gsm8k and math_dapo scorers
(tests/fixtures/verl/, copied unchanged) score through grpo's reward path as calling them directly,
with ground_truth from the `reward_model` column; a dict's "score" is the reward and its other numeric
keys are logged (booleans as 0/1); init refuses data without the columns the function asks for."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import base_config
from pipeline import config as config_mod
from pipeline.errors import GRPOError

FIXTURES = Path(__file__).parent / "fixtures" / "verl"
TEXTS = ["so the answer is #### 72", "#### 10", "The answer is \\boxed{72}", "Answer: 72", "Answer: 9"]
TRUTHS = ["72", "72", "72", "72", "72"]


def _spec(fn, kwargs=None):
    from pydantic import TypeAdapter

    from pipeline.config.rewards import RewardSpec

    return TypeAdapter(RewardSpec).validate_python({"fn": fn, "contract": "verl", "kwargs": kwargs or {}})


def score(s, columns):
    from pipeline.rewards.calls import RewardLog
    from pipeline.rewards.contract import compute_rewards

    log = RewardLog(len(TEXTS))
    out = compute_rewards([s], ["q"] * len(TEXTS), TEXTS, None, columns, iteration=0, log=log)
    return out[:, 0].tolist(), log


COLUMNS = {"reward_model": [{"ground_truth": t, "style": "rule"} for t in TRUTHS], "data_source": ["openai/gsm8k"] * len(TEXTS)}


def test_verls_gsm8k_scorer_scores_as_calling_it_directly_and_kwargs_are_its_reward_kwargs():
    from pipeline.rewards.contract import resolve

    fn = resolve(f"{FIXTURES / 'gsm8k.py'}:compute_score")
    got, _ = score(_spec(f"{FIXTURES / 'gsm8k.py'}:compute_score"), COLUMNS)
    assert got == [float(fn(t, g)) for t, g in zip(TEXTS, TRUTHS)] and got[0] == 1.0 and got[1] == 0.0
    got, _ = score(_spec(f"{FIXTURES / 'gsm8k.py'}:compute_score", {"method": "flexible", "format_score": 0.1}), COLUMNS)
    assert got == [float(fn(t, g, method="flexible", format_score=0.1)) for t, g in zip(TEXTS, TRUTHS)]


def test_math_dapos_dict_gives_its_score_as_reward_and_logs_acc_as_0_or_1_but_not_pred():
    from pipeline.rewards.contract import resolve

    fn = resolve(f"{FIXTURES / 'math_dapo.py'}:compute_score")
    got, log = score(_spec(f"{FIXTURES / 'math_dapo.py'}:compute_score"), COLUMNS)
    direct = [fn(t, g) for t, g in zip(TEXTS, TRUTHS)]
    assert got == [d["score"] for d in direct] and 1.0 in got and -1.0 in got
    assert log.extra["acc"] == [float(d["acc"]) for d in direct]
    assert "pred" not in log.extra


DOCUMENTED = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.endswith(ground_truth)), "src": data_source, "split": (extra_info or {}).get("split")}
'''


def test_the_documented_custom_signature_gets_all_four_and_init_checks_the_columns(assets, tmp_path, monkeypatch):
    from pipeline import preflight

    f = tmp_path / "custom.py"
    f.write_text(DOCUMENTED)
    got, log = score(_spec(f"{f}:compute_score"), {**COLUMNS, "extra_info": [{"split": "train"}] * len(TEXTS)})
    assert got == [1.0, 0.0, 0.0, 1.0, 0.0] and "src" not in log.extra
    monkeypatch.chdir(tmp_path)
    cfg = config_mod.resolve(base_config(assets, rewards=[{"fn": "custom.py:compute_score", "contract": "verl"}]))
    with pytest.raises(GRPOError, match=r"rewards\[0\]: data.train .* has no column 'reward_model'"):
        preflight.check(cfg, judges_reachable=False)
    with pytest.raises(GRPOError, match=r"returned a dict without 'score'"):
        (tmp_path / "noscore.py").write_text("def compute_score(solution_str, ground_truth):\n    return {'acc': 1}\n")
        score(_spec(f"{tmp_path / 'noscore.py'}:compute_score"), COLUMNS)


def test_correct_reads_a_dotted_column_path_and_init_checks_it_against_the_parquet_struct(assets, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline import preflight
    from pipeline.rewards.builtins import _column

    assert _column(COLUMNS, "reward_model.ground_truth", "answer_column") == TRUTHS
    with pytest.raises(GRPOError, match=r"column 'reward_model' has no field 'gold'"):
        _column(COLUMNS, "reward_model.gold", "answer_column")
    data = tmp_path / "verl.parquet"
    pq.write_table(pa.table({"prompt": ["2+2?"], "reward_model": [{"ground_truth": "4", "style": "rule"}]}), data)
    ok = config_mod.resolve(base_config(assets, rewards=[{"fn": "correct", "kwargs": {"answer_column": "reward_model.ground_truth"}}]))
    ok = ok.model_copy(update={"data": ok.data.model_copy(update={"train": str(data), "eval": str(data)})})
    preflight.check(ok, judges_reachable=False)
    bad = config_mod.resolve(base_config(assets, rewards=[{"fn": "correct", "kwargs": {"answer_column": "reward_model.gold"}}]))
    bad = bad.model_copy(update={"data": bad.data.model_copy(update={"train": str(data)})})
    with pytest.raises(GRPOError, match=r"kwargs.answer_column: data.train .* has no column 'reward_model.gold': 'reward_model' has no field 'gold' \(fields: ground_truth, style\)"):
        preflight.check(bad, judges_reachable=False)


def test_the_example_verl_reward_scores_as_calling_it_directly():
    from conftest import REPO
    from pipeline.rewards.contract import resolve

    target = f"{REPO / 'examples' / 'verl_reward.py'}:compute_score"
    fn = resolve(target)
    got, log = score(_spec(target), COLUMNS)
    direct = [fn("openai/gsm8k", t, g) for t, g in zip(TEXTS, TRUTHS)]
    assert got == [d["score"] for d in direct] and log.extra["acc"] == [float(d["acc"]) for d in direct]
