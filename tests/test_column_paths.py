"""Dotted column paths (`reward_model.ground_truth`) wherever a column is named (pipeline/data/fields.py):
init checks them against nested JSON objects as against Parquet structs, in data.train and every
eval set; the eval scores `correct` on verl-format data; a judge's rubric fills them in. The
Parquet side of the built-ins is in tests/test_verl.py, `grpo inspect --column` in tests/test_inspect.py."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import base_config
from pipeline import config as config_mod
from pipeline.errors import GRPOError

DOTTED = [{"fn": "correct", "kwargs": {"answer_column": "reward_model.ground_truth"}}]


def _jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(assets, train: str, eval_: str | None = None, rewards=DOTTED, **sections):
    return config_mod.resolve(base_config(assets, data={"train": train, "eval": eval_ or train}, rewards=rewards, **sections))


def test_init_resolves_a_dotted_path_into_nested_json_objects_and_names_the_missing_key(assets, tmp_path):
    from pipeline import preflight

    good = _jsonl(tmp_path / "verl.jsonl", [{"prompt": "2+2?", "reward_model": {"ground_truth": "4", "style": "rule"}},
                                            {"prompt": "3+4?", "reward_model": {"ground_truth": "7", "style": "rule"}}])
    preflight.check(_cfg(assets, good), judges_reachable=False)
    deep = _jsonl(tmp_path / "deep.jsonl", [{"prompt": "2+2?", "meta": {"gold": {"value": "4"}}}])
    preflight.check(_cfg(assets, deep, rewards=[{"fn": "correct", "kwargs": {"answer_column": "meta.gold.value"}}]),
                    judges_reachable=False)

    with pytest.raises(GRPOError) as err:
        preflight.check(_cfg(assets, good, rewards=[{"fn": "correct", "kwargs": {"answer_column": "reward_model.gold"}}]),
                        judges_reachable=False)
    assert str(err.value) == (f"rewards[0].kwargs.answer_column: data.train {good} has no column 'reward_model.gold': "
                              "'reward_model' has no field 'gold' (fields: ground_truth, style)")
    with pytest.raises(GRPOError) as err:  # a path deeper than the object goes
        preflight.check(_cfg(assets, deep, rewards=[{"fn": "correct", "kwargs": {"answer_column": "meta.gold.value.x"}}]),
                        judges_reachable=False)
    assert str(err.value).startswith(f"rewards[0].kwargs.answer_column: data.train {deep} has no column 'meta.gold.value.x': "
                                     "'meta.gold.value' has no field 'x' (it holds large_string, no nested object)")
    assert "\n" not in str(err.value)


def test_every_eval_set_must_hold_the_path_a_reward_reads(assets, tmp_path):
    """The eval scores with the run's rewards: an eval set without the answer would fail at its first eval."""
    from pipeline import preflight

    data = tmp_path / "verl.parquet"
    pq.write_table(pa.table({"prompt": ["2+2?"], "reward_model": [{"ground_truth": "4", "style": "rule"}]}), data)
    flat = _jsonl(tmp_path / "flat.jsonl", [{"prompt": "2+2?", "answer": "4"}])
    with pytest.raises(GRPOError) as err:
        preflight.check(_cfg(assets, str(data), flat), judges_reachable=False)
    assert str(err.value) == (f"rewards[0].kwargs.answer_column: data.eval {flat} has no column 'reward_model.ground_truth' "
                              "(columns: prompt, answer)")
    named = base_config(assets, data={"train": str(data), "eval": {"hard": str(tmp_path / "flat.jsonl")}}, rewards=DOTTED)
    with pytest.raises(GRPOError, match=r"^rewards\[0\]\.kwargs\.answer_column: data\.eval\.hard .*flat\.jsonl has no column"):
        preflight.check(config_mod.resolve(named), judges_reachable=False)


def test_the_eval_scores_correct_on_reward_model_ground_truth(assets, tmp_path):
    """verl-format data as an eval set: each completion scored against the struct's ground_truth (the
    eval's own path, its recorded completions replayed so no engine runs)."""
    from transformers import AutoTokenizer

    from pipeline import preflight
    from pipeline.data.prompts import load_dataset, make_prompts
    from pipeline.eval.run import eval_parts, eval_table
    from pipeline.run.template_date import dated
    from pipeline.run.run import init_run

    data = tmp_path / "verl.parquet"
    pq.write_table(pa.table({"prompt": ["What is 2+2?", "What is 3+4?", "What is 5+5?"],
                             "reward_model": [{"ground_truth": g, "style": "rule"} for g in ("4", "7", "10")]}), data)
    cfg = _cfg(assets, str(data))
    preflight.check(cfg, judges_reachable=False)
    run = init_run(str(tmp_path / "run"), cfg)
    tok = dated(AutoTokenizer.from_pretrained(run.plain_dir(0)), run.cfg.data.template_date)
    df = load_dataset(str(data), cfg.data.prompt_column, cfg.data.prompt_template)
    prompts = make_prompts(df, [0, 1, 2], tok, run.cfg.data, str(data), 100_000)
    said = ["<answer>4</answer>", "<answer>8</answer>", "<answer>10</answer>"]  # right, wrong, right
    recorded = pa.table({"prompt_id": [p.prompt_id for p in prompts], "prompt": [p.text for p in prompts],
                         "completion": said, "completion_length": [4, 4, 4]})
    [part] = eval_parts(run.cfg)
    table = eval_table(run, 0, None, part, recorded)
    assert table.column("reward_correct").to_pylist() == [1.0, 0.0, 1.0]
    assert table.column("correct").to_pylist() == [True, False, True]


def test_a_judge_rubric_fills_in_a_dotted_path_and_init_checks_it(assets, tmp_path):
    from pipeline import preflight
    from pipeline.config.errors import reward_spec
    from pipeline.rewards.judge.chat import ChatJudge

    entry = {"fn": "judge", "kwargs": {"base_url": "http://127.0.0.1:9/v1", "model": "m",
                                       "rubric": "Gold: {reward_model.ground_truth} ({reward_model.style})\nSaid: {completion}"}}
    o = reward_spec(entry, 0).kwargs
    assert o.columns() == ["reward_model.ground_truth", "reward_model.style"]
    columns = {"reward_model": [{"ground_truth": "4", "style": "rule"}, {"ground_truth": "7", "style": "math"}]}
    bodies = ChatJudge(o).bodies(["p", "p"], ["four", "seven"], columns, "judge")
    said = [json.loads(b)["messages"][-1]["content"] for b in bodies]
    assert said == ["Gold: 4 (rule)\nSaid: four", "Gold: 7 (math)\nSaid: seven"]
    with pytest.raises(GRPOError, match=r"^judge: the rubric names \{reward_model.ground_truth\}: row 1: column 'reward_model' has no field 'ground_truth'"):
        ChatJudge(o).bodies(["p", "p"], ["a", "b"], {"reward_model": [{"ground_truth": "4", "style": "x"}, {"style": "y"}]}, "judge")

    good = _jsonl(tmp_path / "verl.jsonl", [{"prompt": "2+2?", "reward_model": {"ground_truth": "4", "style": "rule"}}])
    preflight.check(_cfg(assets, good, rewards=[entry]), judges_reachable=False)
    bad = {**entry, "kwargs": {**entry["kwargs"], "rubric": "Gold: {reward_model.answer}\n{completion}"}}
    with pytest.raises(GRPOError) as err:
        preflight.check(_cfg(assets, good, rewards=[bad]), judges_reachable=False)
    assert str(err.value) == (f"rewards[0].kwargs.rubric: names {{reward_model.answer}}, but data.train {good} has no column "
                              "'reward_model.answer': 'reward_model' has no field 'answer' (fields: ground_truth, style); "
                              "the rubric also knows {prompt} and {completion}")


def test_a_prompt_template_and_openrlhfs_label_key_take_dotted_paths(assets, tmp_path):
    """The other places a config names a column: data.prompt_template's fields and OpenRLHF's label_key."""
    from pydantic import TypeAdapter

    from pipeline import preflight
    from pipeline.config.rewards import RewardSpec
    from pipeline.data.prompts import load_dataset
    from pipeline.rewards.calls import RewardLog
    from pipeline.rewards.contract import compute_rewards

    data = _jsonl(tmp_path / "nested.jsonl", [{"extra_info": {"question": "2+2?", "split": "train"}, "answer": "4"},
                                              {"extra_info": {"question": "3+4?", "split": "train"}, "answer": "7"}])
    df = load_dataset(data, "prompt", "Q: {extra_info.question}")
    assert df.get_column("prompt").to_list() == ["Q: 2+2?", "Q: 3+4?"]
    ok = config_mod.resolve(base_config(assets, data={"train": data, "eval": data, "prompt_template": "Q: {extra_info.question}"}))
    preflight.check(ok, judges_reachable=False)
    bad = config_mod.resolve(base_config(assets, data={"train": data, "eval": data, "prompt_template": "Q: {extra_info.q}"}))
    with pytest.raises(GRPOError) as err:
        preflight.check(bad, judges_reachable=False)
    assert str(err.value) == (f"data.prompt_template {{extra_info.q}}: data.train {data} has no column 'extra_info.q': "
                              "'extra_info' has no field 'q' (fields: question, split)")

    f = tmp_path / "lab.py"
    f.write_text("def reward_func(queries, prompts, labels):\n    return [float(q.endswith(l)) for q, l in zip(queries, labels)]\n")
    spec = TypeAdapter(RewardSpec).validate_python({"fn": f"{f}:reward_func", "contract": "openrlhf",
                                                    "kwargs": {"label_key": "reward_model.ground_truth"}})
    columns = {"reward_model": [{"ground_truth": "4"}, {"ground_truth": "7"}]}
    out = compute_rewards([spec], ["2+2?", "3+4?"], ["4", "8"], None, columns, iteration=0, log=RewardLog(2), rendered=["a", "b"])
    assert out[:, 0].tolist() == [1.0, 0.0]


def test_a_dotted_prompt_column_reads_the_field_and_init_names_the_missing_key(assets, tmp_path):
    """`data.prompt_column: extra_info.question` as every other column option takes a path: the prompt is
    the field (a string here, a message list in a Parquet struct), rendered into the rows; init names the
    key a file lacks, in data.train and an eval set."""
    from transformers import AutoTokenizer

    from pipeline import preflight
    from pipeline.data.prompts import load_dataset, make_prompts

    data = _jsonl(tmp_path / "nested.jsonl", [{"extra_info": {"question": "2+2?", "split": "train"}, "answer": "4"},
                                              {"extra_info": {"question": "3+4?", "split": "train"}, "answer": "7"}])
    chat = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"extra": [{"messages": [{"role": "user", "content": "5+5?"}], "id": 1}], "answer": ["10"]}), chat)
    flat = _jsonl(tmp_path / "flat.jsonl", [{"extra_info": {"q": "2+2?"}, "answer": "4"}])
    rewards = [{"fn": "correct"}]
    ok = config_mod.resolve(base_config(assets, rewards=rewards, data={"train": data, "eval": data, "prompt_column": "extra_info.question"}))
    preflight.check(ok, judges_reachable=False)
    preflight.check(config_mod.resolve(base_config(assets, rewards=rewards, data={"train": str(chat), "eval": str(chat), "prompt_column": "extra.messages"})),
                    judges_reachable=False)

    df = load_dataset(data, "extra_info.question")
    tok = AutoTokenizer.from_pretrained(assets["model"])
    prompts = make_prompts(df, [0, 1], tok, ok.data, data, 100_000)
    assert [p.raw for p in prompts] == ["2+2?", "3+4?"]
    assert "2+2?" in prompts[0].text and "3+4?" in prompts[1].text
    assert sorted(prompts[0].columns) == ["answer", "extra_info"]  # the column itself still reaches the rewards
    [msg] = load_dataset(str(chat), "extra.messages").get_column("extra.messages").to_list()
    assert msg == [{"role": "user", "content": "5+5?"}]

    for train, eval_, where, bad in ((data, flat, "data.eval", flat), (flat, data, "data.train", flat)):
        with pytest.raises(GRPOError) as err:
            preflight.check(config_mod.resolve(base_config(assets, rewards=rewards, data={"train": train, "eval": eval_, "prompt_column": "extra_info.question"})),
                            judges_reachable=False)
        assert str(err.value) == (f"data.prompt_column: {where} {bad} has no column 'extra_info.question': 'extra_info' has no "
                                  "field 'question' (fields: q)")
    with pytest.raises(GRPOError) as err:  # the stage reading it says the same
        load_dataset(flat, "extra_info.question")
    assert str(err.value) == (f"{flat}: data.prompt_column: no column 'extra_info.question': 'extra_info' has no field 'question' "
                              "(fields: q)")
