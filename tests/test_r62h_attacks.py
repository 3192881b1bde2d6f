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
    assert finished and len(keys) == 2 * len(modes)
    got = {m: rec["ending"] for m, (_, rec) in by_mode(rows).items()}
    assert set(got.values()) == {"malformed_request"}, got
    text = json.dumps(rows, default=str)
    assert not [k for k in keys if k[16:] in text], [(r["mode"], json.loads(r["episode"])["detail"]) for r in rows]
