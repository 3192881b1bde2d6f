"""`python -m bench.templates DIR [--tokenizer TOK] [--only NAME]`: grpo's tool probe on every chat
template (`*.jinja`) in DIR, as a user tries a template collection (llama.cpp's `models/templates/`;
tests/fixtures/llama_cpp_templates holds a pinned copy), printing one row a template and the counts.

Each template runs on SmolLM2-135M-Instruct's tokenizer files (the per-machine GGUF, as the tests get
it; `--tokenizer` names another tokenizer directory) twice:
- `own`: the tokenizer as it ships, the template's markers plain text (a model's own vocabulary
  rarely holds another vendor's markers);
- `marked`: the template's control tokens and tags added as special tokens, and a BOS token where the
  tokenizer has none (what the template's own model has).
A template is accepted when `grpo init`'s probe chooses a format (pipeline.agents.probe.choose) and,
in that format, a turn as the template writes it after its generation prompt (one call; two calls;
one call after thinking where the template keeps thinking), tokenised and split from the prompt at the
first differing token, reads back from its tokens to the same calls, and the glue after it holds the
tool's results and ends the conversation as the template renders it. A refusal is one line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# the markers templates write as special tokens: <|im_end|>, <start_of_turn>, [INST], <｜Assistant｜>, ...
SPECIAL = re.compile(r"<\|[^<>|\s'\"]+\|>|<[^<>|\s'\"]+\|>|<\|[^<>|\s'\"]+>|<｜[^｜]+｜>|\[/?[A-Z_]+\]|<(?:start|end)_of_turn>|</?s>")
# and the tags, so that a split between turns at a token boundary is a split at a tag boundary
TAGS = re.compile(r"</?[A-Za-z_][\w:.\-]*>|" + SPECIAL.pattern)

SCHEMAS = [{"type": "function", "function": {"name": name, "description": f"{name.title()} two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    for name in ("multiply", "add")]
USER = {"role": "user", "content": "What is 6 * 7 and 2 + 3?"}
CALLS = [{"name": "multiply", "arguments": {"a": 6, "b": 7}}, {"name": "add", "arguments": {"a": 2, "b": 3}}]
RESULTS = ["42", "6"]
THOUGHT = "I should multiply."


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2-135M-Instruct's tokenizer files, saved once beside the per-machine GGUF."""
    from transformers import AutoTokenizer

    from pipeline.run.gguf_import import models_cache, smollm2_gguf

    target = models_cache() / "SmolLM2-135M-Instruct-tokenizer"
    if not (target / "tokenizer_config.json").is_file():
        gguf = smollm2_gguf()
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(target)
    return target


def tokenizer(tok_dir: Path, text: str, marked: bool):
    """The tokenizer of `tok_dir` with `text` as its chat template; `marked`: its markers and tags as
    special tokens and a BOS token (see the module docstring)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    if marked:
        for pattern in (SPECIAL, TAGS):
            new = sorted(set(pattern.findall(text)) - set(tok.get_vocab()))
            if new:
                tok.add_special_tokens({"additional_special_tokens": new}, replace_extra_special_tokens=False)
        if tok.bos_token is None:
            tok.add_special_tokens({"bos_token": "<s>"})
    tok.chat_template = text
    return tok


def round_trip(fmt, tok, calls: list[dict], thinking: bool = False) -> str | None:
    """None when a turn making `calls` (after thinking) as this format writes it reads back from its
    tokens to the calls the template wrote and glues to its results as the template renders them; else
    what fails. A template that renders one call a turn (GigaChat 3.1's) writes only the first, and one
    that refuses two (Llama 3.x's) is a one-call format: nothing to check with two."""
    said = {"role": "assistant", "content": "", "tool_calls": [dict(c) for c in calls]}
    if thinking:
        said.update(reasoning_content=THOUGHT, thinking=THOUGHT)
    from pipeline.agents.format import opens_thinking
    from pipeline.agents.probe import _boundary
    from pipeline.errors import GRPOError

    stop = fmt.eot or tok.eos_token or ""

    prompt_text = fmt.render([USER], SCHEMAS, True)
    prompt = tok(prompt_text, add_special_tokens=False)["input_ids"]
    extends = True  # the prompt is the start of the template's rendering of the turn
    if fmt.kind == "template":  # the turn as the template writes it after its generation prompt (as the probe splits it)
        try:
            written = fmt.render([USER, said], SCHEMAS, False)
        except Exception:  # noqa: BLE001 - a template that refuses several calls a turn
            if len(calls) > 1:
                return None
            raise
        extends = written.startswith(prompt_text)
        if extends:  # one tokenisation of the whole, split at the first token past the prompt's, as an engine sees it
            full = tok(written, add_special_tokens=False)["input_ids"]
            k = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
            prompt, turn = full[:k], full[k:]
        else:  # the prompt ends in what the history does not keep (QwQ's `<think>\n`): the turn from the tag on
            n = _boundary(tok, written, next((i for i, (a, b) in enumerate(zip(prompt_text, written)) if a != b), len(written)))
            text = written[n:]
            if opens_thinking(prompt_text) and "</think>" not in text:  # the model closes the thinking its prompt opened
                text = (f"{THOUGHT}\n" if thinking else "") + "</think>\n\n" + text
            turn = tok(text, add_special_tokens=False)["input_ids"]
    else:  # the Hermes fallback: the calls as its system prompt asks for them
        think = f"<think>\n{THOUGHT}\n</think>\n\n" if thinking else ""
        turn = tok(think + "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls), add_special_tokens=False)["input_ids"]
    while turn and tok.decode(turn[-1:]).strip() == "":  # the newlines after the turn's end
        turn = turn[:-1]
    eot = tok.convert_tokens_to_ids(fmt.eot) if fmt.eot else None
    ended = bool(turn) and turn[-1] == eot
    content, got = fmt.parse_turn(turn, prompt, {eot} if eot is not None else set())
    read = [(c.name, {k: str(v) for k, v in c.arguments.items()} if isinstance(c.arguments, dict) else c.arguments) for c in got]
    turn_text = tok.decode(turn, skip_special_tokens=False)
    calls = [c for c in calls if fmt.kind != "template" or c["name"] in turn_text]  # the calls the template wrote
    want = [(c["name"], {k: str(v) for k, v in c["arguments"].items()}) for c in calls]
    if read != want:
        return f"{len(calls)} call(s){' after thinking' if thinking else ''} read back as {json.dumps(read)[:80]}"
    text = tok.decode(turn[:-1] if ended else turn, skip_special_tokens=False)  # the engine's text: less its stop token
    history = {"role": "assistant", "content": content, "raw": text, "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in got]}
    episode = [USER, history] + [{"role": "tool", "name": c["name"], "content": r} for c, r in zip(calls, RESULTS)]
    try:
        glue = fmt.glue_text(episode, len(calls), SCHEMAS, stop, ended or not fmt.eot)
    except GRPOError as err:
        return str(err)
    rendered = fmt.render(episode, SCHEMAS, True)
    if not all(r in glue for r in RESULTS[: len(calls)]) or not rendered.endswith(glue):
        return f"{len(calls)} call(s): the glue {glue[:60]!r} is not the template's"
    if fmt.kind == "template" and not thinking and extends:  # the sampled turn and its glue: the conversation as the template renders it
        truth = fmt.render([USER, said] + episode[2:], SCHEMAS, True)  # the calls as made, not as read
        if tok.decode(prompt + turn, skip_special_tokens=False) + glue != truth:
            return f"{len(calls)} call(s){' after thinking' if thinking else ''}: the episode differs from the template's rendering"
    return None


def thinks(fmt) -> bool:
    """The template keeps a turn's thinking in its history (renders the sample thought)."""
    said = {"role": "assistant", "content": "", "tool_calls": [CALLS[0]], "reasoning_content": THOUGHT, "thinking": THOUGHT}
    try:
        return THOUGHT in fmt.render([USER, said, {"role": "tool", "name": "multiply", "content": "42"}], SCHEMAS, False)
    except Exception:
        return False


def trial(tok_dir: Path, name: str, text: str, marked: bool) -> tuple[bool, str]:
    """(accepted, the format or the refusal's line) of one template in one mode."""
    from pipeline.agents.probe import choose
    from pipeline.errors import GRPOError

    tok = tokenizer(tok_dir, text, marked)
    try:
        fmt, note = choose(tok, "auto", name)
    except GRPOError as err:
        return False, str(err)
    for calls, thinking in ((CALLS[:1], False), (CALLS, False), (CALLS[:1], True)):
        if thinking and not thinks(fmt):
            continue
        try:
            why = round_trip(fmt, tok, calls, thinking)
        except Exception as err:  # noqa: BLE001 - a bench row, not a crash
            why = f"{type(err).__name__}: {err}"
        if why is not None:
            return False, f"accepted by the probe ({fmt.kind} {fmt.parser}) but {why}"
    return True, f"{fmt.kind} {fmt.parser}" + (f" ({note})" if note else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.templates", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a folder of *.jinja chat templates (llama.cpp's models/templates)")
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer directory (default: SmolLM2-135M-Instruct's)")
    ap.add_argument("--only", action="append", default=[], help="a template's file name without .jinja (repeatable)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    files = sorted(args.dir.glob("*.jinja"))
    if args.only:
        files = [f for f in files if f.stem in args.only]
    if not files:
        print(f"bench.templates: no *.jinja file in {args.dir}" + (f" named {args.only}" if args.only else ""), file=sys.stderr)
        return 2
    tok_dir = args.tokenizer or smollm2_tokenizer_dir()
    rows, both = [], 0
    print("| template | own vocabulary | markers as special tokens |\n|---|---|---|")
    for f in files:
        text = f.read_text()
        own, marked = trial(tok_dir, f.stem, text, False), trial(tok_dir, f.stem, text, True)
        rows.append({"template": f.stem, "own": own, "marked": marked})
        both += own[0] and marked[0]
        cell = lambda r: ("accepted: " if r[0] else "refused: ") + r[1].replace("|", "\\|").replace("\n", " ")
        print(f"| {f.stem} | {cell(own)} | {cell(marked)} |", flush=True)
    n_own, n_marked = sum(r["own"][0] for r in rows), sum(r["marked"][0] for r in rows)
    print(f"\n{len(rows)} templates: accepted {n_own} on the tokenizer's own vocabulary, {n_marked} with the markers as "
          f"special tokens, {both} in both; refused in both {sum(not r['own'][0] and not r['marked'][0] for r in rows)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
