"""Where tool calls run, and the arguments they get: TRL 1.16's behaviour, plus a timeout TRL lacks.

- Sync tools: on the rollout's main thread, as TRL runs them (MainThreadCalls): the environment's
  instance is made and reset there, every sync call (environment methods and plain tools) runs
  there, in order, and its state is stored from there, so a tool may use `signal` (TRL's
  `grpo_agent.py` times its query out with `signal.alarm`) and a thread-bound resource made in
  `reset` (a sqlite connection) works in every call. The timeout is a watchdog thread that, at the
  deadline, sends the main thread a signal of its own (TIMEOUT_SIGNAL, not SIGALRM, which tools use):
  its handler raises Deadline inside the call, which unwinds it (its `finally` blocks run). A call
  stuck in C code that never returns to Python cannot be interrupted: it holds the rollout until it
  returns, as in TRL. Where the rollout does not run on the main thread (signal handlers can only
  be set there), each episode gets a thread of its own instead (EpisodeThread): a call past its
  timeout is abandoned on it, and `signal` inside a tool fails there as it would in TRL.
- Async tools: one event loop per rollout process, on a daemon thread, reused by every call (as
  TRL's daemon loop): a client session (aiohttp, httpx) made in one call works in the next.
  A call past its timeout is cancelled. The caller waits on the call's future, not on the loop,
  so a coroutine that blocks its loop (time.sleep in `async def`) still gets its timeout answer.
  A probe is posted to the loop at that moment; if the loop has not run it by the next async call
  (and half a second more), the loop is still blocked: it is retired (stopped once the blocking
  call returns) and a new one serves that call and the later ones; sessions bound to the old loop
  are lost with it. A loop that is not blocked (the call was awaiting) is kept, sessions and all.
- Global randomness: an episode's tool calls of one turn run under `seeded(seed)` (Python's
  `random` and numpy's global generator, when numpy is loaded, seeded from the episode's seed and
  turn; the caller's state restored after), so a tool drawing from them (TRL's `grpo_2048.py`
  places tiles with `random`) gives the same results on every rerun, resume and engine.
- Arguments: as TRL 1.16 types them (transformers' parse_response with tools=): a string value of a
  parameter whose JSON-schema type is integer, number, boolean, null, array or object is cast to
  it, the declared types tried in order; other values are passed as they are. Where TRL passes a
  string that fits none of the declared types on to the tool ("abc" for an int), the call here is
  answered `bad_arguments`: the tool never runs on a value its signature does not accept.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import random
import signal
import sys
import threading
from concurrent.futures import Future, wait
from contextlib import contextmanager
from typing import Any, Callable

from pipeline.errors import GRPOError


class Deadline(BaseException):
    """The call ran past its timeout (a TimeoutError the tool raises itself is its own error). A
    BaseException: raised inside a sync call on the main thread, a tool's `except Exception` does
    not swallow it."""


@contextmanager
def seeded(seed: int | None):
    """Python's `random` and numpy's global generator (when numpy is loaded) seeded with `seed` inside,
    the caller's states restored after (None: left alone)."""
    if seed is None:
        yield
        return
    saved = random.getstate()
    np = sys.modules.get("numpy")
    np_saved = np.random.get_state() if np is not None else None
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        random.setstate(saved)
        if np is not None:
            np.random.set_state(np_saved)


TIMEOUT_SIGNAL = getattr(signal, "SIGRTMIN", signal.SIGUSR2) + (2 if hasattr(signal, "SIGRTMIN") else 0)
"""The signal the watchdog sends the main thread at a sync call's deadline: a real-time one nothing
else here uses (tools use SIGALRM; vLLM and Ray use SIGUSR1, SIGTERM, SIGINT)."""


class _Armed:
    """One sync call on the main thread under a deadline."""

    def __init__(self):
        self.fired = False  # the deadline passed
        self.over = False  # the call returned, or Deadline was raised in it: the handler does nothing


_armed: list[_Armed | None] = [None]


def _on_timeout_signal(signum, frame) -> None:
    call = _armed[0]
    if call is not None and call.fired and not call.over:
        call.over = True  # once per call
        raise Deadline


class MainThreadCalls:
    """An episode's sync calls on the calling thread, the main one (TRL's): see the module's docstring."""

    _installed = False

    def run(self, fn: Callable, kwargs: dict, timeout_s: float | None = None) -> Any:
        """fn(**kwargs) here; Deadline when it runs past `timeout_s` (raised inside it by the watchdog's
        signal, or after it, if it caught that and went on)."""
        if timeout_s is None:
            return fn(**kwargs)
        if not MainThreadCalls._installed:  # kept for the process: a late signal finds it and does nothing
            signal.signal(TIMEOUT_SIGNAL, _on_timeout_signal)
            MainThreadCalls._installed = True
        call = _armed[0] = _Armed()
        main = threading.get_ident()

        def fire() -> None:
            call.fired = True
            signal.pthread_kill(main, TIMEOUT_SIGNAL)

        timer = threading.Timer(timeout_s, fire)
        timer.daemon = True
        timer.start()
        try:
            try:
                value = fn(**kwargs)
            finally:
                call.over = True
        finally:
            timer.cancel()
            _armed[0] = None
        if call.fired:  # the tool swallowed Deadline (a bare except) or returned just as it fired
            raise Deadline
        return value

    def close(self) -> None:
        pass


def episode_calls(name: str) -> "MainThreadCalls | EpisodeThread":
    """Where an episode's sync calls run: the main thread when the rollout runs on it (TRL's), else a
    thread of the episode's own."""
    if threading.current_thread() is threading.main_thread():
        return MainThreadCalls()
    return EpisodeThread(name)


class EpisodeThread:
    """One episode's thread for its sync calls, where the rollout is not on the main thread: started
    at the first call, a daemon (a call stuck past its timeout never holds the process), ended by
    close(). Calls run one at a time, in order."""

    def __init__(self, name: str = "grpo-episode"):
        self.name = name
        self._queue: queue.SimpleQueue | None = None

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._queue,), name=self.name, daemon=True).start()
        fut: Future = Future()
        self._queue.put((fut, fn, args, kwargs))
        return fut

    def run(self, fn: Callable, kwargs: dict, timeout_s: float | None = None) -> Any:
        """fn(**kwargs) on this thread; Deadline past `timeout_s` (the thread is then given up: it
        ends after the late call, and a later call starts a fresh one)."""
        fut = self.submit(fn, **kwargs)
        if not wait([fut], timeout_s).done:
            self.close()
            raise Deadline
        return fut.result()

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put(None)  # behind any call still running: the thread ends after it
            self._queue = None


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        fut, fn, args, kwargs = job
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 (SystemExit too: raised again in the caller's thread)
            fut.set_exception(err)


PROBE_GRACE_S = 0.5


class _Loop:
    """The process's event loop for async tools, on its own daemon thread."""

    def __init__(self):
        self.pid = os.getpid()  # a forked worker makes its own: threads do not survive a fork
        self.loop = asyncio.new_event_loop()
        self.probe: threading.Event | None = None  # posted at a timeout; unset = the loop has not run since
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), name="grpo-tool-loop", daemon=True).start()
        ready.wait()

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(ready.set)
        try:
            self.loop.run_forever()
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            self.loop.close()

    def blocked(self) -> bool:
        """Whether the probe posted at the last timeout is still not run (it is given PROBE_GRACE_S)."""
        if self.probe is None or self.probe.wait(PROBE_GRACE_S):
            self.probe = None
            return False
        return True

    def retire(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)  # runs once the blocking call returns


_loop: list[_Loop] = []
_loop_lock = threading.Lock()


def event_loop() -> _Loop:
    """The process's tool loop: made at the first async call, replaced when a timed-out call left it blocked."""
    with _loop_lock:
        if _loop and (_loop[0].pid != os.getpid() or _loop[0].blocked()):
            if _loop[0].pid == os.getpid():
                _loop[0].retire()
            _loop.clear()
        if not _loop:
            _loop.append(_Loop())
        return _loop[0]


def run_async(coro, timeout_s: float) -> Any:
    """Await `coro` on the process's loop; Deadline past `timeout_s`, the coroutine cancelled."""
    owner = event_loop()
    fut = asyncio.run_coroutine_threadsafe(coro, owner.loop)
    if not wait([fut], timeout_s).done:
        fut.cancel()  # delivered when the loop runs again
        probe = owner.probe = threading.Event()
        owner.loop.call_soon_threadsafe(probe.set)
        raise Deadline
    return fut.result()


# ----------------------------------------------------------------------------- argument types
class BadArgument(GRPOError):
    """A string argument that none of its parameter's declared types can hold."""


def parameters(schema: dict) -> dict:
    """A tool schema's {parameter: JSON schema} (what casting reads)."""
    params = schema.get("function", schema).get("parameters") or {}
    props = params.get("properties") if isinstance(params, dict) else None
    return props if isinstance(props, dict) else {}


def _types(schema: Any) -> list[str]:
    """The JSON-schema types a parameter declares, in order (anyOf/oneOf choices, `nullable` as null)."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    out = [declared] if isinstance(declared, str) else [t for t in declared or [] if isinstance(t, str)]
    for key in ("anyOf", "oneOf"):
        for choice in schema.get(key) or []:
            out += _types(choice)
    if schema.get("nullable") and "null" not in out:
        out.append("null")
    return out


_CASTABLE = ("integer", "number", "boolean", "null", "array", "object")


def _cast_one(raw: str, types: list[str]) -> Any:
    for t in types:
        try:
            if t == "integer":
                return int(raw)
            if t == "number":
                x = float(raw)
                if math.isfinite(x):  # NaN and inf are not JSON numbers
                    return int(x) if x.is_integer() and "." not in raw else x
            elif t == "boolean" and raw.strip().lower() in ("true", "1", "false", "0"):
                return raw.strip().lower() in ("true", "1")
            elif t == "null" and raw.strip() in ("null", "None"):
                return None
            elif t in ("array", "object"):
                value = json.loads(raw)
                if isinstance(value, list if t == "array" else dict):
                    return value
        except ValueError:
            continue
    if all(t in _CASTABLE for t in types):  # no string (or unknown type) to fall back on
        raise BadArgument(f"must be {' or '.join(types)}, got {raw!r}")
    return raw


def cast_arguments(properties: dict, arguments: dict) -> dict:
    """`arguments` with each string value cast to its parameter's declared type (see the module's
    docstring); BadArgument naming the parameter when one cannot be."""
    out = dict(arguments)
    for key, value in arguments.items():
        types = _types(properties.get(key))
        if not types:
            continue
        try:
            if isinstance(value, str):
                out[key] = _cast_one(value, types)
            elif isinstance(value, list) and "array" not in types:  # a repeated parameter
                out[key] = [_cast_one(v, types) if isinstance(v, str) else v for v in value]
        except BadArgument as err:
            raise BadArgument(f"argument {key!r} {err}") from None
    return out
