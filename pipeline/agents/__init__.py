"""Multi-turn rollouts: tools and environments, as TRL 1.16 takes them, recorded turn by turn.

    rollout:
      tools: [calc.py:multiply, python]     # TRL's `tools`; `python`: a sandboxed interpreter
      environment: my_env.py:MyEnv           # TRL's `environment_factory` (optional)
      max_turns: 4                           # model turns per episode (null: unlimited, TRL's default)
      max_episode_tokens: 512                # tokens after the prompt (turns + results + glue)
      tool_timeout_s: 10
      tool_format: auto                      # the template's own, or hermes (the fallback)

Modules: options (the config keys), tools (loading, schemas, one call with a timeout),
environment (the factory contract, pools, routing, get_reward), state (the exact encoding of
an instance's state), format (prompt rendering, call parsing, glue between
turns), inserted (outside text located and tokenised as text), episode (the loop and the record),
setup (loading it all; `grpo init`'s checks).

A rollout row of an episode holds the whole episode after the prompt: `completion_ids` (every
token), `completion_mask` (1 sampled, 0 tool result / template glue), `sampler_logprobs` (0.0
where the mask is 0), `completion` (the text: turns and glue in order), `finish_reason` and
`truncated` (of the last turn), `completion_length` (the tokens the model sampled: the mask's
1s, what every length metric counts), and `episode`, a JSON object:

    {"version": 2, "format": "hermes" | "template", "tools": [names offered],
     "observation": str | null,                       # what reset() returned
     "messages": [
       {"role": "assistant", "content": str,          # text without the call blocks
        "text": str,                                  # the turn exactly as sampled (decoded)
        "tokens": int, "finish_reason": "stop" | "length",
        "tool_calls": [{"type": "function", "function": {"name": str | null, "arguments": {...} | raw str}}]},
       {"role": "tool", "name": str | null, "content": str,   # the result as text (str() of a list)
        "value": ... (only for a list result: the list, exactly, in pipeline.agents.state's encoding;
                      TRL's message holds the list: templates render it, reward functions get it),
        "error": null | "unknown_tool" | "bad_arguments" | "raised" | "timeout"
                 (| "malformed" in records written before a malformed call ended the episode),
        "dropped": true (only when it did not fit the token budget)}, ...],
     "turns": int,
     "ending": "answered" | "malformed" | "max_turns" | "max_episode_tokens" | "length" | "tool_timeout",
     "model_tokens": int, "context_tokens": int,
     "inserted": {"prompt": [[start, end], ...],      # outside text (inserted.py): the observation's spans
                                                      # in the prompt text, and for each glue after a turn
                  "glue": [{"at": int, "chars": int,  # where it starts in `completion`, its length,
                            "data": [[start, end], ...]}, ...]},   # its tool results' spans (in the glue)
                                                      # (absent in version 1: glue tokenised whole)
     "environment": {"class": "module:Class", "codec": 1, "state": ...,   # with an environment: its exact
                     "slot": int, "name": str (a mapping's)}}             # state (agents/state.py), pool slot

Reward functions get, as TRL 1.16 passes them for tool episodes, `completions[i]` = the
conversation after the prompt as messages (assistant messages with `tool_calls` where calls
were made, `tool` messages with name and content, a list where the tool returned one; no
grpo-only keys; a turn with a malformed call is plain text, its whole decoded text the content), `prompts[i]` = the
prompt's messages (with the environment's observation), and with an environment
`environments[i]`, the episode's instance rebuilt from its recorded state. Scoring and replay
read the record only: no tool or environment code runs again.

Tool time is not in the record (a part's bytes must not depend on how fast a tool ran): the
rollout manifest's stats carry `tool_calls` and `tool_s` (seconds in tool calls) per worker.
"""
