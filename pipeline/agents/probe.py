"""Choosing the tool format for a model's chat template (`choose`, for `rollout.tool_format`), and
`grpo init`'s probe of it, before any engine starts.

A sample exchange (a call with a string and an integer argument, then its result) must:
- render with every part visible (the call's name and arguments, the result);
- parse back, in the template's own call format, to the same call (`_round_trip`);
- give a clean glue (format.py's glue_text): the turn renders the same once the result follows it.
The model's turn is probed twice: as a bare call, and with thinking before it, written as the
template writes thinking (a `reasoning_content` / `thinking` field rendered through the template:
Qwen3's `<think>` block, gpt-oss's analysis channel; `<think>` in the Hermes fallback's text).
A template that renders past thinking differently once more messages follow would otherwise pass
here and stop the run at its first thinking turn. Each turn goes through the same path as an
episode's: the text a model writes, parsed by the format's parser, rendered from what it read.
The exchange is rendered with the run's tools (`tools=`), as a run renders it: some templates loop
over them (Hermes-2-Pro's `tool_use`). The turn a model writes is split from its prompt at a token
or tag boundary (`_boundary`): a generation prompt may end in thinking the history does not keep.
A note or a refusal names what the template writes (`_excerpt`, call_formats.WRITES).
"""

from __future__ import annotations

import json
import re

from pipeline.agents import call_formats, templates
from pipeline.agents.format import SENTINELS, Call, ToolFormat, opens_thinking
from pipeline.agents.templates import ChatTemplate
from pipeline.errors import GRPOError
from pipeline.models.stop_tokens import end_of_turn

THINK = "probe_thinking_e5b7c1d3"
USER = "probe_user_f2c8a6d0"


def _renders(tokenizer, messages, template: ChatTemplate, failed: list[str], **kw) -> str | None:
    """The rendering, or None with the error's first line put in `failed`."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template.text, **kw)
    except Exception as err:
        failed.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        return None


def choose(tokenizer, option: str, model: str) -> tuple[ToolFormat, str | None]:
    """The format for `rollout.tool_format` on this tokenizer, and a note when auto fell back;
    GRPOError when neither the template nor the fallback can express a tool exchange, when the
    template's own calls do not parse back, or when it renders a turn differently once a tool's
    result follows (`checked`, below); the template is the model's own or, where that one
    rewrites history, a training template (pipeline/agents/templates.py)."""
    if not getattr(tokenizer, "chat_template", None):
        raise GRPOError(f"rollout.tools: the tokenizer of {model} has no chat template, so tools cannot be rendered")
    name, key, val, content = SENTINELS
    eot = end_of_turn(tokenizer)
    tpl = templates.for_tools(tokenizer)
    if option == "auto":
        call = {"type": "function", "id": "call00001", "function": {"name": name, "arguments": {key: val}}}
        probe = [{"role": "user", "content": USER}, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "name": name, "tool_call_id": "call00001", "content": content}]
        failed: list[str] = []  # why the template could not render the exchange, if it could not
        text = _renders(tokenizer, probe, tpl, failed, tools=[_schema()])  # as a run renders: templates loop over `tools`
        if text is not None and all(s in text for s in SENTINELS):
            for what, pattern in call_formats.AFTER_TURN.items():
                if pattern.search(text):
                    raise GRPOError(f"rollout.tools: the chat template of {model} writes tool calls as {what}, which a model "
                                    "sampled to its end of turn cannot write; tools cannot be expressed for this model")
            if getattr(tokenizer, "response_template", None) is not None:
                return checked(ToolFormat(tokenizer, "template", "response_template", eot, tpl), model), None
            turn = text[text.find(USER) + len(USER):]  # the exchange, not the tool list before it
            family = call_formats.detect(turn, name)
            if family is not None:
                try:
                    return checked(ToolFormat(tokenizer, "template", family, eot, tpl), model), None
                except GRPOError as err:  # without the ids grpo gives calls, where the template renders without them?
                    if _renders(tokenizer, _without_ids(probe), tpl, [], tools=[_schema()]) is None:
                        raise
                    return checked(ToolFormat(tokenizer, "template", family, eot, tpl, call_ids=False), model), None
            writes = f"renders tool calls as {_excerpt(turn)!r}, a format grpo cannot parse (no response_template)"
            try:
                fallback = checked(ToolFormat(tokenizer, "hermes", eot=eot, template=tpl), model)
            except GRPOError as err:
                raise GRPOError(f"{err}; its own format: it {writes}") from None
            return fallback, f"the chat template of {model} {writes}; using the Hermes fallback (rollout.tool_format: hermes)"
        why = "fails on a tool exchange" if text is None else "has no tool support"
        try:
            fallback = checked(ToolFormat(tokenizer, "hermes", eot=eot, template=tpl), model)
        except GRPOError as err:
            raise GRPOError(f"{err}; its own template {why}" + (f" ({failed[0]})" if failed else "")) from None
        return fallback, (f"the chat template of {model} {why}" + (f" ({failed[0]})" if failed else "")
                          + "; using the Hermes fallback (rollout.tool_format: hermes)")
    return checked(ToolFormat(tokenizer, "hermes", eot=eot, template=tpl), model), None


def _without_ids(messages: list[dict]) -> list[dict]:
    """`messages` with no call ids, as TRL passes calls. A template that fails the checks with the ids grpo gives
    calls (`call00001`, ...) and renders without them runs without: one that writes ids only into history
    (Apriel 1.6's) would otherwise render a turn differently once its result follows, through grpo's ids, not
    its own doing; it is then accepted or refused for what fails without them. Every other template keeps the
    ids (Mistral's need them; Gemma's match a result to its call by them)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "tool_call_id"}
        if m.get("tool_calls"):
            m["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]
        out.append(m)
    return out


def checked(fmt: ToolFormat, model: str) -> ToolFormat:
    """`fmt`, once a sample exchange passes every check above; GRPOError naming the model and
    what fails, otherwise."""
    name, key, val, content = SENTINELS
    schema = _schema()
    call = {"name": name, "arguments": {key: val, "count": 7}}
    user, result = {"role": "user", "content": "hi"}, {"role": "tool", "name": name, "content": content}
    raw = f'<tool_call>\n{json.dumps(call)}\n</tool_call>'
    msgs = [user, {"role": "assistant", "content": "", "raw": raw, "tool_calls": [call]}, result]
    try:
        text = fmt.render(msgs, [schema], True)
    except Exception as err:
        raise GRPOError(f"rollout.tools: the chat template of {model} can express neither tool calls nor the Hermes fallback "
                        f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    if not all(s in text for s in SENTINELS):
        raise GRPOError(f"rollout.tools: the chat template of {model} drops part of a tool exchange, in its own format and in the "
                        "Hermes fallback; tools cannot be expressed for this model")
    for thinking in (False, True):
        turn = _written(fmt, user, call, schema, thinking) if fmt.kind == "template" else \
            (f"<think>\n{THINK}\n</think>\n\n" if thinking else "") + raw
        prompt = fmt.render([user], [schema], True)
        try:
            said, calls = fmt.parse(turn, prompt)
        except Exception as err:  # a tokenizer's own response_template may raise
            said, calls = turn, [Call(None, f"{type(err).__name__}: {err}")]
        if fmt.kind == "template":
            _round_trip(fmt, model, calls, call, thinking)
        ran = [{"name": c.name, "arguments": c.arguments} for c in calls if c.name is not None]
        episode = [user, {"role": "assistant", "content": said, "raw": turn, "tool_calls": ran}, result]
        stop = fmt.eot or fmt.tokenizer.eos_token or ""
        try:
            glue = fmt.glue_text(episode, 1, [schema], stop, True)
        except GRPOError as err:
            raise GRPOError(_not_prefix_preserving(fmt, model, thinking, str(err))) from None
        if stop and glue.lstrip().startswith(stop):  # the template moves its end of turn (Nemotron-Nano-v2: "\n<SPECIAL_12>")
            raise GRPOError(_not_prefix_preserving(fmt, model, thinking, (
                f"it writes {glue[:glue.index(stop) + len(stop)]!r} after the turn once the result follows, so the episode "
                f"would hold its end of turn {stop!r} twice")))
    return fmt


def _excerpt(turn: str) -> str:
    """How a template writes the sample call: its rendering from a little before the call's name to
    the tool's result, the sentinels named, whitespace collapsed, cut to 100 characters."""
    name, key, val, content = SENTINELS
    part = turn[: turn.find(content)] if content in turn else turn
    at = part.find(name)
    part = part[max(0, at - 48):]  # from just before the call's name, at a tag when one starts there
    tag = re.search(r"[<\[]", part[: min(48, at)])
    part = part[tag.start():] if tag else part
    for s, word in zip(SENTINELS, ("NAME", "KEY", "VALUE", "RESULT")):
        part = part.replace(s, word)
    part = re.sub(r"\s+", " ", part).strip()
    return part if len(part) <= 100 else part[:97] + "..."


def _schema() -> dict:
    """The sample tool: a string and an integer argument."""
    name, key, _, _ = SENTINELS
    return {"type": "function", "function": {"name": name, "description": "probe", "parameters": {
        "type": "object", "properties": {key: {"type": "string", "description": "probe"},
                                         "count": {"type": "integer", "description": "probe"}}, "required": [key]}}}


def _written(fmt: ToolFormat, user: dict, call: dict, schema: dict, thinking: bool) -> str:
    """What a model of this template writes for `call` (with thinking first): the assistant's part of
    the rendering, after the prompt's generation prompt, less its end of turn."""
    said = {"role": "assistant", "content": "", "tool_calls": [call]}
    if thinking:  # each template reads the field it knows
        said.update(reasoning_content=THINK, thinking=THINK)
    prompt = fmt.render([user], [schema], True)
    full = fmt.render([user, said], [schema], False)
    n = _boundary(fmt.tokenizer, full, next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b),
                                            min(len(prompt), len(full))))
    turn = full[n:].rstrip()
    turn = turn[: -len(fmt.eot)] if fmt.eot and turn.endswith(fmt.eot) else turn
    if opens_thinking(prompt) and "</think>" not in turn:  # the prompt opened thinking the history does not keep (QwQ-32B):
        turn = (f"{THINK}\n" if thinking else "") + "</think>\n\n" + turn  # the model closes it before its call
    return turn


_OPEN_TAG = re.compile(r"(?:<[^<>\s]*|\[[A-Z_]*)$")  # a tag or a bracket marker not yet closed


def _boundary(tokenizer, text: str, n: int) -> int:
    """`n` moved back to a token or tag boundary of `text`: the prompt and the rendered turn first
    differ inside a tag where the generation prompt ends in thinking the history does not keep
    (QwQ's `<think>\n` against `<tool_call>`, GLM-4.7's `<think>` against `</think>`): the turn
    starts at that tag, or at the special token that holds `n`."""
    for tok in getattr(tokenizer, "all_special_tokens", []) + list(getattr(tokenizer, "get_added_vocab", dict)()):
        if not tok:
            continue
        at = text.rfind(tok, 0, n)
        if at != -1 and at < n < at + len(tok):
            n = at
    m = _OPEN_TAG.search(text[:n])
    return m.start() if m else n


def _round_trip(fmt: ToolFormat, model: str, calls: list[Call], want: dict, thinking: bool) -> None:
    """The call the template wrote parses back to itself: same name, same arguments (an XML
    family's values as the strings it writes them in)."""
    ok = len(calls) == 1 and calls[0].name == want["name"] and isinstance(calls[0].arguments, dict) and \
        sorted(calls[0].arguments) == sorted(want["arguments"]) and \
        all(_same_value(calls[0].arguments[k], v) for k, v in want["arguments"].items())
    if not ok:
        label = "its response_template" if fmt.parser == "response_template" else \
            f"the {fmt.parser} call format ({call_formats.WRITES.get(fmt.parser, fmt.parser)})"
        got = [(c.name, c.arguments) for c in calls]
        raise GRPOError(f"rollout.tools: the chat template of {model} writes tool calls in {label}, but a sample call "
                        f"{'after thinking ' if thinking else ''}does not parse back (read {json.dumps(got, default=str)[:120]}); "
                        "set rollout.tool_format: hermes to use the Hermes fallback")


def _same_value(got, want) -> bool:
    return got == want or (isinstance(got, str) and not isinstance(want, str) and got.strip() == json.dumps(want))


def _not_prefix_preserving(fmt: ToolFormat, model: str, thinking: bool, why: str) -> str:
    """The one line for a template that renders a probed turn differently once its result follows."""
    detail = why.split("(", 1)[1].rsplit(")", 1)[0] if "(" in why else why
    turn = "a turn with thinking" if thinking else "a tool-calling turn"
    where = (f"in its own tool format ({fmt.parser}: {call_formats.WRITES.get(fmt.parser, fmt.parser)})"
             if fmt.kind == "template" else "in the Hermes fallback")
    was, _, becomes = detail.partition(" becomes ")
    if "call00001" in becomes and "call00001" not in was:  # the ids are the template's need, not grpo's choice (_without_ids)
        detail += "; it cannot render a call without an id and writes one into history only, where the model's turn holds none"
    elif thinking and THINK in was and THINK not in becomes:
        detail += "; it drops the turn's thinking from history"
    line = (f"rollout.tools: the chat template of {model} renders {turn} differently once the tool's result follows it, "
            f"{where} ({detail}), so the sampled tokens would not stay the conversation's history; "
            + (f"so does its training template {fmt.template.name}" if fmt.template.name != "model" else
               f"no training template is known for it (sha256 {fmt.template.sha256[:12]})"))
    if fmt.kind == "template":
        try:
            checked(ToolFormat(fmt.tokenizer, "hermes", eot=fmt.eot, template=fmt.template), model)
        except GRPOError:
            return line
        return line + "; rollout.tool_format: hermes passes this check"
    return line
