"""The episode loop: every live episode of a part takes its next model turn together, one engine
call per turn (n=1, a seed per episode and turn), then its tool calls run and their results
are appended; an episode ends when the model answers without a call (answered), when a call it
wrote cannot be read (malformed: the turn is plain text, as TRL 1.16's parse_response falls back
to it), at rollout.max_turns (unless null: unlimited, as TRL's default), when its token budget
(rollout.max_episode_tokens) would be exceeded, when a turn is cut at rollout.max_new_tokens
(length), or, with an environment, when a call runs past rollout.tool_timeout_s (tool_timeout).

An episode's sync calls run where pipeline.agents.execution.episode_calls puts them (the main
thread, as TRL runs them): its environment is made and reset there, its calls run there, and the
environment's state is stored from there (a thread-bound resource made in reset serves them all).
A turn's calls run under Python's and numpy's global generators seeded from (group seed, sample,
turn), so a tool drawing from them gives the same results on any engine, rerun or resume.
With an environment, the state is stored before every call and again at the end; an episode
ended by a timed-out call keeps the state from before that call, so the changes the call made
before it was interrupted never reach the record.

Tokens: a turn's tokens are kept exactly as sampled (mask 1, the sampler's logprobs); the next
turn extends them. Between turns, the template's glue and the tool results are tokenised on
their own (ToolFormat.glue) and appended with mask 0 and logprob 0.0; the results (and the
environment's observation in the prompt) as text, so a marker in them is no control token
(pipeline/agents/inserted.py), and the record keeps where they lie (`inserted`). Seeds derive from
(group seed, sample index, turn), so an episode's tokens do not depend on which others share a
call, a part or a worker.

The episode record (the rollout row's `episode`, JSON) is documented in pipeline/agents/__init__.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline.agents import environment as envs
from pipeline.agents import inserted
from pipeline.agents import state as exact
from pipeline.agents.execution import EpisodeThread, MainThreadCalls, cast_arguments, episode_calls, parameters, seeded
from pipeline.agents.format import ToolFormat
from pipeline.agents.tools import call_tool, tool_schema
from pipeline.data.prompts import Prompt, as_messages, derive_seed, raw_to_json
from pipeline.errors import GRPOError

EPISODE_VERSION = 2
"""2: the record keeps what was inserted (`inserted`) and outside text is tokenised as text; 1: the glue
was tokenised whole (a marker in a tool's result became its special token), and audit does not re-derive it."""
TOOL_SEED = 1
"""The last part of the seed a turn's tool calls run under, derive_seed(group seed, sample, turn, TOOL_SEED):
apart from the engine's seed of the next turn, derive_seed(group seed, sample, turn)."""


@dataclass
class Episode:
    prompt: Prompt
    group_idx: int
    sample_idx: int
    seed: int  # the group's seed
    prompt_text: str
    prompt_ids: list[int]
    tools: dict[str, Callable]
    schemas: list[dict]
    observation: str | None = None
    env: Any = None
    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    turns: int = 0
    ending: str | None = None
    finish_reason: str = "stop"
    thread: MainThreadCalls | EpisodeThread = field(default_factory=MainThreadCalls)
    """The episode's sync calls run here (episode_calls): the environment made and reset here, closed at the end."""
    params: dict[str, dict] = field(default_factory=dict)
    """{tool: its parameters' JSON schemas}: what arguments are cast to."""
    state: dict | None = None
    """The environment's stored state (envs.snapshot), taken where its calls run: before each
    call, then at the end; a timed-out call leaves the one from before it."""
    pool: dict | None = None
    """{"name": its environment's name (a mapping's), "slot": its pooled instance's slot}, for the record."""
    inserted: dict = field(default_factory=lambda: {"prompt": [], "glue": []})
    """Where outside text lies (the record's `inserted`): spans in the prompt (the observation) and, for each
    glue, where it starts in the completion, its length and its spans (tool results)."""

    def extend(self, ids: list[int], logprobs: list[float] | None, text: str) -> None:
        self.ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.texts.append(text)


class EpisodeRunner:
    """Runs the episodes of one part; `agents` holds the loaded tools, environment and format."""

    def __init__(self, agents, tokenizer, cfg, data_cfg, max_prompt_len: int, greedy: bool = False, prompt_given: bool = True):
        self.a, self.tok, self.cfg, self.data, self.greedy = agents, tokenizer, cfg, data_cfg, greedy
        self.prompt_given = prompt_given  # False: the dataset has no prompt column, so reset gets none (TRL's)
        self.budget = cfg.episode_tokens()
        self.max_prompt_len = max_prompt_len
        self.stop_ids = set(agents.stop_ids)
        self.tokens = inserted.Tokens(tokenizer)  # outside text tokenised as text (agents/inserted.py)
        self.tool_s, self.tool_calls = 0.0, 0  # this process's tool time, for the rollout manifest's stats

    def start(self, prompt: Prompt, group_idx: int, sample_idx: int, seed: int, where: str) -> Episode:
        raw, obs, env, tools = prompt.raw, None, None, dict(self.a.tools)
        schemas = list(self.a.schemas)
        thread = episode_calls(f"grpo-episode-{group_idx}-{sample_idx}")
        pool = None
        if self.a.env_classes:
            name = envs.route(self.a.env_classes, prompt.columns, where)  # a mapping: the row's `environment` column
            row = {self.data.prompt_column: prompt.raw, **prompt.columns} if self.prompt_given else dict(prompt.columns)
            if name is not None:
                row.pop(envs.ROUTE_COLUMN)  # TRL does not pass it to reset
            # taken from the pool and reset where the episode's calls run: what reset makes (a sqlite connection) serves every call
            try:
                env, obs, slot = thread.run(self._open_env, {"name": name, "row": row, "seed": seed})
            except BaseException:
                thread.close()
                raise
            pool = {"name": name, "slot": slot} if name is not None else {"slot": slot}
            for m in envs.methods(env):
                if m.__name__ in tools:
                    envs.release(env)
                    raise GRPOError(f"rollout.environment: method {m.__name__!r} has the name of a tool in rollout.tools")
                tools[m.__name__] = m
                schemas.append(tool_schema(m, f"rollout.environment method {m.__name__!r}"))
        # the observation is outside text: located in the rendered prompt and tokenised as text
        text, spans = inserted.locate(lambda o: self.a.format.render(
            as_messages(envs.observe(raw, o[0] if o else None), self.data.system_prompt), schemas, True),
            [obs] if isinstance(obs, str) else [])
        ids = self.tokens.encode(text, spans)
        if len(ids) > self.max_prompt_len:
            raise GRPOError(f"{where}: prompt with tools has {len(ids)} tokens, more than the {self.max_prompt_len} the model's "
                            f"context leaves beside rollout.max_episode_tokens ({self.budget})")
        return Episode(prompt, group_idx, sample_idx, seed, text, list(ids), tools, schemas, obs, env, thread=thread,
                       params={s["function"]["name"]: parameters(s) for s in schemas}, pool=pool,
                       inserted={"prompt": spans, "glue": []})

    def _open_env(self, name: str | None, row: dict, seed: int):
        """(instance, observation, slot): a pooled instance of the row's environment (made on first
        need: __init__ once per slot), reset under the group's seed (where the episode's calls run)."""
        label = f"rollout.environment{'.' + name if name else ''}"
        env, slot = envs.acquire(name, self.a.env_classes[name], label)
        try:
            return env, envs.reset(env, row, label, seed), slot
        except BaseException:
            envs.release(env)
            raise

    def run(self, engine, episodes: list[Episode]) -> None:
        live = [e for e in episodes if e.ending is None]
        try:
            while live:
                caps = [min(self.cfg.max_new_tokens, self.budget - len(e.ids)) for e in live]
                # each episode's turn t is seeded by (group seed, sample, t): independent of its batch
                samples = engine.generate([e.prompt_ids + e.ids for e in live],
                                          [derive_seed(e.seed, e.sample_idx, e.turns) for e in live], 1, greedy=self.greedy,
                                          max_tokens=caps)
                live = [e for e, cap, group in zip(live, caps, samples) if self._after_turn(e, group[0], cap)]
        finally:
            for e in episodes:
                e.thread.close()

    def _finish(self, e: Episode) -> bool:
        """The episode ended (e.ending set): its environment's final state stored (where its calls run),
        unless a call timed out (then the state from before that call stays); its calls' thread closed."""
        if e.env is not None and e.ending != "tool_timeout":
            e.state = _stored_state(e)
        e.thread.close()
        return False

    def _cast(self, e: Episode, name: str | None, arguments):
        """The call's arguments as the tool gets them (cast to its schema's types), for the record;
        as parsed when they cannot be (the call is answered bad_arguments)."""
        if name in e.params and isinstance(arguments, dict):
            try:
                return cast_arguments(e.params[name], arguments)
            except GRPOError:
                pass
        return arguments

    def _after_turn(self, e: Episode, s, cap: int) -> bool:
        """Record a sampled turn, run its calls; True while the episode goes on."""
        prefix_len = len(e.ids)
        e.extend(list(s.token_ids), list(s.logprobs), s.text)
        e.turns += 1
        e.finish_reason = s.finish_reason
        # from the tokens, special ones kept: Mistral's [TOOL_CALLS] is one, and s.text dropped it
        content, calls = self.a.format.parse_turn(s.token_ids, e.prompt_ids + e.ids[:prefix_len], self.stop_ids)
        msg = {"role": "assistant", "content": content, "text": s.text, "tokens": len(s.token_ids), "finish_reason": s.finish_reason}
        malformed = any(c.name is None for c in calls)
        if malformed:  # TRL 1.16: the whole turn is plain text (its decode), no calls: the episode ends
            msg["content"], calls = s.text, []
        if calls:
            msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": self._cast(e, c.name, c.arguments)}}
                                 for c in calls]
        e.messages.append(msg)
        if s.finish_reason == "length":
            e.ending = "max_episode_tokens" if cap < self.cfg.max_new_tokens else "length"
        elif malformed:
            e.ending = "malformed"
        elif not calls:
            e.ending = "answered"
        elif self.cfg.max_turns is not None and e.turns >= self.cfg.max_turns:
            e.ending = "max_turns"
        if e.ending is not None:
            return self._finish(e)
        # the turn's calls draw from the global generators seeded by (group seed, sample, turn): same results on any engine
        with seeded(derive_seed(e.seed, e.sample_idx, e.turns, TOOL_SEED)):
            for c in calls:
                if e.env is not None:  # the state a call that times out leaves recorded (its late changes are not)
                    e.state = _stored_state(e)
                r = call_tool(e.tools, c.name, c.arguments, self.cfg.tool_timeout_s, e.thread, e.params.get(c.name))
                # the call's time goes to the manifest's stats, not the record: parts stay byte-identical
                self.tool_s += r.seconds
                self.tool_calls += 1
                result = {"role": "tool", "name": c.name, "content": r.content, "error": r.error}
                if r.value is not None:  # a list, as TRL keeps it: recorded exactly, rendered and rewarded as the list
                    result["value"] = exact.encode_result(r.value, c.name)
                e.messages.append(result)
                if r.error == "timeout" and e.env is not None:  # the instance may be half changed: the episode ends here
                    e.ending = "tool_timeout"
                    return self._finish(e)
        eot_sampled = bool(s.token_ids) and s.token_ids[-1] in self.stop_ids
        eot = self.tok.decode([s.token_ids[-1]]) if eot_sampled else (self.tok.eos_token or "")
        history = [_render_message(m) for m in e.messages]
        glue, spans = self.a.format.glue(_prompt_messages(e, self.data) + history, len(calls), e.schemas, eot, eot_sampled)
        glue_ids = self.tokens.encode(glue, spans)  # the results as text: a marker in them is no special token
        if len(e.ids) + len(glue_ids) > self.budget:  # TRL's test: the results would pass the budget
            for m in e.messages[-len(calls):]:
                m["dropped"] = True  # ran, but its result did not fit: not part of the tokens
            e.ending = "max_episode_tokens"
            return self._finish(e)
        e.inserted["glue"].append({"at": sum(map(len, e.texts)), "chars": len(glue), "data": spans})
        e.extend(list(glue_ids), None, glue)
        if len(e.ids) == self.budget:  # they fit exactly: kept, as TRL keeps them, and no room for another turn
            e.ending = "max_episode_tokens"  # (TRL samples one and cuts it to nothing)
            return self._finish(e)
        return True

    def row(self, e: Episode, policy_hash: str) -> dict:
        p = e.prompt
        record = {
            "version": EPISODE_VERSION,
            "format": self.a.format.kind,
            "tools": [s["function"]["name"] for s in e.schemas],
            "observation": e.observation,
            "messages": e.messages,
            "turns": e.turns,
            "ending": e.ending,
            "model_tokens": sum(e.mask),
            "context_tokens": len(e.mask) - sum(e.mask),
            "inserted": e.inserted,
        }
        if e.env is not None:
            if e.state is None:  # not ended by this runner (a test's own turns): stored now, on its thread
                e.state = _stored_state(e)
                e.thread.close()
            record["environment"] = {**e.state, **(e.pool or {})}
            # recorded: the instance serves the next episode (one a timed-out call may still change is dropped)
            envs.release(e.env, drop=e.ending == "tool_timeout")
        return {
            "prompt_id": p.prompt_id, "sample_idx": e.sample_idx, "group_idx": e.group_idx,
            "prompt": e.prompt_text, "prompt_raw": raw_to_json(p.raw), "prompt_ids": e.prompt_ids,
            "completion": "".join(e.texts), "completion_ids": e.ids, "sampler_logprobs": e.logprobs,
            "finish_reason": e.finish_reason, "truncated": e.finish_reason == "length",
            "completion_length": sum(e.mask), "policy_hash": policy_hash,  # the model's tokens: what length metrics count
            "completion_mask": e.mask, "episode": json.dumps(record, ensure_ascii=False, sort_keys=True),
            **p.columns,
        }


def _stored_state(e: Episode) -> dict:
    """The environment's state as the record stores it, taken where the episode's calls run (a __getstate__
    that reads a thread-bound resource made in reset works)."""
    return e.thread.run(lambda: envs.snapshot(e.env), {})


def _prompt_messages(e: Episode, data) -> list[dict]:
    return as_messages(envs.observe(e.prompt.raw, e.observation), data.system_prompt)


def _render_message(m: dict) -> dict:
    """An episode message as the format renders it: the assistant's raw text rides along for hermes."""
    if m["role"] == "assistant":
        calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m.get("tool_calls", [])]
        return {"role": "assistant", "content": m["content"], "raw": m["text"], "tool_calls": calls}
    return {"role": "tool", "name": m["name"], "content": tool_content(m)}


def tool_content(m: dict) -> Any:
    """A tool message's content as TRL's message holds it: the list a tool returned, else the text."""
    return exact.decode(m["value"]) if "value" in m else m["content"]


def trl_completion(record: dict) -> list[dict]:
    """The episode after the prompt as TRL 1.16 hands it to reward functions: assistant messages
    (content, and tool_calls {type, function: {name, arguments}} when it made calls) and tool
    messages {role, name, content}; results dropped for the token budget are left out, as TRL does."""
    out = []
    for m in record["messages"]:
        if m["role"] == "assistant":
            calls = [c for c in m.get("tool_calls", []) if c["function"]["name"] is not None]
            out.append({"role": "assistant", "content": m["content"], **({"tool_calls": calls} if calls else {})})
        elif m["role"] == "user":  # an endpoint agent's own message between turns (pipeline.agents.endpoint)
            out.append({"role": "user", "content": m["content"]})
        elif m["role"] == "context":  # the tokens route's glue, the client's own ids between turns: no message TRL holds
            continue
        elif not m.get("dropped"):
            out.append({"role": "tool", "name": m["name"] or "unknown", "content": tool_content(m)})
    return out
