"""A real HTTP judge on 127.0.0.1 for the async reward tests: stdlib ThreadingHTTPServer in a
daemon thread, bounded (it shuts itself down after `lifetime` seconds) and stopped by the test.

    /slow?text=T    waits `delay` s, answers len(T); records the most requests in flight at once
    /flaky?text=T   answers 503 to the first `failures` requests for each T, then len(T)
    /hang?text=T    answers nothing for up to `lifetime` s
    /broken?text=T  always 500
    (any other GET path is a 404)

and an OpenAI-compatible chat judge, POST /<mode>/v1/chat/completions (GET /<mode>/v1/models lists
MODEL), whose verdict is `score(user message)`, a number 0-10 the tests compute themselves:
    ok        answers at once ("Score: N")
    slow      waits `delay` s first
    flaky     429 (retry-after-ms: 1) to the first `failures` requests of each body, then answers
    fail-S    HTTP S to the first `failures` requests of each body, then answers (fail-408, fail-409, ...);
              fail-S-retry sends `x-should-retry: true` with it, fail-S-noretry `x-should-retry: false`
    broken    always 500
    toolong   always 400 with vLLM's error for a prompt over the model's context
    hang      answers nothing for up to `lifetime` s
    garbage   answers that cannot be read as 0-10: "Score: 42", "I refuse to grade this", ""
    reasoning a reasoning judge: "<think>... 3 x 4 = 12 ...</think> Score: N"
    cutoff    a reasoning judge cut off by max_tokens: "<think>... 3 x 4 = 12", finish_reason length
    abort     vLLM v1 dropping the request (a pause, a shutdown): the first `failures` requests of each body
              answer "Score: 1" (the partial text) with finish_reason abort, then the verdict
    refused   401 whose message quotes the API key it was sent (as some gateways do)
    nolist    answers as ok; GET /nolist/v1/models is a 404 (a server with no model list)
    listfails answers as ok; GET /listfails/v1/models is a 500 (a model list that fails)
and a served classifier, POST /<mode>/classify as vLLM's pooling server answers it (beside /v1,
not under it), whose logits for a text (its `input`, or its messages' contents newline-joined) are
`logits(text)`, with the same modes; as vLLM it applies softmax unless the request says
`use_activation: false`; its garbage answers are GARBAGE_LOGITS (no logits, one logit, a NaN),
which cannot be read for label 1; mode `ignores` is an older vLLM that knows only `activation` and
ignores `use_activation` (with a warning), so it answers probabilities.
and an OpenRLHF reward server, POST /<mode>/get_reward as `openrlhf.cli.serve_rm` answers it:
`{"query": [...], "prompts": [...], "labels": [...]}` -> `{"rewards": [...], "scores": [...],
"extra_logs": {"dummy_scores": [...], "query_chars": [...]}}`, each reward `rm_reward(query, label)`,
any number of queries per request, with the same modes; its garbage answers are GARBAGE_REWARDS
(no reward, a word, NaN); mode `clash` adds an extra_logs entry `orm_answer`, mode `reason` one named `reason`; it has no /models (GET /<mode>/get_reward is a 405, as FastAPI answers a
POST-only route).
mode `keyed` answers as ok only a request whose query carries `key=<Judge.url_key>` (a random secret; any other
key or none: a 401 quoting the path it was sent), mode `keyed-echo` answers a request with the right key a 400
whose message quotes the whole path, the key in it (as some gateways do), mode `keyed-log` answers as ok with the
path it was sent and the key decoded in two extra_logs (`sent`, `sent_key`); `url_keys` counts the keys sent.
GET /<mode>/v1/models lists MODEL with `root` (the weights it serves: `Judge.root`, which a test
may change to put another model behind the same name), `max_model_len` (`Judge.context`) and a
`created` that is the time of the request.
Every POST is logged: `chats` counts requests per (mode, body sha256), `answered` those answered,
`keys` the Authorization headers sent.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

MODEL = "fault-judge"
GARBAGE = ("Score: 42", "I refuse to grade this", "")
GARBAGE_LOGITS = ([], [0.5], [float("nan"), 1.0])
GARBAGE_REWARDS = ([], ["high"], [float("nan")])


def dead_url() -> str:
    """The URL of a local port nobody listens on (bound, then closed): a server that cannot be reached."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def rm_reward(query: str, label) -> float:
    """The fault OpenRLHF server's reward for one query and its label, in [0, 1] in steps of 1/100."""
    return int(hashlib.sha256(f"{query}|{json.dumps(label)}".encode()).hexdigest(), 16) % 101 / 100


def score(user: str) -> int:
    """The fault judge's verdict on a user message."""
    return int(hashlib.sha256(user.encode()).hexdigest(), 16) % 11


def logits(text: str) -> list[float]:
    """The fault classifier's two logits for a text, each in [-2, 2) in steps of 1/250."""
    h = int(hashlib.sha256(text.encode()).hexdigest(), 16)
    return [(h % 1000) / 250 - 2, (h // 1000 % 1000) / 250 - 2]


def softmax(x: list[float]) -> list[float]:
    exps = [math.exp(v - max(x)) for v in x]
    return [e / sum(exps) for e in exps]


TOO_LONG = ("This model's maximum context length is 4096 tokens. However, you requested 4100 tokens "
            "(3076 in the messages, 1024 in the completion). Please reduce the length of the messages or completion.")


def classified_text(body: dict) -> str:
    """What the fault classifier reads of a /classify request."""
    if "input" in body:
        return body["input"]
    return "\n".join(m["content"] for m in body["messages"])


class Judge:
    def __init__(self, delay: float = 0.4, failures: int = 2, lifetime: float = 60.0):
        self.delay, self.failures, self.lifetime = delay, failures, lifetime
        self.root = f"/models/{MODEL}-v1"
        self.context = 4096
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: Counter = Counter()  # (path, text) -> requests seen
        self.chats: Counter = Counter()  # (mode, body sha256) -> chat requests received
        self.answered: Counter = Counter()  # (mode, body sha256) -> chat requests answered 200
        self.keys: Counter = Counter()  # Authorization header -> POSTs that sent it
        self.url_key = "urlkey-" + secrets.token_hex(12)  # what mode `keyed` answers only with, ?key=...
        self.url_keys: Counter = Counter()  # ?key= value -> requests (GET or POST) to a keyed mode that sent it
        self.stopping = threading.Event()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def refused(self) -> bool:
                """A keyed mode's request without the right ?key=: answered 401, quoting what it was sent."""
                url = urlparse(self.path)
                if not url.path.startswith("/keyed"):
                    return False
                key = parse_qs(url.query).get("key", [None])[0]
                with judge.lock:
                    judge.url_keys[key] += 1
                if key == judge.url_key:
                    if url.path.startswith("/keyed-echo/") and self.command == "POST":
                        self.answer(400, json.dumps({"message": f"cannot score at {self.path}"}))
                        return True
                    return False
                self.answer(401, json.dumps({"detail": f"no access to {self.path}"}))
                return True

            def do_GET(self):
                if self.refused():
                    return
                url = urlparse(self.path)
                if url.path.endswith("/v1/models") and url.path.startswith(("/nolist/", "/listfails/")):  # chats as "ok"
                    return self.answer(404 if url.path.startswith("/nolist/") else 500, "no model list")
                if url.path.endswith("/get_reward"):  # a POST-only route
                    return self.answer(405, json.dumps({"detail": "Method Not Allowed"}))
                if url.path.endswith("/v1/models"):
                    entry = {"id": MODEL, "object": "model", "created": time.time(), "owned_by": "vllm", "root": judge.root,
                             "parent": None, "max_model_len": judge.context}
                    return self.answer(200, json.dumps({"object": "list", "data": [entry]}))
                text = parse_qs(url.query).get("text", [""])[0]
                path = url.path.strip("/")
                with judge.lock:
                    judge.requests[(path, text)] += 1
                    seen = judge.requests[(path, text)]
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                try:
                    if path == "slow":
                        time.sleep(judge.delay)
                        self.answer(200, str(len(text)))
                    elif path == "flaky":
                        self.answer(503, "busy") if seen <= judge.failures else self.answer(200, str(len(text)))
                    elif path == "hang":
                        judge.stopping.wait(judge.lifetime)
                    elif path == "broken":
                        self.answer(500, "broken")
                    else:
                        self.answer(404, "no such route")
                finally:
                    with judge.lock:
                        judge.in_flight -= 1

            def answer(self, status: int, body: str, headers: dict | None = None):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body.encode())))
                self.end_headers()
                self.wfile.write(body.encode())

            def do_POST(self):
                path = urlparse(self.path).path
                mode = path.strip("/").split("/")[0]
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.refused():
                    return
                key = (mode, hashlib.sha256(raw).hexdigest())
                with judge.lock:
                    judge.chats[key] += 1
                    seen = judge.chats[key]
                    if self.headers.get("Authorization"):
                        judge.keys[self.headers["Authorization"]] += 1
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                try:
                    body = json.loads(raw)
                    classify = path.rstrip("/").endswith("/classify")
                    finish = "stop"
                    openrlhf = path.rstrip("/").endswith("/get_reward")
                    if openrlhf:
                        pairs = list(zip(body["query"], body["labels"]))
                        rewards = [rm_reward(q, label) for q, label in pairs]
                        if mode == "garbage":  # one query's garbage answer
                            rewards = list(GARBAGE_REWARDS[score(body["query"][0]) % len(GARBAGE_REWARDS)])
                    elif classify:
                        text = classified_text(body)
                        said = GARBAGE_LOGITS[score(text) % len(GARBAGE_LOGITS)] if mode == "garbage" else logits(text)
                        flag = body.get("activation") if mode == "ignores" else body.get("use_activation")
                        if flag in (None, True) and said and all(map(math.isfinite, said)):  # vLLM's default: activated
                            said = softmax(said)
                    else:
                        user = body["messages"][-1]["content"]
                        verdict = GARBAGE[score(user) % len(GARBAGE)] if mode == "garbage" else f"Score: {score(user)}"
                        thought = f"<think>The answer has {len(user.split())} words; 3 x 4 = 12, so"
                        if mode == "reasoning":
                            verdict = f"{thought} it scores {len(user)}.</think>\n{verdict}"
                        elif mode == "cutoff":
                            verdict, finish = thought, "length"
                        elif mode == "abort" and seen <= judge.failures:
                            verdict, finish = "Score: 1", "abort"
                    if mode == "slow":
                        time.sleep(judge.delay)
                    elif mode == "flaky" and seen <= judge.failures:
                        return self.answer(429, "slow down", {"retry-after-ms": "1"})
                    elif mode.startswith("fail-") and seen <= judge.failures:
                        status, _, retry = mode[5:].partition("-")
                        said_retry = {"retry": {"x-should-retry": "true"}, "noretry": {"x-should-retry": "false"}}.get(retry)
                        return self.answer(int(status), "try again" if status != "400" else "bad request", said_retry)
                    elif mode == "refused":
                        key = self.headers.get("Authorization", "").removeprefix("Bearer ")
                        return self.answer(401, json.dumps({"error": {"message": f"Incorrect API key provided: {key}. "
                                                                      "You can find your API key at https://example.invalid/keys.",
                                                                      "type": "invalid_request_error", "code": "invalid_api_key"}}))
                    elif mode == "toolong":
                        return self.answer(400, json.dumps({"object": "error", "message": TOO_LONG, "type": "BadRequestError",
                                                            "param": None, "code": 400}))
                    elif mode == "broken":
                        return self.answer(500, "broken")
                    elif mode == "hang":
                        judge.stopping.wait(judge.lifetime)
                        return
                    with judge.lock:
                        judge.answered[key] += 1
                    if openrlhf:  # openrlhf.cli.serve_rm's answer
                        logs = {"dummy_scores": rewards, "query_chars": [len(q) for q, _ in pairs]}
                        if mode == "clash":  # a log named as a reward `orm`'s own record column
                            logs["orm_answer"] = rewards
                        if mode == "reason":  # a log named as a record field (`reason`), which another reward may log too
                            logs["reason"] = rewards
                        if mode == "keyed-log":  # a server that logs what it was sent, the key decoded and in its URL
                            logs["sent"] = [self.path]
                            logs["sent_key"] = parse_qs(urlparse(self.path).query).get("key", [""])
                        return self.answer(200, json.dumps({"rewards": rewards, "scores": rewards, "extra_logs": logs}))
                    if classify:  # vLLM's ClassificationResponse
                        usage = {"prompt_tokens": len(text.split()), "total_tokens": len(text.split()), "completion_tokens": 0}
                        return self.answer(200, json.dumps({"id": "classify-x", "object": "list", "created": 0, "model": body["model"],
                                                            "usage": usage, "data": [{"index": 0, "label": None, "probs": said,
                                                                                      "num_classes": len(said)}]}))
                    usage = {"prompt_tokens": len(user.split()), "completion_tokens": len(verdict.split()), "total_tokens": 0}
                    self.answer(200, json.dumps({"id": "x", "object": "chat.completion", "model": body["model"], "usage": usage,
                                                 "choices": [{"index": 0, "finish_reason": finish,
                                                              "message": {"role": "assistant", "content": verdict}}]}))
                finally:
                    with judge.lock:
                        judge.in_flight -= 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.timer = threading.Timer(lifetime, self.stop)
        self.timer.daemon = True

    def start(self) -> Judge:
        self.thread.start()
        self.timer.start()
        return self

    def reset(self) -> None:
        with self.lock:
            self.max_in_flight = 0
            self.requests.clear()
            self.chats.clear()
            self.answered.clear()
            self.keys.clear()
            self.url_keys.clear()

    def stop(self) -> None:
        self.stopping.set()
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()
