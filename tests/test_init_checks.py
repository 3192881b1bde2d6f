"""`grpo init` catches every config mistake before a rollout could run: misspelt built-ins and
options, custom reward functions that do not import or cannot take TRL's arguments, eval.reward
naming no reward, and datasets that are missing, unreadable or lack a column something asks for.
Each is one `error:` line naming the key or file, exit 1, and no run directory left behind.
Fast: no model is built and no engine starts (the checks come before the model is copied)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import init_error_line

from pipeline import preflight
from pipeline import config as config_mod


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": f"q{i}", "answer": f"#### {i}"} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def init(tmp_path, data, capsys, monkeypatch):
    """init(**overrides) -> the one error line of `grpo init` on a config (asserts exit 1, no run dir)."""
    monkeypatch.chdir(tmp_path)

    def run(rewards=None, **sections) -> str:

        tree = {"model": str(tmp_path / "no-model-needed"), "data": {"train": str(data)},
                "rewards": rewards or [{"fn": "correct"}], **sections}
        (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(tree))
        return init_error_line(capsys, tmp_path / "run", "--config", tmp_path / "cfg.yaml")

    return run


def test_a_misspelt_builtin_is_named_with_a_suggestion(init, tmp_path):
    msg = init([{"fn": "format"}, {"fn": "corect"}])
    assert msg.startswith(f"{tmp_path / 'cfg.yaml'}: rewards.1.fn: 'corect' is not a built-in reward (built-ins: correct, format,")
    assert "did you mean 'correct'?" in msg


def test_a_misspelt_or_mistyped_option_of_a_builtin(init, tmp_path):
    assert init([{"fn": "contains", "kwargs": {"keywrod": "x"}}]) == (
        f"{tmp_path / 'cfg.yaml'}: rewards.0.kwargs.keywrod: contains has no option 'keywrod' (options: keyword, value, case_sensitive)"
    )
    assert init([{"fn": "length_range", "kwargs": {"max_tokens": "many"}}]).endswith(
        "rewards.0.kwargs.max_tokens: Input should be a valid integer, unable to parse string as an integer"
    )
    assert init([{"fn": "overlong", "kwargs": {"max_tokens": 4, "buffer": 8}}]).endswith(
        "rewards.0.kwargs: need buffer <= max_tokens, got buffer=8, max_tokens=4"
    )


def test_eval_reward_must_name_a_reward(init, tmp_path, data):
    msg = init([{"fn": "format"}], data={"train": str(data), "eval": str(data)}, eval={"every": 2})
    assert msg == f"{tmp_path / 'cfg.yaml'}: eval.reward 'correct': no reward named so (rewards: format)"


def test_a_custom_function_that_does_not_import(init, tmp_path):
    (tmp_path / "mine.py").write_text("def brevity(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    assert init([{"fn": "missing.py:brevity"}]) == f"rewards[0].fn 'missing.py:brevity': no file missing.py (looked for {tmp_path / 'missing.py'})"
    assert init([{"fn": "mine.py:brevty"}]) == "rewards[0].fn 'mine.py:brevty': no function 'brevty' in mine.py"
    assert init([{"fn": "no_such_module_xyz:f"}]).startswith("rewards[0].fn 'no_such_module_xyz:f': no module 'no_such_module_xyz'")
    assert init([{"fn": "mine.py"}]).startswith(f"{tmp_path / 'cfg.yaml'}: rewards.0.fn: 'mine.py' is not a built-in reward")


def test_a_custom_function_whose_signature_cannot_take_trls_call(init, tmp_path):
    (tmp_path / "sig.py").write_text(
        "def strict(prompts, completions, completion_ids):\n    return [0.0] * len(completions)\n"
        "def wants(completions, solution, **kwargs):\n    return [0.0] * len(completions)\n"
        "def positional(completions, /, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    assert init([{"fn": "sig.py:strict"}]) == (
        "rewards[0].fn 'sig.py:strict': does not accept 'trainer_state', which it would be passed "
        "(TRL passes every reward function its arguments and every dataset column); add **kwargs"
    )
    assert init([{"fn": "sig.py:wants"}]) == (
        "rewards[0].fn 'sig.py:wants': asks for 'solution', which is no TRL argument, no kwargs option and no dataset column (columns: answer)"
    )
    assert init([{"fn": "sig.py:positional"}]) == (
        "rewards[0].fn 'sig.py:positional': argument 'completions' is positional-only; TRL passes every argument by keyword"
    )


def test_the_dataset_is_read_at_init(init, tmp_path, data):
    missing = tmp_path / "missing.jsonl"
    assert init(data={"train": str(missing)}) == f"data.train: {missing}: dataset file not found"
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    assert init(data={"train": str(garbage)}).startswith(f"data.train: {garbage}: cannot read dataset (")
    assert init(data={"train": str(data), "prompt_column": "question"}) == (
        f"data.train {data}: no column 'question' (columns: prompt, answer); set data.prompt_column"
    )
    assert init([{"fn": "correct", "kwargs": {"answer_column": "solution"}}]) == (
        f"rewards[0].kwargs.answer_column: data.train {data} has no column 'solution' (columns: prompt, answer)"
    )
    assert init(data={"train": str(data), "eval": str(missing)}) == f"data.eval: {missing}: dataset file not found"


def test_a_good_config_passes_and_trl_style_functions_are_accepted(tmp_path, data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trl_style.py").write_text(
        "def check_answer(prompts, completions, answer, **kwargs):\n    return [0.0] * len(completions)\n"
        "def curriculum(completions, trainer_state, **kwargs):\n    return [float(trainer_state.global_step)] * len(completions)\n"
        "def exact(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, answer, scale=1):\n"
        "    return [0.0] * len(completions)\n"
    )
    rewards = [{"fn": "correct"}, {"fn": "format"}, {"fn": "trl_style.py:check_answer"}, {"fn": "trl_style.py:curriculum"},
               {"fn": "trl_style.py:exact", "kwargs": {"scale": 2}}]
    cfg = config_mod.resolve({"model": "m", "data": {"train": str(data), "eval": str(data)}, "rewards": rewards})
    preflight.check(cfg)  # raises on any problem
    # the existing demo config stays valid
    demo = yaml.safe_load((Path(config_mod.__file__).parent.parent.parent / "demo" / "configs" / "demo.yaml").read_text())
    assert [r.fn for r in config_mod.resolve(demo).rewards] == ["correct", "format"]


def _model_config(tmp_path, name: str, model_type: str, **kw) -> Path:
    """A model directory whose config.json is all `grpo init` reads of it (a placeholder tokenizer
    and weights file pass its file checks; nothing loads them)."""
    from test_packing import tiny_config
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = tiny_config(model_type, **kw)
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    cfg.save_pretrained(tmp_path / name)
    (tmp_path / name / "tokenizer_config.json").write_text("{}")
    (tmp_path / name / "model.safetensors").write_bytes(b"")
    return tmp_path / name


def test_packing_on_for_a_model_that_cannot_pack_is_refused_at_init(init, tmp_path, data):
    """The bug: `train.packing: on` with a Falcon (its own attention classes) or a dynamic-rope model
    passed init and failed at the logprobs stage's first forward; now init reads the model's (and
    the reference model's) config.json and names the key. A model that packs passes the check.
    Builds the models on the meta device: imports transformers' modeling modules, no weights."""
    falcon = _model_config(tmp_path, "falcon", "falcon", new_decoder_architecture=True, num_kv_heads=2)
    assert init(model=str(falcon), train={"packing": "on"}) == (
        f"model {falcon}: train.packing on: this model (falcon, 'sdpa' attention) cannot pack: it needs SDPA attention "
        "without a sliding window or a length-dependent rope (set train.packing auto or off)")
    dynamic = _model_config(tmp_path, "dynamic", "llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    llama = _model_config(tmp_path, "llama", "llama")  # packs: the error is the reference model's
    assert init(model=str(llama), ref_model=str(dynamic), train={"packing": "on"}).startswith(
        f"ref_model {dynamic}: train.packing on: this model (llama, 'sdpa' attention) cannot pack")
