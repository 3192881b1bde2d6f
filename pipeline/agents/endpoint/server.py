"""The HTTP side of the endpoint: a FastAPI app served by uvicorn in a thread of the rollout process,
on 127.0.0.1 and a port the OS picks. It only receives and answers: each chat request is handed to
the rollout's thread (`Hub.pending`), which samples it with the engine and hands the answer back;
everything that decides an episode's tokens happens there, in an order that does not depend on
when requests arrive (pipeline.agents.endpoint.runner).

    GET  /v1/models             the model name the episodes ask for (GRPO_MODEL)
    POST /v1/chat/completions   stream true/false (SSE: text/event-stream, `data: [DONE]` last)
    POST /inference/v1/generate the tokens route (tokens.py): token ids in and out, as verifiers' train client asks

The bearer key (OPENAI_API_KEY) names the episode; another key is answered 401."""

# no `from __future__ import annotations`: FastAPI reads the routes' annotations (HTTPRequest) at definition

import asyncio
import json
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pipeline.agents.endpoint.chat import body_hash


@dataclass
class Request:
    """One chat request, waiting for the rollout's thread to answer it."""
    key: str
    body: Any  # the parsed JSON body, or None when it did not parse
    raw_error: str | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    answered: bool = False
    arrived: float = field(default_factory=time.monotonic)  # when it came: the agent's timeout clock stops there
    route: str = "chat"  # "chat" | "tokens" (POST /inference/v1/generate)

    @cached_property
    def digest(self) -> str | None:
        """The body's sha256 (chat.body_hash; None when it did not parse), computed once: the runner's
        wait loop looks at a waiting request each time it wakes."""
        return None if self.body is None else body_hash(self.body)

    def answer(self, status: int, payload: dict, stream: list[dict] | None = None) -> None:
        """Answered from the rollout's thread: JSON, or (`stream`) SSE chunks."""
        self.answered = True
        self.loop.call_soon_threadsafe(_resolve, self.future, (status, payload, stream))


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():  # the client may have gone away
        fut.set_result(value)


@dataclass
class Hub:
    """Where requests wait, by episode key; `cond` is notified on every arrival."""
    model: str
    cond: threading.Condition = field(default_factory=threading.Condition)
    pending: dict[str, list[Request]] = field(default_factory=dict)

    def new_key(self) -> str:
        key = "grpo-" + secrets.token_hex(16)  # a secret: in the agent's environment only, never recorded
        with self.cond:
            self.pending[key] = []
        return key

    def drop(self, key: str) -> None:
        with self.cond:
            for r in self.pending.pop(key, []):
                r.answer(400, {"error": {"message": "the episode is over", "type": "invalid_request_error"}})


def make_app(hub: Hub):
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    def key_of(req: HTTPRequest) -> str | None:
        auth = req.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        with hub.cond:
            return key if key in hub.pending else None

    def unauthorized() -> JSONResponse:
        return JSONResponse({"error": {"message": "unknown API key: each episode has its own (OPENAI_API_KEY)",
                                       "type": "invalid_request_error", "code": "invalid_api_key"}}, status_code=401)

    @app.get("/v1/models")
    async def models(req: HTTPRequest):
        if key_of(req) is None:
            return unauthorized()
        return {"object": "list", "data": [{"id": hub.model, "object": "model", "created": 0, "owned_by": "grpo"}]}

    @app.post("/v1/chat/completions")
    async def chat(req: HTTPRequest):
        return await take(req, "chat")

    @app.post("/inference/v1/generate")
    async def generate(req: HTTPRequest):
        return await take(req, "tokens")

    async def take(req: HTTPRequest, route: str):
        key = key_of(req)
        if key is None:
            return unauthorized()
        raw = await req.body()
        body, why = None, None
        try:
            body = json.loads(raw)
        except ValueError as err:
            why = f"the body is not JSON ({err.msg})"
        loop = asyncio.get_running_loop()
        r = Request(key, body, why, loop, loop.create_future(), route=route)
        with hub.cond:
            if key not in hub.pending:
                return unauthorized()
            hub.pending[key].append(r)
            hub.cond.notify_all()
        status, payload, stream = await r.future
        if stream is None:
            return JSONResponse(payload, status_code=status)

        async def events():
            for chunk in stream:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


class Server:
    """uvicorn serving `make_app(hub)` on 127.0.0.1 in a daemon thread, until `close`."""

    def __init__(self, hub: Hub):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(make_app(hub), log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="grpo-endpoint", daemon=True)
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            threading.Event().wait(0.01)
        if not self.server.started:
            raise RuntimeError("grpo's agent endpoint did not start")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
