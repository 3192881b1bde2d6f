"""Tool execution as TRL 1.16's users expect it (issue 32, item 6; issue 42; pipeline/agents/execution.py):
an episode's sync calls and its environment's reset on one thread, the main one as in TRL (a
sqlite connection made in reset works in every call), async tools on one event loop per process (a
client session made in one call works in the next), a blocking async tool still timed out, a
timed-out environment call ending its episode with the state from before that call (never the
changes it made before it was interrupted), and arguments cast to the schema's types as TRL casts them."""

from __future__ import annotations

import ast
import json
import threading
from pathlib import Path

import pytest

from test_agents import agent_plan, call_text, forced, tiny2k  # noqa: F401 (tiny2k: a fixture)

TOOLS = '''
import asyncio, sqlite3, threading, time


class Ledger:
    """An environment holding a sqlite connection made in reset: bound to the thread that made it."""

    def reset(self, **row):
        self.db = sqlite3.connect(":memory:")
        self.db.execute("create table t (n integer)")

    def add(self, n: int) -> str:
        """Add a number to the ledger and return the total.

        Args:
            n: The number.
        """
        self.db.execute("insert into t values (?)", (n,))
        return f"{type(n).__name__} {self.db.execute('select sum(n) from t').fetchone()[0]}"

    def __getstate__(self):
        return {"rows": [r[0] for r in self.db.execute("select n from t order by rowid")]}

    def __setstate__(self, state):
        self.rows = state["rows"]


class Stalling:
    """An environment with a method that does not answer before the test releases it."""
    release = threading.Event()

    def reset(self, **row):
        self.log = []

    def note(self, x: int) -> str:
        """Note a number.

        Args:
            x: The number.
        """
        self.log.append(x)
        return "noted"

    def stall(self, x: int) -> str:
        """Note a number, slowly.

        Args:
            x: The number.
        """
        self.log.append(-x)  # a change the call makes before its deadline: never recorded
        type(self).release.wait(60)  # interrupted at the deadline
        return "late"


def wait_here(x: int) -> str:
    """Wait until released (a plain tool).

    Args:
        x: Anything.
    """
    Stalling.release.wait(60)
    return "late"


def thread_id(x: int) -> int:
    """The thread this call runs on.

    Args:
        x: Anything.
    """
    return threading.get_ident()


def typed(a: int, b: float, c: bool, d: list[int], e: dict, s: str, o: int | None = None) -> str:
    """Show the arguments' types.

    Args:
        a: an int
        b: a float
        c: a bool
        d: a list
        e: a dict
        s: a string
        o: an optional int
    """
    return repr((a, b, c, d, e, s, o))


class Client:
    """A client session in the style of aiohttp's: a connection task on the loop it was made on."""

    def __init__(self):
        self.requests = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self.serve())

    async def serve(self):
        while True:
            x, answer = await self.requests.get()
            answer.set_result(2 * x)

    async def ask(self, x):
        answer = asyncio.get_running_loop().create_future()
        await self.requests.put((x, answer))
        return await answer


_session = []


async def double(x: int) -> int:
    """Double a number through the session made in the first call.

    Args:
        x: The number.
    """
    if not _session:
        _session.append(Client())
    return await _session[0].ask(x)


async def asleep(x: int) -> int:
    """Wait (awaiting) far past any timeout.

    Args:
        x: Anything.
    """
    await asyncio.sleep(60)
    return x


async def blocking(x: int) -> int:
    """Block the event loop (time.sleep inside async def).

    Args:
        x: Anything.
    """
    time.sleep(1.5)
    return x


async def plus(x: int) -> int:
    """Add one.

    Args:
        x: The number.
    """
    return x + 1
'''


@pytest.fixture(scope="module")
def exec_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("exec-tools") / "exec_tools.py"
    path.write_text(TOOLS)
    return path


@pytest.fixture(scope="module")
def fns(exec_file) -> dict:
    from pipeline.agents.tools import load_tools

    names = ("thread_id", "typed", "double", "asleep", "blocking", "plus")
    return {f.__name__: f for f in load_tools([f"{exec_file}:{n}" for n in names])}


# ------------------------------------------------------------------------------ tool level, fast
def test_arguments_are_cast_to_the_schema_types_as_trl_casts_them(fns):
    from pipeline.agents.tools import call_tool

    args = {"a": "3", "b": "2.5", "c": "true", "d": "[1, 2]", "e": '{"k": 1}', "s": "7", "o": "null"}
    r = call_tool(fns, "typed", args, 5.0)
    assert (r.error, r.content) == (None, repr((3, 2.5, True, [1, 2], {"k": 1}, "7", None)))
    r = call_tool(fns, "typed", {**args, "b": "4", "o": "5"}, 5.0)  # a whole number stays an int, as TRL leaves it
    assert r.content == repr((3, 4, True, [1, 2], {"k": 1}, "7", 5))
    r = call_tool(fns, "typed", {**args, "a": 3, "s": 7}, 5.0)  # values that are not strings are passed as they are
    assert r.content == repr((3, 2.5, True, [1, 2], {"k": 1}, 7, None))
    for key, value in (("a", "3x"), ("b", "two"), ("c", "yes"), ("d", "[1"), ("d", '{"k": 1}'), ("o", "none")):
        bad = call_tool(fns, "typed", {**args, key: value}, 5.0)
        message = ast.literal_eval(bad.content)["error"]  # TRL's {"error": ...} text
        assert bad.error == "bad_arguments" and message.startswith(f"typed: argument {key!r} must be "), (key, value, message)


def test_sync_calls_given_one_thread_share_it(fns):
    """Off the main thread (where no signal handler can be set) an episode's calls get a thread of their own."""
    from pipeline.agents.execution import EpisodeThread, MainThreadCalls, episode_calls
    from pipeline.agents.tools import call_tool

    kinds = []
    side = threading.Thread(target=lambda: kinds.append(type(episode_calls("x"))))
    side.start(), side.join()
    assert kinds == [EpisodeThread] and type(episode_calls("x")) is MainThreadCalls

    thread = EpisodeThread()
    try:
        ids = {call_tool(fns, "thread_id", {"x": i}, 5.0, thread).content for i in range(3)}
    finally:
        thread.close()
    assert len(ids) == 1 and ids != {str(threading.get_ident())}  # one thread, not the caller's


def test_async_tools_share_one_event_loop_and_a_blocking_one_times_out(fns):
    from pipeline.agents.tools import call_tool

    # a session made in the first call serves the later ones (a fresh loop per call strands it)
    assert [call_tool(fns, "double", {"x": x}, 5.0).content for x in (1, 2, 3)] == ["2", "4", "6"]
    # a call that awaits past its timeout is cancelled; the loop, and the session on it, go on
    assert call_tool(fns, "asleep", {"x": 1}, 0.2).error == "timeout"
    assert call_tool(fns, "double", {"x": 4}, 5.0).content == "8"
    # a call that blocks the loop itself still gets its timeout answer ...
    blocked = call_tool(fns, "blocking", {"x": 1}, 0.2)
    assert blocked.error == "timeout" and "timed out after 0.2 s" in blocked.content
    # ... and the next async call is served on a new loop, in time, while the old one is still blocked
    assert (call_tool(fns, "plus", {"x": 1}, 1.0).error, call_tool(fns, "plus", {"x": 2}, 1.0).content) == (None, "3")


# ----------------------------------------------------------------------------- episode level
def test_environment_reset_and_its_calls_run_on_one_thread(make_run, tiny2k, exec_file, tmp_path):  # noqa: F811
    """A sqlite connection made in reset serves every call of the episode and the stored state
    (its __getstate__ reads the connection); the record holds the cast arguments; two episodes
    write the same record."""
    from pipeline.agents import environment as envs

    _, plan = agent_plan(make_run, tiny2k, tmp_path, [], environment=f"{exec_file}:Ledger", max_turns=3, tool_timeout_s=5.0)
    runner, tok, p = plan.episodes, plan.tokenizer, plan.prompts[0]
    records = []
    for j in range(2):
        e = runner.start(p, 0, j, 1, "test")
        assert runner._after_turn(e, forced(tok, call_text("add", {"n": "3"})), 12)
        assert runner._after_turn(e, forced(tok, call_text("add", {"n": 4})), 12)
        assert not runner._after_turn(e, forced(tok, "done"), 12) and e.ending == "answered"
        rec = json.loads(runner.row(e, "h")["episode"])
        assert [(m["content"], m["error"]) for m in rec["messages"] if m["role"] == "tool"] == [("int 3", None), ("int 7", None)]
        assert rec["messages"][0]["tool_calls"][0]["function"]["arguments"] == {"n": 3}  # as the tool got it
        assert envs.rebuild(type(e.env), rec["environment"]).rows == [3, 4]
        records.append(rec)
    assert records[0] == records[1]


def test_a_timed_out_environment_call_ends_the_episode_with_the_state_before_it(make_run, tiny2k, exec_file, tmp_path):  # noqa: F811
    """ending tool_timeout; the call is interrupted and the recorded state is the instance's from before
    it, not what the call changed before its deadline; without an environment a timed-out call is
    answered and the episode goes on, every call on the main thread."""
    from pipeline.agents import environment as envs

    _, plan = agent_plan(make_run, tiny2k, tmp_path, [f"{exec_file}:wait_here", f"{exec_file}:thread_id"],
                         environment=f"{exec_file}:Stalling", max_turns=4)
    runner, tok, p = plan.episodes, plan.tokenizer, plan.prompts[0]
    e = runner.start(p, 0, 0, 1, "test")
    cls = type(e.env)
    assert runner._after_turn(e, forced(tok, call_text("note", {"x": 1})), 12)
    assert not runner._after_turn(e, forced(tok, call_text("stall", {"x": 2}) + call_text("note", {"x": 3})), 12)
    assert e.ending == "tool_timeout"
    tools = [m for m in e.messages if m["role"] == "tool"]
    assert [(m["name"], m["error"]) for m in tools] == [("note", None), ("stall", "timeout")]  # the rest not run
    assert e.env.log == [1, -2]  # the interrupted call changed the live instance ...
    rec = json.loads(runner.row(e, "h")["episode"])  # ... and the record holds the state from before it
    assert rec["ending"] == "tool_timeout" and envs.rebuild(cls, rec["environment"]).log == [1]
    other = runner.start(p, 0, 1, 1, "test")  # the interrupted instance is not pooled again
    assert other.env is not e.env and runner._after_turn(other, forced(tok, call_text("note", {"x": 5})), 12)
    assert other.messages[-1]["content"] == "noted" and other.env.log == [5]
    # a plain tool past its timeout in an environment episode ends it too
    third = runner.start(p, 0, 2, 1, "test")
    assert not runner._after_turn(third, forced(tok, call_text("note", {"x": 6}) + call_text("wait_here", {"x": 0})), 12)
    assert third.ending == "tool_timeout"
    assert envs.rebuild(cls, json.loads(runner.row(third, "h")["episode"])["environment"]).log == [6]

    _, plan2 = agent_plan(make_run, tiny2k, tmp_path, [f"{exec_file}:wait_here", f"{exec_file}:thread_id"],
                          name="plain", max_turns=4)
    runner2 = plan2.episodes
    e = runner2.start(p, 0, 0, 1, "test")
    assert runner2._after_turn(e, forced(tok, call_text("thread_id", {"x": 0}) + call_text("wait_here", {"x": 0})), 12)
    assert runner2._after_turn(e, forced(tok, call_text("thread_id", {"x": 1})), 12)
    tools = [m for m in e.messages if m["role"] == "tool"]
    assert [m["error"] for m in tools] == [None, "timeout", None] and e.ending is None
    assert tools[0]["content"] == tools[2]["content"] == str(threading.main_thread().ident)  # TRL's thread
