"""llama.cpp's templates (tests/fixtures/llama_cpp_templates) where a user's trial found grpo wrong
(issue 64): call ids given where the template writes them only into history (Apriel), MiniMax-M2's
own format, Llama 3.x's and GigaChat 3.1's calls on a vocabulary without their markers, Phi-3.5's
fallback glue, and GigaChat 3.1's one call a message. Each test failed before its change.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_vendor_templates import LLAMA_CPP, llama_cpp_tokenizer

SCHEMA = {"type": "function", "function": {"name": "multiply", "description": "Multiply two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
USER = {"role": "user", "content": "What is 6 * 7?"}
CALL = {"name": "multiply", "arguments": {"a": 6, "b": 7}}


def template(name: str) -> str:
    return (LLAMA_CPP / f"{name}.jinja").read_text()


def own_vocabulary(tok_dir: Path, text: str):
    """The tiny model's tokenizer as it ships, `text` its chat template: the template's markers are plain text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.chat_template = text
    return tok


def episode_after(fmt, tok, turn_text: str, results: list[str]):
    """(calls read, glue) for a model turn `turn_text` after the prompt, as an episode reads and glues it."""
    prompt = tok(fmt.render([USER], [SCHEMA], True), add_special_tokens=False)["input_ids"]
    ids = tok(turn_text, add_special_tokens=False)["input_ids"]
    eot = tok.convert_tokens_to_ids(fmt.eot) if fmt.eot else None
    content, calls = fmt.parse_turn(ids, prompt, {eot} if eot is not None else set())
    raw = turn_text.removesuffix(fmt.eot) if fmt.eot else turn_text  # the engine's text: without the stop token
    said = {"role": "assistant", "content": content, "raw": raw,
            "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls if c.name is not None]}
    episode = [USER, said] + [{"role": "tool", "name": "multiply", "content": r} for r in results]
    stop = fmt.eot or tok.eos_token
    return content, calls, fmt.glue_text(episode, len(results), [SCHEMA], stop, True), fmt.render(episode, [SCHEMA], True)


def test_calls_go_without_ids_where_grpos_ids_alone_break_the_template(assets):
    """Apriel 1.6 writes a call's id (`"id": ...`) into every turn but the last: grpo gave each call one, so the
    probe refused the template for rendering a turn differently once its result follows, blaming the template for
    grpo's own ids (TRL passes calls without). Now such a template's calls go without ids: its bare calls pass, and
    it is refused for the real cause, its history drops a turn's thinking (`[BEGIN FINAL RESPONSE]`: only the final
    response of an earlier turn stays). Apriel 1.5 cannot render a call without an id (`tool_call['id']`) and still
    writes it only into history: refused naming that. Mistral's templates refuse calls without ids: they keep
    `call00001`, ..."""
    from pipeline.agents.probe import checked, choose
    from pipeline.agents.format import ToolFormat
    from pipeline.errors import GRPOError

    tok = llama_cpp_tokenizer(Path(assets["model"]), template("Apriel-1.6-15b-Thinker-fixed"))
    with pytest.raises(GRPOError, match=r"renders a turn with thinking differently .*it drops the turn's thinking from history"):
        choose(tok, "auto", "apriel-1.6")
    fmt = ToolFormat(tok, "template", "apriel", call_ids=False)
    text = fmt.render([USER, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                       {"role": "tool", "name": "multiply", "content": "42"}], [SCHEMA], True)
    assert '"id"' not in text and '<tool_calls>[{"name": "multiply", "arguments": {"a": 6, "b": 7}}]</tool_calls>' in text
    turn = '<tool_calls>[{"name": "multiply", "arguments": {"a": 6, "b": 7}}]</tool_calls>'
    content, calls, glue, rendered = episode_after(fmt, tok, turn, ["42"])
    assert [(c.name, c.arguments) for c in calls] == [("multiply", {"a": 6, "b": 7})] and rendered.endswith(glue)
    assert rendered.endswith(turn + glue)  # the bare call stays as the model wrote it once its result follows

    tok = llama_cpp_tokenizer(Path(assets["model"]), template("unsloth-Apriel-1.5"))
    with pytest.raises(GRPOError, match=r"cannot render a call without an id and writes one into history only"):
        choose(tok, "auto", "apriel-1.5")

    for name in ("Mistral-Small-3.2-24B-Instruct-2506", "mistralai-Mistral-Nemo-Instruct-2407"):
        fmt, _ = choose(llama_cpp_tokenizer(Path(assets["model"]), template(name)), "auto", name)
        assert fmt.call_ids, name
        assert "call00001" in fmt.render([USER, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                                          {"role": "tool", "name": "multiply", "content": "42"}], [SCHEMA], True)
    with pytest.raises(GRPOError):  # without ids it cannot render, so the probe would not pass it either
        checked(ToolFormat(fmt.tokenizer, "template", fmt.parser, fmt.eot, call_ids=False), name)


def test_minimax_m2_calls_read_in_its_own_format_with_its_thinking_kept(assets):
    """MiniMax-M2 writes `<minimax:tool_call><invoke name=...><parameter name=...>` and keeps a turn's thinking in
    history while no user message follows, as in a tool episode. Was: no format read it, and in the Hermes fallback
    its tool results are user messages, after which it drops the thinking: refused. Now its own format: a turn
    after the `<think>\\n` its prompt opens reads as its thinking, content and every invoke; the glue after it is the
    template's, and the whole episode is the template's rendering of the conversation with the thinking."""
    from pipeline.agents.probe import choose

    for tok in (llama_cpp_tokenizer(Path(assets["model"]), template("MiniMax-M2")), own_vocabulary(Path(assets["model"]), template("MiniMax-M2"))):
        fmt, note = choose(tok, "auto", "minimax-m2")
        assert (fmt.kind, fmt.parser, note) == ("template", "minimax", None)
        prompt = fmt.render([USER], [SCHEMA], True)
        assert prompt.endswith("]~b]ai\n<think>\n")
        turn = ('I should multiply.\n</think>\n\nLet me.\n<minimax:tool_call>\n<invoke name="multiply">\n<parameter name="a">6'
                '</parameter>\n<parameter name="b">7</parameter>\n</invoke>\n<invoke name="multiply">\n<parameter name="a">2'
                '</parameter>\n<parameter name="b">3</parameter>\n</invoke>\n</minimax:tool_call>[e~[')
        content, calls, glue, rendered = episode_after(fmt, tok, turn, ["42", "6"])
        assert content == "Let me." and [(c.name, c.arguments) for c in calls] == [("multiply", {"a": "6", "b": "7"}),
                                                                                   ("multiply", {"a": "2", "b": "3"})]
        assert glue == "\n]~b]tool\n<response>42</response>\n<response>6</response>[e~[\n]~b]ai\n<think>\n"
        made = {"role": "assistant", "content": "Let me.", "reasoning_content": "I should multiply.",
                "tool_calls": [CALL, {"name": "multiply", "arguments": {"a": 2, "b": 3}}]}
        kept = fmt.render([USER, made, {"role": "tool", "name": "multiply", "content": "42"},
                           {"role": "tool", "name": "multiply", "content": "6"}], [SCHEMA], True)
        assert prompt + turn + glue == kept  # the thinking stays as the template keeps it
        for bad in ('<minimax:tool_call>\n<invoke name="multiply">\n<parameter name="a">6</parameter>',  # never closed
                    '<minimax:tool_call>\nmultiply(6, 7)\n</minimax:tool_call>'):
            ids = tok("</think>\n\n" + bad, add_special_tokens=False)["input_ids"]
            assert [c.name for c in fmt.parse_turn(ids, tok(prompt, add_special_tokens=False)["input_ids"], set())[1]] == [None]


@pytest.mark.parametrize("name", ["meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
                                  "meta-llama-Llama-3.3-70B-Instruct", "GigaChat3.1-10B-A1.8B"])
def test_calls_read_back_on_a_vocabulary_without_the_templates_markers(assets, name):
    """On a tokenizer whose vocabulary lacks the template's end of turn as a token (`<|eot_id|>`,
    `<|message_sep|>`: the model writes it as text before the token it stops on), Llama 3.x's json call and
    GigaChat 3.1's `<|function_call|>` call read back. Was: the end-of-turn text made the call's JSON unreadable,
    so the probe refused a format whose call reads back and glues. Text after the call that is not the end of turn
    still makes it malformed."""
    from pipeline.agents.probe import choose

    tok = own_vocabulary(Path(assets["model"]), template(name))
    fmt, note = choose(tok, "auto", name)
    assert (fmt.kind, fmt.parser, note) == ("template", "gigachat" if "Giga" in name else "json", None)
    end = "<|message_sep|>" if "Giga" in name else "<|eot_id|>"
    body = '{"name": "multiply", "arguments": {"a": 6, "b": 7}}' if "Giga" in name else \
        '{"name": "multiply", "parameters": {"a": 6, "b": 7}}'
    opener = "<|function_call|>" if "Giga" in name else ""
    content, calls, glue, rendered = episode_after(fmt, tok, opener + body + end, ["42"])
    assert [(c.name, c.arguments) for c in calls] == [("multiply", {"a": 6, "b": 7})] and content == ""
    assert "42" in glue and rendered.endswith(glue)
    _, calls = fmt.parse_turn(tok(opener + body + " and more" + end, add_special_tokens=False)["input_ids"], [], set())
    assert [c.name for c in calls] == [None]


def test_gigachat_holds_every_call_of_a_turn_in_its_history(assets):
    """GigaChat 3.1's template renders one call a message (`message.tool_calls[0]`): a turn whose
    `<|function_call|>` holds a list ran every call in it while the history the template renders holds only the
    first. Now a turn holds one object, as the template writes it; a list is a malformed call (which ends the
    episode, as any malformed call does), so every call that runs is in the history."""
    from pipeline.agents.probe import choose

    tok = llama_cpp_tokenizer(Path(assets["model"]), template("GigaChat3.1-10B-A1.8B"))
    fmt, _ = choose(tok, "auto", "gigachat")
    two = '<|function_call|>[{"name": "multiply", "arguments": {"a": 6, "b": 7}}, {"name": "multiply", "arguments": {"a": 2, "b": 3}}]'
    _, calls = fmt.parse_turn(tok(two, add_special_tokens=False)["input_ids"], [], set())
    assert [(c.name, c.arguments) for c in calls] == [(None, two)]
    one = '<|function_call|>{"name": "multiply", "arguments": {"a": 6, "b": 7}}'
    _, calls, glue, rendered = episode_after(fmt, tok, one, ["42"])
    assert [(c.name, c.arguments) for c in calls] == [("multiply", {"a": 6, "b": 7})]
    history = rendered[: len(rendered) - len(glue)]
    assert history.count("<|function_call|>") == 1 + fmt.render([USER], [SCHEMA], True).count("<|function_call|>")


def test_phi35_fallback_glue_is_what_the_template_renders(assets):
    """Phi-3.5-mini's template ends a conversation with eos after its last message (`{{ eos_token }}` without a
    generation prompt), not a turn: the glue was cut at that eos, so with `<|end|>` a token the probe refused the
    fallback as not prefix-preserving, and without it the glue lost the newline the template writes after
    `<|end|>`. Now the turn ends at `<|end|>` and the glue is the template's: the episode (turn, its end of turn,
    glue) is the template's rendering of the fallback's conversation."""
    from pipeline.agents.probe import choose

    raw = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
    tok = llama_cpp_tokenizer(Path(assets["model"]), template("microsoft-Phi-3.5-mini-instruct"))
    fmt, note = choose(tok, "auto", "phi-3.5")
    assert (fmt.kind, fmt.eot) == ("hermes", "<|end|>") and "has no tool support" in note
    _, calls, glue, rendered = episode_after(fmt, tok, raw + "<|end|>", ["42"])
    assert glue == "\n<|user|>\n<tool_response>\n42\n</tool_response><|end|>\n<|assistant|>\n"
    assert fmt.render([USER], [SCHEMA], True) + raw + "<|end|>" + glue == rendered
    tok = own_vocabulary(Path(assets["model"]), template("microsoft-Phi-3.5-mini-instruct"))
    fmt, _ = choose(tok, "auto", "phi-3.5")
    _, _, glue, rendered = episode_after(fmt, tok, raw + "<|end|>", ["42"])
    assert glue == "\n<|user|>\n<tool_response>\n42\n</tool_response><|end|>\n<|assistant|>\n"  # after the turn's own <|end|>
