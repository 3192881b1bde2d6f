"""OpenAI chat-completions bodies and answers, as grpo reads and writes them: a request's messages
turned into the shapes pipeline.agents.format renders, the canonical forms two requests are compared
in (is the new one the recorded history extended?), and the answer in OpenAI's shape (non-streaming
and as SSE chunks) with the token ids and logprobs written as vLLM's server writes them
(`prompt_token_ids` / `token_ids` when the body asks `return_token_ids`; `logprobs.content[i].token`
= "token_id:N" when it asks `logprobs`)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pipeline.agents import inserted
from pipeline.errors import GRPOError

ASKED = ("model", "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "seed", "stop",
         "stream", "stream_options", "logprobs", "top_logprobs", "tool_choice", "parallel_tool_calls", "n",
         "frequency_penalty", "presence_penalty", "stop_token_ids", "return_token_ids", "return_tokens_as_token_ids", "response_format")
"""The body's fields that ask for sampling or answer options: recorded beside what grpo used."""


class BadBody(GRPOError):
    """A request body grpo cannot read as a chat completion (the episode ends malformed_request)."""


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def body_hash(body: Any) -> str:
    return hashlib.sha256(canonical_json(body).encode("utf-8", "surrogatepass")).hexdigest()  # any JSON, a lone surrogate too


def check_stop(stop: Any, name: str) -> None:
    """BadBody unless `stop` is none, a string or a list of strings (read as strings: a number there raised out of the runner)."""
    if not (stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))):
        raise BadBody(f"`{name}` must be a string or a list of strings, not {json.dumps(stop)[:40]}")


def check_ids(ids: Any, name: str) -> None:
    """BadBody unless `ids` is none or a list of token ids (integers), as `stop_token_ids` must be."""
    if not (ids is None or (isinstance(ids, list) and all(type(t) is int for t in ids))):
        raise BadBody(f"`{name}` must be a list of token ids (integers), not {json.dumps(ids)[:40]}")


def check_secret(body: Any, secret: str) -> None:
    """BadBody when `body`'s text holds `secret` (the episode's key): first, as the other messages quote the body's values."""
    if secret and secret in json.dumps(body, ensure_ascii=False):
        raise BadBody("the body holds the episode's API key (OPENAI_API_KEY), which is never recorded")


def check_text(body: Any) -> None:
    """BadBody unless `body` can be recorded as strict JSON in UTF-8 (no lone surrogate, no NaN)."""
    try:
        json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError, UnicodeError) as err:
        raise BadBody(f"the body cannot be recorded as JSON text ({type(err).__name__}: a lone surrogate or NaN)") from None


def check_body(body: Any, secret: str = "") -> None:
    """BadBody naming what is wrong, unless `body` is a chat-completions request grpo serves (n=1) that
    does not hold `secret` (the episode's key: sent to the agent, never recorded)."""
    check_secret(body, secret)  # first: the messages below quote the body's values (a `stop` or `n` that is the key)
    if not isinstance(body, dict):
        raise BadBody("the body is not a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
        raise BadBody("`messages` must be a non-empty list of objects with a role")
    if not isinstance(body.get("model"), str):
        raise BadBody("`model` must be a string")
    if body.get("n", 1) != 1:
        raise BadBody(f"n={body.get('n')!r}: grpo's endpoint samples one choice per request (n=1)")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools)):
        raise BadBody("`tools` must be a list of {type: function, function: {name, ...}}")
    if not isinstance(body.get("stream_options"), (dict, type(None))):
        raise BadBody("`stream_options` must be an object")
    check_stop(body.get("stop"), "stop")
    check_ids(body.get("stop_token_ids"), "stop_token_ids")
    for i, m in enumerate(msgs):
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise BadBody(f"messages[{i}]: role {m['role']!r} is not one of system, developer, user, assistant, tool")
        _check_message(m, f"messages[{i}]")
    check_text(body)  # the record is strict JSON in UTF-8: a lone surrogate (\ud800) or a NaN cannot be written there


def _check_message(m: dict, where: str) -> None:
    """BadBody naming the field of message `where` whose shape grpo cannot read (a crash otherwise: one
    agent's body would stop the rollout of every episode)."""
    content = m.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or (part.get("type") in ("text", None) and not isinstance(part.get("text", ""), str)):
                raise BadBody(f"{where}.content[{j}] must be a content part with text as a string")
    elif not isinstance(content, (str, type(None))):
        raise BadBody(f"{where}.content is a {type(content).__name__}, not text or content parts")
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and calls:
        if not isinstance(calls, list):
            raise BadBody(f"{where}.tool_calls must be a list")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), (str, type(None))):
                raise BadBody(f"{where}.tool_calls[{j}] must be {{id, type: function, function: {{name, arguments}}}}")
    if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), (str, type(None))):
        raise BadBody(f"{where}.tool_call_id must be a string")


def text_of(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in ("text", None))
    raise BadBody(f"a message's content is a {type(content).__name__}, not text or content parts")


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def canonical_message(m: dict) -> dict:
    """What a message means for the conversation (role, text, calls, the call a result answers),
    without the fields clients add or drop on the way back (refusal, annotations, audio, null keys,
    arguments as JSON text or parsed)."""
    out: dict = {"role": "system" if m["role"] == "developer" else m["role"], "content": text_of(m.get("content"))}
    if m["role"] == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [{"name": (c.get("function") or {}).get("name"), "arguments": _arguments((c.get("function") or {}).get("arguments")),
                              "id": c.get("id")} for c in m["tool_calls"]]
    if m["role"] == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
    return out


def render_shape(m: dict, calls_by_id: dict[str, str]) -> dict:
    """A canonical message as ToolFormat renders it (pipeline.agents.format: a tool result names its
    tool; an assistant turn grpo sampled carries its text exactly as sampled in `raw`)."""
    if m["role"] == "tool":
        return {"role": "tool", "name": calls_by_id.get(m.get("tool_call_id") or "", None) or "unknown", "content": m["content"]}
    if m["role"] == "assistant":
        calls = [{"name": c["name"], "arguments": c["arguments"]} for c in m.get("tool_calls", [])]
        return {"role": "assistant", "content": m["content"], "raw": m.get("raw", m["content"]), "tool_calls": calls}
    return {"role": m["role"], "content": m["content"]}


def first_prompt(fmt, shapes: list[dict], tools: list, marked=lambda text: False) -> tuple[str, list[list[int]]]:
    """The first request rendered with the run's template (`fmt`: pipeline.agents.format), and the spans
    its messages' text and its tools' descriptions take in it: all of that text is the agent's (a page it
    fetched, a tool result it replays, an MCP server's tool description it forwards), so it is tokenised
    as text, never as control tokens (pipeline.agents.inserted). The tools' names and types stay as they
    are: bare names the template reads; any other string of a tool (an enum value, a property's name)
    that holds a control token's text (`marked`: inserted.Tokens.marked) is located as text too."""
    contents = [s.get("content") for s in shapes]
    texts = [x for c in contents if c is not None for x in inserted.leaves(c)]
    described = descriptions(tools, marked)

    def render(values: list[str]) -> str:
        values, told = values[:len(texts)], values[len(texts):]
        out = []
        for s, c in zip(shapes, contents):
            new = c if c is None else inserted.replaced(c, values)
            out.append({**s, "content": new, **({"raw": new} if "raw" in s and s["raw"] == c else {})})
        return fmt.render(out, with_descriptions(tools, told, marked) if described else tools, True)

    return inserted.locate(render, texts + described)


def descriptions(value, marked=lambda text: False) -> list[str]:
    """The `description` texts a tool schema holds (the function's and each parameter's), and its other strings
    and keys that are `marked`, in order."""
    if isinstance(value, str):
        return [value] if marked(value) else []
    if isinstance(value, list):
        return [d for v in value for d in descriptions(v, marked)]
    if isinstance(value, dict):
        return [d for k, v in value.items()
                for d in (*descriptions(k, marked), *([v] if k == "description" and isinstance(v, str) else descriptions(v, marked)))]
    return []


def with_descriptions(value, new: list[str], marked=lambda text: False):
    """`value` with its `descriptions` replaced by `new`, in order (consumed from the front)."""
    if isinstance(value, str):
        return new.pop(0) if marked(value) else value
    if isinstance(value, list):
        return [with_descriptions(v, new, marked) for v in value]
    if isinstance(value, dict):  # a key before its value, as `descriptions` lists them
        return {with_descriptions(k, new, marked): (new.pop(0) if k == "description" and isinstance(v, str)
                                                    else with_descriptions(v, new, marked)) for k, v in value.items()}
    return value


def asked(body: dict) -> dict:
    """The options the client asked for, as it sent them (recorded beside what was used)."""
    return {k: body[k] for k in ASKED if k in body}


def assistant_message(content: str, calls: list, turn: int, side: bool = False) -> dict:
    """The answer's message in OpenAI's shape: tool_calls with ids `call_<turn>_<i>` (deterministic),
    arguments as JSON text; content null when the turn is only calls."""
    prefix = "side" if side else "call"
    tool_calls = [{"id": f"{prefix}_{turn}_{i}", "type": "function",
                   "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False) if not isinstance(c.arguments, str) else c.arguments}}
                  for i, c in enumerate(calls)]
    msg: dict = {"role": "assistant", "content": content if content or not tool_calls else None}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def finish(reason: str, message: dict) -> str:
    return "length" if reason == "length" else ("tool_calls" if message.get("tool_calls") else "stop")


def _logprobs(answer: dict, body: dict) -> dict | None:
    """`logprobs` as vLLM's server writes them: a token as its decoded text, or `token_id:N` when the body
    asks `return_tokens_as_token_ids`; its text's UTF-8 bytes; no top_logprobs (an empty list)."""
    if not body.get("logprobs"):
        return None
    texts = [answer["decode"]([t]) for t in answer["ids"]]
    tokens = [f"token_id:{t}" for t in answer["ids"]] if body.get("return_tokens_as_token_ids") else texts
    return {"content": [{"token": tok, "logprob": max(lp, -9999.0), "bytes": list(text.encode("utf-8", errors="replace")),
                         "top_logprobs": []} for tok, text, lp in zip(tokens, texts, answer["logprobs"])]}


def completion(answer: dict, body: dict, rid: str, model: str) -> dict:
    """The non-streaming answer (`answer`: message, finish_reason, prompt_ids, ids, logprobs, decode)."""
    choice = {"index": 0, "message": answer["message"], "finish_reason": answer["finish_reason"],
              "logprobs": _logprobs(answer, body)}
    out = {"id": rid, "object": "chat.completion", "created": 0, "model": model, "choices": [choice],
           "usage": usage(answer)}
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = answer["prompt_ids"]
        choice["token_ids"] = answer["ids"]
    return out


def usage(answer: dict) -> dict:
    p, c = len(answer["prompt_ids"]), len(answer["ids"])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def chunks(answer: dict, body: dict, rid: str, model: str) -> list[dict]:
    """The streaming answer: the role and content, the calls, the finish reason, then (with
    stream_options.include_usage) a chunk of usage alone, as OpenAI's server streams them."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": 0, "model": model}
    msg, with_ids = answer["message"], bool(body.get("return_token_ids"))
    first = {"index": 0, "delta": {"role": "assistant", "content": msg.get("content") or ""}, "finish_reason": None,
             "logprobs": _logprobs(answer, body)}
    if with_ids:
        first["token_ids"] = answer["ids"]
    out = [{**base, "choices": [first], **({"prompt_token_ids": answer["prompt_ids"]} if with_ids else {})}]
    if msg.get("tool_calls"):
        calls = [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]
        out.append({**base, "choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}]})
    out.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": answer["finish_reason"]}]})
    if (body.get("stream_options") or {}).get("include_usage"):
        out.append({**base, "choices": [], "usage": usage(answer)})
    return out


def error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def extension_problem(schemas: list, convo: list[dict], answer: dict, msgs: list[dict], tools: list) -> str | None:
    """Why `msgs` (with `tools`) is not the recorded conversation extended, or None. `convo`: the recorded
    request's canonical messages then grpo's answer (`answer`: that answer as recorded); `schemas`: the
    first request's tools."""
    if canonical_json(tools) != canonical_json(schemas):
        return "its tools differ from the first request's"
    n = len(convo) - 1
    for i, (have, got) in enumerate(zip(convo[:n], msgs)):
        if have != got:
            return f"messages[{i}] ({have['role']}) differs from what was recorded"
    if len(msgs) <= n:
        return f"it has {len(msgs)} messages, not the {n} recorded and grpo's answer"
    if _no_ids(answer) != _no_ids(msgs[n]):
        return f"messages[{n}] is not the assistant message grpo answered"
    new = msgs[n + 1:]
    if not new:
        return "no new message after grpo's answer"
    if any(m["role"] not in ("tool", "user") for m in new):
        return "a message after grpo's answer is neither a tool result nor a user message"
    return None


def _no_ids(m: dict) -> dict:
    """A canonical message without its calls' ids (a client may drop or rewrite them; results find their call by order then)."""
    if "tool_calls" not in m:
        return m
    return {**m, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]}
