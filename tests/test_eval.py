"""Evaluation a researcher can publish (issue 45): pass@k, maj@k, intervals, several eval sets.

The estimators against hand-derived numbers (arithmetic in the comments), the intervals' coverage on
simulated draws (seeded), and the eval settings refused at config time."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import base_config

from pipeline.config import Config, canonical
from pipeline.eval.metrics import FIGURES_VERSION, figures, flat
from pipeline.eval.intervals import clopper_pearson, estimate, paired, wilson
from pipeline.eval.stats import majority, pass_at_k
from pipeline.errors import GRPOError


def cfg_of(**eval_) -> Config:
    return Config.model_validate({"model": "m", "data": {"train": "t.jsonl", "eval": eval_.pop("data", "e.jsonl")},
                                  "rewards": [{"fn": "correct"}, {"fn": "format", "weight": 0.5}], "eval": eval_})


def test_pass_at_k_matches_the_closed_form_on_hand_made_counts():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-12)
    # n=10, c=3, k=4: 1 - C(7,4)/C(10,4) = 1 - 35/210 = 5/6
    assert pass_at_k(10, 3, 4) == pytest.approx(5 / 6, abs=1e-12)
    # k=1 is the share correct: n=8, c=1 -> 1/8; no correct sample -> 0; n-c < k -> every k-subset holds one -> 1
    assert pass_at_k(8, 1, 1) == pytest.approx(0.125, abs=1e-12)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(5, 3, 3) == 1.0
    # n=1024, c=1, k=512: 1 - C(1023,512)/C(1024,512) = 1 - (1024-512)/1024 = 0.5 (the binomials overflow a float)
    assert pass_at_k(1024, 1, 512) == pytest.approx(0.5, abs=1e-9)
    for n in range(1, 13):  # the stable product against math.comb, everywhere it is defined
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_majority_votes_over_answers_compared_as_the_reward_compares_them():
    from pipeline.rewards.answers import answers_match

    # math-verify: "1/2" and "0.5" are one answer (2 votes), "3" twice: a tie goes to the answer seen first
    assert majority(["1/2", "0.5", "3", "3", None], answers_match) == 0
    assert majority(["7", "3", "3,000", "3000"], answers_match) == 2  # 3,000 == 3000 outvotes 3 and 7
    assert majority(["7", "3", "3"], answers_match) == 1
    # samples without an answer vote as one [invalid] answer (lm-eval's filter): 2 invalid votes beat 1 for "3"
    assert majority([None, "3", None], answers_match) == 0
    # 4 unanswered and a 2:2 tie: [invalid] wins (it abstained before, and the tie's first answer counted)
    assert majority(["5", None, "7", None, "5", None, "7", None], answers_match) == 1
    assert majority([], answers_match) is None
    exact = lambda a, b: a == b  # noqa: E731
    assert majority(["0.5", "1/2", "b", "b"], exact) == 2  # without math-verify they are two answers


def _coverage(draw, truth: float, trials: int, samples: int | None = None) -> float:
    rng = np.random.default_rng(45)
    held = 0
    for _ in range(trials):
        _, lo, hi = estimate(draw(rng), samples=samples)
        held += lo <= truth <= hi
    return held / trials


def test_wilson_interval_holds_the_true_rate_about_95_percent_of_the_time():
    # one greedy completion per prompt: 50 prompts, true accuracy 0.3 -> a share of prompts, Wilson's interval;
    # its exact coverage there is 0.957 (the binomial pmf summed over the x whose interval holds 0.3), and
    # 2000 simulated evals put the share within +-0.005 of it
    cov = _coverage(lambda rng: (rng.random(50) < 0.3).astype(float), 0.3, 2000)
    assert 0.935 <= cov <= 0.975, cov
    assert wilson(0, 10)[0] == 0.0 and 1 - 1e-12 <= wilson(10, 10)[1] <= 1.0  # never outside [0, 1]
    # 3 of 10: p=0.3, z=1.96: centre (0.3 + 0.19208)/1.38415 = 0.35557, half 1.96*sqrt(0.021+0.009604)/1.38415 = 0.24774
    assert wilson(3, 10) == pytest.approx((0.10779, 0.60322), abs=1e-4)


def test_fractional_rate_interval_holds_the_true_mean_about_95_percent_of_the_time():
    # mean@4: 4 samples of each of 80 prompts (320 samples), true rate 0.3 -> per-prompt values c/4: the
    # effective-n Wilson interval (every prompt at one rate: no design effect, about Wilson's on 320 samples);
    # tests/test_eval_intervals.py has the harder cases
    cov = _coverage(lambda rng: rng.binomial(4, 0.3, 80) / 4, 0.3, 400, samples=320)
    assert 0.92 <= cov <= 0.98, cov
    v = np.arange(20, dtype=float)
    # the paired difference of identical records is exactly 0; 20 ties do not prove two policies equal, so its
    # interval holds 0 and is not zero wide
    d, lo, hi = paired(v, v, span=(0.0, 19.0))
    assert d == 0.0 and lo < 0.0 < hi


def _record(rows: list[tuple], sets: list[str] | None = None) -> pa.Table:
    """rows: (prompt_id, sample_idx, completion, correct) with reward = correct."""
    cols = {"prompt_id": [r[0] for r in rows]}
    if sets:
        cols["eval_set"] = sets
    cols |= {"sample_idx": [r[1] for r in rows], "prompt": ["q"] * len(rows), "completion": [r[2] for r in rows],
             "completion_length": [len(r[2]) for r in rows], "reward": [float(r[3]) for r in rows],
             "correct": [bool(r[3]) for r in rows], "reward_correct": [float(r[3]) for r in rows],
             "reward_format": [0.5] * len(rows)}
    return pa.table(cols)


def A(x: str) -> str:
    return f"<think>.</think><answer>{x}</answer>"


def test_figures_of_a_hand_made_record():
    cfg = cfg_of(samples=4, greedy=False, pass_k=[1, 2, 4])
    # prompt 0: correct [1,1,0,0], answers 7,7,3,3 (a tie: 7 came first, correct)
    # prompt 1: correct [0,0,0,1], answers 5,5,5,9 (5 wins, wrong)
    rows = [(0, j, A(a), c) for j, (a, c) in enumerate(zip("7733", (1, 1, 0, 0)))] + \
           [(1, j, A(a), c) for j, (a, c) in enumerate(zip("5559", (0, 0, 0, 1)))]
    f = figures(cfg, _record(rows))
    assert f["accuracy"][0] == pytest.approx((0.5 + 0.25) / 2)  # mean@4 = 0.375
    assert f["pass_at_1"][0] == pytest.approx(0.375)  # pass@1 is mean@k
    # pass@2: prompt 0: 1 - C(2,2)/C(4,2) = 5/6; prompt 1: 1 - C(3,2)/C(4,2) = 1/2; mean 2/3
    assert f["pass_at_2"][0] == pytest.approx(2 / 3)
    # both prompts solved: a share of 2 prompts, Clopper-Pearson's interval: 2 of 2 has the lower end 0.025^(1/2)
    assert f["pass_at_4"] == pytest.approx((1.0, 0.025**0.5, 1.0))
    assert f["maj_at_4"] == pytest.approx((0.5, 1 - 0.975**0.5, 0.975**0.5))  # 1 of 2: P(X >= 1 | lo) = 0.025
    assert f["maj_at_1"][0] == pytest.approx(0.375)  # over the 1-subsets: each sample's own hit, pass@1
    # maj@2 over the 6 pairs: prompt 0 (7,7,3,3 / 1,1,0,0): a mixed pair ties, its first sample wins: only (2,3)
    # is wrong -> 5/6; prompt 1 (5,5,5,9 / 0,0,0,1): the 9 wins no pair (it comes last) -> 0; mean 5/12
    assert f["maj_at_2"][0] == pytest.approx(5 / 12)
    assert f["rewards/format"][0] == 0.5 and f["reward"][0] == pytest.approx(0.375)
    lo, hi = f["accuracy"][1:]
    assert lo <= 0.375 <= hi  # not a share of prompts: the bootstrap over prompts
    m = flat(f)
    assert m["eval/pass_at_2"] == f["pass_at_2"][0] and m["eval/maj_at_4_lo"] == f["maj_at_4"][1]


def test_figures_per_named_set_and_over_all():
    cfg = cfg_of(data={"easy": "a.jsonl", "hard": {"path": "b.jsonl"}})
    rows = [(0, 0, A("1"), 1), (1, 0, A("2"), 1), (0, 0, A("3"), 0)]
    f = figures(cfg, _record(rows, sets=["easy", "easy", "hard"]).drop_columns(["sample_idx"]))
    assert f["easy/accuracy"] == pytest.approx((1.0, 0.025**0.5, 1.0))  # Clopper-Pearson: 2 of 2
    assert f["hard/accuracy"] == pytest.approx((0.0, 0.0, 0.975))  # 0 of 1: the upper end 1 - 0.025
    assert f["accuracy"] == pytest.approx((2 / 3, *clopper_pearson(2, 3)))  # prompt 0 of each set is its own prompt
    assert "pass_at_1" not in f  # one sample: pass@1 would only repeat the accuracy


def test_greedy_one_set_figures_are_the_old_means():
    """An eval with none of the new keys: the same accuracy, reward and length as before (row means)."""
    rows = [(i, 0, A(str(i)), i % 3 == 0) for i in range(7)]
    t = _record(rows).drop_columns(["sample_idx"])
    f = figures(cfg_of(), t)
    assert f["accuracy"][0] == float(np.mean(t.column("correct").to_numpy(zero_copy_only=False)))
    assert f["mean_length"][0] == float(np.mean(t.column("completion_length").to_numpy()))
    assert set(f) == {"accuracy", "reward", "mean_length", "rewards/correct", "rewards/format"}


def test_eval_episode_figures():
    """Held-out episodes add how the policy uses its tools and how often it ends with an answer."""
    called = {"messages": [{"role": "assistant", "content": ""}, {"role": "tool", "name": "multiply", "content": "6"},
                           {"role": "assistant", "content": "6"}], "turns": 2, "ending": "answered", "model_tokens": 9, "context_tokens": 5}
    alone = {"messages": [{"role": "assistant", "content": "7"}], "turns": 1, "ending": "max_turns", "model_tokens": 2, "context_tokens": 0}
    t = _record([(i, 0, "x", 0) for i in range(4)]).drop_columns(["sample_idx"])
    t = t.append_column("episode", pa.array([json.dumps(e) for e in (called, alone, alone, alone)]))
    f = figures(cfg_of(), t)
    assert {n: f[n][0] for n in ("episodes/turns_mean", "tools/call_frequency", "tools/used", "episodes/ending/answered")} == \
        {"episodes/turns_mean": 1.25, "tools/call_frequency": 0.25, "tools/used": 0.25, "episodes/ending/answered": 0.25}
    assert f["tools/used"][1:] == pytest.approx(clopper_pearson(1, 4))  # a share of 4 episodes
    assert f["tools/used"][1] == pytest.approx(1 - 0.975**0.25)  # P(X >= 1 | n = 4, lo) = 1 - (1 - lo)^4 = 0.025


def test_tracking_doc_names_every_eval_figure():
    """Every name MLflow gets from an eval (k samples, two named sets, episodes) is in docs/tracking.md's
    Evaluation section: each figure, per set as eval/<set>/<figure>, each with _lo and _hi."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "tracking.md").read_text().split("## Evaluation", 1)[1]
    cfg = cfg_of(samples=2, greedy=False, pass_k=[1, 2], data={"easy": "a.jsonl", "hard": "b.jsonl"})
    t = _record([(i, j, A(str(j)), j) for i in range(2) for j in range(2)], sets=["easy", "easy", "hard", "hard"])
    episode = {"messages": [{"role": "assistant", "content": "7"}], "turns": 1, "ending": "answered",
               "model_tokens": 2, "context_tokens": 0}
    t = t.append_column("episode", pa.array([json.dumps(episode)] * 4))
    names = set(flat(figures(cfg, t)))
    assert {"eval/hard/pass_at_2_hi", "eval/easy/tools/used", "eval/maj_at_1_lo"} <= names  # what is generalised below
    for part in ("`eval/<figure>`", "`eval/<set>/<figure>`", "`<name>_lo`", "`<name>_hi`"):
        assert part in doc

    def generic(name: str) -> str:  # eval/hard/pass_at_2_hi -> pass_at_<k>, as the doc writes a figure
        name = re.sub(r"^eval/((easy|hard)/)?", "", re.sub(r"_(lo|hi)$", "", name))
        return re.sub(r"^rewards/.+", "rewards/<name>", re.sub(r"_at_\d+$", "_at_<k>", name))

    said = {g for g in map(generic, names) if f"`{g}`" in doc or g.startswith("episodes/ending/") and "`episodes/ending/*`" in doc}
    missing = sorted(set(map(generic, names)) - said)
    assert not missing, f"docs/tracking.md does not name {missing}"


@pytest.mark.parametrize("eval_, message", [
    ({"samples": 4}, "eval.samples 4: greedy decoding gives k copies of one completion; set eval.greedy: false"),
    ({"samples": 4, "greedy": False, "pass_k": [1, 8]}, "eval.pass_k 8: each k must be between 1 and eval.samples (4)"),
    ({"data": {"reward": "a.jsonl"}}, "data.eval.reward: an eval set's name is a metric path segment"),
    ({"data": {"a b": "a.jsonl"}}, "data.eval.a b: an eval set's name"),
    ({"data": {"hard": {"path": "b.jsonl", "reward": "judge"}}}, "data.eval.hard.reward 'judge': no reward named so"),
    ({"data": {}}, "data.eval: an empty mapping"),
])
def test_eval_settings_refused_at_init(eval_, message):
    from pipeline.config import resolve

    eval_ = dict(eval_)
    tree = {"model": "m", "data": {"train": "t.jsonl", "eval": eval_.pop("data", "e.jsonl")}, "rewards": [{"fn": "correct"}], "eval": eval_}
    with pytest.raises(GRPOError, match=message.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        resolve(tree)


def test_new_eval_keys_leave_old_config_hashes_alone():
    assert '"samples"' not in canonical(cfg_of()) and '"pass_k"' not in canonical(cfg_of())
    assert '"samples":4' in canonical(cfg_of(samples=4, greedy=False))


# -- the eval stage on the tiny model (hf engine): k samples, two sets, resume, --model, --compare -----------

class Counting:
    """The real engine, its generate calls counted (prompts, n) -- k samples are one call with n=k."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompt_ids, seeds, n, **kw):
        self.calls.append((len(prompt_ids), n, kw.get("temperature")))
        return self.engine.generate(prompt_ids, seeds, n, **kw)

    def close(self):
        self.engine.close()


SAMPLED = {"every": 1, "samples": 4, "greedy": False, "temperature": 0.7, "pass_k": [1, 2, 4], "max_prompts": 3,
           "prompts_per_part": 2}


@pytest.mark.slow
def test_sampled_eval_of_two_sets_resumes_without_repeating_a_part(assets, make_run, tmp_path):
    """k=4 samples per prompt in one engine call per part, two named sets (one with its own accuracy
    reward), killed after its first part: the second attempt samples only the three parts left, and
    the manifest's figures are those of the parts (pass@2 from the counts by the closed form)."""
    import os

    from conftest import grpo
    from pipeline.eval.run import eval_summary, run_eval
    from pipeline.rollout import policy_engine
    from pipeline.run.run import Run

    sets = {"gsm": assets["eval"], "fmt": {"path": assets["eval"], "reward": "format"}}
    path = make_run("sampled", data={"eval": sets}, rollout={"engine": "hf"}, eval=SAMPLED)
    died = grpo("eval", path, "--iter", "0", env={"GRPO_FAULT": "eval:part"}, check=False)
    assert died.returncode == -9
    ev = tmp_path / "sampled/iter-0000/eval"
    first = ev / "part-00000.parquet"
    assert first.exists() and not (ev / "MANIFEST.json").exists()
    written = first.stat().st_mtime_ns
    run = Run(path)
    engine = Counting(policy_engine(run, 0))
    m = run_eval(run, 0, engine)
    assert engine.calls == [(1, 4, 0.7), (2, 4, 0.7), (1, 4, 0.7)]  # parts 1-3 only: gsm [2], fmt [0, 1], fmt [2]
    assert first.stat().st_mtime_ns == written and sorted(m.outputs) == [f"part-0000{i}.parquet" for i in range(4)]
    rows = [r for p in sorted(ev.glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert [(r["eval_set"], r["prompt_id"], r["sample_idx"]) for r in rows] == \
        [(s, i, j) for s in ("gsm", "fmt") for i in range(3) for j in range(4)]
    for r in rows:  # each set's own accuracy reward
        assert r["correct"] == ((r["reward_correct"] if r["eval_set"] == "gsm" else r["reward_format"]) > 0)
    hits = {}
    for r in rows:
        hits.setdefault((r["eval_set"], r["prompt_id"]), []).append(r["correct"])
    want = np.mean([1 - math.comb(4 - sum(h), 2) / math.comb(4, 2) for (s, _), h in hits.items() if s == "gsm"])
    figs = m.metrics
    assert figs["gsm/pass_at_2"]["value"] == pytest.approx(want, abs=1e-12)
    assert figs["fmt/accuracy"]["value"] == pytest.approx(np.mean([r["correct"] for r in rows if r["eval_set"] == "fmt"]))
    for f in figs.values():
        assert f["lo"] <= f["value"] <= f["hi"]
    s = eval_summary(run, 0)
    assert s["eval/gsm/maj_at_4"] == figs["gsm/maj_at_4"]["value"] and s["eval/fmt/pass_at_4_hi"] == figs["fmt/pass_at_4"]["hi"]
    assert s["eval/accuracy"] == pytest.approx(np.mean([r["correct"] for r in rows]))  # over both sets' 6 prompts

    from pipeline.report.audit import audit_run

    assert audit_run(run).ok, audit_run(run).problems
    manifest = ev / "MANIFEST.json"  # a figure edited in the manifest: audit recomputes it from the parts
    body = json.loads(manifest.read_text())
    body["metrics"]["gsm/accuracy"]["value"] += 0.25
    manifest.write_text(json.dumps(body))
    problems = audit_run(Run(path)).problems
    assert len(problems) == 1 and "eval/MANIFEST.json: metrics.gsm/accuracy" in problems[0], problems
    # a record of figures_version 2 (the intervals before issue 64) still audits clean: its intervals came from
    # Wilson's and the samples' own range; its values, maj@k included, are still recomputed and checked
    body["metrics"]["gsm/accuracy"]["value"] -= 0.25
    assert body["figures_version"] == FIGURES_VERSION == 4  # 4: undeclared rewards spanned by the scored record
    body["figures_version"] = 2
    for f in body["metrics"].values():
        f["lo"], f["hi"] = f["lo"] / 2, (1 + f["hi"]) / 2
    manifest.write_text(json.dumps(body))
    assert audit_run(Run(path)).ok, audit_run(Run(path)).problems
    body["metrics"]["gsm/maj_at_4"]["value"] += 0.25  # (it may be 0: halving would change nothing)
    manifest.write_text(json.dumps(body))
    problems = audit_run(Run(path)).problems
    assert len(problems) == 1 and "metrics.gsm/maj_at_4" in problems[0], problems
    body["metrics"]["gsm/maj_at_4"]["value"] -= 0.25
    # a record written before figures_version (first-k maj@k, bootstrap intervals) still audits clean: its
    # intervals and maj@k come from the old definitions; the other values are still recomputed and checked
    assert body.pop("figures_version") == 2
    for name, f in body["metrics"].items():
        f["lo"], f["hi"] = f["lo"] / 2, (1 + f["hi"]) / 2
        if "/maj_at_" in name:
            f["value"] = f["value"] / 2
    manifest.write_text(json.dumps(body))
    assert audit_run(Run(path)).ok, audit_run(Run(path)).problems
    body["metrics"]["fmt/accuracy"]["value"] += 0.25
    manifest.write_text(json.dumps(body))
    problems = audit_run(Run(path)).problems
    assert len(problems) == 1 and "eval/MANIFEST.json: metrics.fmt/accuracy" in problems[0], problems

    # a part rewritten with a sample fewer and the manifest's hashes and rows to match: every part checks out,
    # but pass@4 of a prompt with 3 samples cannot be computed; audit says so instead of skipping the figures
    import hashlib

    last = ev / "part-00003.parquet"  # fmt prompt 2, its 4 samples
    pq.write_table(pq.read_table(last).slice(0, 3), last)
    data = last.read_bytes()
    body = json.loads(manifest.read_text())
    body["outputs"]["part-00003.parquet"].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), rows=3)
    body["rows"] -= 1
    manifest.write_text(json.dumps(body))
    problems = audit_run(Run(path)).problems
    assert problems == [f"iter-0000/eval/MANIFEST.json: metrics: cannot be recomputed from its parts "
                        f"(ValueError: eval.pass_k 4: prompt 2 has only 3 samples)"], problems


@pytest.mark.slow
def test_model_record_replay_and_compare(assets, make_run, tmp_path, capsys):
    """`grpo eval --model` writes the parts a run's own eval of that model as policy 0 writes;
    `--replay` re-scores an eval's completions with another accuracy reward; `--compare` pairs the run's
    and the record's prompts (B - A = 0); a sampled eval against a greedy one, or a record of other
    prompts, is refused."""
    from conftest import write_config
    from stages.cli import run_cli

    cfg = base_config(assets, rollout={"engine": "hf"}, eval={"every": 1, "max_prompts": 5})
    run = make_run("run", rollout={"engine": "hf"}, eval={"every": 1, "max_prompts": 5})
    assert run_cli(["eval", run, "--iter", "0"]) == 0
    assert run_cli(["status", run]) == 0  # the accuracy with its interval, on the row of the policy evaluated
    start = next(line for line in capsys.readouterr().out.splitlines() if "start" in line)
    assert re.search(r"\d\.\d{3} \[\d\.\d\d, \d\.\d\d\]", start), start
    conf = write_config(tmp_path / "c.yaml", cfg)
    assert run_cli(["eval", str(tmp_path / "base"), "--model", assets["model"], "--config", str(conf)]) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "[" in out
    part = "iter-0000/eval/part-00000.parquet"
    assert (tmp_path / "run" / part).read_bytes() == (tmp_path / "base" / part).read_bytes()

    # replayed with another accuracy reward: the same completions, never sampled again, `correct` anew
    assert run_cli(["eval", str(tmp_path / "rescored"), "--replay", run, "--set", "eval.reward=format"]) == 0
    src, new = (pq.read_table(tmp_path / d / part) for d in ("run", "rescored"))
    assert new.drop_columns(["correct"]).equals(src.drop_columns(["correct"]))
    assert new.column("correct").to_pylist() == [x > 0 for x in src.column("reward_format").to_pylist()]
    from pipeline.report.audit import audit_run
    from pipeline.run.run import Run

    assert audit_run(Run(str(tmp_path / "rescored"))).ok

    capsys.readouterr()
    # the run against the --model record of the same model and config: the same parts, B - A = 0 on every figure
    assert run_cli(["eval", "--compare", run, str(tmp_path / "base")]) == 0
    out = capsys.readouterr().out.splitlines()
    acc = next(line for line in out if line.startswith("accuracy "))
    a, b, diff = (float(x) for x in acc.split()[1:4])
    assert diff == 0.0 and a == b
    assert out[-1].startswith("accuracy: B - A = +0.000 ") and "over 5 prompts" in out[-1] and "not distinguishable" in out[-1]
    # a sampled eval of the same prompts: another sampling setting, refused in one line naming both records
    sampled = make_run("sampled", rollout={"engine": "hf"}, eval={"every": 1, "max_prompts": 5, "greedy": False})
    assert run_cli(["eval", sampled, "--iter", "0"]) == 0
    capsys.readouterr()
    assert run_cli(["eval", "--compare", run, sampled]) == 1
    assert f"--compare: {run} and {sampled} evaluated with different eval.greedy (True against False)" in capsys.readouterr().err
    other = make_run("other", rollout={"engine": "hf"}, eval={"every": 1, "max_prompts": 4})
    assert run_cli(["eval", other, "--iter", "0"]) == 0
    assert run_cli(["eval", "--compare", run, other]) == 1
    assert "--compare: the records hold different prompts (set eval, prompt 4 is in one only)" in capsys.readouterr().err


def test_compare_pairs_prompts_counts_wins_and_says_whether_it_is_noise():
    from types import SimpleNamespace

    from pipeline.eval.compare import compare, verdict

    cfg = cfg_of()
    side = lambda name: SimpleNamespace(cfg=cfg, store=SimpleNamespace(display=lambda: name))  # noqa: E731
    # 40 prompts, one greedy sample each: A solves the first 10, B the first 30 (B wins 20, A none)
    a = _record([(i, 0, A("1"), i < 10) for i in range(40)]).drop_columns(["sample_idx"])
    b = _record([(i, 0, A("1"), i < 30) for i in range(40)]).drop_columns(["sample_idx"])
    r = compare(side("A"), 0, a, side("B"), 0, b)
    f = r["figures"]["accuracy"]
    assert (f["a"], f["b"], f["diff"], f["a_wins"], f["b_wins"]) == (0.25, 0.75, 0.5, 0, 20)
    assert 0 < f["lo"] < 0.5 < f["hi"]  # the mean difference's interval on [-1, 1], leaving out 0 as the test does
    # 20 won, none lost: the sign-flip test's exact p is 2 / 2^20; drawn (20 > 16 differing prompts), at most a
    # few of 20000 draws reach it: p <= (1 + 5) / 20001
    assert f["p"] <= 6 / 20001
    assert verdict(r) == (f"accuracy: B - A = +0.500 [{f['lo']:+.3f}, {f['hi']:+.3f}] over 40 prompts: "
                          f"distinguishable from noise, B is better (sign-flip test p = {f['p']:.3g})")
    # one prompt apart: +0.025, an interval that holds 0
    c = _record([(i, 0, A("1"), i < 11) for i in range(40)]).drop_columns(["sample_idx"])
    assert verdict(compare(side("A"), 0, a, side("C"), 0, c)).endswith("not distinguishable from noise (sign-flip test p = 1)")
    with pytest.raises(GRPOError, match="different prompts"):
        compare(side("A"), 0, a, side("D"), 0, a.slice(0, 39))


def test_compare_four_wins_and_no_loss_of_thirty_is_not_distinguishable():
    """4 of 30 prompts won, none lost: the exact sign test's p = 2 / 2^4 = 0.125 -- not distinguishable
    (issue 54), and the interval beside it holds 0 (a percentile bootstrap's was [+0.033, +0.267])."""
    from types import SimpleNamespace

    from pipeline.eval.compare import compare, verdict

    side = lambda name: SimpleNamespace(cfg=cfg_of(), store=SimpleNamespace(display=lambda: name))  # noqa: E731
    a = _record([(i, 0, A("1"), 0) for i in range(30)]).drop_columns(["sample_idx"])
    b = _record([(i, 0, A("1"), i < 4) for i in range(30)]).drop_columns(["sample_idx"])
    r = compare(side("A"), 0, a, side("B"), 0, b)
    f = r["figures"]["accuracy"]
    assert (f["a_wins"], f["b_wins"], f["p"]) == (0, 4, pytest.approx(0.125, abs=1e-12))
    assert f["lo"] <= 0 < f["hi"]  # the interval and the verdict agree
    assert verdict(r).endswith("not distinguishable from noise (sign-flip test p = 0.125)")


@pytest.mark.parametrize("b_eval, setting", [
    ({"samples": 4, "greedy": False}, "eval.greedy (True against False)"),
    ({"samples": 4, "greedy": False, "temperature": 0.6}, "eval.temperature (1.0 against 0.6)"),
    ({"samples": 2, "greedy": False}, "eval.samples (4 against 2)"),
])
def test_compare_refuses_records_sampled_differently(b_eval, setting):
    from types import SimpleNamespace

    from pipeline.eval.compare import compare

    side = lambda name, cfg: SimpleNamespace(cfg=cfg, store=SimpleNamespace(display=lambda: name))  # noqa: E731
    t = _record([(i, 0, A("1"), i % 2) for i in range(6)]).drop_columns(["sample_idx"])
    a_cfg = cfg_of() if "greedy" in setting else cfg_of(samples=4, greedy=False)
    with pytest.raises(GRPOError) as err:
        compare(side("runs/a", a_cfg), 0, t, side("runs/b", cfg_of(**b_eval)), 0, t)
    assert str(err.value) == f"--compare: runs/a and runs/b evaluated with different {setting}; compare evals sampled alike"
