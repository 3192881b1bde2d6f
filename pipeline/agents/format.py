"""How tools reach the prompt, how calls are read from what the model wrote, and the template's
glue between turns, for one tokenizer.

Two formats (`rollout.tool_format`):
- template: the chat template's own tool support, as TRL uses it: the prompt is rendered with
  `tools=` (JSON schemas), assistant turns carry `tool_calls`, results are `tool` messages.
  Calls are parsed by the tokenizer's `response_template` (transformers' parse_response) when
  it has one, else in the family the template writes a sample call in (call_formats: Hermes
  JSON, Llama's bare JSON, Qwen3-Coder/Qwen3.5 XML, GLM-4.5, Mistral, gpt-oss's harmony, LFM2's
  Python calls). `auto` picks it when the
  template renders a whole tool exchange (TRL's supports_tool_calling probe) in a known family.
- hermes, the fallback for templates without tool support (SmolLM2's, the test model's): plain
  messages any template renders. The tool signatures go into the system message (Qwen 2.5's
  wording), calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the assistant's
  text, results come back as a user message of `<tool_response>\n...\n</tool_response>` blocks.
`grpo init` renders a sample call through the template and parses it back; a format that does not
give back the same call is refused there.

A turn is parsed from its token ids decoded with special tokens kept (Mistral's `[TOOL_CALLS]` and
Llama's `<|python_tag|>` are special tokens), less the stop token that ended it.

The glue (`glue_text`) is the text the template puts between the end of a model turn and the
start of the next: the tool messages and the next assistant header. It is the suffix of the
conversation rendered with the tool messages and a generation prompt over the one rendered
without them, from the template's end of the assistant turn (its end-of-turn token, `eot`, when
it renders one there; pipeline/models/stop_tokens.py finds it, and the engines stop on it); the
sampled tokens themselves are never re-tokenised. The tool results in the glue are outside text:
`glue` gives their spans too, and they are tokenised as text (inserted.py). A turn that ended in the token the glue starts
with (the template's end of turn, or GLM's `<|observation|>`) does not get it twice. A turn that ended in another stop token the model can sample (Qwen's `<|endoftext|>`,
Llama 3.1's `<|eom_id|>`) keeps it, as sampled and trained on; it stands in for the template's end
of turn, and the glue goes on after that, as TRL appends its tool suffix after whatever eos ended
the completion. An eos the template writes after its end of turn only where a conversation ends
(Phi-3.5's `{{ eos_token }}` without a generation prompt) is not part of the turn. The template must
render earlier turns the same once more follow (prefix-
preserving): where a vendor's does not, its training template is rendered instead (templates.py,
as TRL swaps one in); one that still does not, for a bare call or a turn with thinking, is refused
at `grpo init` with what changes (probe.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pipeline.agents import call_formats, inserted, templates
from pipeline.agents.call_formats import SPECS
from pipeline.agents.templates import ChatTemplate
from pipeline.errors import GRPOError

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_THINK = re.compile(r"<think>.*?(?:</think>\s*|$)", re.S)
THINKING = ("reasoning_content", "thinking")  # where templates read a turn's thinking (Qwen3, GLM, Nemotron; gpt-oss, LFM2.5)
SENTINELS = ("tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", "tool_content_c4f9a8e2")


@dataclass
class Call:
    name: str | None  # None: the call could not be read (malformed)
    arguments: object  # a dict for a well-formed call; the raw text for a malformed one


def read_call(raw: str, keys: tuple[str, ...] = ("arguments", "parameters")) -> Call:
    """One call written as JSON, {"name": ..., KEY: {...} or its JSON text}, KEY the first of `keys`
    it has (none: no arguments); malformed (name None, the raw text kept) when it does not parse or
    has no name."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return Call(None, raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call(None, raw)
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return Call(obj["name"], {} if args is None else args)


def parse_hermes(text: str, strip_thinking: bool = False, opened: bool = False) -> tuple[str, list[Call]]:
    """(content without the call blocks, calls) from `<tool_call>{json}</tool_call>` blocks; a block
    never closed is malformed, whole JSON or not (TRL's Qwen response template reads no call there).
    A `<think>` block (to its `</think>`, or to the end when never closed) is reasoning, as TRL's Qwen
    response template reads it: a call written inside it is not a call. `strip_thinking` (the
    template's own format, where TRL's parser puts it in `reasoning_content`): it is not content
    either; the Hermes fallback keeps it in the content, as the model wrote it. `opened`: the prompt
    opened the block and the turn closes it, so the turn starts inside it (see `ToolFormat.parse`)."""
    text = "<think>" + text if opened else text
    outside = _THINK.sub(lambda m: "" if strip_thinking else "\0" * len(m.group(0)), text)
    blocks = list(_CALL.finditer(outside))
    # "arguments" only, as TRL's Qwen template reads it: a call with "parameters" is a call with none
    calls = [read_call(m.group(1), ("arguments",)) if m.group(0).rstrip().endswith("</tool_call>") else Call(None, m.group(0))
             for m in blocks]
    # the call blocks cut from the text: without its thinking, or as written (the masked copy keeps its offsets)
    src = outside if strip_thinking else text
    starts, ends = [m.start() for m in blocks] + [len(src)], [0] + [m.end() for m in blocks]
    content = "".join(src[a:b] for a, b in zip(ends, starts)).strip()
    return (content.removeprefix("<think>").strip() if opened and not strip_thinking else content), calls


def opens_thinking(prefix: str) -> bool:
    """The prompt before a turn ends in an open `<think>` (QwQ-32B's generation prompt,
    `<|im_start|>assistant\n<think>\n`): the model's turn starts inside its thinking."""
    return re.search(r"<think>\s*$", prefix) is not None


def without_thinking(text: str, opened: bool = False) -> str:
    """`text` less its `<think>` blocks (to `</think>`, or to the end when never closed; from the start
    when the prompt `opened` one), as TRL's response templates read them off a turn."""
    return _THINK.sub("", "<think>" + text if opened else text)


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
    def __init__(self, tokenizer, kind: str, parser: str = "hermes", eot: str | None = None, template: ChatTemplate | None = None,
                 call_ids: bool = True):
        self.tokenizer, self.kind, self.parser = tokenizer, kind, parser
        self.call_ids = call_ids  # calls get ids; probe.py drops them where they alone break the template (Apriel 1.6)
        self.eot = eot  # the special token the template writes right after an assistant message, if any
        self.template = template or templates.for_tools(tokenizer)  # the model's own, or a training template (templates.py)

    # ------------------------------------------------------------------------------ rendering
    def conversation(self, messages: list[dict], schemas: list[dict]) -> tuple[list[dict], dict]:
        """Episode messages (TRL's shapes) -> (messages to render, apply_chat_template kwargs)."""
        if self.kind == "template":
            return _template_messages(messages, self.call_ids), {"tools": schemas or self._no_tools()}
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

    def _no_tools(self) -> list | None:
        """What a tool-less episode passes as `tools=`: None, as TRL does (Llama 3.x renders its tool
        boilerplate for `tools=[]`), unless the template cannot render None (Hermes 2 Pro / 3's
        `tool_use` iterate `tools` unconditionally): then an empty list. Probed once a template."""
        if not hasattr(self, "_empty_tools"):
            try:
                self.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True,
                                                   chat_template=self.template.text, tools=None)
                self._empty_tools = None
            except TypeError:
                self._empty_tools = []
        return self._empty_tools

    def render(self, messages: list[dict], schemas: list[dict], generation_prompt: bool) -> str:
        msgs, kwargs = self.conversation(messages, schemas)
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt,
                                                  chat_template=self.template.text, **kwargs)

    def glue_text(self, messages: list[dict], n_new: int, schemas: list[dict], eot: str, eot_sampled: bool) -> str:
        """The text between the last model turn's sampled tokens and the next turn: `messages`
        ends with that turn's assistant message and `n_new` tool messages. `eot`: the text of the
        stop token the turn ended in; `eot_sampled`: whether it ended in one (see the module's
        docstring for the stop tokens the template does not render there)."""
        return self._glue(messages, n_new, schemas, eot, eot_sampled, self.render(messages, schemas, True))[0]

    def glue(self, messages: list[dict], n_new: int, schemas: list[dict], eot: str, eot_sampled: bool) -> tuple[str, list[list[int]]]:
        """(glue_text, the [start, end) spans in it of what the template wrote for the new tool messages'
        contents): outside text, tokenised as text (pipeline/agents/inserted.py)."""
        head, new = messages[: len(messages) - n_new], messages[len(messages) - n_new:]
        contents = [m["content"] for m in new]

        def render(values: list[str]) -> str:
            values = list(values)
            return self.render(head + [{**m, "content": inserted.replaced(c, values)} for m, c in zip(new, contents)], schemas, True)

        after, spans = inserted.locate(render, [s for c in contents for s in inserted.leaves(c)])
        text, at = self._glue(messages, n_new, schemas, eot, eot_sampled, after)
        return text, inserted.shifted(spans, -at, len(text))

    def _glue(self, messages: list[dict], n_new: int, schemas: list[dict], eot: str, eot_sampled: bool,
              after: str) -> tuple[str, int]:
        """(the glue, where it starts in `after`: the conversation rendered with the tool messages and a generation prompt)."""
        before = self.render(messages[: len(messages) - n_new], schemas, False)
        body = before.rstrip()
        eos = getattr(self.tokenizer, "eos_token", None)
        if eos and body.endswith(eos) and not after.startswith(body):  # an eos after the turn's own end (Phi-3.5's) ends
            inner = body[: -len(eos)].rstrip()                           # the conversation, not the turn
            body = inner if any(t and inner.endswith(t) for t in (self.eot, self._end_text())) else body
        # from the template's end of turn (or the stop token sampled, where the template writes that one there)
        end = next((t for t in (self.eot, eot if eot_sampled else None) if t and body.endswith(t)), "")
        cut = len(body) - len(end)
        if not after.startswith(before[:cut]):
            at = next(i for i, (a, b) in enumerate(zip(before[:cut] + "\0", after + "\0")) if a != b)
            raise GRPOError("rollout.tools: the chat template renders an earlier turn differently once tool messages follow "
                            f"({before[max(0, at - 24):at + 24]!r} becomes {after[max(0, at - 24):at + 24]!r}: not prefix-preserving)")
        rest = after[cut:]
        if eot_sampled and eot and rest.startswith(eot):  # the template writes the token the turn ended in
            return rest[len(eot):], cut + len(eot)
        if eot_sampled and self.eot and rest.startswith(self.eot):  # another stop token stands in for it
            return rest[len(self.eot):], cut + len(self.eot)
        return rest, cut

    # -------------------------------------------------------------------------------- parsing
    def parse_turn(self, token_ids: list[int], prefix_ids: list[int], stop_ids) -> tuple[str, list[Call]]:
        """(content, calls) of one sampled turn, from its tokens decoded with special tokens kept, less
        the stop token that ended it; `prefix_ids`: the tokens before it (prompt and earlier turns)."""
        ids = list(token_ids)
        if ids and ids[-1] in stop_ids:
            ids.pop()
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        prefix = self.tokenizer.decode(prefix_ids[-64:])  # its end: the generation prompt, and thinking it opens
        if self.parser == "response_template":
            prefix = self.tokenizer.decode(prefix_ids)
        return self.parse(text, prefix)

    def parse(self, text: str, prefix: str) -> tuple[str, list[Call]]:
        """(content, calls) of one model turn's text (special tokens kept)."""
        if self.parser in SPECS:
            content, calls = call_formats.parse(self.tokenizer, self.parser, text, prefix)
            return content, [Call(n, a) for n, a in calls]
        if self.parser == "response_template":
            try:
                parsed = self.tokenizer.parse_response(text, prefix=prefix)
            except Exception:
                return text, ([Call(None, text)] if "<tool_call>" in text else [])
            return parsed.get("content") or "", [Call(n, a) for n, a in call_formats.calls_of(parsed)]
        if self.parser == "json":
            return parse_json_call(self._without_end(text))
        # a turn after a prompt that opened thinking starts in it where the turn closes it, as TRL's DeepSeek-R1
        # response template reads one (a turn with no `</think>` is all answer)
        opened = opens_thinking(prefix) and "</think>" in text
        if self.parser in call_formats.WRAPPED or self.parser == "minimax":
            text = self._without_end(without_thinking(text, opened))
            read = call_formats.parse_minimax if self.parser == "minimax" else lambda t: call_formats.parse_wrapped(self.parser, t)
            content, calls = read(text)
            return content, [Call(n, a) for n, a in calls]
        if self.parser == "pythonic":  # thinking is no content and holds no call, as TRL's lfm2 response template reads it
            content, calls = call_formats.parse_pythonic(without_thinking(text, opened))
            return content, [Call(n, a) for n, a in calls]
        return parse_hermes(text, strip_thinking=self.kind == "template", opened=opened)


    def _end_text(self) -> str:
        """The text the template writes after an assistant message's content (call_formats.end_text), probed once."""
        if not hasattr(self, "_end"):
            self._end = call_formats.end_text(self.tokenizer, self.template.text)
        return self._end

    def _without_end(self, text: str) -> str:
        """`text` less the template's end-of-turn text where the vocabulary lacks it as a token."""
        return text if self.eot else call_formats.without_end(text, self._end_text())


def _template_messages(messages: list[dict], ids: bool = True) -> list[dict]:
    """Episode messages as the template takes them; with `ids`, calls get ids (`call00001`, ...: nine
    alphanumerics, as Mistral's templates require) and each tool message the id of its call. Without
    (a template that renders without them, as TRL passes calls): none, so that a template writing ids
    only into history (Apriel's) renders a turn as the model wrote it."""
    out, pending, n = [], [], 0
    for m in messages:
        t = _template_message(m)
        if not ids:
            out.append(t)
            continue
        if t["role"] == "assistant":
            pending = []
            for c in t.get("tool_calls", []):
                n += 1
                c["id"] = f"call{n:05d}"
                pending.append(c["id"])
        elif t["role"] == "tool":
            if not pending:  # a malformed call's answer: no call in the template's messages to point to
                n += 1
                pending.append(f"call{n:05d}")
            t["tool_call_id"] = pending.pop(0)
        out.append(t)
    return out


def _template_message(m: dict) -> dict:
    if m["role"] == "assistant":
        calls = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in m.get("tool_calls") or [] if c.get("name") is not None and isinstance(c.get("arguments"), dict)]
        thinking = {k: m[k] for k in THINKING if isinstance(m.get(k), str)}  # as a parser read it off the turn
        return {"role": "assistant", "content": m.get("content") or "", **thinking, **({"tool_calls": calls} if calls else {})}
    if m["role"] == "tool":
        return {"role": "tool", "name": m.get("name") or "unknown", "content": m["content"]}
    return {"role": m["role"], "content": m["content"]}
