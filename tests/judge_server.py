"""A real HTTP judge on 127.0.0.1 for the async reward tests: stdlib ThreadingHTTPServer in a
daemon thread, bounded (it shuts itself down after `lifetime` seconds) and stopped by the test.

    /slow?text=T    waits `delay` s, answers len(T); records the most requests in flight at once
    /flaky?text=T   answers 503 to the first `failures` requests for each T, then len(T)
    /hang?text=T    answers nothing for up to `lifetime` s
    /broken?text=T  always 500
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class Judge:
    def __init__(self, delay: float = 0.4, failures: int = 2, lifetime: float = 60.0):
        self.delay, self.failures, self.lifetime = delay, failures, lifetime
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: Counter = Counter()  # (path, text) -> requests seen
        self.stopping = threading.Event()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                url = urlparse(self.path)
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

            def answer(self, status: int, body: str):
                self.send_response(status)
                self.end_headers()
                self.wfile.write(body.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.timer = threading.Timer(lifetime, self.stop)
        self.timer.daemon = True

    def start(self) -> "Judge":
        self.thread.start()
        self.timer.start()
        return self

    def reset(self) -> None:
        with self.lock:
            self.max_in_flight = 0
            self.requests.clear()

    def stop(self) -> None:
        self.stopping.set()
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()
