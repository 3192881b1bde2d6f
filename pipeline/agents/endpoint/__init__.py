"""Agents behind an endpoint (`rollout.agent.command`): any program that talks to the model through
an OpenAI-compatible endpoint grpo serves over its warm engine, trained token-exactly.

Modules: server (the FastAPI/uvicorn endpoint in a thread of the rollout process), chat (bodies and
answers in OpenAI's shape, the canonical forms requests are compared in), process (the agent program
of one episode), runner (the episodes of a part: batching, the history check, the row).

An episode's row has a tool episode's columns (pipeline/agents/__init__.py); its `episode` record:

    {"version": 1, "route": "endpoint", "format": "hermes" | "template",
     "tools": [names], "tool_schemas": [the first request's `tools`], "observation": null,
     "tool_schemas_json": the same as JSON text in the order sent (what the template renders; audit re-renders from it),
     "prompt_messages": [the first request's messages, canonical] | null,
     "messages": [after the prompt, as a tool episode's: assistant turns (content, text, tokens,
                  finish_reason, tool_calls), tool results {role, name, content, error: null},
                  user messages {role, content}],
     "requests": [one per request, in order:
        {"kind": "turn", "body_sha256", "asked": {what the client asked: temperature, max_tokens, ...},
         "sampling": {what was used: the run's temperature/top_p/top_k/min_p, max_tokens (the cap
                      within the episode's budget), stop, stop_token_ids, greedy},
         "seed", "new_messages": [canonical], "prompt_tokens" (the first) | "prompt_delta": [glue ids],
         "completion_ids", "logprobs", "finish_reason", "message": {the assistant message answered}}
        {"kind": "side", ... the same, with "prompt_ids" (its own prompt; never in the row)}
        (a retried body, the same bytes again, gets the answer it had and adds nothing here)
        {"kind": "refused" | "malformed" | "side_refused", "body_sha256", "why"}],
     "turns", "ending": "finished" | "history_rewritten" | "max_turns" | "max_episode_tokens" | "length"
               | "malformed_request" | "agent_crashed" | "agent_timeout" | "no_calls" | "prompt_too_long"
               | "template_rewrites_history" | "unsupported_request" (a `stop` or stop id the run lacks,
                 a turn on the other route than the first turn's),
     "detail": str | null, "agent": {"exit_code", "killed", "result": {"reward", "metrics"} | null,
               "result_error": why there is no result | null (pipeline.agents.endpoint.result),
               "trace_problem": with a verifiers trace only, how it disagrees with the record | null (vf_trace.py)},
     "model_tokens", "context_tokens"}

No timestamp, request id, port, key or timing is recorded: a rerun writes the same bytes.
"""
