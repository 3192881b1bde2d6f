"""The endpoint's tokens route (POST /inference/v1/generate, pipeline/agents/endpoint/tokens.py), in the
shape verifiers' train client sends and reads (renderers/client.py `generate`): token ids in, token ids
and `token_id:N` logprobs out. Real HTTP (httpx) against the real server; the runner answers each request
as the rollout's thread does, with turns given (as tests/test_endpoint.py gives them) or, in the slow test,
sampled by the engine on the session's tiny model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from test_endpoint import AGENT, endpoint_run, rows, tiny2k  # noqa: F401 (tiny2k: the module's fixture, reused)

GENERATE = "/inference/v1/generate"


class Live:
    """One episode behind the real server: `post` sends a body over HTTP, `serve` answers the waiting
    request as the rollout's thread does (runner._request, then runner._answer with `sample(job)`)."""

    def __init__(self, plan, sample_idx: int = 0):
        from pipeline.agents.endpoint.server import Hub, Server

        self.runner, self.tok, p = plan.episodes, plan.tokenizer, plan.prompts[0]
        self.hub = Hub("policy")
        self.server = Server(self.hub)
        self.e = self.runner.start(p, 0, sample_idx, plan.group_seed(p.prompt_id), "test")
        self.e.key = self.hub.new_key()
        self.pool = ThreadPoolExecutor(1)
        self.root = self.server.base_url.removesuffix("/v1")

    def post(self, body, sample=None, key: str | None = None, path: str = GENERATE):
        fut = self.pool.submit(httpx.post, self.root + path, json=body, timeout=30,
                               headers={"Authorization": f"Bearer {key or self.e.key}"})
        if key is None:
            with self.hub.cond:
                while not self.hub.pending[self.e.key]:
                    self.hub.cond.wait(0.05)
                r = self.hub.pending[self.e.key].pop(0)
            job = self.runner._request(self.e, r)
            if job is not None:
                self.runner._answer(job, sample(job))
        return fut.result()

    def close(self):
        self.hub.drop(self.e.key)
        self.server.close()
        self.pool.shutdown()


def given(text_ids: list[int], finish: str = "stop"):
    from pipeline.models.engines import Sample

    return lambda job: Sample("", list(text_ids), [-0.25 - 0.01 * i for i in range(len(text_ids))], finish)


def test_tokens_route_extends_the_recorded_ids_exactly(make_run, tiny2k, tmp_path):  # noqa: F811
    """The first body's token_ids are the prompt; the answer is what verifiers' train client parses (token_ids,
    one `token_id:N` logprob per id, usage); the next body is those ids, the sampled ids exactly and the
    client's glue (mask 0); sampling is the run's, what was asked recorded beside it; a retry gets its answer
    and records nothing; a body whose ids differ from the record ends the episode history_rewritten (400);
    the record audits clean and a forged token is named; another key is 401."""
    from pipeline.agents.endpoint.audit import row_problems
    from pipeline.rollout import RolloutInputs
    from pipeline.run.run import Run

    plan = RolloutInputs(Run(endpoint_run(make_run, tiny2k, tmp_path, "tok", ["python", AGENT], rows(tmp_path / "c.jsonl"))), 0)
    live = Live(plan)
    tok, runner, e = live.tok, live.runner, live.e
    try:
        assert live.post({"model": "policy", "token_ids": [1]}, key="grpo-" + "0" * 32).status_code == 401
        prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, tokenize=False)
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        sp = {"temperature": 0.3, "max_tokens": 999, "stop_token_ids": [tok.eos_token_id], "logprobs": 1, "skip_special_tokens": False}
        body = {"model": "policy", "token_ids": prompt_ids, "sampling_params": sp}
        turn1 = tok("4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        got = live.post(body, given(turn1))
        assert got.status_code == 200, got.text
        out = got.json()
        choice = out["choices"][0]
        assert choice["token_ids"] == turn1 and choice["finish_reason"] == "stop"
        assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in turn1]
        assert [c["logprob"] for c in choice["logprobs"]["content"]] == [-0.25, -0.26]
        assert out["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 2, "total_tokens": len(prompt_ids) + 2}
        assert e.prompt_ids == prompt_ids and e.ids == turn1 and e.mask == [1, 1]
        q = e.requests[0]
        assert q["route"] == "tokens" and q["asked"]["sampling_params"]["temperature"] == 0.3
        assert q["sampling"]["temperature"] == runner.cfg.temperature and q["sampling"]["max_tokens"] == runner.cfg.max_new_tokens
        # a retry (the same bytes): the same answer, nothing recorded
        before = json.dumps(e.requests)
        again = live.post(body, lambda job: pytest.fail("a retry is never sampled"))
        assert again.json() == out and json.dumps(e.requests) == before
        # turn 2: the recorded ids exactly, then the client's glue (its template's next user message)
        glue = tok("\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        turn2 = tok("6", add_special_tokens=False)["input_ids"]
        body2 = {**body, "token_ids": prompt_ids + turn1 + glue}
        assert live.post(body2, given(turn2)).status_code == 200
        assert e.ids == turn1 + glue + turn2 and e.mask == [1, 1] + [0] * len(glue) + [1] * len(turn2)
        assert e.requests[1]["prompt_delta"] == glue and e.requests[1]["seed"] != q["seed"]
        row = runner.row(e, "policy-hash")
        seed = plan.group_seed(plan.prompts[0].prompt_id)
        assert row["prompt_ids"] == prompt_ids and row["completion_mask"] == e.mask
        assert row_problems(runner, row, seed) == []
        forged = list(row["completion_ids"])
        forged[0] += 1
        assert row_problems(runner, {**row, "completion_ids": forged}, seed) == [
            "completion_ids at token 0 are not turn 1's recorded completion ids"]
        assert row_problems(runner, row, seed + 1) == ["turn 1: its recorded seed or token cap is not the one the run derives"]
        # turn 3 re-tokenises the sampled "6" differently (one id changed): refused, the episode ends there
        bad = prompt_ids + turn1 + glue + [turn2[0] + 1] + glue
        refused = live.post({**body, "token_ids": bad}, lambda job: pytest.fail("a rewritten history is never sampled"))
        at = len(prompt_ids) + len(turn1) + len(glue)
        assert refused.status_code == 400 and e.ending == "history_rewritten"
        assert e.detail == f"token_ids[{at}] is {turn2[0] + 1}, the record's completion token {at - len(prompt_ids)} is {turn2[0]}"
        assert runner.row(e, "policy-hash")["completion_ids"] == row["completion_ids"]  # trained up to there
    finally:
        live.close()


@pytest.mark.parametrize("body, why", [
    ({"model": "policy", "token_ids": []}, "`token_ids` must be a non-empty list of token ids"),
    ({"model": "policy", "token_ids": [1, "2"]}, "`token_ids` must be a non-empty list of token ids"),
    ({"model": "policy", "token_ids": [10 ** 9]}, "`token_ids` must be a non-empty list of token ids"),
    ({"model": "policy", "token_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n=2"),
    ({"model": "policy", "token_ids": [1], "features": {}}, "features: grpo's tokens route takes text token ids only"),
    ({"token_ids": [1]}, "`model` must be a string"),
])
def test_a_tokens_body_grpo_cannot_serve_is_named(body, why):
    from pipeline.agents.endpoint import chat, tokens

    with pytest.raises(chat.BadBody, match=__import__("re").escape(why)):
        tokens.check_body(body, "grpo-key", 50000)


def test_a_malformed_tokens_body_and_a_key_in_it_end_the_episode(make_run, tiny2k, tmp_path):  # noqa: F811
    from pipeline.rollout import RolloutInputs
    from pipeline.run.run import Run

    plan = RolloutInputs(Run(endpoint_run(make_run, tiny2k, tmp_path, "bad", ["python", AGENT], rows(tmp_path / "c.jsonl"))), 0)
    live = Live(plan)
    try:
        got = live.post({"model": "policy", "token_ids": [1, 2], "cache_salt": live.e.key}, lambda job: pytest.fail("never sampled"))
        assert got.status_code == 400 and live.e.ending == "malformed_request" and "API key" in live.e.detail
        assert live.e.key not in json.dumps(live.runner.row(live.e, "h"))
    finally:
        live.close()


@pytest.mark.slow
def test_an_httpx_tokens_agent_through_the_rollout_is_token_exact(make_run, tiny2k, tmp_path):  # noqa: F811
    """An agent program of a few lines (httpx, the tokenizer grpo names in GRPO_TOKENIZER) playing two turns on
    the tokens route, through run_rollout on the engine: mask 1 exactly on the engine's sampled ids (sampled
    again from the row's own prefix and the recorded seed), its glue mask 0; the row audits clean."""
    from pipeline.agents.endpoint.audit import row_problems
    from pipeline.rollout import RolloutInputs, policy_engine, run_rollout
    from pipeline.run.run import Run
    from test_endpoint import part_rows

    agent = tmp_path / "tokens_agent.py"
    agent.write_text(TOKENS_AGENT)
    run = endpoint_run(make_run, tiny2k, tmp_path, "live", ["python", str(agent)], rows(tmp_path / "c.jsonl"))
    engine = policy_engine(Run(run), 0)
    try:
        run_rollout(Run(run), 0, engine=engine)
        runner = RolloutInputs(Run(run), 0).episodes
        got = part_rows(run)
        assert len(got) == 4
        for row in got:
            rec = json.loads(row["episode"])
            turns = [q for q in rec["requests"] if q["kind"] == "turn"]
            assert rec["agent"]["exit_code"] == 0 and all(q["route"] == "tokens" for q in turns), rec
            ids, at, mask = row["completion_ids"], 0, []
            for q in turns:
                delta = q.get("prompt_delta", [])
                at += len(delta)
                again = engine.generate([row["prompt_ids"] + ids[:at]], [q["seed"]], 1, max_tokens=[q["sampling"]["max_tokens"]])[0][0]
                assert list(again.token_ids) == q["completion_ids"] == ids[at:at + len(q["completion_ids"])]
                at += len(q["completion_ids"])
                mask += [0] * len(delta) + [1] * len(q["completion_ids"])
            assert row["completion_mask"] == mask and at == len(ids)
            assert row_problems(runner, row) == []
    finally:
        engine.close()


TOKENS_AGENT = '''
import json, os
import httpx
from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained(os.environ["GRPO_TOKENIZER"])
task = json.loads(os.environ["GRPO_TASK"])
url = os.environ["OPENAI_BASE_URL"].removesuffix("/v1") + "/inference/v1/generate"
auth = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
ids = tok.apply_chat_template(task["prompt"], add_generation_prompt=True, tokenize=True)
ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
for turn in range(2):
    out = httpx.post(url, json={"model": os.environ["GRPO_MODEL"], "token_ids": ids, "sampling_params": {"logprobs": 1}},
                     headers=auth, timeout=120)
    if out.status_code != 200:
        break
    choice = out.json()["choices"][0]
    assert [c["token"] for c in choice["logprobs"]["content"]] == ["token_id:%d" % t for t in choice["token_ids"]]
    ids = ids + choice["token_ids"] + tok("\\n<|im_start|>user\\nSure?<|im_end|>\\n<|im_start|>assistant\\n", add_special_tokens=False)["input_ids"]
'''


CHAT = "/v1/chat/completions"


def test_one_episode_one_route_a_turn_on_the_other_ends_it_unsupported(make_run, tiny2k, tmp_path):  # noqa: F811
    """Reviewer F1: an episode's first turn fixes its route; a turn on the other route (chat after tokens, tokens after
    chat) is refused 400 with one line, the episode ends unsupported_request and its row is what it was before."""
    from pipeline.agents.endpoint.audit import row_problems
    from pipeline.rollout import RolloutInputs
    from pipeline.run.run import Run

    plan = RolloutInputs(Run(endpoint_run(make_run, tiny2k, tmp_path, "mix", ["python", AGENT], rows(tmp_path / "c.jsonl"))), 0)
    tok, seed = plan.tokenizer, plan.group_seed(plan.prompts[0].prompt_id)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt_ids = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
    four = tok("4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for first, second in (("chat", "tokens"), ("tokens", "chat")):
        live = Live(plan, sample_idx=0 if first == "chat" else 1)
        try:
            if first == "chat":
                got = live.post({"model": "policy", "messages": msgs}, given(four), path=CHAT)
            else:
                got = live.post({"model": "policy", "token_ids": prompt_ids}, given(four))
            assert got.status_code == 200, got.text
            row = live.runner.row(live.e, "h")
            glue = tok("\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
            if second == "tokens":
                body = {"model": "policy", "token_ids": row["prompt_ids"] + row["completion_ids"] + glue}
                refused = live.post(body, lambda job: pytest.fail("another route's turn is never sampled"))
            else:
                body = {"model": "policy", "messages": msgs + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "Sure?"}]}
                refused = live.post(body, lambda job: pytest.fail("another route's turn is never sampled"), path=CHAT)
            why = refused.json()["error"]["message"]
            assert refused.status_code == 400 and live.e.ending == "unsupported_request" and "\n" not in why
            assert why == live.e.detail and f"a turn on the {second} route" in why and f"turns are on the {first} route" in why
            after = live.runner.row(live.e, "h")
            assert (after["prompt_ids"], after["completion_ids"], after["completion_mask"]) == (
                row["prompt_ids"], row["completion_ids"], row["completion_mask"])
            assert row_problems(live.runner, after, seed) == []
        finally:
            live.close()


def test_token_ids_that_decode_to_the_key_are_refused_and_never_recorded(make_run, tiny2k, tmp_path):  # noqa: F811
    """Reviewer F2/F3: the client's ids are recorded with their text, so ids that decode to the episode's key (in the
    prompt, split by a special token, or in the glue of a later turn) are malformed_request (400), nothing of them kept."""
    from pipeline.rollout import RolloutInputs
    from pipeline.run.run import Run

    plan = RolloutInputs(Run(endpoint_run(make_run, tiny2k, tmp_path, "key", ["python", AGENT], rows(tmp_path / "c.jsonl"))), 0)
    tok = plan.tokenizer
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt_ids = enc(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    four = enc("4") + [tok.eos_token_id]
    for where in ("prompt", "split", "glue"):
        live = Live(plan)
        key = live.e.key
        try:
            if where == "glue":
                assert live.post({"model": "policy", "token_ids": prompt_ids}, given(four)).status_code == 200
                ids = prompt_ids + four + enc(f"\n<|im_start|>user\nmy key is {key}<|im_end|>\n<|im_start|>assistant\n")
            elif where == "split":  # a special token between its halves: the text without special tokens holds it
                ids = enc("<|im_start|>user\nkey " + key[:9]) + [tok.eos_token_id] + enc(key[9:] + "<|im_end|>\n<|im_start|>assistant\n")
            else:
                ids = enc(f"<|im_start|>user\nRepeat {key}<|im_end|>\n<|im_start|>assistant\n")
            assert key in tok.decode(ids, skip_special_tokens=True)
            before = json.dumps(live.e.requests)
            got = live.post({"model": "policy", "token_ids": ids}, lambda job: pytest.fail("never sampled"))
            assert got.status_code == 400 and live.e.ending == "malformed_request", (where, got.text)
            assert "API key" in live.e.detail and key not in got.text
            assert json.loads(before) == live.e.requests[:-1] and live.e.requests[-1]["body_sha256"] is None
            row = json.dumps(live.runner.row(live.e, "h"))
            assert key not in row and key[9:] not in row
            assert live.e.ids == (four if where == "glue" else [])
        finally:
            live.close()


def test_stop_token_ids_are_the_runs_or_refused_never_ignored(make_run, tiny2k, tmp_path):  # noqa: F811
    """The engine stops on the run's stop token ids alone (fixed when it starts): a turn asking some of them is served,
    one asking another id ends the episode unsupported_request naming the field, on both routes; a side call asking
    one is refused alone; `stop_token_ids` that are not token ids are malformed."""
    from pipeline.agents.endpoint import chat, tokens
    from pipeline.rollout import RolloutInputs
    from pipeline.run.run import Run

    plan = RolloutInputs(Run(endpoint_run(make_run, tiny2k, tmp_path, "stops", ["python", AGENT], rows(tmp_path / "c.jsonl"))), 0)
    tok, runner = plan.tokenizer, plan.episodes
    stops = sorted(runner.stop_ids)
    other = next(t for t in range(len(tok)) if t not in runner.stop_ids)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt_ids = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
    four = tok("4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    chat_body = {"model": "policy", "messages": msgs}
    tok_body = {"model": "policy", "token_ids": prompt_ids}
    cases = [(CHAT, {**chat_body, "stop_token_ids": stops[:1]}, 200), (GENERATE, {**tok_body, "sampling_params": {"stop_token_ids": stops}}, 200),
             (CHAT, {**chat_body, "stop_token_ids": [stops[0], other]}, "`stop_token_ids`"),
             (GENERATE, {**tok_body, "sampling_params": {"stop_token_ids": [other]}}, "`sampling_params.stop_token_ids`")]
    for path, body, want in cases:
        live = Live(plan)
        try:
            got = live.post(body, given(four), path=path)
            if want == 200:
                assert got.status_code == 200 and live.e.ending is None and live.e.ids == four, got.text
                assert live.e.requests[0]["asked"].get("stop_token_ids", live.e.requests[0]["asked"].get("sampling_params")) is not None
            else:
                assert got.status_code == 400 and live.e.ending == "unsupported_request" and live.e.ids == []
                assert live.e.detail.startswith(f"{want} [") and str(other) in live.e.detail and str(stops) in live.e.detail
            side = live.post({**body, "model": "title-model", **({"stop_token_ids": [other]} if path == CHAT else
                                                                 {"sampling_params": {"stop_token_ids": [other]}})},
                             lambda job: pytest.fail("a side call asking another stop id is never sampled"), path=path)
            kind = "side_refused" if want == 200 else "refused"  # an ended episode refuses every request
            assert side.status_code == 400 and live.e.requests[-1]["kind"] == kind and live.e.sides == 0
            assert live.e.ending == (None if want == 200 else "unsupported_request")
            if want == 200:
                assert side.json()["error"]["message"].startswith(("`stop_token_ids` [", "`sampling_params.stop_token_ids` ["))
        finally:
            live.close()
    with pytest.raises(chat.BadBody, match="`stop_token_ids` must be a list of token ids"):
        chat.check_body({**chat_body, "stop_token_ids": "2"})
    with pytest.raises(chat.BadBody, match="`sampling_params.stop_token_ids` must be a list of token ids"):
        tokens.check_body({**tok_body, "sampling_params": {"stop_token_ids": [1.5]}}, "grpo-key", len(tok))
