"""How tools reach the prompt, how calls are read from what the model wrote, and the template's
glue between turns, for one tokenizer.

Two formats (`rollout.tool_format`):
- template: the chat template's own tool support, as TRL uses it: the prompt is rendered with
  `tools=` (JSON schemas), assistant turns carry `tool_calls`, results are `tool` messages.
  Calls are parsed by the tokenizer's `response_template` (transformers' parse_response) when
  it has one, else as Hermes/Qwen `<tool_call>{json}</tool_call>` blocks when that is how the
  template renders a call, else as Llama 3.x's bare JSON (a turn that is one
  `{"name": ..., "parameters": {...}}` object, after an optional `<|python_tag|>`) when that is.
  `auto` picks it when the template renders a whole tool exchange (TRL's supports_tool_calling
  probe).
- hermes, the fallback for templates without tool support (SmolLM2's, the test model's): plain
  messages any template renders. The tool signatures go into the system message (Qwen 2.5's
  wording), calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the assistant's
  text, results come back as a user message of `<tool_response>\n...\n</tool_response>` blocks.

The glue (`glue_text`) is the text the template puts between the end of a model turn and the
start of the next: the tool messages and the next assistant header. It is the suffix of the
conversation rendered with the tool messages and a generation prompt over the one rendered
without them, cut after the turn's end-of-turn token; the sampled tokens themselves are never
re-tokenised. A template that renders earlier turns differently once more follow (not prefix-
preserving) is refused at `grpo init`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pipeline.errors import GRPOError

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_SENTINELS = ("tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", "tool_content_c4f9a8e2")


@dataclass
class Call:
    name: str | None  # None: the call could not be read (malformed)
    arguments: object  # a dict for a well-formed call; the raw text for a malformed one


def read_call(raw: str) -> Call:
    """One call written as JSON, {"name": ..., "arguments" or "parameters": {...} or its JSON
    text}; malformed (name None, the raw text kept) when it does not parse or has no name."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return Call(None, raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call(None, raw)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return Call(obj["name"], {} if args is None else args)


def parse_hermes(text: str) -> tuple[str, list[Call]]:
    """(content without the call blocks, calls) from `<tool_call>{json}</tool_call>` blocks."""
    return _CALL.sub("", text).strip(), [read_call(m.group(1)) for m in _CALL.finditer(text)]


_PYTHON_TAG = "<|python_tag|>"


def parse_json_call(text: str) -> tuple[str, list[Call]]:
    """Llama 3.x's calls: a turn that is one JSON object with a "name" and its "parameters" (or
    "arguments") is a call; a turn that starts like one and does not parse is a malformed call;
    anything else is the answer."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not re.match(r'\{\s*"name"\s*:', body):
        return text, []
    return "", [read_call(body)]


def hermes_system(schemas: list[dict]) -> str:
    return HERMES_SYSTEM.format(tools="\n".join(json.dumps(s, ensure_ascii=False) for s in schemas))


class ToolFormat:
    def __init__(self, tokenizer, kind: str, parser: str = "hermes"):
        self.tokenizer, self.kind, self.parser = tokenizer, kind, parser

    # ------------------------------------------------------------------------------ rendering
    def conversation(self, messages: list[dict], schemas: list[dict]) -> tuple[list[dict], dict]:
        """Episode messages (TRL's shapes) -> (messages to render, apply_chat_template kwargs)."""
        if self.kind == "template":
            return [_template_message(m) for m in messages], {"tools": schemas or None}
        out, pending = [], []
        for m in messages:
            if m["role"] == "tool":
                pending.append(f"<tool_response>\n{m['content']}\n</tool_response>")
                continue
            if pending:
                out.append({"role": "user", "content": "\n".join(pending)})
                pending = []
            out.append({"role": m["role"], "content": m.get("raw", m.get("content") or "")})
        if pending:
            out.append({"role": "user", "content": "\n".join(pending)})
        if schemas:
            block = hermes_system(schemas)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": (out[0]["content"] + "\n\n" if out[0]["content"] else "") + block}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out, {}

    def render(self, messages: list[dict], schemas: list[dict], generation_prompt: bool) -> str:
        msgs, kwargs = self.conversation(messages, schemas)
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)

    def glue_text(self, messages: list[dict], n_new: int, schemas: list[dict], eot: str, eot_sampled: bool) -> str:
        """The text between the last model turn's sampled tokens and the next turn: `messages`
        ends with that turn's assistant message and `n_new` tool messages. `eot`: the end-of-turn
        text; `eot_sampled`: whether the turn's tokens end with it (else the glue starts with it)."""
        before = self.render(messages[: len(messages) - n_new], schemas, False)
        after = self.render(messages, schemas, True)
        cut = before.rfind(eot)
        if cut < 0 or not after.startswith(before[:cut]):
            raise GRPOError("rollout.tools: the chat template renders earlier turns differently once tool messages follow "
                            "(not prefix-preserving); set rollout.tool_format: hermes")
        return after[cut + len(eot) if eot_sampled else cut:]

    # -------------------------------------------------------------------------------- parsing
    def parse(self, text: str, prefix: str) -> tuple[str, list[Call]]:
        """(content, calls) of one model turn's text."""
        if self.parser == "response_template":
            try:
                parsed = self.tokenizer.parse_response(text, prefix=prefix)
            except Exception:
                return text, ([Call(None, text)] if "<tool_call>" in text else [])
            calls = []
            for c in parsed.get("tool_calls") or []:
                f = c.get("function", c) if isinstance(c, dict) else None
                ok = isinstance(f, dict) and isinstance(f.get("name"), str)
                calls.append(Call(f["name"], f.get("arguments") or {}) if ok else Call(None, json.dumps(c, default=str)))
            return parsed.get("content") or "", calls
        if self.parser == "json":
            return parse_json_call(text)
        return parse_hermes(text)


def _template_message(m: dict) -> dict:
    if m["role"] == "assistant":
        calls = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in m.get("tool_calls") or [] if c.get("name") is not None and isinstance(c.get("arguments"), dict)]
        return {"role": "assistant", "content": m.get("content") or "", **({"tool_calls": calls} if calls else {})}
    if m["role"] == "tool":
        return {"role": "tool", "name": m.get("name") or "unknown", "content": m["content"]}
    return {"role": m["role"], "content": m["content"]}


def _renders(tokenizer, messages, **kw) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    except Exception:
        return None


def choose(tokenizer, option: str, model: str) -> tuple[ToolFormat, str | None]:
    """The format for `rollout.tool_format` on this tokenizer, and a note when auto fell back;
    GRPOError when neither the template nor the fallback can express a tool exchange."""
    if not getattr(tokenizer, "chat_template", None):
        raise GRPOError(f"rollout.tools: the tokenizer of {model} has no chat template, so tools cannot be rendered")
    name, key, val, content = _SENTINELS
    if option == "auto":
        call = {"type": "function", "function": {"name": name, "arguments": {key: val}}}
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "name": name, "content": content}]
        text = _renders(tokenizer, probe)
        if text is not None and all(s in text for s in _SENTINELS):
            if getattr(tokenizer, "response_template", None) is not None:
                return _checked(ToolFormat(tokenizer, "template", "response_template"), model), None
            if "<tool_call>" in text:
                return _checked(ToolFormat(tokenizer, "template", "hermes"), model), None
            if re.search(rf'\{{\s*"name"\s*:\s*"{name}"\s*,\s*"(?:parameters|arguments)"\s*:', text):  # Llama 3.x
                return _checked(ToolFormat(tokenizer, "template", "json"), model), None
            return _checked(ToolFormat(tokenizer, "hermes"), model), (
                f"the chat template of {model} renders tool calls in a format grpo cannot parse (no response_template); "
                "using the Hermes fallback (rollout.tool_format: hermes)")
        note = f"the chat template of {model} has no tool support; using the Hermes fallback (rollout.tool_format: hermes)"
        return _checked(ToolFormat(tokenizer, "hermes"), model), note
    return _checked(ToolFormat(tokenizer, "hermes"), model), None


def _checked(fmt: ToolFormat, model: str) -> ToolFormat:
    """A dummy exchange renders with every part visible, and the glue is a clean suffix."""
    name, key, val, content = _SENTINELS
    schema = {"type": "function", "function": {"name": name, "description": "probe", "parameters": {
        "type": "object", "properties": {key: {"type": "string", "description": "probe"}}, "required": [key]}}}
    raw = f'<tool_call>\n{{"name": "{name}", "arguments": {{"{key}": "{val}"}}}}\n</tool_call>'
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "raw": raw, "tool_calls": [{"name": name, "arguments": {key: val}}]},
            {"role": "tool", "name": name, "content": content}]
    try:
        text = fmt.render(msgs, [schema], True)
    except Exception as err:
        raise GRPOError(f"rollout.tools: the chat template of {model} can express neither tool calls nor the Hermes fallback "
                        f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    if not all(s in text for s in _SENTINELS):
        raise GRPOError(f"rollout.tools: the chat template of {model} drops part of a tool exchange, in its own format and in the "
                        "Hermes fallback; tools cannot be expressed for this model")
    fmt.glue_text(msgs, 1, [schema], fmt.tokenizer.eos_token or "", True)
    return fmt
