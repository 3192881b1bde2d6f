"""The tool-call formats models write, as transformers response templates, and how to tell them
apart from one call rendered through a chat template.

A family is recognised from what the template writes for a sample call (`detect`), not from the
model's name: a fine-tune that keeps its base's template keeps its format. The families are those
TRL 1.16 ships response schemas for, and Mistral's:

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5 / Qwen3, Hermes);
- json: one bare `{"name": ..., "parameters": {...}}` object, after an optional `<|python_tag|>`
  (Llama 3.1 / 3.2);
- qwen_xml: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
  (Qwen3-Coder, Qwen3.5, Nemotron 3);
- glm: `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>` (GLM-4.5 and later);
- mistral_list: `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}]` (Mistral 7B v0.3, Small 3.1);
- mistral_args: `[TOOL_CALLS]NAME[ARGS]{...}`, one per call, after an optional `[THINK]...[/THINK]` (Mistral Small 3.2,
  Magistral, Devstral, Ministral 3 Reasoning);
- harmony: `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>`, after an
  optional `<|channel|>analysis<|message|>...<|end|>` (gpt-oss), one call per message, each ended by `<|call|>`;
- pythonic: `<|tool_call_start|>[NAME(key='value', n=7), ...]<|tool_call_end|>` (LFM2 since its v2 template, LFM2.5).
- apriel, nemotron_v2, gigachat: JSON calls between the template's own markers (`WRAPPED`):
  `<tool_calls>[...]</tool_calls>` (Apriel 1.5 / 1.6), `<TOOLCALL>[...]</TOOLCALL>` (Nemotron-Nano-v2),
  `<|function_call|>{...}` (GigaChat 3.1), as llama.cpp's common/chat.cpp reads them. GigaChat 3.1's
  template renders one call a message (`message.tool_calls[0]`), so a turn holds one object: a list,
  or a second call, is malformed (a call the history would not hold never runs).
- minimax: `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE</parameter>\n</invoke>\n
  </minimax:tool_call>` (MiniMax-M2), values as written (strings raw, others JSON), as qwen_xml's.

hermes and json are read by format.py's own parsers; the others go through transformers'
`parse_response` with the response templates below. Values in the XML families are the raw
strings the model wrote: the tool's JSON schema types them, in one place (the tool call).
`[TOOL_CALLS]` is a special token in Mistral's tokenizers, dropped by a decode that skips special
tokens, so a turn is parsed from its token ids decoded with special tokens kept.
"""

from __future__ import annotations

import ast
import json
import re

_STRING = r"(?P<value>.*?)"
SPECS: dict[str, dict] = {
    "qwen_xml": {
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*"},
            "tool_calls": {
                "open_pattern": r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
                "close_pattern": r"</function>\s*</tool_call>\s*",
                "repeats": True,
                "content": "xml-inline",
                "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\n?" + _STRING + r"\n?</parameter>"},
                "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
            },
            "content": {"close_pattern": r"<\|im_end\|>"},
        },
    },
    "glm": {
        "start_anchor": "<|assistant|>",
        "fields": {
            "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*"},
            "tool_calls": {
                "open_pattern": r"\s*<tool_call>(?P<name>[^\s<]+)\s*",
                "close_pattern": r"</tool_call>\s*",
                "repeats": True,
                "content": "xml-inline",
                "content_args": {"tag_pattern": r"<arg_key>(?P<key>[^<]+)</arg_key>\s*<arg_value>" + _STRING + r"</arg_value>"},
                "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
            },
            "content": {"close_pattern": r"<\|(?:user|observation|endoftext)\|>"},
        },
    },
    "mistral_list": {
        "start_anchor": ["[/INST]", "[/TOOL_RESULTS]"],
        "fields": {
            "tool_calls": {"open_pattern": r"\s*\[TOOL_CALLS\]", "content": "json", "content_args": {"allow_non_json": True}},
            "content": {"close": "</s>"},
        },
    },
    "mistral_args": {
        "start_anchor": ["[/INST]", "[/TOOL_RESULTS]"],
        "fields": {
            "reasoning_content": {"open": "[THINK]", "close_pattern": r"\[/THINK\]\s*"},  # Ministral 3 Reasoning, Magistral
            "tool_calls": {
                "open_pattern": r"\s*\[TOOL_CALLS\](?P<name>[^\[\]\s]+)(?:\[CALL_ID\][^\[]*)?\[ARGS\]",
                "close_pattern": r"(?=\[TOOL_CALLS\])",
                "repeats": True,
                "content": "json",
                "content_args": {"allow_non_json": True},
                "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
            },
            "content": {"close": "</s>"},
        },
    },
    "harmony": {
        "start_anchor": "<|start|>assistant",
        "fields": {
            "thinking": {"open_pattern": r"\s*(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>", "close_pattern": r"<\|end\|>"},
            "tool_calls": {
                "open_pattern": r"\s*(?:<\|start\|>assistant)?\s*to=functions\.(?P<name>[^<\s]+)\s*<\|channel\|>commentary(?:\s*(?:<\|constrain\|>)?json)?<\|message\|>",
                "close_pattern": r"<\|call\|>|$",
                "repeats": True,
                "content": "json",
                "content_args": {"allow_non_json": True},
                "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
            },
            "content": {"open_pattern": r"\s*(?:<\|start\|>assistant)?<\|channel\|>final<\|message\|>", "close_pattern": r"<\|return\|>|<\|end\|>|$"},
        },
    },
}
MARKERS = {"hermes": "<tool_call>", "qwen_xml": "<tool_call>", "glm": "<tool_call>",
           "mistral_list": "[TOOL_CALLS]", "mistral_args": "[TOOL_CALLS]", "harmony": "to=functions."}
# the text that closes one call, where a call can be left open (cut off, or a stop token inside it)
CLOSERS = {"qwen_xml": re.compile(r"</function>\s*</tool_call>"), "glm": re.compile(r"</tool_call>")}


# JSON calls between a template's own markers: {family: (opening marker, closing marker or None: to the end)};
# a list of {"name", "arguments"} objects (Apriel 1.5 / 1.6, Nemotron-Nano-v2) or one object (GigaChat 3 / 3.1's
# function-call role), as llama.cpp's common/chat.cpp reads them
WRAPPED = {"apriel": ("<tool_calls>", "</tool_calls>"), "nemotron_v2": ("<TOOLCALL>", "</TOOLCALL>"),
           "gigachat": ("<|function_call|>", None)}
ONE_CALL = {"gigachat"}  # the template renders one call a message: a turn holds one object, not a list


# what each family writes, for the lines that name it
WRITES = {"hermes": "<tool_call>{json}</tool_call>", "json": "a bare {\"name\", \"parameters\"} object",
          "qwen_xml": "<tool_call><function=NAME><parameter=KEY>", "glm": "<tool_call>NAME<arg_key>KEY</arg_key>",
          "mistral_list": "[TOOL_CALLS][{json}]", "mistral_args": "[TOOL_CALLS]NAME[ARGS]{json}",
          "harmony": "to=functions.NAME<|channel|>commentary", "pythonic": "<|tool_call_start|>[NAME(key=value)]",
          "apriel": "<tool_calls>[{json}]</tool_calls>", "nemotron_v2": "<TOOLCALL>[{json}]</TOOLCALL>",
          "gigachat": "<|function_call|>{json}", "minimax": '<minimax:tool_call><invoke name="NAME"><parameter name="KEY">'}
# a call the template writes outside the assistant's turn, after its end: a model sampled to its end of turn
# cannot write it (GigaChat 3's `function call` role message, after the assistant's empty message)
AFTER_TURN = {"a separate 'function call' role message after the assistant's turn ends": re.compile(r"function call<\|role_sep\|>")}


def parse_wrapped(family: str, text: str) -> tuple[str, list]:
    """(content, [(name or None, arguments or raw text)]) of a turn in one of the WRAPPED families:
    the content is the text before the opening marker; a block never closed (where the family
    closes one) or whose JSON does not read as calls is malformed."""
    opener, closer = WRAPPED[family]
    head, found, body = text.partition(opener)
    if not found:
        return text.strip(), []
    if closer is not None:
        body, closed, _ = body.partition(closer)
        if not closed:
            return head.strip(), [(None, opener + body)]
    try:
        items = json.loads(body.strip())
    except ValueError:
        return head.strip(), [(None, opener + body)]
    if family in ONE_CALL and not isinstance(items, dict):
        return head.strip(), [(None, opener + body)]
    return head.strip(), calls_of({"tool_calls": items}) or [(None, opener + body)]


def end_text(tokenizer, template: str | None) -> str:
    """The text the template writes right after an assistant message's content, up to the first
    whitespace (`<|eot_id|>`, `<|message_sep|>`, `[e~[`); "" when it writes none there. A model whose
    vocabulary lacks the marker as a token writes it as text before the token it stops on: a family
    that reads a call to the turn's end (json, gigachat) reads it to there."""
    sentinel = "probe_content_9d1e7b35"
    for tools in (None, [{"type": "function", "function": {"name": "probe", "description": "probe",
                                                           "parameters": {"type": "object", "properties": {}}}}]):
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": sentinel}],
                                                 tokenize=False, chat_template=template, tools=tools)
        except Exception:  # a template that loops over `tools` fails without them
            continue
        tail = text[text.rindex(sentinel) + len(sentinel):].split() if sentinel in text else []
        return tail[0] if tail else ""
    return ""


def without_end(text: str, end: str) -> str:
    """`text` less a trailing `end` (the template's end-of-turn text, see end_text) and the whitespace around it."""
    body = text.rstrip()
    return body[: -len(end)].rstrip() if end and body.endswith(end) else text


_INVOKE = re.compile(r'<invoke name="(?P<name>[^"]*)">(?P<body>.*?)</invoke>', re.S)
_PARAM = re.compile(r'<parameter name="(?P<key>[^"]*)">(?P<value>.*?)</parameter>', re.S)


def parse_minimax(text: str) -> tuple[str, list]:
    """(content, [(name or None, arguments or raw text)]) of a MiniMax-M2 turn: each `<invoke>` of a
    `<minimax:tool_call>` block is a call, its `<parameter>`s the arguments (the strings as written);
    the content is the text outside the blocks. A block never closed, an invoke holding anything but
    parameters, or a block holding anything but invokes is malformed."""
    calls: list = []
    for m in _MINIMAX.finditer(text):
        body = m.group("body")
        if m.group("close") is None:
            calls.append((None, m.group(0)))
            continue
        invokes = list(_INVOKE.finditer(body))
        if not invokes or _INVOKE.sub("", body).strip():
            calls.append((None, m.group(0)))
            continue
        for inv in invokes:
            ok = bool(inv.group("name")) and not _PARAM.sub("", inv.group("body")).strip()
            calls.append((inv.group("name"), {p.group("key"): p.group("value") for p in _PARAM.finditer(inv.group("body"))})
                         if ok else (None, inv.group(0)))
    return _MINIMAX.sub("", text).strip(), calls


_MINIMAX = re.compile(r"<minimax:tool_call>(?P<body>(?:(?!</minimax:tool_call>).)*)(?P<close></minimax:tool_call>)?", re.S)


def detect(turn: str, name: str) -> str | None:
    """The family of a call to `name` as the template wrote it in `turn` (the assistant's part of
    the rendering); None when none of them."""
    for family, (opener, _) in WRAPPED.items():
        if re.search(re.escape(opener) + r"\s*\[?\s*\{\s*\"name\"\s*:\s*\"" + re.escape(name) + '"', turn):
            return family
    if re.search(r'<minimax:tool_call>\s*<invoke name="' + re.escape(name) + '">', turn):
        return "minimax"
    if re.search(r"to=functions\." + re.escape(name) + r"\s*<\|channel\|>", turn):
        return "harmony"
    if re.search(r"<\|tool_call_start\|>\[" + re.escape(name) + r"\(", turn):
        return "pythonic"
    if "[TOOL_CALLS]" in turn:
        return "mistral_args" if re.search(r"\[TOOL_CALLS\]\s*" + re.escape(name) + r"(?:\[CALL_ID\][^\[]*)?\[ARGS\]", turn) \
            else "mistral_list"
    if re.search(r"<tool_call>\s*<function=" + re.escape(name) + ">", turn):
        return "qwen_xml"
    if re.search(r"<tool_call>" + re.escape(name) + r"\s*<arg_key>", turn):
        return "glm"
    if re.search(r"<tool_call>\s*\{", turn):
        return "hermes"
    if re.search(r'\{\s*"name"\s*:\s*"' + re.escape(name) + r'"\s*,\s*"(?:parameters|arguments)"\s*:', turn):
        return "json"
    return None


def calls_of(parsed: dict) -> list:
    """The parsed `tool_calls` as (name or None, arguments or raw) pairs: a call is well formed when it
    has a string name and an object of arguments (a JSON string of one is read)."""
    out, found = [], parsed.get("tool_calls")
    for item in found if isinstance(found, list) else [] if found is None else [found]:
        for c in item if isinstance(item, list) else [item]:  # a region can hold a list of calls
            f = c.get("function", c) if isinstance(c, dict) else None
            name = f.get("name") if isinstance(f, dict) else None
            args = f.get("arguments", f.get("parameters", {})) if isinstance(f, dict) else None
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    pass
            args = {} if args is None and isinstance(name, str) else args
            ok = isinstance(name, str) and isinstance(args, dict)
            out.append((name, args) if ok else (None, c if isinstance(c, str) else json.dumps(c, ensure_ascii=False, default=str)))
    return out


def parse(tokenizer, family: str, text: str, prefix: str) -> tuple[str, list]:
    """(content, [(name or None, arguments or raw text)]) of one turn written in `family`."""
    spec = {"defaults": {"role": "assistant"}, **SPECS[family]}
    anchors = spec["start_anchor"] if isinstance(spec["start_anchor"], list) else [spec["start_anchor"]]
    if not any(a in prefix for a in anchors):
        prefix = ""  # without its anchor the parser would read the whole prompt as the answer
    marker = MARKERS[family]
    try:
        parsed = tokenizer.parse_response(text, spec, prefix=prefix)
    except Exception:  # the parser gave up on the whole turn: each call in it is malformed
        return text.split(marker)[0].strip(), [(None, marker + part) for part in text.split(marker)[1:]]
    content, calls = parsed.get("content") or "", calls_of(parsed)
    closer = CLOSERS.get(family)
    if closer is not None:  # a call never closed (cut off, or a stop token inside it) is malformed
        closed = len(closer.findall(text))
        calls = [c if i < closed else (None, json.dumps({"name": c[0], "arguments": c[1]}, ensure_ascii=False, default=str))
                 for i, c in enumerate(calls)]
    if marker in content:  # a call the template's pattern does not read (no name, wrong shape)
        head, _, tail = content.partition(marker)
        content, calls = head.strip(), calls + [(None, marker + tail)]
    return content.strip(), calls


_PYTHONIC = re.compile(r"<\|tool_call_start\|>(.*?)(?:<\|tool_call_end\|>|$)", re.S)


def parse_pythonic(text: str) -> tuple[str, list]:
    """(content, [(name or None, arguments or raw text)]) of a turn whose calls are a Python list of
    keyword calls between <|tool_call_start|> and <|tool_call_end|>; each value a Python literal
    (strings single-quoted and raw, as LFM2's templates write them: `_raw_strings`) or a JSON object."""
    calls = [c for m in _PYTHONIC.finditer(text) for c in _python_calls(m.group(1).strip())]
    return _PYTHONIC.sub("", text).strip(), calls


_STRING_END = re.compile(r"'(?=\s*(?:[,)\]]|$))")  # a single quote that a value's end follows


def _raw_strings(body: str) -> str:
    """`body` with each string value (single-quoted, right after `=`) written as the Python literal of its raw text: LFM2's
    templates write a string value as `'` + value + `'`, no escapes (a newline, a backslash, a quote
    as they are), and TRL's lfm2 response template reads it back so; it ends at a quote that the
    value's end (`,`, `)`, `]`) follows. Other strings keep their escapes: a JSON object's, and a
    list's (Jinja's `string` filter writes Python's repr)."""
    out, i = [], 0
    while i < len(body):
        if body[i] == '"':
            j = i + 1
            while j < len(body) and body[j] != '"':
                j += 2 if body[j] == "\\" else 1
            out.append(body[i:j + 1])
            i = j + 1
        elif body[i] == "'" and body[:i].rstrip().endswith("=") and (end := _STRING_END.search(body, i + 1)):
            out.append(repr(body[i + 1:end.start()]))
            i = end.end()
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


def _python_calls(written: str) -> list:
    body = _raw_strings(written)
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return [(None, written)]
    out = []
    for node in tree.elts if isinstance(tree, ast.List) else [tree]:
        raw = ast.get_source_segment(body, node) or body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args or \
                any(kw.arg is None for kw in node.keywords):
            out.append((None, raw))
            continue
        try:
            out.append((node.func.id, {kw.arg: _literal(kw.value, body) for kw in node.keywords}))
        except ValueError:
            out.append((None, raw))
    return out


def _literal(node, body: str):
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError):  # a JSON object with true / false / null in it
        return json.loads(ast.get_source_segment(body, node) or "")
