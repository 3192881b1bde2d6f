"""TRL 1.16's own example tools and environments behave here as in TRL (issue 42, item 5 and 6):
`grpo_agent.py`'s `query_biogrid` (a sync tool timed out with `signal.alarm`, returning a list
its reward checks with `isinstance(res, list)`) and `grpo_2048.py`'s `Game2048Env` (tiles placed
with Python's global `random`), with their reward functions, written below as the example files
define them; biogrid's database, which the example builds from a Hub data set, is a local stand-in
file of the same table. The reference is TRL's `_tool_call_loop`, restated in `trl_tool_results`:
`sync_tools[name](**arguments)` on the main thread, `{"error": str(e)}` for any exception, a list
result kept, anything else str(). Also TRL's malformed calls (its test_train_with_malformed_tool_calls
completions), unlimited turns, and reset without a prompt where the data set has none. On a real
engine: SmolLM2 with Qwen3's original template runs both examples through `grpo iterate` on vLLM,
rerun byte-identical, every tool result and reward TRL's loop and reward functions re-executed;
and gpt-oss's original template on a tiny model of its special tokens, the same through `grpo iterate`
on the HF engine."""

from __future__ import annotations

import json
import random
import shutil
import signal
import sqlite3
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import base_config, grpo, write_config
from test_agents import agent_plan, call_text, forced, tiny2k, tools_file  # noqa: F401 (tiny2k, tools_file: fixtures)

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
    from pipeline.run.run import Run

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
    from pipeline.agents.episode import trl_completion

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
    env, want = trl_episode(m, {"draw": m["draw"]}, a, 7, 0)
    assert [msg for msg in trl_completion(a) if msg["role"] == "tool"] == [msg for msg in want if msg["role"] == "tool"]
    rebuilt = envs.rebuild(type(env), a["environment"])  # what the score stage gives reward_score
    assert rebuilt.board == env.board and m["reward_score"]([rebuilt]) == [env.score] and env.score > 0


# ------------------------------------------------- the examples on a real engine, with Qwen3's template
SQL = "SELECT * FROM interactions WHERE Alt_IDs_Interactor_A LIKE '%JNKK%'"
EXAMPLE_REWARDS = ("reward_score", "query_reward", "correctness_reward", "structure_reward")  # the two examples'
BOARD = ["score=0.0\n  0   0   0   0\n  0   2   0   0\n  0   0   0   0\n  2   0   0   0\ndone=False",
         "score=4.0\n  0   0   0   0\n  0   0   0   0\n  0   0   2   0\n  4   2   0   0\ndone=False"]


def trl_rows(gene: str) -> list[tuple]:
    """What query_biogrid answers for SQL on `gene`: the stand-in table's rows of that interactor."""
    return [row for row in INTERACTIONS if gene in row[0]]


def example_rows(path: Path, n: int = 6) -> str:
    """Chat prompts holding worked episodes in Qwen3's (Hermes) call format, the environment's board
    after the last question: a database query then a 2048 move, asked again; or two products, then
    another. SmolLM2 writes the calls of the last worked episode in some samples."""
    def result(x: str) -> dict:
        return {"role": "user", "content": f"<tool_response>\n{x}\n</tool_response>"}

    def product(a: int, b: int) -> list[dict]:
        return [{"role": "user", "content": f"What is {a} * {b}?\n" + BOARD[0]},
                {"role": "assistant", "content": call_text("multiply", {"a": a, "b": b})}, result(str(a * b)),
                {"role": "assistant", "content": str(a * b)}]
    def query(gene: str, partner: str) -> list[dict]:
        return [{"role": "user", "content": f"Does {gene} interact with {partner}? Then make a 2048 move.\n" + BOARD[0]},
                {"role": "assistant", "content": call_text("query_biogrid", {"sql_command": SQL.replace("JNKK", gene)})},
                result(str(trl_rows(gene))), {"role": "assistant", "content": call_text("move", {"direction": "down"})},
                result(BOARD[1]), {"role": "assistant", "content": "*yes*"}]
    rows = []
    for i in range(n):
        a, b = 11 + 7 * i, 23 + 3 * i
        rows.append({"prompt": query("JNKK", "MAP2K4")[:3] + [{"role": "assistant", "content": "*yes*"}] + product(12, 13) + product(41, 27)
                     + [{"role": "user", "content": f"What is {a} * {b}?\n"}], "answer": str(a * b)} if i % 2 == 0 else
                    {"prompt": query("JNKK", "MAP2K4") + query("TP53", "MDM2")
                     + [{"role": "user", "content": "Does JNKK interact with MAP2K4? Then make a 2048 move.\n"}], "answer": "yes"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def trl_episode(m: dict, tools: dict, rec: dict, seed: int, sample: int):
    """TRL's loop re-executed for a recorded episode on the live classes, under the seeds it ran with:
    a new Game2048Env reset under the group seed, each turn's calls (where the record ran them) under
    that turn's seed. Returns the environment and the completion TRL hands its reward functions."""
    import numpy as np

    from pipeline.agents.episode import TOOL_SEED
    from pipeline.data.prompts import derive_seed

    env = m["Game2048Env"]()
    random.seed(seed)
    env.reset()
    live, msgs, out, turn = {**tools, "move": env.move}, rec["messages"], [], 0
    for i, msg in enumerate(msgs):
        if msg["role"] != "assistant":
            continue
        turn += 1
        out.append({"role": "assistant", "content": msg["content"], **({"tool_calls": msg["tool_calls"]} if "tool_calls" in msg else {})})
        ran = []
        for t in msgs[i + 1:]:
            if t["role"] != "tool":
                break
            ran.append(t)
        if not ran:  # none of the turn's calls ran: the episode ended on it (max_turns, or cut)
            continue
        random.seed(derive_seed(seed, sample, turn, TOOL_SEED)), np.random.seed(derive_seed(seed, sample, turn, TOOL_SEED))
        results = trl_tool_results(live, msg["tool_calls"])
        out += [r for r, t in zip(results, ran) if not t.get("dropped")]  # a result past the token budget: left out, as TRL does
    return env, out


def trl_semantics_hold(run: Path, examples: Path, rows: list[dict], records: list[dict], tools: dict) -> None:
    """Every recorded episode of iteration 0 is TRL's: its tool messages are what TRL's loop gives on
    the live classes under the episode's seeds (the group seed: seed 0, iteration 0, its prompt), the
    completion handed to the rewards is TRL's, the environment rebuilt for the rewards is the live one,
    and every reward in the score parts is the example's reward function on TRL's side."""
    from pipeline.agents import environment as envs
    from pipeline.agents.episode import tool_content, trl_completion
    from pipeline.data.prompts import derive_seed

    trl = module(examples)
    names = EXAMPLE_REWARDS
    score = {(s["prompt_id"], s["sample_idx"]): s for p in sorted((run / "iter-0000/score").glob("part-*.parquet"))
             for s in pq.read_table(p).to_pylist()}
    for r, rec in zip(rows, records):
        env, completion = trl_episode(trl, {"query_biogrid": trl["query_biogrid"], **tools}, rec,
                                      derive_seed(0, 0, r["prompt_id"]), r["sample_idx"])
        recorded = [t for t in rec["messages"] if t["role"] == "tool" and not t.get("dropped")]
        assert [t["content"] for t in completion if t["role"] == "tool"] == [tool_content(t) for t in recorded]
        assert trl_completion(rec) == completion
        rebuilt = envs.rebuild(type(env), rec["environment"])  # what the score stage hands reward_score
        assert (rebuilt.board, rebuilt.score, rebuilt.done) == (env.board, env.score, env.done)
        want = [trl["reward_score"]([env])[0], trl["query_reward"]([completion], [r["answer"]])[0],
                trl["correctness_reward"]([completion], [r["answer"]])[0], trl["structure_reward"]([completion])[0]]
        assert [score[(r["prompt_id"], r["sample_idx"])][f"reward_{n}"] for n in names] == want, rec


@pytest.mark.slow
def test_qwen3_template_trl_examples_on_smollm2_through_iterate(assets, smollm2, examples, tools_file, tmp_path, monkeypatch):  # noqa: F811
    """SmolLM2 (ChatML, as Qwen3) with Qwen3's original template, TRL's Game2048Env as the environment
    and its query_biogrid beside our multiply as tools, on vLLM: `grpo iterate` samples, scores and
    trains with the training template TRL swaps in (named in the manifest); a second run, each shard
    its own process, one SIGKILLed by its tool mid-part and resumed, writes the same bytes; every tool
    result and reward is TRL's loop and TRL's reward functions re-executed on the live classes under
    the same seeds; replay re-scores without running a tool; audit is clean, and catches a forged result."""
    from pipeline.agents.tools import load_tools
    from test_agents import rollout_manifest
    from test_vendor_templates import trl_templates

    model = tmp_path / "smollm2-qwen3"
    shutil.copytree(smollm2["dir"], model)
    (model / "chat_template.jinja").write_text(trl_templates()["qwen3"])
    ex, names = str(examples), EXAMPLE_REWARDS
    cfg = base_config(assets, model=str(model), data={"train": example_rows(tmp_path / "rows.jsonl"), "eval": None, "system_prompt": None},
                      rollout={"num_generations": 4, "prompts_per_iter": 2, "groups_per_part": 1, "max_new_tokens": 100,
                               "temperature": 0.7, "tools": [f"{ex}:query_biogrid", f"{tools_file}:multiply"],
                               "environment": f"{ex}:Game2048Env", "max_turns": 3, "max_episode_tokens": 400},
                      rewards=[{"fn": f"{ex}:{n}"} for n in names])
    write_config(tmp_path / "cfg.yaml", cfg)
    log_a, log_b = tmp_path / "calls_a.log", tmp_path / "calls_b.log"
    a, b = tmp_path / "a", tmp_path / "b"

    def cli(*args, **kw):  # in the examples' folder: query_biogrid opens biogrid.db from the working directory
        return grpo(*args, cwd=examples.parent, **kw)

    assert "Hermes fallback" not in cli("init", str(a), "--config", str(tmp_path / "cfg.yaml")).stdout
    cli("iterate", str(a), "--iters", "1", env={"CALC_LOG": str(log_a)}, timeout=1200)  # ~1,100-token prompts: a long update on a loaded machine
    assert rollout_manifest(a)["inputs"]["chat_template"] == {
        "name": "qwen3_training", "sha256": rollout_manifest(a)["inputs"]["chat_template"]["sha256"], "tool_format": "template", "parser": "hermes"}
    rows = [r for p in sorted((a / "iter-0000/rollout").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    records = [json.loads(r["episode"]) for r in rows]
    called = {m["name"] for rec in records for m in rec["messages"] if m["role"] == "tool" and m["error"] is None}
    assert all(rec["tools"] == ["query_biogrid", "multiply", "move"] for rec in records)  # the tools, then the environment's
    assert {"multiply", "move"} <= called, called  # SmolLM2 starts query_biogrid calls but did not finish one in 100 tokens here
    assert rollout_manifest(a)["stats"]["tool_calls"] == sum(m["role"] == "tool" for rec in records for m in rec["messages"])
    assert len(log_a.read_text().splitlines()) == sum(m["role"] == "tool" and m["name"] == "multiply" and m["error"] is None
                                                      for rec in records for m in rec["messages"])

    # the rerun: each worker its own process, in the other order; the one holding the first multiply
    # call is SIGKILLed by that tool mid-part (no part left behind), then resumed
    cli("init", str(b), "--config", str(tmp_path / "cfg.yaml"))
    with_multiply = sorted({p.name for p in (a / "iter-0000/rollout").glob("part-*.parquet")
                            if any(m["role"] == "tool" and m["name"] == "multiply" and m["error"] is None for e in pq.read_table(p).column("episode").to_pylist()
                                   for m in json.loads(e)["messages"])})
    shard_of = {"part-00000.parquet": "0/2", "part-00001.parquet": "1/2"}
    first = with_multiply[0]
    other = next(s for n, s in shard_of.items() if n != first)
    cli("rollout", str(b), "--iter", "0", "--shard", other, env={"CALC_LOG": str(log_b)})
    killed = cli("rollout", str(b), "--iter", "0", "--shard", shard_of[first], check=False,
                 env={"CALC_LOG": str(log_b), "KILL_ONCE": str(tmp_path / "killed")})
    assert killed.returncode == -9 and not (b / "iter-0000/rollout" / first).exists()
    cli("rollout", str(b), "--iter", "0", "--shard", shard_of[first], env={"CALC_LOG": str(log_b)})
    assert rollout_manifest(a)["outputs"] == rollout_manifest(b)["outputs"]  # same bytes, part by part
    assert sorted(log_a.read_text().splitlines()) == sorted(log_b.read_text().splitlines())
    cli("score", str(b), "--iter", "0")
    score_manifest = lambda run: json.loads((run / "iter-0000/score/MANIFEST.json").read_text())["outputs"]  # noqa: E731
    score_rows = lambda run: [s for p in sorted((run / "iter-0000/score").glob("part-*.parquet")) for s in pq.read_table(p).to_pylist()]  # noqa: E731
    assert score_manifest(a) == score_manifest(b)

    # the tokens: each turn as sampled (mask 1), then the template's glue with the results (mask 0)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(model)
    for r, rec in zip(rows, records):
        ids, mask = r["completion_ids"], r["completion_mask"]
        assert len(mask) == len(ids) == len(r["sampler_logprobs"]) and sum(mask) == rec["model_tokens"]
        pos, msgs = 0, rec["messages"]
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            assert mask[pos:pos + m["tokens"]] == [1] * m["tokens"]
            pos += m["tokens"]
            results = [t for t in msgs[i + 1:i + 1 + len(m.get("tool_calls", []))] if t["role"] == "tool" and not t.get("dropped")]
            if results:
                glue = pos
                while glue < len(mask) and mask[glue] == 0:
                    glue += 1
                text = tok.decode(ids[pos:glue])
                assert text.count("<tool_response>\n") == len(results)
                assert all(t["content"] in text for t in results if "value" not in t)  # a list renders as Qwen3's template renders it
                pos = glue
        assert pos == len(ids)
        assert all(x == 0.0 for x, m in zip(r["sampler_logprobs"], mask) if m == 0)

    # TRL's loop and reward functions on the live classes, under the episodes' seeds
    monkeypatch.chdir(examples.parent)  # where query_biogrid finds its database
    multiply = load_tools([f"{tools_file}:multiply"])[0]
    trl_semantics_hold(a, examples, rows, records, {"multiply": multiply})

    # it trained: the update ran on the model's own tokens, and the run audits clean
    metrics = pq.read_table(a / "iter-0000/update/metrics.parquet").to_pylist()
    assert sum(x["tokens"] for x in metrics) == sum(rec["model_tokens"] for rec in records)
    assert (a / "policy/iter-0001").is_dir()
    assert ": ok, 1 iteration(s)" in cli("audit", str(a)).stdout

    calls = log_a.read_text()
    cli("replay", str(a), "--iter", "0", "--to", str(tmp_path / "c"), "--until", "score", env={"CALC_LOG": str(log_a)})
    assert log_a.read_text() == calls  # re-scored from the record: no tool ran again
    assert score_rows(tmp_path / "c") == score_rows(a)

    part = next(p for p in sorted((a / "iter-0000/rollout").glob("part-*.parquet"))
                if any(json.loads(e)["turns"] > 1 for e in pq.read_table(p).column("episode").to_pylist()))
    table = pq.read_table(part)
    eps = table.column("episode").to_pylist()
    i = next(j for j, e in enumerate(eps) if json.loads(e)["turns"] > 1)
    rec = json.loads(eps[i])
    rec["messages"][1]["content"] = "999999"  # a forged tool result
    eps[i] = json.dumps(rec, ensure_ascii=False, sort_keys=True)
    import pyarrow as pa

    pq.write_table(table.set_column(table.schema.get_field_index("episode"), "episode", pa.array(eps, pa.string())), part)
    proc = cli("audit", str(a), check=False)
    assert proc.returncode == 1 and part.name in proc.stdout + proc.stderr


# ------------------------------------------------ gpt-oss's template on a tiny model of its tokens, on the HF engine
HARMONY_TASKS = [("Make the 2048 move {}.\n", d) for d in ("left", "right", "up", "down")] + \
                [("Query {} in the database.\n", g) for g in ("JNKK", "TP53", "BRCA1")]


def harmony_conversation(trl: dict, task: tuple[str, str], seed: int) -> list[dict]:
    """One tool episode as gpt-oss's template gets it: the task with the board reset gave (appended
    to the user message, as TRL does), the call it asks for, its live result, and a final answer."""
    text, arg = task
    env = trl["Game2048Env"]()
    random.seed(seed)
    board = env.reset()
    if arg in ("left", "right", "up", "down"):
        name, args, result, final = "move", {"direction": arg}, env.move(arg), "done"
    else:
        name, args = "query_biogrid", {"sql_command": SQL.replace("JNKK", arg)}
        result = trl["query_biogrid"](args["sql_command"])
        final = "*yes*" if result else "*no*"
    return [{"role": "user", "content": text.format(arg) + board},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]},
            {"role": "tool", "name": name, "content": result}, {"role": "assistant", "content": final}]


GPTOSS_DAY = "2026-11-28"
"""The day gpt-oss's template writes ("Current date:", strftime_now) in the warm start's texts and the run's
prompts (data.template_date): the date's text is in every prompt, so it shapes the tokenizer's merges, the
warm-started weights and every sample; pinned, the model and its episodes are the same on any day."""


def gptoss_dated(**kwargs) -> dict:
    """apply_chat_template's kwargs with GPTOSS_DAY as today (as pipeline/run/template_date.py's `dated`)."""
    import datetime

    return {**kwargs, "strftime_now": datetime.datetime.fromisoformat(GPTOSS_DAY).strftime}


GPTOSS_SIZE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
GPTOSS_LR = 3e-3


def gptoss_tokenizer(texts: list[str]):
    """demo.tinymodel's byte-level BPE trained on `texts`, with gpt-oss's special tokens and its
    template as TRL ships it; `<|return|>` (the end of its final message) is the eos."""
    from demo.tinymodel import build_tokenizer
    from test_vendor_templates import SPECIAL, trl_templates

    template = trl_templates()["gptoss"]
    tok = build_tokenizer(texts, 1024)
    tok.add_special_tokens({"additional_special_tokens": sorted(set(SPECIAL.findall(template)))}, replace_extra_special_tokens=False)
    tok.chat_template, tok.eos_token = template, "<|return|>"
    return tok


def gptoss_tiny(out: Path, examples: Path, steps: int, seed: int = 0) -> tuple[Path, list[float]]:
    """A tiny Qwen2 (demo.tinymodel's) whose tokenizer carries gpt-oss's special tokens and its
    template, with gpt-oss's stop tokens (<|return|> the eos, <|call|> beside it in
    generation_config.json, as gpt-oss's files list them), warm-started on harmony tool episodes of
    TRL's 2048 environment and biogrid tool: the model's part of each (after `<|start|>assistant`, to
    <|call|> or <|return|>) is what it learns to write. Run from the examples' folder (biogrid.db).
    Returns the model directory and the loss of every step."""
    import re

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from demo.tinymodel import _pad, torch_threads
    from pipeline.agents.tools import tool_schema

    trl = module(examples)
    schemas = [tool_schema(trl["query_biogrid"], "t"), tool_schema(trl["Game2048Env"]().move, "t")]
    convs = [harmony_conversation(trl, task, seed=s) for s in range(8) for task in HARMONY_TASKS]
    draft = gptoss_tokenizer([json.dumps(c, default=str) for c in convs])  # renders the texts the real one is trained on
    texts = [draft.apply_chat_template(c, **gptoss_dated(tools=schemas, tokenize=False)) for c in convs]
    tok = gptoss_tokenizer(texts)
    stops = [tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None,
                                         eos_token_id=stops[0], pad_token_id=tok.pad_token_id, dtype="float32", **GPTOSS_SIZE))
    model.generation_config = GenerationConfig(eos_token_id=stops, pad_token_id=tok.pad_token_id, bos_token_id=None)
    encoded = []
    for text in texts:  # the model's spans are labelled; the rest (prompt, glue, results) is context
        ids, labels = [], []
        for j, piece in enumerate(re.split(r"(?<=<\|start\|>assistant)(.*?(?:<\|call\|>|<\|return\|>|<\|end\|>))", text, flags=re.S)):
            part = tok(piece, add_special_tokens=False)["input_ids"]
            ids += part
            labels += part if j % 2 else [-100] * len(part)
        encoded.append((ids, labels))
    opt = torch.optim.AdamW(model.parameters(), lr=GPTOSS_LR, betas=(0.9, 0.95), weight_decay=0.0)
    order, losses = random.Random(seed), []
    model.train()
    with torch_threads(1):
        for _ in range(steps):
            batch = order.sample(encoded, 8)
            input_ids = torch.tensor(_pad([b[0] for b in batch], tok.pad_token_id))  # [B, L]
            labels = torch.tensor(_pad([b[1] for b in batch], -100))  # [B, L]
            mask = torch.tensor(_pad([[1] * len(b[0]) for b in batch], 0))  # [B, L]
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, losses


GPTOSS_WARM_STEPS = 60  # measured: the fewest of 20, 40, 60, ... whose samples hold well-formed calls of both tools (loss 6.8 -> 0.11)


@pytest.fixture(scope="module")
def gptoss_model(examples, tmp_path_factory) -> Path:
    """gptoss_tiny's model, built once for the module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(examples.parent)  # where query_biogrid finds its database
        model, _ = gptoss_tiny(tmp_path_factory.mktemp("gptoss") / "model", examples, GPTOSS_WARM_STEPS)
    return model


@pytest.mark.slow
def test_gptoss_template_trl_examples_on_the_hf_engine(assets, examples, gptoss_model, tmp_path, monkeypatch):
    """gpt-oss's original template on a tiny model whose tokenizer carries its special tokens,
    warm-started on harmony tool episodes: with TRL's Game2048Env and query_biogrid and
    `rollout.engine: hf`, `grpo iterate` samples calls in gpt-oss's own format (harmony, no
    training template), scores and trains; a second run writes the same bytes, stage by stage;
    every tool result and reward is TRL's loop and reward functions on the live classes; audit is clean."""
    monkeypatch.chdir(examples.parent)  # where query_biogrid finds its database, for the tests' calls and the CLI's
    rows_file = tmp_path / "rows.jsonl"
    tasks = [HARMONY_TASKS[0], HARMONY_TASKS[4]]  # a 2048 move, a database query
    rows_file.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": text.format(arg)}], "answer": "yes"}) + "\n"
                                 for text, arg in tasks))
    ex = str(examples)
    cfg = base_config(assets, model=str(gptoss_model), data={"train": str(rows_file), "eval": None, "system_prompt": None,
                                                             "template_date": GPTOSS_DAY},  # the warm start's day
                      rollout={"engine": "hf", "hf_sampler": "per_group", "num_generations": 4, "prompts_per_iter": 2, "groups_per_part": 1, "max_new_tokens": 32,
                               "temperature": 1.0, "tools": [f"{ex}:query_biogrid"], "environment": f"{ex}:Game2048Env",
                               "max_turns": 2, "max_episode_tokens": 160},
                      rewards=[{"fn": f"{ex}:{n}"} for n in EXAMPLE_REWARDS])
    write_config(tmp_path / "cfg.yaml", cfg)
    for run in ("a", "b"):  # gpt-oss's template writes the date into the prompt: both runs render GPTOSS_DAY
        grpo("init", str(tmp_path / run), "--config", str(tmp_path / "cfg.yaml"), cwd=examples.parent)
        grpo("iterate", str(tmp_path / run), "--iters", "1", cwd=examples.parent)
    a, b = tmp_path / "a", tmp_path / "b"
    manifest = lambda run, stage: json.loads((run / f"iter-0000/{stage}/MANIFEST.json").read_text())  # noqa: E731
    template = manifest(a, "rollout")["inputs"]["chat_template"]
    assert {k: template[k] for k in ("name", "tool_format", "parser")} == {"name": "model", "tool_format": "template", "parser": "harmony"}
    for stage in ("rollout", "score", "logprobs"):
        assert manifest(a, stage)["outputs"] == manifest(b, stage)["outputs"], stage  # same bytes, part by part
    assert manifest(a, "update")["policy_hash"] == manifest(b, "update")["policy_hash"]
    rows = [r for p in sorted((a / "iter-0000/rollout").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    records = [json.loads(r["episode"]) for r in rows]
    called = {m["name"] for rec in records for m in rec["messages"] if m["role"] == "tool" and m["error"] is None}
    assert {"query_biogrid", "move"} <= called, called
    trl_semantics_hold(a, examples, rows, records, {})
    # the tokens are gpt-oss's template rendering TRL's conversation: the prompt with the board reset
    # gave, the sampled calls, each result as the template writes it (the biogrid list as its JSON), the answer
    from transformers import AutoTokenizer

    from pipeline.agents.episode import trl_completion

    tok, trl = AutoTokenizer.from_pretrained(gptoss_model), module(examples)
    answered = [(r, rec) for r, rec in zip(rows, records) if rec["ending"] == "answered" and rec["turns"] == 2]
    assert len(answered) >= 2, [rec["ending"] for rec in records]
    for r, rec in answered:
        text, arg = tasks[r["prompt_id"]]
        conversation = [{"role": "user", "content": text.format(arg) + rec["observation"]}] + trl_completion(rec)
        assert tok.decode(r["prompt_ids"] + r["completion_ids"]) == \
            tok.apply_chat_template(conversation, **gptoss_dated(tools=[trl["query_biogrid"], trl["Game2048Env"]().move], tokenize=False))
    metrics = pq.read_table(a / "iter-0000/update/metrics.parquet").to_pylist()
    assert sum(x["tokens"] for x in metrics) == sum(rec["model_tokens"] for rec in records)
    assert ": ok, 1 iteration(s)" in grpo("audit", str(a)).stdout
