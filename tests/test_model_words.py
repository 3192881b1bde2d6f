"""The model's own words and the model's own distribution (issue 32, items 3 and 7).

Built-in rewards on a multi-turn episode read what the model wrote, not the tool results between
its turns; every length (the built-ins', `completions/*length*`, `eval/mean_length`) counts the
tokens it sampled. Your reward functions still get what TRL passes. And the HF engine samples
softmax(logits / T), whatever processors the model directory's generation_config.json asks for.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.config.errors import reward_spec
from pipeline.rewards.contract import compute_rewards

TOOLS = '''
def search(query: str) -> str:
    """Look a question up.

    Args:
        query: The question.
    """
    return "<answer>156</answer> banana\\n```python\\ndef f():\\n    return 156\\n```"
'''

REWARDS = '''
def ids_seen(prompts, completions, completion_ids, log_extra, **kwargs):
    """What TRL passes a reward function: every token of an episode, and its tool messages."""
    log_extra("ids", [len(i) for i in completion_ids])
    log_extra("messages", [len(c) for c in completions])
    return [0.0] * len(completions)
'''


def call_text(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


FIRST = "<think>look it up</think>\n" + call_text("search", {"query": "x"})
"""Every episode's first turn: a call whose result holds an <answer> block, `banana` and code."""
FINAL = {"12 * 13": "I do not know.", "13 * 12": "<think>the tool says so</think>\n<answer>156</answer>"}
"""The second (last) turn, by question: one gives up, one answers in the format."""


# ------------------------------------------------------------------------ the built-ins, by hand

def episode(final: str, result: str = "<answer>156</answer> is a banana") -> list[dict]:
    """An episode after the prompt as TRL passes it: a call, the tool's result, the last turn."""
    call = {"type": "function", "function": {"name": "search", "arguments": {"query": "x"}}}
    return [{"role": "assistant", "content": "<think>look it up</think>", "tool_calls": [call]},
            {"role": "tool", "name": "search", "content": result},
            {"role": "assistant", "content": final}]


def test_builtins_read_the_assistant_messages_and_count_the_model_tokens():
    completions = [episode("I do not know."), episode("<think>so</think><answer>156</answer>")]
    ids = [list(range(40)), list(range(48))]
    masks = [[1] * 5 + [0] * 30 + [1] * 5, [1] * 5 + [0] * 30 + [1] * 13]  # 10 and 18 model tokens
    specs = [reward_spec(s, j) for j, s in enumerate([
        {"fn": "correct"}, {"fn": "format"}, {"fn": "contains", "kwargs": {"keyword": "BANANA"}},
        {"fn": "contains", "name": "think", "kwargs": {"keyword": "look it up"}},
        {"fn": "overlong", "kwargs": {"max_tokens": 20, "buffer": 5}},
        {"fn": "length_range", "kwargs": {"min_tokens": 10, "max_tokens": 20}},
        {"fn": "length_range", "name": "words", "kwargs": {"unit": "words", "max_tokens": 4}},
    ])]
    got = compute_rewards(specs, [[{"role": "user", "content": "q"}]] * 2, completions, ids, {"answer": ["#### 156"] * 2},
                          iteration=0, completion_masks=masks)
    # correct: the tool's <answer>156</answer> does not count; format: the last turn alone is the answer;
    # contains: the tool's "banana" does not count, the model's own words do; overlong (L_max 20, L_cache 5)
    # on 10 and 18 model tokens: 0 and (15 - 18) / 5 = -0.6 (not -1 for 40 and 48 tokens); length_range:
    # 10 and 18 are in [10, 20]; words (at most 4): "<think>look it up</think>\nI do not know." is 7,
    # "<think>look it up</think>\n<think>so</think><answer>156</answer>" 4 (6 with the tool's "is a banana")
    np.testing.assert_allclose(got, [[0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0],
                                     [1.0, 1.0, 0.0, 1.0, -0.6, 1.0, 1.0]], atol=1e-12)


def test_code_tests_runs_the_code_of_the_final_answer():
    spec = reward_spec({"fn": "code_tests"}, 0)
    code = "```python\ndef f():\n    return 156\n```"
    completions = [episode("I could not write it.", result=code), episode(code, result="ok")]
    got = compute_rewards([spec], ["q", "q"], completions, [[1], [1]], {"tests": [["assert f() == 156"]] * 2}, iteration=0)
    assert got[:, 0].tolist() == [0.0, 1.0]  # the tool result's code is not the model's answer


def test_single_completions_read_as_before():
    """A single completion is its one assistant message: the masks change nothing."""
    specs = [reward_spec(s, j) for j, s in enumerate([
        {"fn": "correct"}, {"fn": "format"}, {"fn": "contains", "kwargs": {"keyword": "so"}},
        {"fn": "overlong", "kwargs": {"max_tokens": 8, "buffer": 4}}, {"fn": "length_range", "kwargs": {"max_tokens": 7}}])]
    texts = ["<think>so</think><answer>156</answer>", "<answer>155</answer> so", "no"]
    ids = [list(range(n)) for n in (5, 7, 9)]
    cols = {"answer": ["#### 156"] * 3}
    chat = [[{"role": "assistant", "content": t}] for t in texts]
    plain = compute_rewards(specs, ["q"] * 3, texts, ids, cols, iteration=0)
    masked = compute_rewards(specs, [[{"role": "user", "content": "q"}]] * 3, chat, ids, cols, iteration=0,
                             completion_masks=[None] * 3)
    # overlong (8, 4): 5 -> (4 - 5) / 4, 7 -> -0.75, 9 -> -1
    want = [[1.0, 1.0, 1.0, -0.25, 1.0], [0.0, 0.5, 1.0, -0.75, 1.0], [0.0, 0.0, 0.0, -1.0, 0.0]]
    np.testing.assert_allclose(plain, want, atol=1e-12)
    np.testing.assert_allclose(masked, want, atol=1e-12)


# --------------------------------------------------------------- through the record and the stages

class Scripted:
    """A sampler that writes given turns (this test is about what happens to them, not about
    sampling): the first turn of every episode calls `search`, the second answers by question."""

    def __init__(self, tok):
        self.tok = tok

    def turn(self, text: str):
        from pipeline.models.engines import Sample

        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return Sample(text, ids, [-0.5] * len(ids), "stop")

    def generate(self, prompt_ids, seeds, n, greedy=False, max_tokens=None):
        out = []
        for ids in prompt_ids:
            seen = self.tok.decode(ids)
            text = FIRST if seen.count("<|im_start|>assistant") == 1 else next(v for k, v in FINAL.items() if k in seen)
            out.append([self.turn(text)] * n)
        return out

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def tiny2k(assets, tmp_path_factory) -> str:
    """The session's tiny model with a 2048-token context: the Hermes tool block is ~700 of its tokens."""
    model = tmp_path_factory.mktemp("words-tiny2k") / "model"
    shutil.copytree(assets["model"], model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 2048}))
    return str(model)


def test_episode_rewards_and_lengths_through_rollout_score_and_eval(make_run, tiny2k, tmp_path):
    from transformers import AutoTokenizer

    from pipeline.eval.run import eval_summary, run_eval
    from pipeline.report.inspect import stage_metrics
    from pipeline.rollout import run_rollout
    from pipeline.score import run_score
    from pipeline.run.run import Run

    (tmp_path / "words_tools.py").write_text(TOOLS)
    (tmp_path / "words_rewards.py").write_text(REWARDS)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {q}?"}], "answer": "#### 156"}) + "\n"
                            for q in FINAL))
    engine = Scripted(AutoTokenizer.from_pretrained(tiny2k))
    model_tokens = {q: len(engine.turn(FIRST).token_ids) + len(engine.turn(t).token_ids) for q, t in FINAL.items()}
    lo, hi = min(model_tokens.values()), max(model_tokens.values())
    run = Run(make_run(
        "words", model=tiny2k, data={"train": str(rows), "eval": str(rows), "system_prompt": None},
        rollout={"tools": [f"{tmp_path / 'words_tools.py'}:search"], "num_generations": 2, "prompts_per_iter": 2,
                 "groups_per_part": 2, "max_new_tokens": 64, "max_episode_tokens": 600},
        rewards=[{"fn": "correct"}, {"fn": "format"}, {"fn": "contains", "kwargs": {"keyword": "banana"}},
                 {"fn": "overlong", "kwargs": {"max_tokens": hi + 1, "buffer": 1}},
                 {"fn": "length_range", "kwargs": {"min_tokens": lo, "max_tokens": hi}},
                 {"fn": f"{tmp_path / 'words_rewards.py'}:ids_seen", "name": "seen"}],
        eval={"every": 1, "max_prompts": 2}))
    run_rollout(run, 0, engine=engine)
    run_score(run, 0)
    it = Path(run.uri) / "iter-0000"
    roll = pq.read_table(it / "rollout/part-00000.parquet").to_pylist()
    score = pq.read_table(it / "score/part-00000.parquet").to_pylist()
    assert [(r["prompt_id"], r["sample_idx"]) for r in roll] == [(s["prompt_id"], s["sample_idx"]) for s in score]
    assert len(roll) == 4
    for r, s in zip(roll, score):
        q = list(FINAL)[r["prompt_id"]]
        rec = json.loads(r["episode"])
        assert [m["role"] for m in rec["messages"]] == ["assistant", "tool", "assistant"]
        assert "banana" in rec["messages"][1]["content"] and rec["ending"] == "answered"
        hidden = len(r["completion_ids"]) - sum(r["completion_mask"])
        assert hidden > 10  # the tool result and the template's glue
        assert r["completion_length"] == sum(r["completion_mask"]) == model_tokens[q] == rec["model_tokens"]
        answered = q == "13 * 12"
        assert s["reward_correct"] == float(answered)  # not the tool's <answer>156</answer>
        assert s["reward_format"] == float(answered)  # the last turn, not the episode's text
        assert s["reward_contains"] == 0.0  # "banana" is the tool's word
        assert s["reward_overlong"] == 0.0 and s["reward_length_range"] == 1.0  # model tokens, not + hidden
        # your function gets what TRL passes: every token, the tool message too
        assert s["extra_ids"] == len(r["completion_ids"]) and s["extra_messages"] == 3
    metrics = stage_metrics(run, 0, "rollout")
    lengths = [model_tokens[q] for q in FINAL for _ in range(2)]
    assert metrics["completions/mean_length"] == pytest.approx(np.mean(lengths))
    assert (metrics["completions/min_length"], metrics["completions/max_length"]) == (lo, hi)

    run_eval(run, 0, engine=engine)
    ev = pq.read_table(it / "eval/part-00000.parquet").to_pylist()
    assert [r["completion_length"] for r in ev] == [model_tokens[q] for q in FINAL]
    assert [r["correct"] for r in ev] == [False, True]
    summary = eval_summary(run, 0)
    assert summary["eval/mean_length"] == pytest.approx(np.mean(list(model_tokens.values())))
    assert summary["eval/accuracy"] == 0.5
    assert stage_metrics(run, 0, "eval")["eval/mean_length"] == summary["eval/mean_length"]


# ------------------------------------------------------------------- the HF engine's distribution

PROCESSORS = {
    "repetition_penalty": 2.0, "no_repeat_ngram_size": 2, "bad_words_ids": [[5], [6, 7]], "suppress_tokens": [8, 9],
    "begin_suppress_tokens": [10], "min_new_tokens": 6, "forced_eos_token_id": 11, "typical_p": 0.5,
    "epsilon_cutoff": 0.001, "exponential_decay_length_penalty": [2, 1.5], "renormalize_logits": True,
    "temperature": 0.3, "top_k": 3, "top_p": 0.5, "min_p": 0.2, "do_sample": False, "max_new_tokens": 3,
}
"""What a generation_config.json may ask `generate` for (Qwen2.5-Instruct: repetition_penalty 1.05)."""


def test_hf_engine_samples_softmax_of_logits_over_temperature_whatever_generation_config_says(assets, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config.rollout import RolloutConfig
    from pipeline.models.hf_engine import HFEngine

    plain, loaded = tmp_path / "plain", tmp_path / "loaded"
    shutil.copytree(assets["model"], plain)
    shutil.copytree(assets["model"], loaded)
    gen = json.loads((plain / "generation_config.json").read_text())  # the stop tokens (and pad)
    (loaded / "generation_config.json").write_text(json.dumps({**gen, **PROCESSORS}))
    tok = AutoTokenizer.from_pretrained(plain)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in ("What is 3 + 4?", "What is 12 - 5?")]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    cfg = RolloutConfig(engine="hf", max_new_tokens=16, temperature=0.7)
    a, b = HFEngine(plain, cfg, 512, seed=0), HFEngine(loaded, cfg, 512, seed=0)
    for greedy in (False, True):
        want, got = a.generate(prompt_ids, [3, 4], n=4, greedy=greedy), b.generate(prompt_ids, [3, 4], n=4, greedy=greedy)
        assert [[s.token_ids for s in g] for g in got] == [[s.token_ids for s in g] for g in want]
        assert [[s.logprobs for s in g] for g in got] == [[s.logprobs for s in g] for g in want]
    samples = b.generate(prompt_ids, [3, 4], n=4)
    assert len({tuple(s.token_ids) for g in samples for s in g}) > 1  # sampled, not greedy
    # what the trainer scores: log softmax(logits / T) of one forward over prompt + completion
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    for ids, group in zip(prompt_ids, samples):
        for s in group:
            with torch.no_grad():
                logits = model(torch.tensor([ids + s.token_ids])).logits[0, len(ids) - 1 : -1]  # [L, V]
            trainer = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]  # [L]
            np.testing.assert_allclose(s.logprobs, trainer.numpy(), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_vllm_engine_samples_softmax_of_logits_over_temperature_whatever_generation_config_says(assets, tmp_path):
    """vLLM reads a generation_config.json's sampling settings only as defaults for calls that pass
    none; the engine passes explicit SamplingParams, so only the stop tokens come from the file.
    And the files need not list them all (issue 32, item 4): this copy names only <|endoftext|>,
    yet each completion ends at the template's end of turn, <|im_end|>, kept as sampled."""
    from conftest import unlisted_end_of_turn
    from transformers import AutoTokenizer

    from pipeline.config.rollout import RolloutConfig
    from pipeline.logprobs import Batch, token_logprobs
    from pipeline.run.policy import load_model
    from pipeline.models.vllm_engine import VLLMEngine

    loaded = unlisted_end_of_turn(Path(assets["model"]), tmp_path / "loaded")
    gen = json.loads((loaded / "generation_config.json").read_text())
    (loaded / "generation_config.json").write_text(json.dumps({**gen, **PROCESSORS}))
    tok = AutoTokenizer.from_pretrained(loaded)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True, tokenize=False)
    prompt = [tok(chat, add_special_tokens=False)["input_ids"]]
    eng = VLLMEngine(loaded, RolloutConfig(max_new_tokens=24, temperature=0.7), 512, seed=0)
    samples = eng.generate(prompt, [5], n=4)[0]
    eng.close()
    assert max(len(s.token_ids) for s in samples) > 3  # not the file's max_new_tokens
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert eng.stop_ids == sorted({tok.convert_tokens_to_ids("<|endoftext|>"), im_end})
    assert any(s.finish_reason == "stop" for s in samples), [s.text for s in samples]  # the warm start answers in ~9 tokens
    for s in samples:  # no turn runs on past its end; the one that ends it stays, as with an eos
        assert im_end not in s.token_ids[:-1] and (s.token_ids[-1] == im_end) == (s.finish_reason == "stop"), s.text
        assert "<|im_end|>" not in s.text and len(s.logprobs) == len(s.token_ids)
    batch = Batch.build(prompt * 4, [s.token_ids for s in samples])
    with torch.no_grad():
        logp, _ = token_logprobs(load_model(loaded), batch, temperature=0.7)  # [4, T]
    for i, s in enumerate(samples):  # a repetition penalty of 2 would move these by far more than 2e-4
        np.testing.assert_allclose(s.logprobs, logp[i, : len(s.token_ids)].numpy(), atol=2e-4, rtol=0)
