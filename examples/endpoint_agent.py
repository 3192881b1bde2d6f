"""An agent written against the OpenAI SDK as its documentation shows it, with one tool, that grpo
trains through its endpoint (`rollout.agent.command: [python, examples/endpoint_agent.py]`,
examples/endpoint_agent.yaml, docs/agents.md "Agents behind an endpoint").

grpo starts it once per episode with OPENAI_BASE_URL and OPENAI_API_KEY (which the SDK reads
itself), GRPO_MODEL (the model to ask for), GRPO_TASK (the prompt row as JSON) and GRPO_RESULT
(where it may write its own reward). `--stream` asks for streamed answers.

Test hooks, read from the environment (tests/test_endpoint.py): AGENT_REWRITE=1 changes the
assistant's answer before sending the history back; AGENT_SIDE=1 asks another model for a title
first (a harness's side call).
"""

from __future__ import annotations

import json
import os
import sys

from openai import OpenAI


def multiply(a: int, b: int) -> int:
    return a * b


TOOLS = [{
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first factor."},
                                                        "b": {"type": "integer", "description": "The second factor."}},
                       "required": ["a", "b"]},
    },
}]


def ask(client: OpenAI, model: str, messages: list, stream: bool):
    """The assistant message of one completion, as a dict the next request carries back."""
    if not stream:
        response = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        return response.choices[0].message.model_dump(exclude_none=True)
    content, calls = "", {}
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=TOOLS, stream=True,
                                                stream_options={"include_usage": True}):
        if not chunk.choices:
            continue  # the usage chunk
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": tc.id, "type": "function", "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += tc.function.name or ""
            call["function"]["arguments"] += tc.function.arguments or ""
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def main() -> None:
    task = json.loads(os.environ["GRPO_TASK"])
    model = os.environ["GRPO_MODEL"]
    client = OpenAI(max_retries=0)  # base URL and key from OPENAI_BASE_URL / OPENAI_API_KEY
    prompt = task["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if os.environ.get("AGENT_SIDE"):
        client.chat.completions.create(model="title-model", messages=[{"role": "user", "content": "A title for: " + str(prompt)[:80]}])
    calls, nudged = 0, False
    for _ in range(4):
        message = ask(client, model, messages, "--stream" in sys.argv)
        if os.environ.get("AGENT_REWRITE"):
            message = {**message, "content": (message.get("content") or "") + " (edited)"}
        messages.append(message)
        if not message.get("tool_calls"):
            if calls or nudged:
                break
            nudged = True  # once, when it answered without calling
            messages.append({"role": "user", "content": "Please call the multiply tool."})
            continue
        for call in message["tool_calls"]:
            calls += 1
            try:
                args = json.loads(call["function"]["arguments"])
                result = str(multiply(int(args["a"]), int(args["b"])))
            except (ValueError, KeyError, TypeError) as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    result_path = os.environ.get("GRPO_RESULT")
    if result_path:
        with open(result_path, "w") as f:
            json.dump({"tool_calls": calls}, f)


if __name__ == "__main__":
    main()
