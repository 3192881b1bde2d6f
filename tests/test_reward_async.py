"""TRL 1.16's reward contract beyond prompts and completions (trainer_state, log_metric,
log_extra) and async reward functions against a real HTTP judge on 127.0.0.1: concurrency seen
by the server, retries of a flaky judge, one-line errors for a hanging or broken one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from judge_server import Judge
from pipeline.config.errors import reward_spec
from pipeline.errors import GRPOError
from pipeline.rewards.calls import RewardLog, TrainerState
from pipeline.rewards.contract import compute_rewards

FIXTURES = Path(__file__).parent / "fixtures" / "rewards"


@pytest.fixture(scope="module")
def judge():
    server = Judge(delay=0.8, failures=2, lifetime=120.0).start()  # 0.8 s: calls that may overlap surely do
    yield server
    server.stop()


@pytest.fixture
def judged(judge, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    import judge_rewards

    monkeypatch.setattr(judge_rewards, "JUDGE", judge.url)
    monkeypatch.delenv("GRPO_TEST_JUDGE", raising=False)
    judge.reset()
    return judge


def score(specs, completions, log=None, state=None, iteration=0):
    specs = [reward_spec(s, j) for j, s in enumerate(specs)]
    return compute_rewards(specs, ["p"] * len(completions), completions, [[1]] * len(completions), {},
                           iteration=iteration, trainer_state=state, log=log)


def error_of(*args, **kwargs) -> str:
    with pytest.raises(GRPOError) as info:
        score(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


TEXTS = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "g" * 7, "h" * 8]


# -- trainer_state, log_metric, log_extra ---------------------------------------------------

def test_trainer_state_log_metric_and_log_extra_reach_the_function(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("contract.py").write_text(
        "def curriculum(completions, trainer_state, **kwargs):\n"
        "    return [float(trainer_state.global_step) / trainer_state.max_steps] * len(completions)\n"
        "def logs(completions, log_metric, log_extra, **kwargs):\n"
        "    lengths = [len(c) for c in completions]\n"
        "    log_metric('judge/mean_length', sum(lengths) / len(lengths))\n"
        "    log_metric('judge/mean_length', 10.0)\n"
        "    log_extra('verdict', ['long' if n > 2 else 'short' for n in lengths])\n"
        "    log_extra('length', lengths)\n"
        "    return [0.0] * len(completions)\n"
    )
    log = RewardLog(4)
    rewards = score([{"fn": "contract.py:curriculum"}, {"fn": "contract.py:logs"}], ["a", "bb", "ccc", "dddd"], log=log,
                    state=TrainerState(global_step=3, epoch=0.75, max_steps=12))
    np.testing.assert_allclose(rewards[:, 0], [0.25] * 4)  # 3 / 12
    # two calls to log_metric in one batch: [sum, count] = [(1+2+3+4)/4 + 10, 2] = [12.5, 2]
    assert log.metric_sums() == {"judge/mean_length": [12.5, 2]}
    assert log.extra == {"verdict": ["short", "short", "long", "long"], "length": [1, 2, 3, 4]}


def test_a_bad_log_call_is_a_one_line_error_naming_the_function(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("bad.py").write_text(
        "def short(completions, log_extra, **kwargs):\n    log_extra('x', [1])\n    return [0.0] * len(completions)\n"
        "def nan(completions, log_metric, **kwargs):\n    log_metric('m', float('nan'))\n    return [0.0] * len(completions)\n"
    )
    assert error_of([{"fn": "bad.py:short"}], ["a", "b"], iteration=2) == (
        "reward 'short' (iteration 2): log_extra('x', ...) got 1 values for 2 completions"
    )
    assert error_of([{"fn": "bad.py:nan"}], ["a"]) == "reward 'nan' (iteration 0): log_metric('m', nan): expected a name and a finite number"


# -- async functions against the judge -----------------------------------------------------

def test_rows_of_an_async_function_are_judged_concurrently_up_to_max_concurrency(judged):
    spec = {"fn": "judge_rewards:slow", "rows_per_call": 1, "max_concurrency": 4}
    rewards = score([spec], TEXTS)
    np.testing.assert_array_equal(rewards[:, 0], [1, 2, 3, 4, 5, 6, 7, 8])  # each row's own verdict, in row order
    assert judged.max_in_flight == 4  # 8 calls of 0.8 s, 4 at a time: never more, and overlapping
    judged.reset()
    score([{**spec, "max_concurrency": 1}], TEXTS[:3])
    assert judged.max_in_flight == 1  # serial: what the bound is compared with


def test_several_async_functions_run_at_the_same_time(judged):
    specs = [{"fn": "judge_rewards:slow", "rows_per_call": 1, "max_concurrency": 2},
             {"fn": "judge_rewards:slow_too", "rows_per_call": 1, "max_concurrency": 2}, {"fn": "format"}]
    rewards = score(specs, TEXTS[:4])
    np.testing.assert_array_equal(rewards[:, :2], [[1, 1], [2, 2], [3, 3], [4, 4]])
    assert judged.max_in_flight == 4  # both functions' calls in flight together: 2 + 2


def test_a_whole_batch_call_is_one_call_as_in_trl(judged):
    rewards = score([{"fn": "judge_rewards:slow", "max_concurrency": 8}], TEXTS[:3])
    np.testing.assert_array_equal(rewards[:, 0], [1, 2, 3])
    assert judged.max_in_flight == 1  # the function itself asks row after row


def test_a_flaky_judge_is_retried_to_success(judged):
    rewards = score([{"fn": "judge_rewards:flaky", "rows_per_call": 1, "retries": 2}], TEXTS[:3])
    np.testing.assert_array_equal(rewards[:, 0], [1, 2, 3])
    assert [judged.requests[("flaky", t)] for t in TEXTS[:3]] == [3, 3, 3]  # two 503s, then the answer


def test_a_flaky_judge_with_too_few_retries_names_the_row(judged):
    message = error_of([{"fn": "judge_rewards:flaky", "rows_per_call": 1, "retries": 1, "max_concurrency": 1}], TEXTS[:2], iteration=5)
    assert message == "reward 'flaky' (iteration 5) row 0: raised ConnectionError: judge answered 503 for /flaky (2 attempts)"


def test_a_hanging_judge_is_stopped_at_its_timeout(judged):
    message = error_of([{"fn": "judge_rewards:hang", "timeout_s": 0.3, "retries": 1}], TEXTS[:2], iteration=3)
    assert message == "reward 'hang' (iteration 3) rows 0-1: timed out after 0.3 s (2 attempts)"
    assert judged.requests[("hang", "a")] == 2


def test_a_broken_judge_and_a_wrong_answer_are_one_line_errors(judged):
    assert error_of([{"fn": "judge_rewards:broken", "retries": 0}], TEXTS[:2]) == (
        "reward 'broken' (iteration 0) rows 0-1: raised ConnectionError: judge answered 500 for /broken (1 attempts)"
    )
    assert error_of([{"fn": "judge_rewards:wrong_type", "rows_per_call": 1}], TEXTS[:2]) == (
        "reward 'wrong_type' (iteration 0) row 0: returned 'high', expected a number or None"
    )
    assert error_of([{"fn": "judge_rewards:picky", "rows_per_call": 2}], TEXTS[:4]) == (
        "reward 'picky' (iteration 0) row 3: returned 'high', expected a number or None"  # the batch's row, not the slice's
    )
