"""A case on multi-turn tool episodes: the ids trained are the ids sampled, never a re-tokenisation.

An episode is turns the engine sampled, with the template's glue and the tool results between them.
Rendering the finished conversation and tokenising it again does not give the sampled ids back: a
BPE tokeniser merges text that the sampler emitted as separate tokens ('a', 'b' -> 'ab'), and the
joins between turns and glue tokenise differently as one string. Training on those ids trains tokens
the policy never sampled, against logprobs of other tokens.

The implementation asked is an `Assembler`: `episode(turns)` -> the row's (completion_ids,
completion_mask, sampler_logprobs) after the sampled turns `turns` (pipeline.models.engines.Sample),
on a one-tool Hermes episode. grpo's runs its real EpisodeRunner (`_after_turn`, ToolFormat.glue,
`row`) on a small byte-level BPE tokenizer built here whose one merge is 'a' + 'b'; the broken one
re-tokenises the rendered completion and rebuilds the mask from the turns' character spans.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

from pipeline.conformance.case import Case

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def merging_tokenizer():
    """A byte-level BPE (Qwen2's pre-tokenizer, ChatML) with one merge, 'a' + 'b' -> 'ab'."""
    from tokenizers import pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab = {t: i for i, t in enumerate([PAD, IM_START, IM_END, *sorted(pre_tokenizers.ByteLevel.alphabet()), "ab"])}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[("a", "b")], eos_token=IM_END, pad_token=PAD, unk_token=None,
                         extra_special_tokens=[IM_START], clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML
    return tok


def sampled(tok, text: str):
    """A turn as a sampler may emit it: one token per character ('a', 'b', never 'ab'), then the
    end-of-turn token; logprob -0.1 - 0.001 i on token i, so every sampled token's is distinct."""
    from pipeline.models.engines import Sample

    ids = [tok(ch, add_special_tokens=False)["input_ids"][0] for ch in text] + [tok.eos_token_id]
    assert all(len(tok(ch, add_special_tokens=False)["input_ids"]) == 1 for ch in text), text  # ASCII: one byte each
    return Sample(text, ids, [-0.1 - 0.001 * i for i in range(len(ids))], "stop")


@dataclass(frozen=True)
class Assembler:
    tok: object
    episode: Callable  # (turns: list[Sample]) -> (completion_ids, completion_mask, sampler_logprobs)


def _run_episode(tok, turns) -> tuple[object, dict, object]:
    """(episode, row, format): grpo's EpisodeRunner on a one-tool Hermes episode, fed `turns` as the engine's samples."""
    from pipeline.agents.episode import EpisodeRunner
    from pipeline.agents.probe import choose
    from pipeline.agents.tools import tool_schema
    from pipeline.config.rollout import RolloutConfig
    from pipeline.data.prompts import Prompt

    fmt, _ = choose(tok, "hermes", "conformance")
    agents = SimpleNamespace(tools={"add": add}, schemas=[tool_schema(add, "add")], env_classes={}, format=fmt,
                             stop_ids=[tok.eos_token_id])
    cfg = RolloutConfig(max_new_tokens=128, max_episode_tokens=2048, max_turns=4)
    runner = EpisodeRunner(agents, tok, cfg, SimpleNamespace(system_prompt=None, prompt_column="prompt"), max_prompt_len=4096)
    e = runner.start(Prompt(0, "What is 2 + 3? Say ab.", "", [], {}), 0, 0, 1, "conformance")
    for i, s in enumerate(turns):
        going = runner._after_turn(e, s, cfg.max_new_tokens)
        assert going == (i < len(turns) - 1), (i, e.ending)  # a call goes on; the last turn answers
    return e, runner.row(e, "conformance"), fmt


def grpo_assembler() -> Assembler:
    tok = merging_tokenizer()

    def episode(turns):
        _, row, _ = _run_episode(tok, turns)
        return row["completion_ids"], row["completion_mask"], row["sampler_logprobs"]

    return Assembler(tok, episode)


def retokenising_assembler() -> Assembler:
    """TRL's tool loop before #5242 (TRL #5224), rllm's fallback (#816): the finished conversation rendered
    by the template and tokenised again; the assistant tokens are those whose characters lie in a turn's
    text (and its end-of-turn token), the sampler's logprobs laid on them in order."""
    tok = merging_tokenizer()

    def episode(turns):
        from pipeline.agents.episode import _prompt_messages, _render_message

        e, _, fmt = _run_episode(tok, turns)
        msgs = _prompt_messages(e, SimpleNamespace(system_prompt=None)) + [_render_message(m) for m in e.messages]
        full = fmt.render(msgs, e.schemas, False)
        assert full.startswith(e.prompt_text), "the template rewrote the prompt"
        spans, at = [], len(e.prompt_text)
        for m in e.messages:
            if m["role"] == "assistant":
                start = full.index(m["text"] + IM_END, at)
                spans.append((start, start + len(m["text"]) + len(IM_END)))
                at = spans[-1][1]
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        kept = [(t, s) for t, (s, _) in zip(enc["input_ids"], enc["offset_mapping"]) if s >= len(e.prompt_text)]
        mask = [int(any(a <= s < b for a, b in spans)) for _, s in kept]
        lps = iter([lp for t in turns for lp in t.logprobs])
        return [t for t, _ in kept], mask, [next(lps, 0.0) if m else 0.0 for m in mask]

    return Assembler(tok, episode)


def exact_ids_experiment(a: Assembler) -> tuple[bool, str]:
    tok = a.tok
    call = '<tool_call>\n' + json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}}) + '\n</tool_call>'
    turns = [sampled(tok, "ab, then I call" + call), sampled(tok, "absolutely: 5")]
    merges = tok("ab", add_special_tokens=False)["input_ids"]  # one id: re-tokenising the sampled 'a','b' differs
    ids, mask, lps = a.episode(turns)
    want = [t for s in turns for t in s.token_ids]
    got = [t for t, m in zip(ids, mask) if m == 1]
    got_lp = [lp for lp, m in zip(lps, mask) if m == 1]
    want_lp = [lp for s in turns for lp in s.logprobs]
    # expected: the mask-1 ids are the sampled ids exactly, in order (2 turns, each ending in <|im_end|>),
    # each with its sampler logprob; a re-tokenisation merges the sampled 'a','b' into 'ab' (2 of them here)
    ok = len(merges) == 1 and got == want and got_lp == want_lp and len(ids) == len(mask) == len(lps)
    first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    return ok, (f"mask-1 ids: {len(got)}, sampled: {len(want)}, equal: {got == want}"
                + ("" if got == want else f" (first difference at token {first})") + f"; logprobs equal: {got_lp == want_lp}")


def cases() -> list[Case]:
    return [
        Case("multi-turn-ids-as-sampled", "a multi-turn episode trains the ids sampled, never a re-tokenised history",
             "TRL #5224, fixed by #5242; rllm #816 (open)", "ids[mask = 1] = concat(sampled turn ids) exactly, logprobs likewise (turns whose 'a','b' BPE merges to 'ab')",
             exact_ids_experiment, grpo_assembler, retokenising_assembler,
             trl_na="not measured: TRL's tool loop (concatenating ids since #5242) runs inside its own generation; it cannot be fed these turns"),
    ]
