"""Bad input: one-line errors naming the file, row, key or option, exit 1, nothing partial
written and nothing of the user's overwritten. The command line runs in-process here (the
real `stages.cli.main`); what fails is found before any engine starts."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import base_config, write_config
from test_reproduce import copy_run, manifest, reference_run


@pytest.fixture
def cli(capsys, monkeypatch):
    """cli(*args) -> the error line `grpo *args` printed; asserts exit 1 and a single line."""

    def run(*args) -> str:
        from stages.cli import main

        monkeypatch.setattr(sys, "argv", ["grpo", *map(str, args)])
        with pytest.raises(SystemExit) as exit_:
            main()
        err = capsys.readouterr().err
        assert exit_.value.code == 1, err
        assert "Traceback" not in err
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1, err
        return lines[0][len("error: "):]

    return run


def nothing_in(stage_dir: Path) -> bool:
    """No manifest, no part, no temporary file: the stage left nothing behind."""
    return not stage_dir.exists() or not [p for p in stage_dir.iterdir() if not p.name.startswith(".lock")]


@pytest.fixture
def ref(assets, tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory, assets)


@pytest.fixture
def iter1_undone(ref, tmp_path) -> Path:
    """The reference run with iteration 1's rollout done and nothing after it."""
    run = copy_run(ref, tmp_path / "run")
    for rel in ("iter-0001/score", "iter-0001/logprobs", "iter-0001/update", "policy/iter-0002"):
        shutil.rmtree(run / rel)
    return run


# -- data ----------------------------------------------------------------------------------

def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_missing_dataset(make_run, cli, tmp_path):
    run = Path(make_run("run", data={"train": str(tmp_path / "missing.jsonl")}))
    assert cli("rollout", run) == f"{tmp_path / 'missing.jsonl'}: dataset file not found"
    assert not (run / "iter-0000").exists()


def test_empty_dataset(make_run, cli, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    run = Path(make_run("run", data={"train": str(tmp_path / "empty.jsonl")}))
    assert cli("rollout", run) == f"{tmp_path / 'empty.jsonl'}: dataset is empty"
    assert not (run / "iter-0000").exists()


def test_missing_prompt_column(make_run, cli, tmp_path):
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": f"{i} + 1", "answer": str(i + 1)} for i in range(8)])
    run = Path(make_run("run", data={"train": str(data)}))
    assert cli("rollout", run) == f"{data}: no prompt column 'prompt' (columns: question, answer); set data.prompt_column"
    assert not (run / "iter-0000").exists()


def test_prompt_longer_than_the_context(make_run, cli, tmp_path):
    data = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "1 + 2 = 3, " * 200, "answer": "3"}] * 4)
    run = Path(make_run("run", data={"train": str(data)}))
    # 512 positions (the tiny model's context) - 24 new tokens leave 488 for the prompt
    assert re.fullmatch(rf"{re.escape(str(data))} row \d: prompt has \d+ tokens, more than the 488 the model's context leaves for it", cli("rollout", run))
    assert not (run / "iter-0000").exists()


# -- models and configs --------------------------------------------------------------------

def test_tokenizer_without_chat_template(assets, make_run, cli, tmp_path):
    model = tmp_path / "no-template"
    shutil.copytree(assets["model"], model)
    (model / "chat_template.jinja").unlink()
    run = Path(make_run("run", model=str(model)))
    assert re.fullmatch(
        rf"{re.escape(assets['train'])} row \d+: the tokenizer has no chat template; set data.chat_template: false for plain text prompts",
        cli("rollout", run),
    )
    assert not (run / "iter-0000").exists()


def test_model_dir_missing_or_not_a_causal_lm(assets, cli, tmp_path):
    cfg = write_config(tmp_path / "missing.yaml", base_config(assets, model=str(tmp_path / "nope")))
    assert cli("init", tmp_path / "run", "--config", cfg) == f"model {tmp_path / 'nope'}: model directory not found"
    encoder = tmp_path / "encoder"
    shutil.copytree(assets["model"], encoder)
    conf = json.loads((encoder / "config.json").read_text())
    (encoder / "config.json").write_text(json.dumps({**conf, "architectures": ["Qwen2Model"]}))
    cfg = write_config(tmp_path / "encoder.yaml", base_config(assets, model=str(encoder)))
    assert cli("init", tmp_path / "run", "--config", cfg) == f"model {encoder}: not a causal LM (architectures ['Qwen2Model'])"
    assert not (tmp_path / "run").exists()


def test_config_unknown_key_or_invalid_value(assets, cli, tmp_path):
    cfg = write_config(tmp_path / "unknown.yaml", base_config(assets, rollout={"temprature": 0.7}))
    assert cli("init", tmp_path / "run", "--config", cfg) == f"{cfg}: rollout.temprature: unknown key; did you mean 'temperature'?"
    cfg = write_config(tmp_path / "invalid.yaml", base_config(assets, rollout={"num_generations": 1}))
    assert cli("init", tmp_path / "run", "--config", cfg) == f"{cfg}: rollout.num_generations: Input should be greater than or equal to 2"
    cfg = write_config(tmp_path / "good.yaml", base_config(assets))
    assert cli("init", tmp_path / "run", "--config", cfg, "--set", "train.lr=-1") == f"{cfg}: train.lr: Input should be greater than 0"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args, line",
    [
        (["nosuch"], "error: No such command 'nosuch' (see 'grpo --help')"),
        (["status", "r", "--bogus"], "error: No such option: --bogus (see 'grpo status --help')"),
        (["rollout", "r", "--iter", "-1"], "error: Invalid value for '--iter': Input should be greater than or equal to 0 (see 'grpo rollout --help')"),
    ],
)
def test_usage_errors_are_one_line_in_the_same_form(args, line, capsys, monkeypatch):
    """Typer's usage errors print as ours do: one `error: ...` line, no box, exit 2."""
    from stages.cli import main

    monkeypatch.setattr(sys, "argv", ["grpo", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_init_never_overwrites(assets, make_run, cli, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    cfg = write_config(tmp_path / "cfg.yaml", base_config(assets))
    assert cli("init", mine, "--config", cfg) == f"{mine}: directory exists and is not empty; choose a new run directory"
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    run = Path(make_run("run"))
    before = (run / "config.yaml").read_bytes()
    assert cli("init", run, "--config", cfg, "--set", "seed=7") == f"{run}/config.yaml: a run with a different config already exists; choose a new run directory"
    assert (run / "config.yaml").read_bytes() == before


# -- stored artifacts ----------------------------------------------------------------------

@pytest.mark.slow
def test_corrupt_parquet_part(iter1_undone, cli):
    part = iter1_undone / "iter-0001/rollout/part-00000.parquet"
    part.write_bytes(part.read_bytes()[:1000])
    assert cli("score", iter1_undone, "--iter", 1) == (
        f"{part}: sha256 differs from its manifest (changed or replaced since it was written; see `grpo audit`)"
    )
    assert nothing_in(iter1_undone / "iter-0001/score")


@pytest.mark.slow
def test_schema_version_mismatch(iter1_undone, cli, monkeypatch):
    """A run written by a grpo whose rollout schema was version 2, read by one at version 3 that no longer reads it."""
    import pipeline.score
    from schemas.artifacts import ROLLOUT

    monkeypatch.setattr(pipeline.score, "ROLLOUT", replace(ROLLOUT, version=3, reads=()))
    assert cli("score", iter1_undone, "--iter", 1) == (
        f"{iter1_undone}/iter-0001/rollout/part-00000.parquet: rollout schema version 2, this grpo reads version 3"
    )
    assert nothing_in(iter1_undone / "iter-0001/score")


@pytest.mark.slow
@pytest.mark.parametrize(
    "fn, message",
    [
        ("boom", "reward 'boom' (iteration 0): raised ValueError: no gold answer"),
        ("infinite", "reward 'infinite' (iteration 0) row 0: returned inf, expected a finite number or None"),
    ],
)
def test_reward_function_errors_and_infinite_rewards(ref, cli, tmp_path, fn, message):
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(
        "def boom(prompts, completions, **kwargs):\n"
        "    raise ValueError('no gold answer')\n\n"
        "def infinite(prompts, completions, **kwargs):\n"
        "    return [float('inf')] * len(completions)\n"
    )
    new = tmp_path / "rescored"
    assert cli("replay", ref, "--iter", 0, "--to", new, "--set", f"rewards=[{{fn: '{rewards}:{fn}'}}]", "--until", "score") == message
    assert nothing_in(new / "iter-0000/score")


@pytest.mark.slow
def test_nan_logprobs(iter1_undone, cli):
    """A policy whose weights went NaN (recorded consistently, as an update would have)."""
    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.run.run import policy_manifest
    from schemas.manifests import Lineage, dump_manifest

    policy = iter1_undone / "policy/iter-0001"
    weights = load_file(policy / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, policy / "model.safetensors", metadata={"format": "pt"})
    old = manifest(iter1_undone, "policy/iter-0001")
    body = policy_manifest(policy, 1, old["source"], Lineage(**old["lineage"]))
    (policy / "MANIFEST.json").write_bytes(dump_manifest(body))
    assert re.fullmatch(r"logprobs iteration 1 row 0 \(prompt_id \d+\): old_logprobs has NaN/inf", cli("logprobs", iter1_undone, "--iter", 1))
    assert nothing_in(iter1_undone / "iter-0001/logprobs")


# -- disk full -----------------------------------------------------------------------------

REAL_FSYNC = os.fsync


def no_space_for(monkeypatch, pattern: str) -> None:
    """fsync (where the store's writes reach the disk) fails with ENOSPC for files matching `pattern`."""

    def fsync(fd):
        if re.search(pattern, os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        REAL_FSYNC(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.slow
def test_disk_full_while_writing_parts_and_manifest(ref, iter1_undone, cli, monkeypatch):
    score = iter1_undone / "iter-0001/score"
    no_space_for(monkeypatch, r"part-\d+\.parquet$")
    assert cli("score", iter1_undone, "--iter", 1) == f"{score}/part-00000.parquet: write failed: No space left on device"
    assert nothing_in(score)

    no_space_for(monkeypatch, r"MANIFEST\.json$")
    assert cli("score", iter1_undone, "--iter", 1) == f"{score}/MANIFEST.json: write failed: No space left on device"
    assert sorted(p.name for p in score.iterdir() if not p.name.startswith(".lock")) == ["part-00000.parquet", "part-00001.parquet"]

    monkeypatch.setattr(os, "fsync", REAL_FSYNC)  # space again: the same command finishes from the parts written
    from pipeline.run.run import Run
    from pipeline.score import run_score

    run_score(Run(str(iter1_undone)), 1)
    assert manifest(iter1_undone, "iter-0001/score")["outputs"] == manifest(ref, "iter-0001/score")["outputs"]


def test_disk_full_while_copying_a_model_dir(assets, tmp_path, monkeypatch):
    from pipeline.errors import GRPOError
    from pipeline.store import RunStore

    def copytree(src, dst, **kwargs):
        os.makedirs(dst)
        shutil.copy(Path(src) / "config.json", dst)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copytree", copytree)
    store = RunStore(str(tmp_path / "run"))
    with pytest.raises(GRPOError) as err:
        store.put_dir(Path(assets["model"]), "policy/iter-0001")
    assert str(err.value) == f"{tmp_path}/run/policy/iter-0001: write failed: No space left on device"
    assert os.listdir(tmp_path / "run/policy") == []  # neither the target nor the temporary copy


# -- stage order ---------------------------------------------------------------------------

@pytest.mark.slow
def test_iterations_out_of_order(iter1_undone, cli):
    from pipeline.run.run import Run
    from pipeline.score import run_score

    run = iter1_undone
    assert cli("update", run, "--iter", 1) == f"update iteration 1: score of iteration 1 is not done (run `grpo score {run} --iter 1` first)"
    run_score(Run(str(run)), 1)
    assert cli("update", run, "--iter", 1) == f"update iteration 1: logprobs of iteration 1 is not done (run `grpo logprobs {run} --iter 1` first)"
    assert cli("logprobs", run, "--iter", 2) == f"logprobs iteration 2: rollout of iteration 2 is not done (run `grpo rollout {run} --iter 2` first)"
    assert cli("rollout", run, "--iter", 3) == f"{run}/policy/iter-0003: policy missing (run `grpo update` for iteration 2 first)"
    assert not (run / "policy/iter-0002").exists()
    assert not (run / "iter-0002").exists() and not (run / "iter-0003").exists()
