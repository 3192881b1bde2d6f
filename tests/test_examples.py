"""examples/: the real-model demo's generated word problems, its TRL-style reward functions
(loaded by path as a user's file is) and its config."""

from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "examples"))

import word_problems  # noqa: E402


def test_problems_are_seeded_split_and_correct(tmp_path):
    a = word_problems.write(tmp_path / "a", n_train=300, n_eval=30, seed=3)
    b = word_problems.write(tmp_path / "b", n_train=300, n_eval=30, seed=3)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    train, eval_ = ([json.loads(line) for line in p.read_text().splitlines()] for p in a)
    assert (len(train), len(eval_)) == (300, 30)
    assert not {r["question"] for r in train} & {r["question"] for r in eval_}
    shots = {q for q, _, _ in word_problems.FEW_SHOT}
    templates = set()
    for row in train + eval_:
        assert row["question"] not in shots
        assert row["prompt"][-1] == {"role": "user", "content": row["question"]}
        assert [m["role"] for m in row["prompt"]] == ["user", "assistant", "user", "assistant", "user"]
        steps = row["working"].split(". ")
        assert 2 <= len(steps) <= 3
        # the working's last equation is the gold answer, and every equation holds
        for eq in re.findall(r"([\d +*/-]+) = (\d+)", row["working"]):
            assert eval(eq[0]) == int(eq[1]), row
        assert row["working"].rstrip(".").endswith(f"= {row['answer']}")
        assert int(row["answer"]) >= 0
        templates.add(re.sub(r"\d+", "N", row["question"]).split()[1])
    assert len(templates) >= 5  # varied wording


def _load(name):
    from pipeline.config_errors import reward_spec
    from pipeline.rewards.contract import load_reward

    return load_reward(reward_spec({"fn": f"examples/rewards.py:{name}"}))


def c(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_rewards_give_partial_credit(monkeypatch):
    monkeypatch.chdir(REPO)
    good = c("<start_working_out>3 * 4 = 12. 5 + 12 = 17.<end_working_out><SOLUTION>17</SOLUTION>")
    wrong = c("<start_working_out>3 + 4 = 7.<end_working_out><SOLUTION>7</SOLUTION>")
    unit = c("<start_working_out>12 + 5<end_working_out><SOLUTION>17 apples</SOLUTION>")
    partial = c("<start_working_out>3 * 4 = 12, so 17<SOLUTION>")
    repeated = c("<start_working_out>a<end_working_out><start_working_out>b<end_working_out><SOLUTION>17</SOLUTION>")
    plain = c("She has 5 + 12 = 17 apples.")
    completions = [good, wrong, unit, partial, repeated, plain]
    gold = ["17"] * len(completions)
    assert _load("match_format_exactly")(None, completions) == [3.0, 3.0, 3.0, 0.0, 3.0, 0.0]
    assert _load("match_format_approximately")(None, completions) == [2.0, 2.0, 2.0, 1.0, 0.0, 0.0]
    assert _load("check_answer")(None, completions, answer=gold) == [3.0, 0.0, 1.5, 0.0, 3.0, 0.0]
    assert _load("check_numbers")(None, completions, answer=gold) == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]


def test_real_config_validates_and_loads_its_rewards(monkeypatch):
    from pipeline import config as config_mod
    from pipeline.rewards.contract import load_reward

    monkeypatch.chdir(REPO)
    cfg = config_mod.load(REPO / "examples" / "real.yaml")
    assert cfg.data.system_prompt == word_problems.SYSTEM_PROMPT
    assert cfg.eval.reward in [r.column for r in cfg.rewards]
    assert cfg.train.keep_policies.last == 2
    for j, spec in enumerate(cfg.rewards):
        assert callable(load_reward(spec, index=j))
