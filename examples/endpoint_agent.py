"""An agent written against the OpenAI SDK as its documentation shows it, with one tool, that grpo
trains through its endpoint (`rollout.agent.command: [python, examples/endpoint_agent.py]`,
examples/endpoint_agent.yaml, docs/agents.md "Agents behind an endpoint").

grpo starts it once per episode with OPENAI_BASE_URL and OPENAI_API_KEY (which the SDK reads
itself), GRPO_MODEL (the model to ask for), GRPO_TASK (the prompt row as JSON) and GRPO_RESULT_FILE
(where it writes its own reward and metrics: {"reward": 1.0 when the model's last answer ends in the
task's `answer`, else 0.0; null without one, "metrics": {"tool_calls": n, "turns": n}}, which grpo
scores as the reward `agent` and the columns extra_agent_tool_calls / extra_agent_turns).
`--stream` asks for streamed answers, and so does a task row whose `stream` column is true (chosen
per episode from its row, never from timing). An answer without a call is followed once by a user
message asking for the tool; `--no-nudge` ends the episode there instead, as a tool episode of
`rollout.tools` ends (examples/endpoint_agent.yaml: the same task as examples/agent.yaml's).

Test hooks, read from the environment (tests/test_endpoint.py): AGENT_REWRITE=1 changes the
assistant's answer before sending the history back; AGENT_SIDE=1 asks another model for a title
first (a harness's side call).
"""

from __future__ import annotations

import json
import os
import re
import sys

from openai import BadRequestError, OpenAI


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
        "return": {"type": "integer"},  # as transformers' get_json_schema writes examples/calc_tools.py's multiply:
    },                                  # the tool block the model sees is examples/agent.yaml's, token for token
}]


def run_call(name: str, arguments: str) -> str:
    """The tool message for one call, as grpo's own tool episodes answer it (pipeline/agents/tools.py, TRL's
    texts): the product, or str({"error": ...}) for another tool's name or arguments multiply does not take.
    A string argument is cast to the schema's integer, as grpo casts one; other values are passed as they are."""
    if name != "multiply":
        return str({"error": f"Tool {name} not found."})
    try:
        args = json.loads(arguments)
        for k, v in list(args.items()):
            if isinstance(v, str) and k in ("a", "b"):
                try:
                    args[k] = int(v)
                except ValueError:
                    return str({"error": f"multiply: argument {k!r} must be integer, got {v!r}"})
        return str(multiply(**args))
    except (json.JSONDecodeError, TypeError, AttributeError) as err:
        return str({"error": str(err)})


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
    given = len(messages)  # the task's own messages (a few-shot prompt's worked answers are not the model's turns)
    if os.environ.get("AGENT_SIDE"):
        client.chat.completions.create(model="title-model", messages=[{"role": "user", "content": "A title for: " + str(prompt)[:80]}])
    calls, nudged = 0, False
    for _ in range(4):
        try:
            message = ask(client, model, messages, bool(task.get("stream")) or "--stream" in sys.argv)
        except BadRequestError:  # grpo answers 400 once the episode has ended (its turns or tokens are spent)
            break
        if os.environ.get("AGENT_REWRITE"):
            message = {**message, "content": (message.get("content") or "") + " (edited)"}
        messages.append(message)
        if not message.get("tool_calls"):
            if calls or nudged or "--no-nudge" in sys.argv:
                break
            nudged = True  # once, when it answered without calling
            messages.append({"role": "user", "content": "Please call the multiply tool."})
            continue
        for call in message["tool_calls"]:
            calls += 1
            result = run_call(call["function"]["name"], call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    said = [m.get("content") or "" for m in messages[given:] if m.get("role") == "assistant"]
    numbers = re.findall(r"-?\d+", said[-1] if said else "")
    gold = re.findall(r"-?\d+", str(task.get("answer", "")))
    reward = None if not gold else float(bool(numbers) and numbers[-1] == gold[-1])
    turns = len(said)
    with open(os.environ["GRPO_RESULT_FILE"], "w") as f:
        json.dump({"reward": reward, "metrics": {"tool_calls": calls, "turns": turns}}, f)


if __name__ == "__main__":
    main()
