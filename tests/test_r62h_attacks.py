"""Fresh review r62h of f3f9348 (the endpoint's clock, retries answered as they come, `stop` checked,
the key kept out of the result and the log): real agent programs against the real endpoint, reusing
tests/test_endpoint_attacks.py's harness (`make`, `drive`, `Slow`, the module's `world`)."""

from __future__ import annotations

import json
import sys

import pytest

from test_endpoint import tiny2k  # noqa: F401 - the module's fixture, reused
from test_endpoint_attacks import Slow, by_mode, drive, notes, notes_of, run_of, world  # noqa: F401 - fixtures reused

KEY = "grpo-" + "0123456789abcdef" * 2


@pytest.mark.parametrize("route,body", [
    ("chat", {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "stop": [KEY, 1]}),
    ("chat", {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "n": KEY}),
    ("chat", {"model": "policy", "messages": [{"role": KEY, "content": "hi"}]}),
    ("tokens", {"model": "policy", "token_ids": [1, 2], "sampling_params": {"stop": [KEY, 1]}}),
    ("tokens", {"model": "policy", "token_ids": [1, 2], "sampling_params": {"n": KEY}}),
])
def test_a_bad_body_quoting_the_key_is_refused_without_it(route, body):
    """Found: check_stop (new in f3f9348) quotes the value (`stop: [KEY, 1]`: all 37 characters of the key in
    40), as `n` and `role` did, before the key is looked for: the message is the episode's `detail` and the
    refusal's `why`, in the record. Fixed: the body's text is checked for the key first."""
    from pipeline.agents.endpoint import chat, tokens

    with pytest.raises(chat.BadBody) as err:
        chat.check_body(body, KEY) if route == "chat" else tokens.check_body(body, KEY, 100)
    assert KEY not in str(err.value) and KEY[16:] not in str(err.value), str(err.value)


LEAK = '''
import httpx
bodies = {
    "stop": {"model": MODEL, "messages": [{"role": "user", "content": Q}], "stop": [KEY, 1]},
    "n": {"model": MODEL, "messages": [{"role": "user", "content": Q}], "n": KEY},
    "role": {"model": MODEL, "messages": [{"role": KEY, "content": Q}]},
}
mode = task["mode"]
if mode.startswith("tokens_"):
    sp = {"stop": [KEY, 1]} if mode == "tokens_stop" else {"n": KEY}
    r = httpx.post(BASE.removesuffix("/v1") + "/inference/v1/generate", json={"model": MODEL, "token_ids": [1, 2, 3], "sampling_params": sp},
                   headers={"Authorization": "Bearer " + KEY}, timeout=60)
else:
    r = httpx.post(BASE + "/chat/completions", json=bodies[mode], headers={"Authorization": "Bearer " + KEY}, timeout=60)
note(key=KEY, status=r.status_code, leaked=KEY in r.text)
'''


def test_a_body_quoting_the_key_in_a_bad_field_leaves_it_out_of_the_record(world, notes):
    """The same through the real endpoint: the part's rows (record, detail) hold no piece of any episode's key."""
    modes = ["stop", "n", "role", "tokens_stop", "tokens_n"]
    run = run_of(world, "leak", LEAK, modes)
    rows, finished, _ = drive(run, world["engine"], limit=90)
    keys = {n["key"] for n in notes_of(notes)}
    assert finished and len(keys) == len(modes)  # drive runs sample 0 of each prompt
    got = {m: rec["ending"] for m, (_, rec) in by_mode(rows).items()}
    assert set(got.values()) == {"malformed_request"}, got
    text = json.dumps(rows, default=str)
    assert not [k for k in keys if k[16:] in text], [(r["mode"], json.loads(r["episode"])["detail"]) for r in rows]


SIDES = '''
client = OpenAI(max_retries=0, timeout=120)
for i in range(3):  # an honest harness: three side calls (a judge, a title), each at once, then its one turn
    client.chat.completions.create(model="judge-model", messages=[{"role": "user", "content": f"Judge {i}: " + Q}])
r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": Q}])
note(content=r.choices[0].message.content)
'''


def test_a_busy_engine_never_times_out_an_agent_whose_side_calls_wait_for_it(world, notes):
    """timeout_s 12 (~3 s of it importing openai); an engine taking 5 s a call; the agent's three side calls
    and its turn take 20 s of the engine's time and almost none of its own."""
    run = run_of(world, "slowsides", SIDES, ["sides"], timeout_s=12)
    slow = Slow(world["engine"], 5.0)
    rows, finished, _ = drive(run, slow, limit=150)
    rec = json.loads(rows[0]["episode"])
    assert finished and rec["ending"] in ("finished", "length"), (rec["ending"], rec["detail"], [q["kind"] for q in rec["requests"]])


def test_a_result_file_holding_the_key_in_pieces_is_refused(tmp_path):
    """A result writing the key in two halves (metrics a and b) is refused, as the whole key is (found: both
    halves reached the record's episode.agent); pieces of 12 characters, so a hex hash never matches by chance."""
    from pipeline.agents.endpoint.process import AgentProcess

    p = AgentProcess([sys.executable, "-c", "pass"], {}, 30)
    try:
        p.proc.wait()
        p.result_path.write_text(json.dumps({"reward": 1, "metrics": {"a": KEY[:18], "b": KEY[18:]}}))
        result, why = p.result(KEY)
        assert result is None and "API key" in why, result
    finally:
        p.cleanup()
