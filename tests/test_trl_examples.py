"""TRL 1.16's own example tools and environments behave here as in TRL (issue 42, item 5 and 6):
`grpo_agent.py`'s `query_biogrid` (a sync tool timed out with `signal.alarm`, returning a list
its reward checks with `isinstance(res, list)`) and `grpo_2048.py`'s `Game2048Env` (tiles placed
with Python's global `random`), with their reward functions, written below as the example files
define them; biogrid's database, which the example builds from a Hub data set, is a local stand-in
file of the same table. The reference is TRL's `_tool_call_loop`, restated in `trl_tool_results`:
`sync_tools[name](**arguments)` on the main thread, `{"error": str(e)}` for any exception, a list
result kept, anything else str(). Also TRL's malformed calls (its test_train_with_malformed_tool_calls
completions), unlimited turns, and reset without a prompt where the data set has none."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import threading
from pathlib import Path

import pytest

from conftest import base_config, grpo, write_config
from test_agents import agent_plan, call_text, forced, tiny2k  # noqa: F401 (tiny2k: a fixture)

# ------------------------------------------------------------- TRL's examples, as the files define them
TRL_EXAMPLES = '''
import random
import re
import signal
import sqlite3

import numpy as np


# --- examples/scripts/grpo_agent.py (TRL 1.16): rewards and the database tool, unchanged

def query_reward(completions, answer, **kwargs):
    """
    Reward query strategy:
    - Penalize more than 2 queries
    - Penalize generic queries (LIMIT 1 / PRAGMA)
    - Reward usage of WHERE
    - Reward evidence supporting the final answer
    """
    rewards = []

    for completion, ans in zip(completions, answer, strict=False):
        reward = 0.0
        sql_queries = []
        tool_results = []

        # collect all SQL queries and tool results
        for turn in completion:
            if turn.get("tool_calls"):
                for call in turn["tool_calls"]:
                    sql = call["function"]["arguments"].get("sql_command", "").lower()
                    sql_queries.append(sql)
            if turn.get("role") == "tool" and turn.get("content"):
                tool_results.append(turn["content"])

        # --- penalize too many queries ---
        if len(sql_queries) > 3:
            reward -= 1.5

        # --- check query quality ---
        where_count = 0
        for q in sql_queries:
            if "limit 1" in q:
                reward -= 1.0
            if " where " not in q:
                reward -= 0.5
            else:
                where_count += 1
        reward += min(where_count, 3) * 0.4  # small bonus for WHERE usage

        # --- evidence check: do queries support the answer? ---
        combined_results = []
        error_detected = False

        for res in tool_results:
            if isinstance(res, dict) and "error" in res:
                error_detected = True
            elif isinstance(res, list):
                combined_results.extend(res)

        # if error detected, penalize heavily
        if error_detected:
            reward -= 2.0
        elif len(sql_queries) == 0:
            reward -= 1.5
        else:
            has_hits = len(combined_results) > 0
            correct_answer = ans.lower()
            if (has_hits and correct_answer == "yes") or (not has_hits and correct_answer == "no"):
                reward += 2.0
            else:
                reward -= 1.5

        rewards.append(reward)

    return rewards


def correctness_reward(completions, answer, **kwargs):
    """
    Reward Yes/No correctness.
    Model must provide final answer enclosed in stars — *yes* or *no*.
    Does not reward informal yes/no buried in text.
    """
    rewards = []
    for completion, ans in zip(completions, answer, strict=False):
        raw = completion[-1]["content"].lower()

        # detect form *yes* or *no*
        match = re.search(r"\\*(yes|no)\\*", raw)
        guess = match.group(1) if match else None

        reward = 0.0

        if guess is None:
            reward -= 0.5  # invalid format
        elif guess == ans.lower():
            reward += 0.6  # correct under required format
        else:
            reward -= 1.0  # wrong answer

        rewards.append(reward)

    return rewards


def structure_reward(completions, **kwargs):
    """
    Reward proper assistant structure.
    Encourages a logical sequence: tool call + response + optional extra content.
    """
    rewards = []

    for completion in completions:
        has_call = False
        has_response = False
        has_other = False

        for turn in completion:
            role = turn.get("role")
            if role == "assistant" and turn.get("tool_calls"):
                has_call = True
            elif role == "tool":
                has_response = True
            else:
                content = turn.get("content")
                if content and content.strip() not in ["", "<think>"]:
                    has_other = True

        # Reward sequences
        if has_call and has_response:
            if has_other:
                reward = 0.1
            else:
                reward = 0.05  # still positive even without extra text
        elif has_call and not has_response:
            reward = -0.15
        else:
            reward = 0.0  # neutral if no call

        rewards.append(reward)

    return rewards


class TimeoutError(Exception):
    """Raised when a function call times out."""

    pass


from contextlib import contextmanager


@contextmanager
def timeout(seconds):
    """Context manager that raises TimeoutError if execution exceeds time limit."""

    def timeout_handler(signum, frame):
        raise TimeoutError(f"Operation timed out after {seconds} seconds")

    signal.signal(signal.SIGALRM, timeout_handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


def query_biogrid(sql_command: str) -> list[tuple]:
    """
    Execute a read-only SQL command on the BioGRID database.

    BioGRID is a curated biological database that compiles protein, genetic, and chemical interactions from multiple organisms. It provides researchers with experimentally verified interaction data to support studies in systems biology and functional genomics.

    Args:
        sql_command: The SQL command to execute.

    Returns:
        A list of tuples containing the query results.
    """
    with timeout(5):
        conn = sqlite3.connect("file:biogrid.db?mode=ro", uri=True)
        cursor = conn.cursor()
        try:
            cursor.execute(sql_command)
            results = cursor.fetchall()
        finally:
            conn.close()
    return results


# --- examples/scripts/grpo_2048.py (TRL 1.16): the environment and its reward, unchanged

PROMPT = "Play 2048 on a 4x4 board. Use the tool `move` with one of: up, down, left, right. Maximize the score."


class Game2048Env:
    def reset(self, **kwargs) -> str:
        self.board = [[0] * 4 for _ in range(4)]
        self.score = 0.0
        self.done = False
        self._spawn()
        self._spawn()
        return f"score={self.score}\\n{self._render()}\\ndone={self.done}"

    def move(self, direction: str) -> str:
        """
        Play one move in 2048.

        Args:
            direction: One of "up", "down", "left", "right".

        Returns:
            Environment feedback after the move.
        """
        if self.done:
            raise ValueError("Game over.")
        moved, gained = self._apply_move(direction.strip().lower())
        if moved:
            self.score += gained
            self._spawn()
        self.done = not self._can_move()
        return f"score={self.score}\\n{self._render()}\\ndone={self.done}"

    def _spawn(self) -> None:
        empty = [(r, c) for r in range(4) for c in range(4) if self.board[r][c] == 0]
        if not empty:
            return
        r, c = random.choice(empty)
        self.board[r][c] = 4 if random.random() < 0.1 else 2

    @staticmethod
    def _merge_line(line: list[int]) -> tuple[list[int], int]:
        vals = [x for x in line if x]
        out = []
        gained = 0
        i = 0
        while i < len(vals):
            if i + 1 < len(vals) and vals[i] == vals[i + 1]:
                v = vals[i] * 2
                out.append(v)
                gained += v
                i += 2
            else:
                out.append(vals[i])
                i += 1
        out += [0] * (4 - len(out))
        return out, gained

    def _apply_move(self, direction: str) -> tuple[bool, int]:
        if direction not in {"up", "down", "left", "right"}:
            return False, 0

        before = [row[:] for row in self.board]
        gained_total = 0

        if direction in {"left", "right"}:
            for r in range(4):
                row = self.board[r][:]
                if direction == "right":
                    row.reverse()
                merged, gained = self._merge_line(row)
                if direction == "right":
                    merged.reverse()
                self.board[r] = merged
                gained_total += gained
        else:
            for c in range(4):
                col = [self.board[r][c] for r in range(4)]
                if direction == "down":
                    col.reverse()
                merged, gained = self._merge_line(col)
                if direction == "down":
                    merged.reverse()
                for r in range(4):
                    self.board[r][c] = merged[r]
                gained_total += gained

        moved = self.board != before
        return moved, gained_total

    def _can_move(self) -> bool:
        if any(0 in row for row in self.board):
            return True
        for r in range(4):
            for c in range(4):
                if r + 1 < 4 and self.board[r][c] == self.board[r + 1][c]:
                    return True
                if c + 1 < 4 and self.board[r][c] == self.board[r][c + 1]:
                    return True
        return False

    def _render(self) -> str:
        return "\\n".join(" ".join(f"{v:3d}" for v in row) for row in self.board)


def reward_score(environments, **kwargs):
    return [env.score for env in environments]


# --- ours: TRL's test tool, a numpy draw, and an environment that shows what reset gets

def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def draw(n: int) -> int:
    """
    Draw from numpy's global generator.

    Args:
        n: The upper bound.
    """
    return int(np.random.randint(n))


class ResetKwargs:
    def reset(self, **kwargs) -> str:
        self.got = sorted(kwargs)
        return "ready"

    def get_reward(self) -> float:
        return float(len(self.got))
'''

INTERACTIONS = [  # the stand-in for the BioGRID table the example builds (two of its columns)
    ("entrez gene/locuslink:JNKK(gene name synonym)|entrez gene/locuslink:MAPKK4", "taxid:9606", "MAP2K4"),
    ("entrez gene/locuslink:TP53", "taxid:9606", "MDM2"),
    ("entrez gene/locuslink:cdc28", "taxid:559292", "CLN2"),
]


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    """The examples' module, and biogrid.db beside it (the example opens it from the working directory)."""
    root = tmp_path_factory.mktemp("trl-examples")
    (root / "trl_examples.py").write_text(TRL_EXAMPLES)
    db = sqlite3.connect(root / "biogrid.db")
    db.execute("create table interactions (Alt_IDs_Interactor_A text, Taxid_Interactor_A text, Official_Symbol_Interactor_B text)")
    db.executemany("insert into interactions values (?, ?, ?)", INTERACTIONS)
    db.commit()
    db.close()
    return root / "trl_examples.py"


@pytest.fixture(scope="module")
def tiny4k(assets, tmp_path_factory) -> str:
    """The session's tiny model with a 4096-token context: room for long episodes beside the tool block."""
    import shutil

    model = tmp_path_factory.mktemp("tiny4k") / "model"
    shutil.copytree(assets["model"], model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 4096}))
    return str(model)


def module(examples: Path):
    from pipeline.rewards.contract import _resolve

    return _resolve(f"{examples}:query_biogrid", str(examples.parent)).__globals__


def trl_tool_results(tools: dict, calls: list[dict]) -> list[dict]:
    """TRL 1.16's _tool_call_loop for one turn's calls (sync tools): the tool messages it appends."""
    out = []
    for call in calls:
        name = call["function"]["name"]
        try:
            if name in tools:
                result = tools[name](**call["function"]["arguments"])
            else:
                raise ValueError(f"Tool {name} not found.")
        except Exception as e:
            result = {"error": str(e)}
        out.append({"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)})
    return out


# --------------------------------------------------------------------------------------- fast
def test_biogrid_tool_runs_on_the_main_thread_and_its_list_is_kept(make_run, tiny2k, examples, tmp_path, monkeypatch):  # noqa: F811
    """signal.alarm inside the tool works (it failed with "signal only works in main thread" on every
    call); the result stays the list of tuples in the message the template renders and the rewards
    get, so the example's query_reward finds the hits (it saw a string: -1.1 instead of 2.4)."""
    from pipeline.agents.episode import trl_completion

    monkeypatch.chdir(examples.parent)
    m = module(examples)
    _, plan = agent_plan(make_run, tiny2k, tmp_path, [f"{examples}:query_biogrid"], tool_timeout_s=10.0)
    runner, tok, p = plan.episodes, plan.tokenizer, plan.prompts[0]
    sql = "SELECT Official_Symbol_Interactor_B FROM interactions WHERE Alt_IDs_Interactor_A LIKE '%JNKK%'"
    e = runner.start(p, 0, 0, 1, "test")
    saved = signal.getsignal(signal.SIGALRM)
    try:
        assert runner._after_turn(e, forced(tok, call_text("query_biogrid", {"sql_command": sql})), 12)
        assert signal.getsignal(signal.SIGALRM).__qualname__ == "timeout.<locals>.timeout_handler"  # set by the tool, here
    finally:
        signal.signal(signal.SIGALRM, saved)
    assert not runner._after_turn(e, forced(tok, "*yes*"), 12) and e.ending == "answered"
    rec = json.loads(runner.row(e, "h")["episode"])
    tool = rec["messages"][1]
    assert (tool["content"], tool["error"]) == ("[('MAP2K4',)]", None)
    assert "<tool_response>\n[('MAP2K4',)]\n</tool_response>" in "".join(e.texts)  # str() of the list, as a template renders it
    completion = trl_completion(rec)
    live = m["query_biogrid"](sql)
    assert completion[1] == trl_tool_results({"query_biogrid": m["query_biogrid"]}, completion[0]["tool_calls"])[0]
    assert completion[1]["content"] == live == [("MAP2K4",)] and isinstance(completion[1]["content"][0], tuple)
    assert m["query_reward"]([completion], ["yes"]) == [pytest.approx(2.4)]  # 0.4 (a WHERE) + 2.0 (hits, "yes")
    assert m["correctness_reward"]([completion], ["yes"]) == [0.6]
    assert m["structure_reward"]([completion]) == [0.1]


def test_sync_tools_run_on_the_main_thread_and_a_timeout_interrupts_them(examples):
    from pipeline.agents.execution import Deadline, MainThreadCalls
    from pipeline.agents.tools import call_tool

    calls = MainThreadCalls()
    assert calls.run(threading.get_ident, {}, 5.0) == threading.main_thread().ident
    stop = threading.Event()

    def stuck() -> str:
        stop.wait(60)  # interrupted by the watchdog's signal at the deadline
        return "late"

    with pytest.raises(Deadline):
        calls.run(stuck, {}, 0.3)

    def stubborn() -> str:  # swallows the interruption: still answered as timed out
        try:
            stop.wait(60)
        except BaseException:
            pass
        return "late"

    with pytest.raises(Deadline):
        calls.run(stubborn, {}, 0.3)
    assert calls.run(lambda: "on time", {}, 5.0) == "on time"  # nothing left armed
    r = call_tool({"stuck": stuck}, "stuck", {}, 0.3)
    assert r.error == "timeout" and r.content == str({"error": "stuck timed out after 0.3 s"})


def test_wrong_arguments_answer_with_trls_texts(examples):
    """A wrong or missing argument name, or arguments that are no mapping, answer with the text
    TRL's call gives (Python's own), for a tool and an environment method."""
    from pipeline.agents.tools import call_tool

    m = module(examples)
    env = m["Game2048Env"]()
    env.reset()
    tools = {"query_biogrid": m["query_biogrid"], "move": env.move}
    cases = [("query_biogrid", {"sql": "select 1"}), ("query_biogrid", {}), ("move", {"dir": "up"}),
             ("move", {"direction": "up", "fast": True}), ("move", "up"), ("nope", {"x": 1})]
    for name, args in cases:
        r = call_tool(tools, name, args, 5.0)
        want = trl_tool_results(tools, [{"function": {"name": name, "arguments": args}}])[0]["content"]
        assert r.content == want and r.error in ("bad_arguments", "unknown_tool"), (name, args, r.content, want)
    assert call_tool(tools, "move", {"dir": "up"}, 5.0).content == \
        str({"error": "Game2048Env.move() got an unexpected keyword argument 'dir'"})


@pytest.mark.parametrize("text, ending", [
    # TRL's test_train_with_malformed_tool_calls: no second generation for any of them
    ('<tool_call>\n{"arguments": {"a": 3, "b": 4}}\n</tool_call>', "malformed"),
    ('<toolcall>\n{"arguments": {"a": 3, "b": 4}}\n</toolcall>', "answered"),
    ('<tool_call>\n{"arguments": {a: 3, b: 4}}\n</tool_call>', "malformed"),
    # one good call beside a malformed one: the whole turn is text, nothing runs
    (call_text("multiply_tool", {"a": 3, "b": 4}) + "<tool_call>{oops</tool_call>", "malformed"),
])
def test_a_malformed_call_is_plain_text_that_ends_the_episode(make_run, tiny2k, examples, tmp_path, text, ending):  # noqa: F811
    from pipeline.agents.episode import trl_completion

    _, plan = agent_plan(make_run, tiny2k, tmp_path, [f"{examples}:multiply_tool"])
    runner, tok, p = plan.episodes, plan.tokenizer, plan.prompts[0]
    e = runner.start(p, 0, 0, 1, "test")
    turn = forced(tok, text)
    assert not runner._after_turn(e, turn, 12) and e.ending == ending
    rec = json.loads(runner.row(e, "h")["episode"])
    assert [m["role"] for m in rec["messages"]] == ["assistant"] and "tool_calls" not in rec["messages"][0]
    assert trl_completion(rec) == [{"role": "assistant", "content": turn.text}]  # TRL: the turn's decoded text


def test_unlimited_turns_bounded_by_the_token_budget(make_run, tiny4k, examples, tmp_path, assets):
    _, plan = agent_plan(make_run, tiny4k, tmp_path, [f"{examples}:multiply_tool"], max_turns=None, max_episode_tokens=1200)
    runner, tok, p = plan.episodes, plan.tokenizer, plan.prompts[0]
    e = runner.start(p, 0, 0, 1, "test")
    turns = 0
    while runner._after_turn(e, forced(tok, call_text("multiply_tool", {"a": turns, "b": 2})), 12):
        turns += 1
    assert turns > 8 and e.ending == "max_episode_tokens"  # well past the default 4: the budget ends it
    assert [m["content"] for m in e.messages if m["role"] == "tool"][:3] == ["0", "2", "4"]
    cfg = base_config(assets, rollout={"tools": [f"{examples}:multiply_tool"], "max_turns": None})
    proc = grpo("init", str(tmp_path / "r"), "--config", str(write_config(tmp_path / "c.yaml", cfg)), check=False)
    assert proc.returncode == 1 and "rollout.max_turns null (unlimited turns) needs rollout.max_episode_tokens" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_reset_gets_no_prompt_where_the_data_has_none(make_run, tiny2k, examples, tmp_path):  # noqa: F811
    """TRL passes reset the data set's row: no `prompt` when the data set has no prompt column."""
    from pipeline.rollout import RolloutInputs
    from pipeline.store.run import Run

    (tmp_path / "levels.jsonl").write_text("".join(json.dumps({"level": i}) + "\n" for i in range(8)))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": "hi", "level": i}) + "\n" for i in range(8)))
    got = []
    for name, data in (("no-prompt", "levels.jsonl"), ("prompt", "prompts.jsonl")):
        run = Run(make_run(name, model=tiny2k, data={"train": str(tmp_path / data), "eval": None, "system_prompt": None},
                           rollout={"environment": f"{examples}:ResetKwargs", "max_new_tokens": 12}, rewards=[]))
        plan = RolloutInputs(run, 0)
        e = plan.episodes.start(plan.prompts[0], 0, 0, 1, "test")
        got.append(e.env.got)
        plan.episodes.row(e, "h")
    assert got == [["level"], ["level", "prompt"]]


def test_global_randomness_in_tools_is_seeded_per_turn(make_run, tiny4k, examples, tmp_path):
    """Game2048Env.move places tiles with Python's global random, `draw` uses numpy's: the same
    episode (group seed, sample, turns) gives the same results whatever the generators held before
    (they differed run to run), other samples get other draws, the caller's state is left alone,
    and the results are TRL's calls on the live class under the same seeds."""
    import numpy as np

    from pipeline.agents import environment as envs
    from pipeline.agents.episode import TOOL_SEED, trl_completion
    from pipeline.data.prompts import derive_seed

    m = module(examples)
    _, plan = agent_plan(make_run, tiny4k, tmp_path, [f"{examples}:draw"], environment=f"{examples}:Game2048Env",
                         max_turns=None, max_episode_tokens=1600)
    runner, tok, p = plan.episodes, plan.tokenizer, plan.prompts[0]
    moves = ["left", "up", "right", "down", "left", "up"]

    def play(sample: int) -> dict:
        e = runner.start(p, 0, sample, 7, "test")
        for t, d in enumerate(moves):
            assert runner._after_turn(e, forced(tok, call_text("move", {"direction": d}) + call_text("draw", {"n": 1000})), 12)
            random.random(), np.random.random()  # whatever else draws between turns
        assert not runner._after_turn(e, forced(tok, "done"), 12)
        return json.loads(runner.row(e, "h")["episode"])

    random.seed(1), np.random.seed(1)
    a = play(0)
    random.seed(2), np.random.seed(2)
    b, other = play(0), play(1)
    tools = lambda rec: [m_["content"] for m_ in rec["messages"] if m_["role"] == "tool"]  # noqa: E731
    assert tools(a) == tools(b) and tools(a) != tools(other)
    # TRL's loop on the live class: reset under the group seed, each turn's calls under its seed
    env = m["Game2048Env"]()
    random.seed(7)
    env.reset()
    completion = trl_completion(a)
    assistant = [msg for msg in completion if msg["role"] == "assistant" and msg.get("tool_calls")]
    want = []
    for t, msg in enumerate(assistant, start=1):
        random.seed(derive_seed(7, 0, t, TOOL_SEED)), np.random.seed(derive_seed(7, 0, t, TOOL_SEED))
        want += trl_tool_results({"move": env.move, "draw": m["draw"]}, msg["tool_calls"])
    assert [msg for msg in completion if msg["role"] == "tool"] == want
    rebuilt = envs.rebuild(type(env), a["environment"])  # what the score stage gives reward_score
    assert rebuilt.board == env.board and m["reward_score"]([rebuilt]) == [env.score] and env.score > 0
