"""`grpo audit`'s check of episode rows (rollout parts' rows with an `episode` record): the ids
the episode put there re-derived from what its record keeps.

An episode row's ids are the model's turns as sampled (not re-derivable: the sampler's) and, between
them, the glue: the template's text around the tool results, tokenised with the results as plain
text (pipeline/agents/inserted.py). The record (episode version 2) keeps each glue's place in the
completion text and the spans of outside text in it, and the spans of the observation in the prompt;
audit tokenises them again with the run's tokenizer and names the first row whose ids differ: the
prompt's ids, or the glue after a turn (a row whose ids were edited, say a tool's `<|im_end|>` turned
into the special token, is named although every hash was recomputed). Each assistant message's
`text` and `tokens` place the turns. Where the iteration's rollout inputs can be rebuilt (its chat
template, tool format, tools), the prompt text and each glue are not taken from the row: they are
rendered again from the recorded messages (the template's text between the turns, the tool results
located in it as `inserted` spans), so a row forged consistently in ids, spans and text (a result's
marker moved out of its span and into the template's text, the recorded result shortened to match)
is named too. A record of episode version 1 (written before grpo recorded what
it inserted, when the glue was tokenised whole) is not re-derived: its ids are not called forged, and
the summary counts such rows.
"""

from __future__ import annotations

import io
import json

import pyarrow.parquet as pq

from pipeline.agents.inserted import Tokens

COLUMNS = ("prompt", "prompt_ids", "completion", "completion_ids", "completion_mask", "episode")
ENDPOINT_COLUMNS = ("prompt_id", "group_idx", "sample_idx", "sampler_logprobs", "prompt_raw")


def row_problems(tokens, row: dict, runner=None) -> list[str] | None:
    """What is wrong with one episode row's ids (empty: they re-derive), or None: its record is of
    episode version 1 and keeps no spans, so its ids are not re-derived. `tokens`: the run's tokenizer,
    or its `Tokens`; `runner`: the iteration's EpisodeRunner (pipeline/agents/episode.py), whose template
    renders the prompt and the glue again from the recorded messages (None: they are the row's)."""
    tokens = tokens if isinstance(tokens, Tokens) else Tokens(tokens)
    record = json.loads(row["episode"])
    ins = record.get("inserted")
    if record.get("version", 1) < 2 or ins is None:
        return None
    derive = Rendered(runner, record, row) if runner is not None and row.get("prompt_raw") is not None else None
    if derive is not None and (problem := derive.prompt(row["prompt"], ins["prompt"])):
        return [problem]
    if tokens.encode(row["prompt"], ins["prompt"]) != list(row["prompt_ids"]):
        return ["prompt_ids are not the tokens of its prompt (the observation as text, the rest as the tokenizer reads it)"]
    ids, mask, text = list(row["completion_ids"]), list(row["completion_mask"] or []), row["completion"]
    glues = ins["glue"]
    turns, results = [], []  # the assistant messages, and the tool messages answering each
    for m in record["messages"]:
        if m["role"] == "assistant":
            turns.append(m)
            results.append([])
        elif results:
            results[-1].append(m)
    if len(glues) > len(turns) or len(mask) != len(ids):
        return [f"its record holds {len(turns)} turn(s) and {len(glues)} glue(s) for {len(ids)} ids and a mask of {len(mask)}"]
    t = c = 0
    for j, m in enumerate(turns):
        n = m["tokens"]
        if text[c:c + len(m["text"])] != m["text"] or set(mask[t:t + n]) - {1} or t + n > len(ids):
            return [f"turn {j + 1} at token {t}: not the {n} sampled tokens (mask 1) and text its record holds"]
        t, c = t + n, c + len(m["text"])
        if j >= len(glues):
            continue
        g = glues[j]
        glue = text[c:c + g["chars"]]
        if derive is not None and (problem := derive.glue(j, turns, results[j], ids[t - 1] if n else None, glue, g["data"])):
            return [problem]
        outside = [r["content"] for r in results[j] if isinstance(r.get("content"), str) and "value" not in r]
        if (bare := _unmarked(glue, g["data"], outside)) is not None:
            return [f"the glue after turn {j + 1} holds the tool result {bare[:40]!r} outside the spans its record marks as "
                    "inserted (a record edited to pass the result off as the template's text?)"]
        want = tokens.encode(glue, g["data"])
        if g["at"] != c or ids[t:t + len(want)] != want or set(mask[t:t + len(want)]) - {0}:
            return [f"completion_ids at token {t} are not the tokens of the glue after turn {j + 1} as its record holds it "
                    "(the template's text with the tool results as text, mask 0)"]
        t, c = t + len(want), c + g["chars"]
    if t != len(ids) or c != len(text):
        return [f"{len(ids) - t} id(s) and {len(text) - c} character(s) after its last turn and glue that its record does not hold"]
    return []


class Rendered:
    """An episode row's prompt and glues as the run's template renders them from its record (what
    EpisodeRunner.start and _after_turn rendered): the text and the spans of outside text in it."""

    def __init__(self, runner, record: dict, row: dict):
        from pipeline.agents import environment as envs
        from pipeline.agents.episode import _render_message
        from pipeline.data.prompts import as_messages, raw_from_json

        self.runner, self.record, self.render_message = runner, record, _render_message
        self.schemas = list(runner.a.schemas) + _method_schemas(runner, record)
        raw, obs = raw_from_json(row["prompt_raw"]), record.get("observation")
        self.prompt_messages = lambda o: as_messages(envs.observe(raw, o), runner.data.system_prompt)
        self.obs = obs

    def prompt(self, text: str, spans: list) -> str | None:
        from pipeline.agents import inserted

        names = [s["function"]["name"] for s in self.schemas]
        if names != self.record["tools"]:
            return f"its record names the tools {self.record['tools']}, the run's config gives {names}"
        fmt, obs = self.runner.a.format, self.obs
        want, at = inserted.locate(lambda o: fmt.render(self.prompt_messages(o[0] if o else None), self.schemas, True),
                                   [obs] if isinstance(obs, str) else [])
        if want != text or at != spans:
            return "its prompt is not its recorded messages and observation as the run's chat template renders them"
        return None

    def glue(self, j: int, turns: list[dict], results: list[dict], last: int | None, text: str, spans: list) -> str | None:
        runner = self.runner
        eot_sampled = last is not None and last in runner.stop_ids
        eot = runner.tok.decode([last]) if eot_sampled else (runner.tok.eos_token or "")
        msgs = self.record["messages"]
        upto = msgs[:next(i for i, m in enumerate(msgs) if m is turns[j]) + 1 + len(results)]
        history = [self.render_message(m) for m in upto]
        want, at = runner.a.format.glue(self.prompt_messages(self.obs) + history, len(results), self.schemas, eot, eot_sampled)
        if want != text or at != spans:
            return (f"the glue after turn {j + 1} is not what the run's chat template writes there for its recorded messages "
                    "(the template's text, the tool results' spans as inserted)")
        return None


def _method_schemas(runner, record: dict) -> list[dict]:
    """The schemas of the row's environment's methods (its class's, as EpisodeRunner.start lists an instance's)."""
    import inspect
    import types

    from pipeline.agents import environment as envs
    from pipeline.agents.tools import tool_schema

    if not runner.a.env_classes:
        return []
    cls = runner.a.env_classes.get((record.get("environment") or {}).get("name"))
    if cls is None:
        return []
    out = []
    for name, f in inspect.getmembers(cls, predicate=inspect.isfunction):
        if name in envs.SKIPPED_METHODS or name.startswith("_"):
            continue
        bound = f if isinstance(inspect.getattr_static(cls, name), staticmethod) else types.MethodType(f, cls)
        out.append(tool_schema(bound, f"rollout.environment method {name!r}"))
    return out


def _unmarked(glue: str, spans: list[list[int]], contents: list[str]) -> str | None:
    """A tool result written in the glue (as it is, or escaped as JSON) that lies in no inserted span."""
    inside = [glue[s:e] for s, e in spans]
    for content in contents:
        # a text shorter than 3 characters holds no marker and may be any template's text as well ("42")
        forms = {f for f in (content, json.dumps(content, ensure_ascii=False)[1:-1], content.strip()) if len(f.strip()) >= 3}
        if any(f in glue for f in forms) and not any(f in part for f in forms for part in inside):
            return content
    return None


def check_episodes(a, rel: str, data: bytes) -> None:
    """Every episode row of one part (already read and hash-checked: `data`) into `a.audit`."""
    f = pq.ParquetFile(io.BytesIO(data))
    if not set(COLUMNS) <= set(f.schema_arrow.names):  # no episodes, or no ids kept (an eval part's: counted)
        if "episode" in f.schema_arrow.names:
            a.audit.eval_episodes += f.metadata.num_rows - f.read(columns=["episode"]).column("episode").null_count
        return
    names = list(COLUMNS) + [c for c in ENDPOINT_COLUMNS if c in f.schema_arrow.names]
    rows = f.read(columns=names).to_pylist()
    episodes = [(i, r) for i, r in enumerate(rows) if r["episode"] is not None]
    if not episodes:
        return
    if '"route": "endpoint"' in episodes[0][1]["episode"]:  # an endpoint agent's part: its record replayed (pipeline/agents/endpoint/audit.py)
        return check_endpoint_episodes(a, rel, episodes)
    tokens = a.episode_tokens()
    if tokens is None:
        a.audit.unchecked_episodes += len(episodes)
        return
    runner = _runner(a, rel)
    for i, r in episodes:
        try:
            found = row_problems(tokens, r, runner)
        except (KeyError, TypeError, ValueError) as err:
            found = [f"its episode record is malformed ({type(err).__name__}: {err})"]
        if found is None:
            a.audit.unchecked_episodes += 1
        elif found:
            a.audit.problem(rel, f"row {i}: {found[0]}")
            return  # the first row: what follows from it is the same edit


def _runner(a, rel: str):
    """The iteration's EpisodeRunner (its template, tool format and tools), or None where its rollout
    inputs cannot be rebuilt (its policy pruned): then the prompt and glue texts are the row's."""
    import re

    from pipeline.errors import GRPOError

    try:
        inputs, _ = a.endpoint_inputs(int(re.search(r"iter-(\d+)", rel).group(1)))
    except (GRPOError, OSError):
        return None
    return inputs.episodes


def check_endpoint_episodes(a, rel: str, episodes: list[tuple[int, dict]]) -> None:
    """An endpoint part's rows, each its record replayed through the endpoint's code; unchecked when
    the iteration's rollout inputs (its policy's tokenizer and template) cannot be rebuilt."""
    import re

    from pipeline.agents.endpoint.audit import row_problems as endpoint_problems
    from pipeline.errors import GRPOError

    k = int(re.search(r"iter-(\d+)", rel).group(1))
    try:
        inputs, seeded = a.endpoint_inputs(k)
    except (GRPOError, OSError):
        inputs = None
    if inputs is None or inputs.episodes is None:
        a.audit.unchecked_episodes += len(episodes)
        return
    for i, r in episodes:
        try:
            seed = inputs.group_seed(r["prompt_id"]) if seeded else None
            found = endpoint_problems(inputs.episodes, r, seed)
        except (KeyError, TypeError, ValueError, IndexError) as err:
            found = [f"its episode record is malformed ({type(err).__name__}: {err})"]
        if found:
            a.audit.problem(rel, f"row {i}: {found[0]}")
            return
