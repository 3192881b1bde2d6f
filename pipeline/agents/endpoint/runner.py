"""The episodes of one part, each an agent program talking to grpo's endpoint (server.py).

The rollout's thread owns every decision. Agents start in the part's order (at most
rollout.agent.max_running at once). A client's retry (a body answered before) is answered as it
arrives. Otherwise it waits until each live episode has a request waiting or its agent has exited
(or used up rollout.agent.timeout_s of its own time: killed; the clock is held while a turn or a side
call waits, never for a retry or a refusal; side calls are bounded by rollout.agent.max_side_calls), then takes one request per such episode, in the part's order,
and samples all of them in one engine call (n=1, each request its own seed: derive_seed(group seed, sample, turn), as
pipeline.agents.episode seeds a turn; a side call derive_seed(group seed, sample, turn, SIDE_SEED, k)).
So which requests share a call depends only on what the agents sent, never on when; and with
per-request seeds a request's tokens do not depend on which others share it either.

A request whose `model` is the run's (GRPO_MODEL) is the episode's next turn. The first renders the
episode's prompt with the run's chat template and tool format (pipeline.agents.format, its `tools`
as the schemas). Each later one must be the recorded conversation extended: the messages grpo
answered before, exactly (canonical_message: what a message means, not how a client spells it),
the assistant message grpo returned, then new tool or user messages; their glue (format.glue_text,
as a tool episode's) is appended under mask 0 and the sampled tokens are never re-tokenised. Any
other history ends the episode (history_rewritten, what differs in `detail`), trained up to there.
A request for another model is a side call: sampled and answered, recorded, never in the row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from jinja2 import TemplateError

from pipeline.agents import inserted
from pipeline.agents.endpoint import chat, tokens, vf_trace
from pipeline.agents.endpoint.jobs import AGENT_SEED, MODEL, SIDE_SEED, Job, again, other_route, side_refused, stops_unserved
from pipeline.agents.endpoint.process import AgentProcess, stamp
from pipeline.agents.endpoint.vf_run import agent_argv
from pipeline.agents.endpoint.server import Hub, Request, Server
from pipeline.data.prompts import Prompt, derive_seed, raw_to_json
from pipeline.errors import GRPOError

ENDPOINT_VERSION = 1


@dataclass
class EndpointEpisode:
    prompt: Prompt
    group_idx: int
    sample_idx: int
    seed: int  # the group's
    key: str = ""
    proc: AgentProcess | None = None
    prompt_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    schemas: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # after the prompt, as a tool episode's record holds them
    prompt_messages: list[dict] | None = None
    convo: list[dict] = field(default_factory=list)  # canonical messages answered so far (request + answer)
    convo_answer: dict | None = None  # the last answer's message, canonical
    shapes: list[dict] = field(default_factory=list)  # the same, as ToolFormat renders them
    calls_by_id: dict[str, str] = field(default_factory=dict)
    requests: list[dict] = field(default_factory=list)
    last: tuple | None = None  # (body hash, status, payload, stream) of the last turn answered or refused
    side_answers: dict = field(default_factory=dict)  # body hash -> (status, payload, stream) of each side call
    last_ids: list[int] = field(default_factory=list)
    turns: int = 0
    sides: int = 0
    ending: str | None = None
    detail: str | None = None
    finish_reason: str = "stop"
    agent: dict | None = None
    done: bool = False
    route: str | None = None  # "chat" | "tokens": fixed by the first turn (jobs.other_route)
    tail: str = ""  # a crashed agent's last output line, its key blanked (for the log and the rollout's error, never the record)

    def extend(self, ids: list[int], logprobs: list[float] | None, text: str) -> None:
        self.ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.texts.append(text)

    def end(self, ending: str, detail: str | None = None) -> None:
        if self.ending is None:
            self.ending, self.detail = ending, detail


class EndpointRunner:
    """Runs a part's endpoint episodes (the interface of pipeline.agents.episode.EpisodeRunner)."""

    def __init__(self, agents, tokenizer, cfg, data_cfg, max_prompt_len: int, greedy: bool = False, prompt_given: bool = True):
        self.a, self.tok, self.cfg, self.data, self.greedy = agents, tokenizer, cfg, data_cfg, greedy
        self.tokens = inserted.Tokens(tokenizer)  # tool results and new messages tokenised as text (agents/inserted.py)
        self.budget, self.max_prompt_len = cfg.episode_tokens(), max_prompt_len
        self.stop_ids = set(agents.stop_ids)
        self.tool_s, self.tool_calls = 0.0, 0  # the agent's tools run in its process: results counted, not timed
        self.command = agent_argv(cfg.agent)  # what runs: the rollout names the run's copies of its scripts (RUN/code)
        self.temperature = cfg.temperature  # what the engine samples at (a held-out eval: eval.temperature)

    def stamp(self) -> dict:
        return stamp(agent_argv(self.cfg.agent))

    def sampling(self, cap: int) -> dict:
        c = self.cfg
        return {"temperature": self.temperature, "top_p": c.top_p, "top_k": c.top_k, "min_p": c.min_p,
                "max_tokens": cap, "stop": list(c.stop), "stop_token_ids": sorted(self.stop_ids), "greedy": self.greedy}

    def start(self, prompt: Prompt, group_idx: int, sample_idx: int, seed: int, where: str) -> EndpointEpisode:
        return EndpointEpisode(prompt, group_idx, sample_idx, seed)

    def _task(self, e: EndpointEpisode) -> str:
        return json.dumps({self.data.prompt_column: e.prompt.raw, **e.prompt.columns}, ensure_ascii=False, sort_keys=True, default=str)

    def run(self, engine, episodes: list[EndpointEpisode]) -> None:
        hub, waiting, live, cap = Hub(MODEL), list(episodes), [], self.cfg.agent.max_running or len(episodes)
        server = Server(hub)
        try:
            while live or waiting:
                while waiting and len(live) < cap:  # as earlier ones end: never by timing
                    e = waiting.pop(0)
                    e.key = hub.new_key()
                    env = {"OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": e.key, "GRPO_MODEL": MODEL, "GRPO_TASK": self._task(e),
                           "GRPO_SEED": str(derive_seed(e.seed, e.sample_idx, 0, AGENT_SEED)), "GRPO_TOKENIZER": self.tok.name_or_path}
                    e.proc = AgentProcess(self.command, env, self.cfg.agent.timeout_s)
                    live.append(e)
                with hub.cond:
                    while True:
                        for e in live:  # a retry is answered as it comes: it never waits for a round, nor holds the clock
                            while hub.pending[e.key] and again(e, hub.pending[e.key][0]):
                                hub.pending[e.key].pop(0)
                        if all(hub.pending[e.key] or e.proc.poll() is not None or e.proc.expired() for e in live):
                            break
                        hub.cond.wait(0.05)  # an exit or a timeout is polled; an arrival notifies
                    taken = {e.key: hub.pending[e.key].pop(0) for e in live if hub.pending[e.key]}
                jobs = []
                for e in live:
                    r = taken.get(e.key)
                    if r is None or (e.proc.poll() is None and e.proc.expired(r.arrived)):
                        self._exited(e)  # exited, or out of its own time (before this request came: killed)
                    elif (job := self._request(e, r)) is not None:
                        e.proc.hold(r.arrived)  # waiting for the others' requests and the engine is not the agent's time
                        jobs.append(job)
                if jobs:
                    samples = engine.generate([j.prompt for j in jobs], [j.seed for j in jobs], 1, greedy=self.greedy,
                                              max_tokens=[j.cap for j in jobs])
                    for j, group in zip(jobs, samples):
                        self._answer(j, group[0])
                for e in (e for e in live if e.key in taken):
                    e.proc.go()  # every request taken this round is answered by now
                live = [e for e in live if not e.done]
        finally:
            for e in episodes:
                if e.proc is not None:
                    if not e.done:
                        self._exited(e)
                    e.proc.cleanup()
                hub.drop(e.key)
            server.close()

    def _exited(self, e: EndpointEpisode) -> None:  # it exited (or ran past its timeout: killed); the ending if none yet
        rc = e.proc.poll()
        if rc is None:
            e.proc.kill()
            e.end("agent_timeout", f"still running after rollout.agent.timeout_s ({self.cfg.agent.timeout_s} s)")
        elif rc != 0:
            e.end("agent_crashed", f"exit status {rc}")
            tail = e.proc.output_tail(e.key)
            e.tail = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "(no output)")[:300]
            print(f"grpo: agent of episode {e.group_idx}/{e.sample_idx} exited {rc}:\n{tail}", flush=True)
        elif e.turns == 0:
            e.end("no_calls", "the agent exited without asking for a turn")
        else:
            e.end("finished")
        result, why = e.proc.result(e.key)
        e.agent = {"exit_code": None if e.proc.killed else rc, "killed": e.proc.killed, "result": result, "result_error": why}
        if result is not None and "verifiers" in result:  # the trace verifiers scored, checked against what grpo recorded
            e.agent["trace_problem"] = vf_trace.problem(e.requests, result["verifiers"])
            said = [p for p in (e.agent["trace_problem"], vf_trace.errors(result["verifiers"])) if p]  # else in the record alone
            if said:
                print(f"grpo: verifiers episode {e.group_idx}/{e.sample_idx}: {'; recorded errors: '.join(said)}", flush=True)
        e.done = True

    def _over(self, e: EndpointEpisode, r: Request, h: str | None, ending: str, detail: str | None = None, message: str | None = None) -> None:
        """Ends the episode (`ending`, `detail`) and refuses the request that met it (`message`, else the detail)."""
        e.end(ending, detail)
        self._refuse(e, r, h, message or detail or ending)

    def _refuse(self, e: EndpointEpisode, r: Request, h: str | None, message: str, kind: str = "refused") -> None:
        e.requests.append({"kind": kind, "body_sha256": h, "why": message})
        e.last = (h, 400, chat.error(message), None)
        r.answer(400, chat.error(message))

    def _request(self, e: EndpointEpisode, r: Request) -> Job | None:
        """A job for the engine, or None when the request is answered without one (refused, repeated)."""
        if r.route == tokens.ROUTE:  # POST /inference/v1/generate: the client's own token ids (tokens.py)
            return tokens.request(self, e, r)
        try:
            if r.body is not None:
                chat.check_body(r.body, e.key)  # first: a body that is no request grpo serves is recorded with no hash
        except chat.BadBody as err:
            return self._malformed(e, r, None, err)
        h = r.digest
        if again(e, r):
            return None
        if e.ending is not None:
            self._refuse(e, r, h, f"the episode has ended ({e.ending})")
            return None
        try:
            if r.body is None:
                raise chat.BadBody(r.raw_error)
            msgs = [chat.canonical_message(m) for m in r.body["messages"]]
        except chat.BadBody as err:
            return self._malformed(e, r, h, err)
        try:
            return self._turn(e, r, h, msgs)
        except TemplateError as err:  # the template's own raise_exception (Qwen 3.5: the system message first)
            return self._malformed(e, r, h, chat.BadBody(f"the chat template refuses the conversation: {err}"))

    def _malformed(self, e: EndpointEpisode, r: Request, h: str | None, err: chat.BadBody) -> None:
        if e.ending is None:
            e.end("malformed_request", str(err))
        self._refuse(e, r, h, f"malformed request: {err}", "malformed")
        return None

    def _turn(self, e: EndpointEpisode, r: Request, h: str | None, msgs: list[dict]) -> Job | None:
        """`_request` for a body that reads as a chat completion (`msgs`: its canonical messages)."""
        body, tools = r.body, r.body.get("tools") or []
        entry = {"body_sha256": h, "asked": chat.asked(body)}
        unserved = stops_unserved(self, body.get("stop"), body.get("stop_token_ids"))  # refused, never ignored
        if body["model"] != MODEL:
            return self._side(e, r, msgs, tools, entry, unserved)
        if (why := other_route(e, r) or unserved) is not None:  # one route per episode (jobs.other_route)
            return self._over(e, r, h, "unsupported_request", why)
        if not e.convo:
            shapes = [chat.render_shape(m, {}) for m in msgs]
            text, spans = chat.first_prompt(self.a.format, shapes, tools, self.tokens.marked)
            ids = self.tokens.encode(text, spans)  # the agent's messages as text: a marker in them is no special token
            if len(ids) > self.max_prompt_len:
                e.end("prompt_too_long", f"{len(ids)} tokens, more than the {self.max_prompt_len} the context leaves beside "
                                         f"rollout.max_episode_tokens ({self.budget})")
                self._refuse(e, r, h, e.detail)
                return None
            e.prompt_text, e.prompt_ids, e.schemas, e.prompt_messages = text, ids, tools, msgs
            e.convo, e.shapes = msgs, shapes
            entry.update(new_messages=msgs, prompt_tokens=len(ids))
        else:
            if (why := chat.extension_problem(e.schemas, e.convo, e.convo_answer, msgs, tools)) is not None:
                return self._over(e, r, h, "history_rewritten", why, f"the conversation does not extend the episode's record: {why}")
            if self.cfg.max_turns is not None and e.turns >= self.cfg.max_turns:
                return self._over(e, r, h, "max_turns", None, f"the episode has ended (max_turns {self.cfg.max_turns})")
            new = msgs[len(e.convo):]
            shapes = [chat.render_shape(m, e.calls_by_id) for m in new]
            last = e.last_ids
            eot_sampled = bool(last) and last[-1] in self.stop_ids
            eot = self.tok.decode([last[-1]]) if eot_sampled else (self.tok.eos_token or "")
            try:
                glue, spans = self.a.format.glue(e.shapes + shapes, len(shapes), e.schemas, eot, eot_sampled)
            except GRPOError as err:
                return self._over(e, r, h, "template_rewrites_history", str(err))
            glue_ids = self.tokens.encode(glue, spans)  # the new messages' text as text: a marker in it is no special token
            if len(e.ids) + len(glue_ids) >= self.budget:  # no room for a token of the next turn
                return self._over(e, r, h, "max_episode_tokens", None, f"the episode has ended (rollout.max_episode_tokens {self.budget})")
            e.extend(glue_ids, None, glue)
            e.convo, e.shapes = msgs, e.shapes + shapes
            for m in new:
                if m["role"] == "tool":
                    self.tool_calls += 1
                    e.messages.append({"role": "tool", "name": e.calls_by_id.get(m.get("tool_call_id") or "") or None,
                                       "content": m["content"], "error": None})
                else:
                    e.messages.append({"role": m["role"], "content": m["content"]})
            entry.update(new_messages=new, prompt_delta=glue_ids)
        cap = min(self.cfg.max_new_tokens, self.budget - len(e.ids))
        seed = derive_seed(e.seed, e.sample_idx, e.turns)
        return Job(e, r, "turn", e.prompt_ids + e.ids, seed, cap, {"kind": "turn", **entry, "seed": seed, "sampling": self.sampling(cap)})

    def _side(self, e: EndpointEpisode, r: Request, msgs: list[dict], tools: list, entry: dict, unserved: str | None) -> Job | None:
        text = self.a.format.render([chat.render_shape(m, {}) for m in msgs], tools, True)
        ids = list(self.tok(text, add_special_tokens=False, verbose=False)["input_ids"])
        if (why := unserved or side_refused(self, e, len(ids))) is not None:
            self._refuse(e, r, entry["body_sha256"], why, "side_refused")
            return None
        e.sides += 1
        seed = derive_seed(e.seed, e.sample_idx, e.turns, SIDE_SEED, e.sides)
        cap = self.cfg.max_new_tokens
        return Job(e, r, "side", ids, seed, cap, {"kind": "side", **entry, "seed": seed, "sampling": self.sampling(cap), "prompt_ids": ids})

    def _answer(self, j: Job, s) -> None:
        if j.entry.get("route") == tokens.ROUTE:
            return tokens.answer(self, j, s)
        e, ids = j.e, list(s.token_ids)
        content, calls = self.a.format.parse_turn(ids, j.prompt, self.stop_ids)
        malformed = any(c.name is None for c in calls)
        if malformed:  # as a tool episode reads it: the whole turn is plain text
            content, calls = s.text, []
        turn = e.turns + 1 if j.kind == "turn" else e.sides
        msg = chat.assistant_message(content, calls, turn, side=j.kind == "side")
        answer = {"message": msg, "finish_reason": chat.finish(s.finish_reason, msg), "prompt_ids": j.prompt, "ids": ids,
                  "logprobs": list(s.logprobs), "decode": self.tok.decode}
        j.entry.update(completion_ids=ids, logprobs=list(s.logprobs), finish_reason=answer["finish_reason"], message=msg)
        e.requests.append(j.entry)
        rid = f"chatcmpl-{e.group_idx}-{e.sample_idx}-{len(e.requests)}"
        model = j.r.body["model"]
        stream = chat.chunks(answer, j.r.body, rid, model) if j.r.body.get("stream") else None
        payload = chat.completion(answer, j.r.body, rid, model)
        if j.kind == "turn":
            e.extend(ids, list(s.logprobs), s.text)
            e.turns, e.finish_reason, e.last_ids = turn, s.finish_reason, ids
            record = {"role": "assistant", "content": content, "text": s.text, "tokens": len(ids), "finish_reason": s.finish_reason}
            if calls:
                record["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            e.messages.append(record)
            e.convo_answer = chat.canonical_message(msg)
            e.convo = e.convo + [e.convo_answer]
            e.shapes = e.shapes + [{"role": "assistant", "content": content, "raw": s.text,
                                    "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls]}]
            e.calls_by_id.update({c["id"]: c["function"]["name"] for c in msg.get("tool_calls", [])})
            e.last = (j.entry["body_sha256"], 200, payload, stream)
            if s.finish_reason == "length":
                e.end("max_episode_tokens" if j.cap < self.cfg.max_new_tokens else "length")
        else:
            e.side_answers[j.entry["body_sha256"]] = (200, payload, stream)
        j.r.answer(200, payload, stream)

    def row(self, e: EndpointEpisode, policy_hash: str) -> dict:
        p = e.prompt
        prompt_text, prompt_ids = (e.prompt_text, e.prompt_ids) if e.prompt_ids else (p.text, p.ids)  # no turn: the task's prompt
        record = {
            "version": ENDPOINT_VERSION, "route": "endpoint", "format": self.a.format.kind,
            "tools": [t["function"]["name"] for t in e.schemas], "tool_schemas": e.schemas, "observation": None,
            # the schemas' JSON in the order the agent sent them: the template renders that order (the record's keys are sorted)
            "tool_schemas_json": json.dumps(e.schemas, ensure_ascii=False, separators=(",", ":")),
            "prompt_messages": e.prompt_messages, "messages": e.messages, "requests": e.requests,
            "turns": e.turns, "ending": e.ending, "detail": e.detail, "agent": e.agent,
            "model_tokens": sum(e.mask), "context_tokens": len(e.mask) - sum(e.mask),
        }
        return {
            "prompt_id": p.prompt_id, "sample_idx": e.sample_idx, "group_idx": e.group_idx,
            "prompt": prompt_text, "prompt_raw": raw_to_json(p.raw), "prompt_ids": prompt_ids,
            "completion": "".join(e.texts), "completion_ids": e.ids, "sampler_logprobs": e.logprobs,
            "finish_reason": e.finish_reason, "truncated": e.finish_reason == "length",
            "completion_length": sum(e.mask), "policy_hash": policy_hash,
            "completion_mask": e.mask, "episode": json.dumps(record, ensure_ascii=False, sort_keys=True),
            **p.columns,
        }

