"""OpenRLHF's reward-function file contract (pipeline/rewards/openrlhf.py): its own example file
(tests/fixtures/openrlhf/reward_func.py, copied unchanged) scores as calling it directly does, with
queries = rendered prompt + completion and labels from `kwargs.label_key`; init refuses a label column
the data lacks and a function OpenRLHF could not call."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import base_config
from pipeline import config as config_mod
from pipeline.errors import GRPOError

FIXTURE = Path(__file__).parent / "fixtures" / "openrlhf" / "reward_func.py"
RENDERED = ["<|user|>2+2?<|assistant|>", "<|user|>3+3?<|assistant|>"]
TEXTS = ["<answer>4</answer>", "<answer>5</answer>"]


def _spec(fn, kwargs):
    from pydantic import TypeAdapter

    from pipeline.config.rewards import RewardSpec

    return TypeAdapter(RewardSpec).validate_python({"fn": fn, "contract": "openrlhf", "kwargs": kwargs})


def score(s, columns):
    from pipeline.rewards.calls import RewardLog
    from pipeline.rewards.contract import compute_rewards

    log = RewardLog(len(TEXTS))
    out = compute_rewards([s], ["2+2?", "3+3?"], TEXTS, None, columns, iteration=0, log=log, rendered=RENDERED)
    return out[:, 0].tolist(), log


def test_openrlhfs_example_reward_func_scores_as_calling_it_directly(capsys):
    import torch

    from pipeline.rewards.contract import resolve

    torch.manual_seed(7)
    got, log = score(_spec(f"{FIXTURE}:reward_func", {}), {"answer": ["4", "6"]})
    printed = capsys.readouterr().out
    for p, t in zip(RENDERED, TEXTS):  # it prints its queries: the rendered prompt, then the completion
        assert repr([p + t]) in printed
    fn = resolve(f"{FIXTURE}:reward_func")
    torch.manual_seed(7)  # called as OpenRLHF calls it: one query at a time
    direct = [fn([p + t], [p], [None])["rewards"].item() for p, t in zip(RENDERED, TEXTS)]
    assert got == direct and set(got) <= {0.0, 1.0}
    assert log.extra["dummy_scores"] == direct  # its extra_logs: one value per completion


LABELLED = '''def reward_func(queries, prompts, labels, bonus=0.0):
    return [float(q.endswith("<answer>" + l + "</answer>") and q.startswith(p)) + bonus for q, p, l in zip(queries, prompts, labels)]
'''


def test_labels_come_from_the_label_key_column_and_other_kwargs_are_passed(tmp_path):
    f = tmp_path / "lab.py"
    f.write_text(LABELLED)
    got, _ = score(_spec(f"{f}:reward_func", {"label_key": "answer", "bonus": 0.5}), {"answer": ["4", "6"]})
    assert got == [1.5, 0.5]
    with pytest.raises(GRPOError, match=r"kwargs.label_key: no column 'gold'"):
        score(_spec(f"{f}:reward_func", {"label_key": "gold"}), {"answer": ["4", "6"]})


def test_init_refuses_a_missing_label_column_and_a_function_openrlhf_could_not_call(assets, tmp_path, monkeypatch):
    from pipeline import preflight

    monkeypatch.chdir(tmp_path)
    (tmp_path / "lab.py").write_text(LABELLED)
    (tmp_path / "two.py").write_text("def reward_func(queries, prompts):\n    return [0.0 for q in queries]\n")
    ok = config_mod.resolve(base_config(assets, rewards=[{"fn": "lab.py:reward_func", "contract": "openrlhf", "kwargs": {"label_key": "answer"}}]))
    preflight.check(ok, judges_reachable=False)
    bad = config_mod.resolve(base_config(assets, rewards=[{"fn": "lab.py:reward_func", "contract": "openrlhf", "kwargs": {"label_key": "gold"}}]))
    with pytest.raises(GRPOError, match=r"rewards\[0\].kwargs.label_key: data.train .* has no column 'gold'"):
        preflight.check(bad, judges_reachable=False)
    two = config_mod.resolve(base_config(assets, rewards=[{"fn": "two.py:reward_func", "contract": "openrlhf"}]))
    with pytest.raises(GRPOError, match=r"rewards\[0\].fn 'two.py:reward_func': cannot be called as OpenRLHF calls it"):
        preflight.check(two, judges_reachable=False)


def test_the_example_config_passes_init_and_scores_with_its_labels(assets, monkeypatch):
    import yaml

    from conftest import REPO
    from pipeline import preflight

    monkeypatch.chdir(REPO)
    example = yaml.safe_load((REPO / "examples" / "openrlhf.yaml").read_text())
    cfg = config_mod.resolve(base_config(assets, rewards=example["rewards"]))
    preflight.check(cfg, judges_reachable=False)
    got, log = score(cfg.rewards[0], {"answer": ["4", "6"]})
    assert got == [1.0, 0.0] and log.extra["has_answer"] == [1.0, 1.0]


LOGS = '''import torch


def reward_func(queries, prompts, labels):
    ok = [q.endswith("<answer>4</answer>") for q in queries]
    return {"rewards": torch.tensor([float(x) for x in ok]), "extra_logs": {"ok": torch.tensor(ok), "flag": ok[0], "pair": torch.tensor([[0.25, 9.0]])}}


def listed(queries, prompts, labels):
    return {"rewards": [torch.tensor(float(queries[0].endswith("<answer>4</answer>")))]}  # a list of 0-d tensors


def says(queries, prompts, labels):
    return {"rewards": [1.0], "extra_logs": {"pred": "4"}}
'''


def test_extra_logs_are_numbers_as_openrlhf_logs_them_booleans_as_0_or_1(tmp_path):
    """A boolean extra_logs value became the string column 'True'; a string one stopped the stage with
    'returned str as rewards' and no row."""
    f = tmp_path / "logs.py"
    f.write_text(LOGS)
    got, log = score(_spec(f"{f}:reward_func", {}), {})
    assert got == [1.0, 0.0]
    assert log.extra["ok"] == [1.0, 0.0] and log.extra["flag"] == [1.0, 0.0] and log.extra["pair"] == [0.25, 0.25]  # flatten()[0]
    assert score(_spec(f"{f}:listed", {}), {})[0] == [1.0, 0.0]
    with pytest.raises(GRPOError, match=r"reward 'says' \(iteration 0\) row 0: extra_logs\['pred'\] is str '4', expected a number"):
        score(_spec(f"{f}:says", {}), {})
