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


def _spec(fn, kwargs=None, name=None):
    from pydantic import TypeAdapter

    from pipeline.config.rewards import RewardSpec

    return TypeAdapter(RewardSpec).validate_python({"fn": fn, "contract": "verl", "kwargs": kwargs or {}, "name": name})


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


def test_two_rewards_logging_one_name_keep_both_columns():
    """math_dapo and a second verl scorer both return `acc`: the first keeps `acc`, the second's goes to
    `<its reward column>_acc`. Was: one column, the second reward's values over the first's."""
    from pipeline.rewards.calls import RewardLog
    from pipeline.rewards.contract import compute_rewards, resolve

    dapo = f"{FIXTURES / 'math_dapo.py'}:compute_score"
    second = _spec(f"{FIXTURES.parent.parent.parent / 'examples' / 'verl_reward.py'}:compute_score", name="mine")
    log = RewardLog(len(TEXTS))
    compute_rewards([_spec(dapo), second], ["q"] * len(TEXTS), TEXTS, None, COLUMNS, iteration=0, log=log)
    direct = [resolve(dapo)(t, g) for t, g in zip(TEXTS, TRUTHS)]
    assert log.extra["acc"] == [float(d["acc"]) for d in direct]
    mine = [float(resolve(second.fn)("openai/gsm8k", t, g)["acc"]) for t, g in zip(TEXTS, TRUTHS)]
    assert log.extra["mine_acc"] == mine and mine != log.extra["acc"]


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
    # a null struct (a Parquet row without one) holds no answer, as a null in a plain column: None, not an error
    assert _column({"reward_model": [{"ground_truth": "4"}, None]}, "reward_model.ground_truth", "answer_column") == ["4", None]
    from pipeline.rewards.builtins import correct

    assert correct(["q", "q"], ["<answer>4</answer>"] * 2, reward_model=[{"ground_truth": "4"}, None],
                   answer_column="reward_model.ground_truth") == [1.0, None]
    data = tmp_path / "verl.parquet"
    pq.write_table(pa.table({"prompt": ["2+2?"], "reward_model": [{"ground_truth": "4", "style": "rule"}]}), data)
    ok = config_mod.resolve(base_config(assets, rewards=[{"fn": "correct", "kwargs": {"answer_column": "reward_model.ground_truth"}}]))
    ok = ok.model_copy(update={"data": ok.data.model_copy(update={"train": str(data)})})
    preflight.check(ok, judges_reachable=False)
    bad = config_mod.resolve(base_config(assets, rewards=[{"fn": "correct", "kwargs": {"answer_column": "reward_model.gold"}}]))
    bad = bad.model_copy(update={"data": bad.data.model_copy(update={"train": str(data)})})
    with pytest.raises(GRPOError, match=r"kwargs.answer_column: data.train .* has no column 'reward_model.gold' \(fields: ground_truth, style\)"):
        preflight.check(bad, judges_reachable=False)


def test_the_example_verl_reward_scores_as_calling_it_directly():
    from conftest import REPO
    from pipeline.rewards.contract import resolve

    target = f"{REPO / 'examples' / 'verl_reward.py'}:compute_score"
    fn = resolve(target)
    got, log = score(_spec(target), COLUMNS)
    direct = [fn("openai/gsm8k", t, g) for t, g in zip(TEXTS, TRUTHS)]
    assert got == [d["score"] for d in direct] and log.extra["acc"] == [float(d["acc"]) for d in direct]


AS_VERL = '''import asyncio


def reads_info(data_source, solution_str, ground_truth, extra_info=None):
    extra_info["seen"] = True  # verl's managers add to it too: the row's own dict must not change
    return float(extra_info.get("split", "none") == "train")


def kwargs_win(data_source, solution_str, ground_truth, extra_info=None):
    return float(ground_truth == "10" and solution_str.endswith(ground_truth))


async def awaited(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return float(solution_str.endswith(str(ground_truth)))

'''


def test_verl_is_called_as_its_reward_managers_call_it(tmp_path):
    """verl passes extra_info as a dict ({} when the data has none: `extra_info.get(...)` works), its
    reward_kwargs win over the four names (_call_with_kwargs), and its reward loop awaits an async
    compute_score: each failed after a whole rollout here."""
    f = tmp_path / "as_verl.py"
    f.write_text(AS_VERL)
    got, _ = score(_spec(f"{f}:reads_info"), COLUMNS)
    assert got == [0.0] * len(TEXTS)
    info = [{"split": "train"}, {"split": "test"}, None, {"split": "train"}, {}]
    columns = {**COLUMNS, "extra_info": info}
    got, _ = score(_spec(f"{f}:reads_info"), columns)
    assert got == [1.0, 0.0, 0.0, 1.0, 0.0] and columns["extra_info"] == [{"split": "train"}, {"split": "test"}, None, {"split": "train"}, {}]
    got, _ = score(_spec(f"{f}:kwargs_win", {"ground_truth": "10"}), COLUMNS)
    assert got == [0.0, 1.0, 0.0, 0.0, 0.0]
    got, _ = score(_spec(f"{f}:awaited"), COLUMNS)
    assert got == [1.0, 0.0, 0.0, 1.0, 0.0]


def test_solution_str_of_a_tool_episode_is_its_final_assistant_message():
    """Every message joined without a separator made "#### 7" and a tool's "2" read as "#### 72" to
    verl's gsm8k scorer, in an episode whose answer is 9."""
    from pipeline.rewards.calls import RewardLog
    from pipeline.rewards.contract import compute_rewards

    right = [{"role": "assistant", "content": "calc(8*9)"}, {"role": "tool", "content": "72"},
             {"role": "assistant", "content": "so #### 72"}]
    wrong = [{"role": "assistant", "content": "checking #### 7"}, {"role": "tool", "content": "2"},
             {"role": "assistant", "content": "The answer is 9"}]
    chat = [[{"role": "user", "content": "8*9?"}]] * 2
    out = compute_rewards([_spec(f"{FIXTURES / 'gsm8k.py'}:compute_score")], chat, [right, wrong], None,
                          {"reward_model": [{"ground_truth": "72"}] * 2}, iteration=0, log=RewardLog(2))
    assert out[:, 0].tolist() == [1.0, 0.0]


NUMPY = '''import numpy as np
import torch


def compute_score(solution_str, ground_truth):
    ok = np.array([solution_str.endswith(ground_truth)])[0]  # np.bool_, as a scorer comparing arrays returns
    return {"score": torch.tensor(float(ok)), "acc": ok, "hits": np.int64(ok), "t": torch.tensor(True)}
'''


def test_numpy_and_torch_scalars_are_numbers_and_their_booleans_log_as_0_or_1(tmp_path):
    f = tmp_path / "np_score.py"
    f.write_text(NUMPY)
    got, log = score(_spec(f"{f}:compute_score"), COLUMNS)
    want = [1.0, 0.0, 0.0, 1.0, 0.0]
    assert got == want and log.extra["acc"] == want and log.extra["hits"] == want and log.extra["t"] == [1.0] * 5


def test_init_refuses_a_verl_function_the_stages_could_not_call(assets, tmp_path, monkeypatch):
    """A misspelt reward_kwargs option or an argument verl never passes failed only in the score stage."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline import preflight

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "verl.parquet"
    pq.write_table(pa.table({"prompt": ["2+2?"], "data_source": ["x"], "reward_model": [{"ground_truth": "4"}]}), data)
    (tmp_path / "f.py").write_text("def compute_score(solution_str, ground_truth, method='strict'):\n    return 1.0\n"
                                   "def needs(solution_str, ground_truth, tokenizer):\n    return 1.0\n")

    def check(fn, kwargs):
        cfg = config_mod.resolve(base_config(assets, rewards=[{"fn": fn, "contract": "verl", "kwargs": kwargs}]))
        preflight.check(cfg.model_copy(update={"data": cfg.data.model_copy(update={"train": str(data)})}), judges_reachable=False)

    check("f.py:compute_score", {"method": "flexible"})
    check("f.py:needs", {"tokenizer": "t"})
    with pytest.raises(GRPOError, match=r"rewards\[0\].fn 'f.py:compute_score': cannot be called as verl calls it, .*'methd'"):
        check("f.py:compute_score", {"methd": "flexible"})
    with pytest.raises(GRPOError, match=r"rewards\[0\].fn 'f.py:needs': cannot be called as verl calls it, .*'tokenizer'"):
        check("f.py:needs", {})
