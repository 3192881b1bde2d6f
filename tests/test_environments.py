"""Environments as TRL 1.16's environment_factory (pipeline/agents/environment.py, state.py): the
state reward functions get is the state the episode ended with, exactly (types, keys, numpy
values, dataclasses, __slots__), with the same bytes whatever the hash seed; state that cannot be
stored stops the rollout with one line; pooled instances (__init__ once per slot), reset seeded by
the group and taking content parts, get_reward as a reward source, environments routed by the
`environment` column, environment-owned data, `grpo init`'s checks; and through `grpo iterate`,
rewards from rebuilt instances equal the live ones', reruns byte-identical, audit clean."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import REPO, base_config, grpo, write_config


@dataclass
class Cell:
    pos: tuple
    marks: frozenset


@dataclass
class Board:
    cells: list
    size: np.int64


class Slotted:
    __slots__ = ("hits", "last")

    def __init__(self):
        self.hits = {3, 1}
        self.last = (np.int32(7), "x")


class Seen:
    """A TRL-style environment whose state holds what JSON cannot (the issue's failing scenario)."""

    def reset(self, **row):
        self.seen = {"cat", "dog", "emu"}
        self.tried = frozenset({4, 2})
        self.target = "dog"
        self.span = (2, 5)
        self.names = {1: "one", 10: "ten"}
        self.moves = {(0, 1): "up", (1, 0): "left"}
        self.count = np.int64(42)
        self.score = np.float32(0.1)
        self.grid = np.arange(6, dtype=np.int16).reshape(2, 3)
        self.board = Board([Cell((0, 1), frozenset({"a"}))], np.int64(3))
        self.slots = Slotted()
        self.blob = b"\x00\xff"
        self.inf = float("inf")

    def step(self, animal: str) -> str:
        """Look for an animal.

        Args:
            animal: Its name.
        """
        self.seen.add(animal)
        return "ok"


def exact(environments, **kwargs):
    """1 when every value has its exact type and value (what a TRL reward function may rely on)."""
    out = []
    for e in environments:
        ok = (e.target in e.seen and isinstance(e.seen, set) and 4 in e.tried and isinstance(e.tried, frozenset)
              and e.span == (2, 5) and e.names[10] == "ten" and e.moves[(0, 1)] == "up"
              and type(e.count) is np.int64 and e.count == 42 and type(e.score) is np.float32 and e.score == np.float32(0.1)
              and e.grid.dtype == np.int16 and e.grid.shape == (2, 3) and int(e.grid[1, 2]) == 5
              and e.board == Board([Cell((0, 1), frozenset({"a"}))], np.int64(3)) and type(e.board.size) is np.int64
              and e.slots.hits == {1, 3} and type(e.slots.last[0]) is np.int32 and e.blob == b"\x00\xff" and e.inf == float("inf"))
        out.append(float(ok))
    return out


def stored(instance):
    """The instance as the score stage gets it: snapshot, the record's JSON (sorted keys, as the rollout writes it), rebuild."""
    from pipeline.agents import environment as envs

    text = json.dumps({"environment": envs.snapshot(instance)}, ensure_ascii=False, sort_keys=True)
    return envs.rebuild(type(instance), json.loads(text)["environment"]), text


def test_state_round_trips_exactly():
    live = Seen()
    live.reset(prompt="q")
    live.step("yak")
    rebuilt, text = stored(live)
    assert exact([live]) == [1.0]
    assert exact([rebuilt]) == [1.0]  # the old JSON-or-repr snapshot scored 0 here
    assert list(vars(rebuilt)) == list(vars(live)) and list(rebuilt.names) == [1, 10]  # insertion order kept
    assert rebuilt.seen == {"cat", "dog", "emu", "yak"} and stored(rebuilt)[1] == text  # a fixed point
    assert "np.int64" not in text  # values, not repr strings


def test_old_records_still_rebuild():
    """Records written before the exact encoding hold plain attributes (JSON, or repr strings)."""
    from pipeline.agents import environment as envs

    old = {"class": "x:Seen", "state": {"target": "dog", "seen": ["cat", "dog"], "count": "np.int64(42)"}}
    env = envs.rebuild(Seen, old)
    assert env.target == "dog" and env.seen == ["cat", "dog"] and env.count == "np.int64(42)"
    assert envs.describe(old) == "Seen(target='dog', seen=['cat', 'dog'], count='np.int64(42)')"


ENCODE_SET = """
import json, sys
sys.path.insert(0, {repo!r})
from pipeline.agents import state
words = {{f"w{{i}}" for i in range(40)}}
print(json.dumps([repr(words), state.encode({{"a": words, "b": frozenset(words), "c": {{(w, 1) for w in words}}}}, "Env.seen")]))
"""


def test_set_bytes_do_not_depend_on_the_hash_seed():
    outs = []
    for seed in ("1", "2", "3"):
        proc = subprocess.run([sys.executable, "-c", ENCODE_SET.format(repo=str(REPO))], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}, check=True)
        outs.append(json.loads(proc.stdout))
    assert len({o[0] for o in outs}) > 1  # the interpreter's own set order does follow the seed
    assert len({json.dumps(o[1]) for o in outs}) == 1  # the stored form does not
    assert outs[0][1]["a"]["items"] == sorted(f"w{i}" for i in range(40))


class Holder:
    def reset(self, **row):
        self.fine = {1, 2}


class Reconnecting:
    """The way out: __getstate__/__setstate__ store what rebuilds the connection."""

    def reset(self, **row):
        self.path = ":memory:"
        self.db = sqlite3.connect(self.path)

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.path = state["path"]
        self.db = sqlite3.connect(self.path)


@pytest.mark.parametrize("value, type_name", [
    (threading.Lock(), "_thread.lock"),
    (sqlite3.connect(":memory:"), "sqlite3.Connection"),
    ((i for i in range(3)), "generator"),
    (lambda x: x, "function"),
])
def test_state_that_cannot_be_stored_stops_with_one_line(value, type_name, tmp_path):
    from pipeline.agents import environment as envs
    from pipeline.errors import GRPOError

    env = Holder()
    env.reset()
    env.handle = value
    with pytest.raises(GRPOError) as err:
        envs.snapshot(env)
    msg = str(err.value)
    assert "\n" not in msg and f"Holder.handle: a {type_name} cannot be stored exactly" in msg
    assert "define __getstate__/__setstate__ on Holder" in msg
    env.handle = {"inner": [1, value]}
    with pytest.raises(GRPOError, match=r"Holder\.handle\['inner'\]\[1\]: a "):
        envs.snapshot(env)
    with open(tmp_path / "f.txt", "w") as f:
        env.handle = f
        with pytest.raises(GRPOError, match=r"Holder\.handle: a _io.TextIOWrapper cannot be stored exactly"):
            envs.snapshot(env)
    ok = Reconnecting()
    ok.reset()
    back, _ = stored(ok)
    assert back.path == ":memory:" and back.db.execute("select 1").fetchone() == (1,)


def test_inspect_shows_the_state_readably():
    from pipeline.agents import environment as envs
    from pipeline.report.episodes import conversation

    env = Seen()
    env.reset()
    record = {"messages": [], "ending": "answered", "turns": 1, "model_tokens": 3, "context_tokens": 0,
              "environment": envs.snapshot(env)}
    text = conversation(record, width=10_000)
    assert "[environment] Seen(seen={'cat', 'dog', 'emu'}, tried=frozenset({2, 4}), target='dog', span=(2, 5), " \
           "names={1: 'one', 10: 'ten'}, moves={(0, 1): 'up', (1, 0): 'left'}, count=np.int64(42)" in text
    assert "board=Board(cells=[Cell(pos=(0, 1), marks=frozenset({'a'}))], size=np.int64(3))" in text


# ------------------------------------------------------- TRL parity: pools, routing, get_reward
TRL_ENVS = '''
import os
import random

import numpy as np


def _born(name):
    log = os.environ.get("ENV_INIT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {name}\\n")


class IncrementEnv:
    """TRL's documented example: the environment self-samples a target and owns the reward."""

    def __init__(self):
        _born("IncrementEnv")

    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        self.target = random.randint(1, 6)
        return f"Increment the counter by {self.target}."

    def get_reward(self) -> float:
        return 1.0 - abs(self.target - self.counter) / 6

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class EchoEnv:
    """TRL's echo example, without its server: the reward is set by the tool."""

    def __init__(self):
        _born("EchoEnv")
        self.reward = 0.0

    def reset(self, **kwargs) -> None | str:
        self.reward = 0.0
        self.phrase = random.choice(["Hello World!", "TRL is great!", "Goodbye World!"])
        return f"Make the environment echo '{self.phrase}'"

    def get_reward(self) -> float:
        return self.reward

    def echo(self, message: str) -> str:
        """
        Echo the message back from the environment.

        Args:
            message: The message to echo

        Returns:
            The echoed message.
        """
        self.reward = float(message == self.phrase)
        return message


class GuessEnv:
    """A guessing game: a secret number, guesses as tool calls, an async reward, content parts from reset."""

    def __init__(self):
        _born("GuessEnv")

    def reset(self, **kwargs) -> list:
        self.secret = random.randint(1, 9)
        self.tries = set()
        return [{"type": "text", "text": "Guess my number "}, {"type": "text", "text": "between 1 and 9."}]

    async def get_reward(self) -> float:
        return 1.0 if self.secret in self.tries else 0.1 * len(self.tries) - 0.01 * self.secret

    def guess(self, number: int) -> str:
        """
        Guess the secret number.

        Args:
            number: The guess.

        Returns:
            Whether it is higher, lower or right.
        """
        self.tries.add(number)
        return "right" if number == self.secret else ("higher" if number < self.secret else "lower")


class TallyEnv:
    """State JSON cannot hold (a set of numpy integers, a tuple-keyed dict, numpy integers), and a
    reward comparing it, as TRL reward functions do (`self.target in self.seen`)."""

    def __init__(self):
        _born("TallyEnv")

    def reset(self, **kwargs) -> str:
        a, b = random.randint(10, 99), random.randint(10, 99)
        self.seen = {np.int64(int(d)) for d in str(a)}
        self.target = np.int64((a * b) % 10)
        self.board = {(0, 0): np.int64(a), (0, 1): np.int64(b)}
        self.calls = np.int64(0)
        return f"What is {a} * {b}?"

    def get_reward(self) -> float:
        return float(self.target in self.seen) + 0.01 * int(self.board[(0, 1)]) + 0.001 * len(self.seen) + 0.0001 * int(self.calls)

    def mark(self, digit: int) -> str:
        """
        Mark a digit as seen.

        Args:
            digit: The digit.

        Returns:
            A confirmation.
        """
        self.seen.add(np.int64(digit))
        self.calls += 1
        self.board[(1, int(self.calls))] = np.int64(digit)
        return "marked"


class Untyped:
    def reset(self, **kwargs):
        return None

    def poke(self, x):
        """Poke.

        Args:
            x: anything
        """
        return x


class NoReset:
    def poke(self, x: int) -> int:
        """Poke.

        Args:
            x: anything
        """
        return x


def echo(message: str) -> str:
    """A standalone tool whose name clashes with EchoEnv.echo.

    Args:
        message: The message.
    """
    return message
'''


@pytest.fixture(scope="module")
def trl_envs(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trl-envs") / "trl_envs.py"
    path.write_text(TRL_ENVS)
    return path


def load_trl_envs(path: Path):
    from pipeline.rewards.contract import _resolve

    return {n: _resolve(f"{path}:{n}", os.getcwd()) for n in ("IncrementEnv", "EchoEnv", "GuessEnv", "TallyEnv")}


def test_pool_gives_one_instance_per_slot(trl_envs, tmp_path, monkeypatch):
    from pipeline.agents import environment as envs

    log = tmp_path / "born.log"
    monkeypatch.setenv("ENV_INIT_LOG", str(log))
    cls = load_trl_envs(trl_envs)["IncrementEnv"]
    for _ in range(3):  # three parts of four concurrent episodes each
        held = [envs.acquire("t", cls, "x") for _ in range(4)]
        assert [slot for _, slot in held] == [0, 1, 2, 3]
        for inst, _ in held:
            envs.release(inst)
    assert log.read_text().count("IncrementEnv") == 4  # once per slot, not once per episode (12)
    first, _ = envs.acquire("t", cls, "x")
    second, slot = envs.acquire("t", cls, "x")
    envs.release(first, drop=True)  # a timed-out call may still change it: a new one serves slot 0 next
    again, slot0 = envs.acquire("t", cls, "x")
    assert slot0 == 0 and again is not first and log.read_text().count("IncrementEnv") == 5
    envs.release(again), envs.release(second)


def test_tools_are_the_class_functions_as_trl_lists_them():
    """An environment's tools are its class's public functions, as TRL 1.16 lists them (getmembers on
    the class): a staticmethod is one; a classmethod, a property, a callable stored on the instance
    are not, and no property runs (getmembers on the instance ran this one, which raises before reset)."""
    from pipeline.agents import environment as envs

    class Other:
        def ping(self) -> str:
            """Ping."""
            return "pong"

    class Env:
        def __init__(self):
            self.callback = Other().ping  # a bound method of another object, stored on the instance

        def reset(self, **row):
            self.board = [0, 0]

        @property
        def score(self):
            return sum(self.board)  # AttributeError before reset; a side effect in general

        @staticmethod
        def rules() -> str:
            """The rules."""
            return "none"

        @classmethod
        def make(cls) -> "Env":
            """A new one."""
            return cls()

        def move(self, d: str) -> str:
            """Move.

            Args:
                d: The direction.
            """
            return d

        def get_reward(self) -> float:
            return 0.0

    class Counted(Env):
        reads = 0

        @property
        def score(self):
            Counted.reads += 1
            raise RuntimeError("no board yet")

    for cls in (Env, Counted):
        got = envs.methods(cls())
        assert [m.__name__ for m in got] == ["move", "rules"], cls
        assert got[0]("up") == "up" and got[1]() == "none"
    assert Counted.reads == 0


def test_reset_is_seeded_and_takes_content_parts(trl_envs):
    import random

    from pipeline.agents import environment as envs
    from pipeline.errors import GRPOError

    classes = load_trl_envs(trl_envs)
    g = classes["GuessEnv"]()
    assert envs.reset(g, {}, "x", seed=5) == "Guess my number between 1 and 9."
    secrets = set()
    for seed in (5, 5, 6, 7, 8, 9):
        envs.reset(g, {}, "x", seed=seed)
        secrets.add((seed, g.secret))
    assert len({s for s, _ in secrets}) == len(secrets)  # the same seed draws the same task
    before = random.random()
    random.seed(123)
    a = random.random()
    random.seed(123)
    envs.reset(g, {}, "x", seed=1)
    assert random.random() == a and before != a  # the caller's random state is left as it was

    class Pictures:
        def reset(self, **kw):
            return [{"type": "image", "image": None}]

    with pytest.raises(GRPOError, match="reset returned a content part .*only text parts"):
        envs.reset(Pictures(), {}, "rollout.environment")


def test_get_reward_is_a_reward_source(trl_envs):
    import asyncio

    from pipeline.agents import environment as envs

    classes = load_trl_envs(trl_envs)
    specs = envs.reward_specs({"increment": f"{trl_envs}:IncrementEnv", "again": f"{trl_envs}:IncrementEnv",
                               "guess": f"{trl_envs}:GuessEnv", "echo": f"{trl_envs}:EchoEnv"})
    assert [(s["name"], s["fn"], s["weight"]) for s in specs] == [  # one per class, named after it, weight 1
        ("IncrementEnv", envs.REWARD_FN, 1.0), ("GuessEnv", envs.REWARD_FN_ASYNC, 1.0), ("EchoEnv", envs.REWARD_FN, 1.0)]
    inc, guess = classes["IncrementEnv"](), classes["GuessEnv"]()
    envs.reset(inc, {}, seed=1)
    envs.reset(guess, {}, seed=1)
    guess.guess(guess.secret)
    assert envs.get_reward([inc, guess], environment_class=f"{trl_envs}:IncrementEnv") == [inc.get_reward(), None]
    assert asyncio.run(envs.get_reward_async([inc, guess], environment_class=f"{trl_envs}:GuessEnv")) == [None, 1.0]


def test_environment_owned_data_has_an_empty_prompt(tmp_path):
    from pipeline.data.prompts import load_dataset
    from pipeline.errors import GRPOError

    (tmp_path / "routes.jsonl").write_text('{"environment": "guess"}\n{"environment": "echo"}\n')
    df = load_dataset(str(tmp_path / "routes.jsonl"), "prompt", None, environment=True)
    assert df.get_column("prompt").to_list() == ["", ""] and df.get_column("environment").to_list() == ["guess", "echo"]
    with pytest.raises(GRPOError, match="no prompt column 'prompt'"):
        load_dataset(str(tmp_path / "routes.jsonl"), "prompt")


@pytest.fixture(scope="module")
def tiny2k(assets, tmp_path_factory) -> str:
    """The session's tiny model with a 2048-token context (room for the Hermes tool block)."""
    import shutil

    model = tmp_path_factory.mktemp("tiny2k-env") / "model"
    shutil.copytree(assets["model"], model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 2048}))
    return str(model)


def route_rows(path: Path, names: list[str]) -> str:
    path.write_text("".join(json.dumps({"environment": n}) + "\n" for n in names))
    return str(path)


@pytest.mark.parametrize("environment, rows, rewards, tools, message", [
    ({"a": "{f}:IncrementEnv", "b": "{f}:NoReset"}, ["a", "b"], [], [],
     "rollout.environment.b '{f}:NoReset': the class has no reset method"),
    ({"a": "{f}:IncrementEnv", "b": "{f}:Untyped"}, ["a", "b"], [], [], "rollout.environment.b method 'poke': "),
    ({"a": "{f}:IncrementEnv", "e": "{f}:EchoEnv"}, ["a", "e"], [], ["{f}:echo"],
     "rollout.environment.e: method 'echo' of EchoEnv has the name of a tool in rollout.tools"),
    ({"a": "{f}:IncrementEnv", "e": "{f}:EchoEnv"}, ["a", "e", "chess"], [], [],
     "data.train {d}/rows.jsonl row 2: column 'environment' is 'chess', not one of rollout.environment's names (a, e)"),
    ("{f}:Untyped", ["a"], [], [], "rewards: none given, and no rollout.environment class defines get_reward"),
])
def test_bad_environments_fail_at_init(assets, trl_envs, tmp_path, environment, rows, rewards, tools, message):
    fill = lambda v: v.format(f=trl_envs, d=tmp_path)  # noqa: E731
    env = fill(environment) if isinstance(environment, str) else {k: fill(v) for k, v in environment.items()}
    cfg = base_config(assets, data={"train": route_rows(tmp_path / "rows.jsonl", rows), "eval": None, "system_prompt": None},
                      rollout={"environment": env, "tools": [fill(t) for t in tools]}, rewards=rewards)
    proc = grpo("init", str(tmp_path / "run"), "--config", str(write_config(tmp_path / "cfg.yaml", cfg)), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    assert fill(message) in errors[0], errors[0]
    assert not (tmp_path / "run").exists()


def trl_config(assets, model, trl_envs, tmp_path, **overrides) -> tuple[Path, list[str]]:
    """TRL's environment_factory={"increment": ..., "echo": ..., "guess": ..., "tally": ...} with no
    reward_funcs and no prompt column: rows routed by their `environment` column."""
    names = ["increment", "echo", "guess", "tally"] * 2
    rollout = {"num_generations": 2, "prompts_per_iter": 8, "groups_per_part": 4, "max_new_tokens": 12,
               "environment": {n: f"{trl_envs}:{n.capitalize()}Env" for n in dict.fromkeys(names)},
               "max_turns": 2, "max_episode_tokens": 400}
    cfg = base_config(assets, model=model,
                      data={"train": route_rows(tmp_path / "routes.jsonl", names), "eval": None, "system_prompt": None},
                      rollout={**rollout, **overrides.pop("rollout", {})}, rewards=[], **overrides)
    return write_config(tmp_path / "cfg.yaml", cfg), names


def check_trl_iteration(run: Path, trl_envs: Path) -> None:
    """Each row of iteration 0 was served by the environment its column names (its own tool in its
    prompt, reset's observation as the prompt) and rewarded by its get_reward exactly as the live
    instance is (TallyEnv's reward compares a set of numpy integers and a tuple-keyed dict); __init__
    ran once per pool slot in the rollout (and once per class in init's probe); the update counted
    the model's own tokens; audit is clean and inspect shows the stored state."""
    import asyncio
    import random
    from collections import Counter

    from pipeline.data.prompts import derive_seed

    written = (run / "config.yaml").read_text()
    assert "name: IncrementEnv" in written and "pipeline.agents.environment:get_reward_async" in written
    classes = load_trl_envs(trl_envs)
    per_part_max, episodes, model_tokens = Counter(), 0, 0
    for part in sorted((run / "iter-0000/rollout").glob("part-*.parquet")):
        rows = pq.read_table(part).to_pylist()
        score = {(s["prompt_id"], s["sample_idx"]): s for s in pq.read_table(run / "iter-0000/score" / part.name).to_pylist()}
        in_part = Counter()
        for r in rows:
            rec = json.loads(r["episode"])
            env_rec, name = rec["environment"], r["environment"]
            cls = classes[name.capitalize() + "Env"]
            assert env_rec["name"] == name and env_rec["class"].endswith(f":{cls.__name__}")
            assert env_rec["slot"] == in_part[name]  # the i-th episode of X in a part holds X's slot i
            in_part[name] += 1
            assert rec["tools"] == [{"increment": "increment", "echo": "echo", "guess": "guess", "tally": "mark"}[name]]
            # the live instance, replayed: reset under the group's seed, then the calls that ran
            live = cls()
            random.seed(derive_seed(0, 0, r["prompt_id"]))
            obs = live.reset()
            obs = "".join(p["text"] for p in obs) if isinstance(obs, list) else obs
            assert rec["observation"] == obs and r["prompt"].count(obs) == 1  # the observation is the prompt
            calls = [c["function"] for m in rec["messages"] if m["role"] == "assistant" for c in m.get("tool_calls", [])]
            for c, res in zip(calls, [m for m in rec["messages"] if m["role"] == "tool"]):
                if res["error"] is None:
                    getattr(live, c["name"])(**c["arguments"])
            value = live.get_reward()
            value = asyncio.run(value) if asyncio.iscoroutine(value) else value
            s = score[(r["prompt_id"], r["sample_idx"])]
            assert s["reward"] == value and s[f"reward_{cls.__name__}"] == value  # the score stage's rebuilt instance
            assert [o for o in classes if s[f"reward_{o}"] is not None] == [cls.__name__]  # None for the other classes
            episodes += 1
            model_tokens += sum(r["completion_mask"])
        for n, c in in_part.items():
            per_part_max[n] = max(per_part_max[n], c)
    births = Counter(tuple(line.split()) for line in Path(str(run) + ".born").read_text().splitlines())
    by_pid: dict = {}
    for (pid, cls_name), c in births.items():
        by_pid.setdefault(pid, {})[cls_name] = c
    probe = {c: 1 for c in classes}  # grpo init builds one of each, as TRL probes one
    pooled = {f"{n.capitalize()}Env": c for n, c in per_part_max.items()}
    assert sorted(sorted(d.items()) for d in by_pid.values()) == sorted([sorted(probe.items()), sorted(pooled.items())]), by_pid
    assert episodes == 16 and sum(pooled.values()) < episodes  # once per slot, not once per episode
    steps = pq.read_table(run / "iter-0000/update/metrics.parquet").to_pylist()
    assert sum(s["tokens"] for s in steps) == model_tokens  # the model's tokens, never tool results or the template's
    assert ": ok, 1 iteration(s)" in grpo("audit", str(run), timeout=1800).stdout
    shown = grpo("inspect", str(run), "--iter", "0", "--format", "json", timeout=1800).stdout
    assert "[environment] TallyEnv(seen={np.int64(" in shown


@pytest.mark.slow
def test_trl_environments_routed_pooled_and_self_rewarded_through_iterate(assets, tiny2k, trl_envs, tmp_path):
    """Four TRL environments, no reward functions, no prompt column, on the tiny model (see
    check_trl_iteration); a rerun under another PYTHONHASHSEED writes the same bytes."""
    from test_reproduce import record

    cfg, _ = trl_config(assets, tiny2k, trl_envs, tmp_path)
    runs = [tmp_path / "a", tmp_path / "b"]
    for run, seed in zip(runs, ("1", "2")):
        env = {"ENV_INIT_LOG": str(run) + ".born", "PYTHONHASHSEED": seed}
        grpo("init", str(run), "--config", str(cfg), env=env, timeout=1800)
        grpo("iterate", str(run), "--iters", "1", env=env, timeout=1800)
    check_trl_iteration(runs[0], trl_envs)
    assert record(runs[0], iters=1) == record(runs[1], iters=1)
