"""A real HTTP judge on 127.0.0.1 for the async reward tests: stdlib ThreadingHTTPServer in a
daemon thread, bounded (it shuts itself down after `lifetime` seconds) and stopped by the test.

    /slow?text=T    waits `delay` s, answers len(T); records the most requests in flight at once
    /flaky?text=T   answers 503 to the first `failures` requests for each T, then len(T)
    /hang?text=T    answers nothing for up to `lifetime` s
    /broken?text=T  always 500

and an OpenAI-compatible chat judge, POST /<mode>/v1/chat/completions (GET /<mode>/v1/models lists
MODEL), whose verdict is `score(user message)`, a number 0-10 the tests compute themselves:
    ok        answers at once ("Score: N")
    slow      waits `delay` s first
    flaky     429 (Retry-After: 0) to the first `failures` requests of each body, then answers
    broken    always 500
    hang      answers nothing for up to `lifetime` s
    garbage   answers that cannot be read as 0-10: "Score: 42", "I refuse to grade this", ""
Every POST is logged: `chats` counts requests per (mode, body sha256), `answered` those answered.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

MODEL = "fault-judge"
GARBAGE = ("Score: 42", "I refuse to grade this", "")


def score(user: str) -> int:
    """The fault judge's verdict on a user message."""
    return int(hashlib.sha256(user.encode()).hexdigest(), 16) % 11


class Judge:
    def __init__(self, delay: float = 0.4, failures: int = 2, lifetime: float = 60.0):
        self.delay, self.failures, self.lifetime = delay, failures, lifetime
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: Counter = Counter()  # (path, text) -> requests seen
        self.chats: Counter = Counter()  # (mode, body sha256) -> chat requests received
        self.answered: Counter = Counter()  # (mode, body sha256) -> chat requests answered 200
        self.stopping = threading.Event()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                url = urlparse(self.path)
                if url.path.endswith("/v1/models"):
                    return self.answer(200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
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
                    else:
                        self.answer(500, "broken")
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
                mode = self.path.strip("/").split("/")[0]
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                key = (mode, hashlib.sha256(raw).hexdigest())
                with judge.lock:
                    judge.chats[key] += 1
                    seen = judge.chats[key]
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                try:
                    body = json.loads(raw)
                    user = body["messages"][-1]["content"]
                    verdict = f"Score: {score(user)}"
                    if mode == "slow":
                        time.sleep(judge.delay)
                    elif mode == "flaky" and seen <= judge.failures:
                        return self.answer(429, "slow down", {"Retry-After": "0"})
                    elif mode == "broken":
                        return self.answer(500, "broken")
                    elif mode == "hang":
                        judge.stopping.wait(judge.lifetime)
                        return
                    elif mode == "garbage":
                        verdict = GARBAGE[score(user) % len(GARBAGE)]
                    with judge.lock:
                        judge.answered[key] += 1
                    usage = {"prompt_tokens": len(user.split()), "completion_tokens": len(verdict.split()), "total_tokens": 0}
                    self.answer(200, json.dumps({"id": "x", "object": "chat.completion", "model": body["model"], "usage": usage,
                                                 "choices": [{"index": 0, "finish_reason": "stop",
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

    def stop(self) -> None:
        self.stopping.set()
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()
