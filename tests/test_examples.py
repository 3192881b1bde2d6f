"""examples/: the real-model demos' generated problems (times_problems for examples/real.yaml,
word_problems for examples/gsm8k_format.yaml, calc_problems for the agent demo's
examples/agent.yaml), their TRL-style reward functions (loaded by path as a user's file is) and
their configs."""

from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "examples"))

import calc_problems  # noqa: E402
import demo_real  # noqa: E402
import times_problems  # noqa: E402
import word_problems  # noqa: E402


def seeded_splits(task, tmp_path, key: str) -> tuple[list[dict], list[dict]]:
    """TASK's train and held-out rows for seed 3, written twice with the same bytes, no `key` in both."""
    a = task.write(tmp_path / "a", n_train=300, n_eval=30, seed=3)
    b = task.write(tmp_path / "b", n_train=300, n_eval=30, seed=3)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    train, eval_ = ([json.loads(line) for line in p.read_text().splitlines()] for p in a)
    assert (len(train), len(eval_)) == (300, 30)
    assert not {r[key] for r in train} & {r[key] for r in eval_}
    return train, eval_


def test_problems_are_seeded_split_and_correct(tmp_path):
    train, eval_ = seeded_splits(word_problems, tmp_path, "question")
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
    from pipeline.config.errors import reward_spec
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


def test_times_problems_are_seeded_split_and_correct(tmp_path):
    train, eval_ = seeded_splits(times_problems, tmp_path, "prompt")
    wordings = set()
    for row in train + eval_:
        x, y, product = map(int, re.fullmatch(r"(\d) \* (\d) = (\d+)", row["working"]).groups())
        assert 2 <= x <= 9 and 2 <= y <= 9 and product == x * y == int(row["answer"])
        assert sorted(map(int, re.findall(r"\d+", row["prompt"]))) == sorted([x, y])  # the question holds both factors
        wordings.add(re.sub(r"\d+", "N", row["prompt"]).split(".")[-2][-12:])
    assert len(wordings) >= 5  # varied wording


def test_last_number_correct(monkeypatch):
    monkeypatch.chdir(REPO)
    completions = [c("6 * 7 = 42"), c("She has 6 * 7 = 42 apples."), c("That is $42."), c("42 apples, not 6 * 7 = 41"),
                   c("To solve this problem, we need to multiply 6 by"), c("6 * 7 = 4"), c(""), c("1,042")]
    # right only when the LAST number is 42: a cut-off answer (`= 4`, `by`) or a later number scores 0
    assert _load("last_number_correct")(None, completions, answer=["42"] * 8) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_calc_problems_are_seeded_split_and_need_the_tool(tmp_path):
    train, eval_ = seeded_splits(calc_problems, tmp_path, "question")
    wordings = set()
    for row in train + eval_:
        assert row["prompt"][:-1] == calc_problems.WORKED and row["prompt"][-1] == {"role": "user", "content": row["question"]}
        x, y = map(int, re.findall(r"\d+", row["question"]))
        assert int(row["answer"]) == x * y and 100 <= max(x, y) <= 999 and 11 <= min(x, y) <= 99
        wordings.add(re.sub(r"\d+", "N", row["question"]))
    assert len(wordings) == len(calc_problems.WORDINGS)
    # the worked calls are what the Hermes fallback reads: each call parses to multiply with its factors
    from pipeline.agents.format import parse_hermes

    calls = [parse_hermes(m["content"])[1] for m in calc_problems.WORKED if "<tool_call>" in m["content"]]
    assert [(c.name, c.arguments) for [c] in calls] == [("multiply", {"a": 12, "b": 13}), ("multiply", {"a": 41, "b": 27})]


def test_final_answer_correct_reads_the_models_last_message(monkeypatch):
    monkeypatch.chdir(REPO)
    call = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}]},
            {"role": "tool", "name": "multiply", "content": "42"}]
    completions = [[*call, {"role": "assistant", "content": "42"}], [*call, {"role": "assistant", "content": "It is 41."}],
                   call, c("6 * 7 = 42"), c("42, or 43"), [{"role": "tool", "name": "multiply", "content": "42"}]]
    # the tool's 42 alone pays nothing: only what the model said, and its last number
    assert _load("final_answer_correct")(None, completions, answer=["42"] * 6) == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("name", sorted(demo_real.TASKS))
def test_example_configs_validate_and_load_their_rewards(monkeypatch, tmp_path, name):
    from pipeline import config as config_mod
    from pipeline.rewards.contract import load_reward

    monkeypatch.chdir(REPO)
    cfg = config_mod.load(REPO / "examples" / name)
    task = {"times_problems": times_problems, "word_problems": word_problems, "calc_problems": calc_problems}[demo_real.TASKS[name]]
    assert cfg.data.system_prompt == task.SYSTEM_PROMPT
    assert cfg.eval.reward in [r.column for r in cfg.rewards]
    assert cfg.train.keep_policies.last == 2
    assert cfg.train.lora.r == 16
    for j, spec in enumerate(cfg.rewards):
        assert callable(load_reward(spec, index=j))
    # the demo fills in the task's generated data and the model, and refuses a config it has no task for
    filled = demo_real.real_config(REPO / "examples" / name, tmp_path / "data", tmp_path / "model", 0, [])
    assert (filled.data.train, filled.data.eval) == (str(tmp_path / "data" / "train.jsonl"), str(tmp_path / "data" / "eval.jsonl"))
    assert filled.model == str(tmp_path / "model")


def test_the_endpoint_demo_is_the_agent_demos_task_on_another_route():
    """examples/endpoint_agent.yaml differs from examples/agent.yaml only in the route (an agent program
    instead of rollout.tools), the agent's own reward, weighted 0, and the eval's parts (25 prompts, so 25
    agent processes at a time; greedy figures per prompt are the same): the same prompts, turns, budget,
    sampling, total reward, loss, training and eval; and its agent's tool is calc_tools' schema."""
    from transformers.utils import get_json_schema

    from pipeline import config as config_mod

    tools, endpoint = (config_mod.load(REPO / "examples" / n).model_dump(mode="json") for n in ("agent.yaml", "endpoint_agent.yaml"))
    assert tools["rollout"].pop("tools") == ["examples/calc_tools.py:multiply"] and tools["rollout"].pop("agent") is None
    assert endpoint["rollout"].pop("tools") == [] and endpoint["rollout"].pop("agent")["command"][1:] == ["examples/endpoint_agent.py", "--no-nudge"]
    assert endpoint["eval"].pop("prompts_per_part") == 25 and tools["eval"].pop("prompts_per_part") is None  # fewer agents at once
    agent_reward = endpoint["rewards"].pop()
    assert (agent_reward["name"], agent_reward["weight"]) == ("agent", 0.0)
    assert tools == endpoint
    from calc_tools import multiply
    from endpoint_agent import TOOLS

    assert TOOLS == [get_json_schema(multiply)]


def test_the_endpoint_agents_tool_answers_as_grpos_tool_episodes_do():
    """examples/endpoint_agent.py's tool messages are the texts grpo's own tool episode gives for the same
    parsed call (pipeline/agents/tools.py:call_tool on calc_tools.multiply): the product, and for a call of
    another tool or with other arguments the same error (a wrong name once paid as if it were multiply)."""
    from calc_tools import multiply
    from endpoint_agent import run_call

    from pipeline.agents.tools import call_tool

    for name, args in [("multiply", {"a": 301, "b": 19}), ("add", {"a": 301, "b": 19}), ("divide", {"a": 5, "b": 2}),
                       ("multiply", {"a": 3}), ("multiply", {"a": 3, "c": 4}),
                       # arguments of other types, cast as grpo casts them by the schema (strings only):
                       ("multiply", {"a": 2.5, "b": 3}), ("multiply", {"a": 2.0, "b": 3}), ("multiply", {"a": "7", "b": 3}),
                       ("multiply", {"a": "seven", "b": 3}), ("multiply", {"a": None, "b": 3}), ("multiply", {"a": True, "b": 3})]:
        assert run_call(name, json.dumps(args)) == call_tool({"multiply": multiply}, name, args, 5.0).content, (name, args)


def test_demo_real_refuses_an_unknown_config(tmp_path):
    from pipeline.errors import GRPOError

    other = tmp_path / "mine.yaml"
    other.write_text((REPO / "examples" / "real.yaml").read_text())
    with pytest.raises(GRPOError, match=r"mine\.yaml: not one of the examples \(real\.yaml, gsm8k_format\.yaml, agent\.yaml, endpoint_agent\.yaml, judge\.yaml\)"):
        demo_real.real_config(other, tmp_path / "data", tmp_path / "model", 0, [])


def test_demo_real_prints_the_eval_table_with_intervals():
    """The demo's closing table: policy 0 and the last policy side by side, every figure with its interval,
    pass@k before maj@k in k's order, a figure one side lacks as `-`."""
    def summary(**figs):  # name -> (value, lo, hi), as eval_summary flattens them
        return {f"eval/{n}{s}": x for n, v in figs.items() for s, x in zip(("", "_lo", "_hi"), v)}

    first = summary(accuracy=(0.31, 0.254, 0.372), maj_at_8=(0.4, 0.31, 0.5), pass_at_8=(0.9, 0.83, 0.95),
                    pass_at_2=(0.5, 0.41, 0.6), reward=(0.31, 0.25, 0.37), mean_length=(31.24, 30.1, 32.0))
    final = summary(accuracy=(0.875, 0.81, 0.92), pass_at_2=(0.95, 0.9, 0.99), pass_at_8=(1.0, 0.96, 1.0),
                    reward=(0.875, 0.8, 0.9), mean_length=(25.96, 25.0, 27.0))
    lines = demo_real.eval_table(first, final, 8, 8).splitlines()
    assert [re.split(r"\s{2,}", line.strip()) for line in lines] == [
        ["held-out, 8 samples a prompt", "policy 0", "policy 8"],
        ["accuracy (mean@8)", "0.310 [0.25, 0.37]", "0.875 [0.81, 0.92]"],
        ["pass@2", "0.500 [0.41, 0.60]", "0.950 [0.90, 0.99]"],
        ["pass@8", "0.900 [0.83, 0.95]", "1.000 [0.96, 1.00]"],
        ["maj@8", "0.400 [0.31, 0.50]", "-"],
        ["reward", "0.310 [0.25, 0.37]", "0.875 [0.80, 0.90]"],
        ["length (tokens)", "31.2 [30.1, 32.0]", "26.0 [25.0, 27.0]"],
    ]
    assert demo_real.eval_table(first, final, 4, 1).splitlines()[1].startswith("accuracy (greedy)")
