"""Reward functions: the built-ins on hand-made completions, loading user functions, TRL's
argument shapes, and the one-line errors for reward functions that misbehave."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config.errors import reward_spec
from pipeline.errors import GRPOError
from pipeline.rewards.calls import TrainerState
from pipeline.rewards.contract import compute_rewards, extract_code, load_reward

FIXTURES = Path(__file__).parent / "fixtures" / "rewards"
NAN = float("nan")


def score(specs, completions, prompts=None, completion_ids=None, iteration=0, **columns):
    """compute_rewards with plain prompts and one-token-per-character ids unless given."""
    specs = [reward_spec(s, j) for j, s in enumerate(specs)]
    prompts = prompts if prompts is not None else ["p"] * len(completions)
    if completion_ids is None:
        completion_ids = [list(range(len(c if isinstance(c, str) else c[0]["content"]))) for c in completions]
    return compute_rewards(specs, prompts, completions, completion_ids, columns, iteration=iteration)


def same(actual, expected, atol: float = 1e-6):
    np.testing.assert_allclose(actual, np.asarray(expected, dtype=np.float64), atol=atol, rtol=0)


PADDED_ATOL = 5e-5
"""A padded batch and one text at a time are the same sums in another order: on an AVX2 CPU the
fp32 logits differ by up to ~1e-5 (measured 8.7e-6); the texts' scores differ by > 0.01."""


def error_of(*args, **kwargs) -> str:
    with pytest.raises(GRPOError) as info:
        score(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------ built-ins


def test_correct_compares_the_answer_block_with_the_gold_answer_numerically():
    completions = [
        "<think>3 + 4 = 7</think><answer>7</answer>",
        "<answer>7.0</answer>",  # numerically equal
        "<answer>8</answer>",
        "7",  # no answer block
        "<answer>1,000</answer>",  # thousands separator
        "<answer>5</answer> then <answer>7</answer>",  # the last block counts
        "<answer>7</answer>",  # gold missing: does not apply
    ]
    answers = ["3 plus 4 #### 7", "#### 7", "#### 7", "#### 7", "#### 1000", "#### 7", None]
    rewards = score([{"fn": "correct"}], completions, answer=answers, question=["q"] * 7)
    assert rewards.shape == (7, 1) and rewards.dtype == np.float64
    same(rewards[:, 0], [1, 1, 0, 0, 1, 1, NAN])


def test_correct_reads_another_column_and_names_a_missing_one():
    spec = {"fn": "correct", "kwargs": {"answer_column": "solution"}}
    rewards = score([spec], ["<answer>12</answer>"] * 2, solution=["12", "#### 13"])
    same(rewards[:, 0], [1, 0])  # a gold value without #### is taken whole
    message = error_of([{"fn": "correct"}], ["<answer>1</answer>"], iteration=2, solution=["1"])
    assert message == (
        "reward 'correct' (iteration 2): no dataset column 'answer' (dataset columns: solution); set the `answer_column` option"
    )


def test_format_gives_one_for_think_then_answer_and_half_for_an_answer_block_alone():
    completions = [
        "<think>3 + 4 = 7</think><answer>7</answer>",
        "  <think>a</think>\n<answer>b</answer>\n",  # whitespace around the blocks is fine
        "<answer>7</answer>",
        "The answer is <answer>7</answer> I think",
        "<think>a</think><answer>7</answer> and more",  # not exact: only the answer block counts
        "<think>a</think>",
        "7",
    ]
    same(score([{"fn": "format"}], completions)[:, 0], [1, 1, 0.5, 0.5, 0.5, 0, 0])


def test_contains_matches_case_insensitively_unless_told():
    completions = ["AI is Important", "AI helps hospitals", "important"]
    same(score([{"fn": "contains", "kwargs": {"keyword": "important"}}], completions)[:, 0], [1, 0, 1])
    spec = {"fn": "contains", "kwargs": {"keyword": "important", "case_sensitive": True, "value": 2.5}}
    same(score([spec], completions)[:, 0], [0, 0, 2.5])


def test_length_range_counts_tokens_or_words_inclusively():
    ids = [[1], [1, 2], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]]
    spec = {"fn": "length_range", "kwargs": {"min_tokens": 2, "max_tokens": 5}}
    same(score([spec], ["a"] * 4, completion_ids=ids)[:, 0], [0, 1, 1, 0])
    words = {"fn": "length_range", "kwargs": {"min_tokens": 2, "unit": "words", "value": 3}}  # no upper bound
    same(score([words], ["one", "one two", "one two three four five six seven"])[:, 0], [0, 3, 3])


def test_the_seed_notes_reward_is_contains_plus_length_range():
    # Seed notes: +1 if the text contains "important", +1 if it is 2-5 tokens long (words here).
    # "AI is important": 1 + 1 = 2; "AI helps hospitals": 0 + 1 = 1; "Healthcare uses AI": 0 + 1 = 1;
    # the second prompt's three completions (3, 3 and 4 words, no "important") get 1 each.
    specs = [
        {"fn": "contains", "kwargs": {"keyword": "important"}},
        {"fn": "length_range", "kwargs": {"min_tokens": 2, "max_tokens": 5, "unit": "words"}},
    ]
    completions = ["AI is important", "AI helps hospitals", "Healthcare uses AI"]
    completions += ["RL is learning", "RL trains agents", "Agents learn via RL"]
    prompts = ["Summarize AI in healthcare"] * 3 + ["Explain RL in simple words"] * 3
    rewards = score(specs, completions, prompts=prompts)  # [6, 2]
    same(rewards, [[1, 1], [0, 1], [0, 1], [0, 1], [0, 1], [0, 1]])
    same(rewards.sum(axis=1), [2, 1, 1, 1, 1, 1])


def test_overlong_is_dapos_soft_punishment():
    # L_max = 10, L_cache = 4: no penalty up to 10 - 4 = 6 tokens, then (6 - |y|) / 4, then -1.
    # |y| = 5 -> 0; 6 -> 0; 7 -> -1/4; 9 -> -3/4; 10 -> -4/4 = -1; 11 -> beyond L_max -> -1.
    ids = [list(range(n)) for n in (5, 6, 7, 9, 10, 11)]
    spec = {"fn": "overlong", "kwargs": {"max_tokens": 10, "buffer": 4}}
    same(score([spec], ["x"] * 6, completion_ids=ids)[:, 0], [0, 0, -0.25, -0.75, -1, -1])
    message = error_of([{"fn": "overlong", "kwargs": {"max_tokens": 4, "buffer": 8}}], ["x"])
    assert message == "rewards: rewards.0.kwargs: need buffer <= max_tokens, got buffer=8, max_tokens=4"


def test_code_tests_scores_the_fraction_of_asserts_passed():
    fenced = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    half = "```py\ndef add(a, b):\n    return a + b if a < 10 else 0\n```"
    plain = "def add(a, b):\n    return a + b\n"
    broken = "I would add them."
    tests = ["assert add(1, 2) == 3", "assert add(20, 2) == 22"]
    completions = [fenced, half, plain, broken, fenced]
    column = [tests, json.dumps(tests), tests, tests, None]  # a list, or a JSON string of one; None: no tests
    rewards = score([{"fn": "code_tests", "kwargs": {"timeout_s": 10.0}}], completions, tests=column)
    same(rewards[:, 0], [1, 0.5, 1, 0, NAN])
    message = error_of([{"fn": "code_tests"}], [plain, plain], iteration=1, tests=[tests, "not json"])
    assert message == (
        "reward 'code_tests' (iteration 1): row 1: column 'tests' is not a list of test strings (or a JSON string of one)"
    )


def test_extract_code_prefers_the_last_python_block():
    text = "```python\nx = 1\n```\nor better\n```python\nx = 2\n```\n```\ny = 3\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("x = 4") == "x = 4"


# --------------------------------------------------------------------------------- reward model


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory):
    """A seeded, randomly initialised 3-label BERT classifier with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    words = "Summarize AI in healthcare is important helps hospitals uses Explain RL simple words learning trains agents"
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + sorted(set(words.split())))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    specials = {"unk_token": "[UNK]", "pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=3, id2label={0: "toxic", 1: "neutral", 2: "kind"},
        label2id={"toxic": 0, "neutral": 1, "kind": 2}, pad_token_id=0, initializer_range=0.5,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("classifier")
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def direct_logits(path, texts):
    """One unpadded forward pass per text on a separately loaded copy of the model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return torch.stack([model(**tokenizer(t, return_tensors="pt")).logits[0] for t in texts]).double()  # [N, 3]


@pytest.mark.slow
def test_reward_model_scores_equal_a_direct_forward_pass(tiny_classifier):
    prompts = ["Summarize AI in healthcare "] * 3 + ["Explain RL in simple words "] * 2
    completions = ["AI is important", "AI helps hospitals", "healthcare uses AI"]
    completions += ["RL is learning", "RL trains agents in simple words"]
    logits = direct_logits(tiny_classifier, [p + c for p, c in zip(prompts, completions)])  # [5, 3]
    assert logits[:, 0].std() > 0.01  # the texts do score differently, so a mix-up would show

    def rm(**kwargs):
        spec = {"fn": "reward_model", "kwargs": {"model": tiny_classifier, "batch_size": 2, "device": "cpu", **kwargs}}
        return score([spec], completions, prompts=prompts)[:, 0]

    same(rm(), logits[:, 0], PADDED_ATOL)  # batches of 2, padded, still equal to one text at a time
    same(rm(label="kind", sign=-1), -logits[:, 2], PADDED_ATOL)
    same(rm(label=1, activation="sigmoid"), logits[:, 1].sigmoid(), PADDED_ATOL)
    same(rm(label="kind", activation="softmax"), logits.softmax(dim=-1)[:, 2], PADDED_ATOL)
    same(rm(use_prompt=False), direct_logits(tiny_classifier, completions)[:, 0], PADDED_ATOL)


@pytest.mark.slow
def test_reward_model_joins_chat_messages_without_a_template(tiny_classifier):
    prompts = [[{"role": "system", "content": "Explain RL"}, {"role": "user", "content": "in simple words"}]]
    expected = direct_logits(tiny_classifier, ["Explain RL\nin simple words\nRL is learning"])[:, 0]
    spec = {"fn": "reward_model", "kwargs": {"model": tiny_classifier, "device": "cpu"}}
    same(score([spec], ["RL is learning"], prompts=prompts)[:, 0], expected)
    message = error_of([{"fn": "reward_model", "kwargs": {"model": tiny_classifier, "label": "rude", "device": "cpu"}}], ["x"])
    assert message == (
        f"reward 'reward_model' (iteration 0): reward model {tiny_classifier}: no label 'rude' (labels: toxic, neutral, kind)"
    )


# ---------------------------------------------------------------------------- user functions


@pytest.fixture
def user_module(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    import user_rewards

    user_rewards.CALLS.clear()
    return user_rewards


def test_a_user_function_by_module_path_gets_trls_arguments_for_plain_prompts(user_module):
    spec = reward_spec({"fn": "user_rewards:record", "kwargs": {"scale": 2}})
    ids = [[5, 6], [7]]
    rewards = compute_rewards([spec], ["Say hi", "Say bye"], ["hi!", "bye"], ids, {"answer": ["#### 1", "#### 2"]}, iteration=0)
    same(rewards[:, 0], [3, 3])
    (call,) = user_module.CALLS
    assert call.pop("trainer_state") == TrainerState(global_step=0, epoch=0.0, max_steps=0)  # TRL 1.16's extras
    assert callable(call.pop("log_metric")) and callable(call.pop("log_extra"))
    assert call == {
        "prompts": ["Say hi", "Say bye"],
        "completions": ["hi!", "bye"],
        "completion_ids": ids,
        "answer": ["#### 1", "#### 2"],  # a dataset column
        "scale": 2,  # from the config's kwargs
    }


def test_chat_prompts_get_message_lists_as_trl_passes_them(user_module):
    prompts = [
        [{"role": "user", "content": "Say hi"}],
        [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Say bye"}],
    ]
    spec = reward_spec({"fn": "user_rewards:record"})
    compute_rewards([spec], prompts, ["hi!", "bye"], [[1], [2]], {}, iteration=0)
    wrapped = [[{"role": "assistant", "content": "hi!"}], [{"role": "assistant", "content": "bye"}]]
    compute_rewards([spec], prompts, wrapped, [[1], [2]], {}, iteration=0)  # already in TRL's shape: unchanged
    first, second = user_module.CALLS
    assert first["prompts"] == prompts and second["prompts"] == prompts
    assert first["completions"] == wrapped and second["completions"] == wrapped


def test_a_user_function_by_file_path_relative_or_absolute(monkeypatch):
    monkeypatch.chdir(FIXTURES.parent)
    completions = ["wow!!", "ok", "!"]
    for fn in ("rewards/user_rewards.py:shout", f"{FIXTURES / 'user_rewards.py'}:shout"):
        same(score([{"fn": fn}], completions)[:, 0], [2, 0, 1])
    # A config option wins over a dataset column of the same name: bonus 1.0, not the column.
    spec = {"fn": "rewards/user_rewards.py:shout", "kwargs": {"bonus": 1.0}}
    same(score([spec], completions, bonus=[5, 5, 5])[:, 0], [4, 0, 2])


def test_none_and_nan_mean_does_not_apply_and_numpy_and_bools_are_numbers(user_module):
    specs = [reward_spec({"fn": f"user_rewards:{f}"}) for f in ("none_for_short", "as_numpy", "as_bools")]
    rewards = score(specs, ["hi", "hello", "hello world"])  # [3, 3]
    same(rewards, [[NAN, 0, 1], [NAN, 1, 0], [1, 2, 1]])


# ------------------------------------------------------------------------------------- errors


def test_a_bad_reward_function_stops_with_one_line_naming_it_the_iteration_and_the_row(user_module):
    eight = ["c"] * 8
    ok = {"fn": "format"}
    assert error_of([ok, {"fn": "user_rewards:one_short", "name": "correct"}], eight, iteration=3) == (
        "reward 'correct' (iteration 3): returned 7 values for 8 completions"
    )
    assert error_of([{"fn": "user_rewards:as_dict"}], eight) == (
        "reward 'as_dict' (iteration 0): returned dict, expected a list of 8 numbers or None"
    )
    assert error_of([{"fn": "user_rewards:string_at_5", "name": "x"}], eight) == (
        "reward 'x' (iteration 0) row 5: returned 'abc', expected a number or None"
    )
    assert error_of([{"fn": "user_rewards:inf_at_2"}], eight) == (
        "reward 'inf_at_2' (iteration 0) row 2: returned inf, expected a finite number or None"
    )
    assert error_of([{"fn": "user_rewards:divides_by_zero", "name": "x"}], eight) == (
        "reward 'x' (iteration 0): raised ZeroDivisionError: division by zero"
    )
    assert error_of([{"fn": "user_rewards:strict_signature"}], ["c"], answer=["#### 1"]) == (
        "reward 'strict_signature' (iteration 0): raised TypeError: strict_signature() got an unexpected keyword argument 'answer'"
    )


def test_a_value_outside_the_declared_range_stops_the_stage_naming_the_reward_and_the_row(user_module):
    """`range:` is what the eval's intervals take as the values a function can give: a value past it is refused
    (the first such row named), None and NaN ("does not apply") and the ends themselves are not."""
    three = ["hi", "hello", "hello world"]
    assert error_of([{"fn": "format"}, {"fn": "user_rewards:as_numpy", "name": "n", "range": [0, 1]}], three, iteration=2) == (
        "reward 'n' (iteration 2) row 2: returned 2, outside its declared range [0, 1] (rewards.1.range)")
    assert error_of([{"fn": "contains", "kwargs": {"keyword": "hello"}, "range": [-0.5, 0.5]}], three) == (
        "reward 'contains' (iteration 0) row 1: returned 1, outside its declared range [-0.5, 0.5] (rewards.0.range)")
    same(score([{"fn": "user_rewards:as_numpy", "range": [0, 2]}, {"fn": "user_rewards:none_for_short", "range": [0.5, 1]}],
               three), [[0, NAN], [1, NAN], [2, 1]])


def test_loading_errors_name_the_config_entry(tmp_path, monkeypatch, user_module):
    monkeypatch.chdir(tmp_path)
    Path("foo.py").write_text("def baz(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    Path("broken.py").write_text("raise RuntimeError('boom')\n")
    first = {"fn": "format"}
    assert error_of([first, {"fn": "foo.py:bar"}], ["c"]) == "rewards[1].fn 'foo.py:bar': no function 'bar' in foo.py"
    assert error_of([first, {"fn": "missing.py:bar"}], ["c"]) == (
        f"rewards[1].fn 'missing.py:bar': no file missing.py (looked for {tmp_path / 'missing.py'})"
    )
    assert error_of([{"fn": "broken.py:f"}], ["c"]) == (
        "rewards[0].fn 'broken.py:f': importing broken.py raised RuntimeError: boom"
    )
    assert error_of([{"fn": "no_such_module_xyz:f"}], ["c"]) == (
        "rewards[0].fn 'no_such_module_xyz:f': no module 'no_such_module_xyz' (looked in the current directory and the environment)"
    )
    assert error_of([{"fn": "user_rewards:NOT_A_FUNCTION"}], ["c"]) == (
        "rewards[0].fn 'user_rewards:NOT_A_FUNCTION': 'NOT_A_FUNCTION' in user_rewards is not callable"
    )
    unknown = error_of([{"fn": "corect"}], ["c"])
    assert unknown.startswith("rewards: rewards.0.fn: 'corect' is not a built-in reward (built-ins: correct, format,")
    assert "did you mean 'correct'?" in unknown
    same(score([{"fn": "foo.py:baz"}], ["c", "d"])[:, 0], [0, 0])
    Path("grpo_cwd_rewards.py").write_text(Path("foo.py").read_text())
    same(score([{"fn": "grpo_cwd_rewards:baz"}], ["c", "d"])[:, 0], [0, 0])  # a module in the current directory
    monkeypatch.delitem(sys.modules, "grpo_cwd_rewards")


def test_builtin_options_are_checked_by_the_config():
    assert error_of([{"fn": "contains"}], ["c"]) == "rewards: rewards.0.kwargs.keyword: required key is missing"
    assert error_of([{"fn": "contains", "kwargs": {"keywrod": "x"}}], ["c"]) == (
        "rewards: rewards.0.kwargs.keywrod: contains has no option 'keywrod' (options: keyword, value, case_sensitive)"
    )
    assert error_of([{"fn": "length_range", "kwargs": {"unit": "chars"}}], ["c"]) == (
        "rewards: rewards.0.kwargs.unit: Input should be 'tokens' or 'words'"
    )
    bound = load_reward(reward_spec({"fn": "length_range", "kwargs": {"max_tokens": 5}}))
    assert bound.keywords == {"min_tokens": 0, "max_tokens": 5, "value": 1.0, "unit": "tokens"}


def test_inputs_that_do_not_line_up_are_refused():
    with pytest.raises(GRPOError, match=r"^rewards \(iteration 4\): 1 column 'answer' for 2 completions$"):
        compute_rewards([reward_spec({"fn": "format"})], ["p", "p"], ["a", "b"], [[1], [2]], {"answer": ["x"]}, iteration=4)
    with pytest.raises(GRPOError, match="dataset column 'completions' clashes"):
        compute_rewards([reward_spec({"fn": "format"})], ["p"], ["a"], [[1]], {"completions": ["x"]}, iteration=0)
