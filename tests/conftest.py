"""Shared fixtures: one tiny model and demo data set built once per session, and runs on them.

Everything is real: the model is a Qwen2 built and briefly trained here, loaded through the
Hugging Face code; vLLM, DeepSpeed, MLflow and Parquet run as they do for users.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest-xdist workers, a module to a worker: each worker and every process
    # it starts computes on one thread, and vLLM leaves the threads' placement to the OS, so the two
    # share the two cores (the tiny models' kernels gain little from a second thread). A test's two
    # sides always run under the same setting; bench/ measures speed, the tests never do.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# the trainer has DeepSpeed skip its JIT-built shm comm op; should any other op be built, each
# venv keeps its own cache (one shared between venvs rebuilds back and forth, 100-200 s each)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # bench/ (not an installed package) describes the machine
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Keep the user's ~/.cache/grpo and MLflow settings out of the tests."""
    os.environ["GRPO_CACHE_DIR"] = str(tmp_path_factory.mktemp("grpo-cache"))
    os.environ.pop("MLFLOW_TRACKING_URI", None)


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict:
    """Demo data (small) and a tiny warm-started model, built once for the whole session."""
    from demo.task import SYSTEM_PROMPT, write_demo_data
    from demo.tinymodel import make_model

    root = tmp_path_factory.mktemp("assets")
    train, eval_ = write_demo_data(root / "data", n_train=400, n_eval=24, seed=0)
    make_model(root / "model", size="tiny", seed=0, data_dir=root / "data", sft_steps=40)
    return {"root": root, "train": str(train), "eval": str(eval_), "model": str(root / "model"), "system_prompt": SYSTEM_PROMPT}


def base_config(assets: dict, **sections) -> dict:
    """A small run config on the session's tiny model; `sections` override top-level keys."""
    cfg = {
        "model": assets["model"],
        "data": {"train": assets["train"], "eval": assets["eval"], "system_prompt": assets["system_prompt"]},
        "rollout": {"num_generations": 4, "prompts_per_iter": 4, "groups_per_part": 2, "max_new_tokens": 24},
        "rewards": [{"fn": "correct"}, {"fn": "format", "weight": 0.5}],
        # fp32 pinned: the tests compare arithmetic across paths and process counts at 1e-5, and
        # `auto` is bf16 on CPUs with AVX512-bf16 or AMX, whose rounding is larger than that (on
        # such a CPU, 7 comparisons failed with auto); bf16 itself is tested in test_perf.py
        "train": {"mini_batch_size": 8, "lr": 1e-4, "precision": "fp32"},
        "eval": {"every": 0, "max_prompts": 8},
        "tracking": {"mlflow": False},
        "seed": 0,
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def grpo(*args: str, cwd: Path | None = None, check: bool = True, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real `grpo` command line in a separate process, on this checkout's code: with another
    `cwd` (a test's examples folder) `python -m stages.cli` would otherwise import the editable
    install's checkout, not this one."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "stages.cli", *args], cwd=cwd or REPO, capture_output=True, text=True, env=full_env, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"grpo {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def padded(values: list, T: int):
    """Per-row lists (logprobs of one column of a rollout/logprobs table) as a zero-padded [B, T] tensor."""
    import torch

    out = torch.zeros(len(values), T)
    for i, v in enumerate(values):
        out[i, : len(v)] = torch.tensor(v)
    return out


def init_error_line(capsys, run_dir: Path, *args) -> str:
    """The one error line of `grpo init RUN_DIR *args` run in process; asserts exit 1, one `error:`
    line, no traceback, and no run directory left behind."""
    from stages.cli import main

    argv = sys.argv
    sys.argv = ["grpo", "init", str(run_dir), *map(str, args)]
    try:
        with pytest.raises(SystemExit) as exit_:
            main()
    finally:
        sys.argv = argv
    err = capsys.readouterr().err
    assert exit_.value.code == 1, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not run_dir.exists()
    return lines[0][len("error: "):]


def short_answers_run(assets: dict, tmp_path: Path, iters: int, **train) -> tuple[Path, list[float]]:
    """The learning check: reward short completions only (<= 6 tokens: about a quarter of the
    warm-started model's samples, which mostly write their working in 9) and run `iters`
    iterations through the real CLI; returns the run and each iteration's mean reward."""
    import polars as pl

    cfg = base_config(
        assets,
        rollout={"num_generations": 8, "prompts_per_iter": 8, "groups_per_part": 8, "max_new_tokens": 24},
        rewards=[{"fn": "length_range", "kwargs": {"min_tokens": 1, "max_tokens": 6}}],
        train={"mini_batch_size": 16, "lr": 1e-3, **train},
    )
    run = tmp_path / "run"
    grpo("init", str(run), "--config", str(write_config(tmp_path / "cfg.yaml", cfg)))
    grpo("iterate", str(run), "--iters", str(iters))
    return run, [pl.read_parquet(run / f"iter-{k:04d}/score/*.parquet")["reward"].mean() for k in range(iters)]


def unlisted_end_of_turn(src: Path, dst: Path) -> Path:
    """A copy of model `src` whose files name only <|endoftext|> as eos (generation_config.json,
    config.json, the tokenizer), as Qwen2.5 base-style files do; its template still closes each
    assistant turn with <|im_end|>, which the model was trained to write."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    tok.eos_token = "<|endoftext|>"
    tok.save_pretrained(dst)
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    for name in ("generation_config.json", "config.json"):
        (dst / name).write_text(json.dumps({**json.loads((dst / name).read_text()), "eos_token_id": pad}))
    return dst


@pytest.fixture
def make_run(assets, tmp_path):
    """make_run(name, **sections) -> run path: `grpo init` on base_config with overrides (in-process)."""
    from pipeline import config as config_mod
    from pipeline.run.run import init_run

    def _make(name: str = "run", **sections) -> str:
        cfg = config_mod.resolve(base_config(assets, **sections))
        path = tmp_path / name
        init_run(str(path), cfg)
        return str(path)

    return _make


@pytest.fixture(scope="session")
def smollm2() -> dict:
    """SmolLM2-135M-Instruct: the GGUF file and its converted HF directory, from the per-machine
    model cache (fetched and converted once per machine, reused across test runs)."""
    from pipeline.run.gguf_import import converted, smollm2_gguf

    gguf = smollm2_gguf()
    folder, record = converted(gguf, "SmolLM2")
    return {"gguf": str(gguf), "dir": str(folder), "sha256": record["gguf_sha256"]}


def logprob_rows(run: Path, k: int) -> dict[tuple[int, int], dict]:
    """Iteration k's logprobs rows by (prompt_id, sample_idx): old_logprobs and the sampler gaps
    from the logprobs parts, or from the update's old_logprobs.parquet where the update took
    them from its own forward (train.old_logprobs); ref_logprobs from the logprobs parts."""
    import pyarrow.parquet as pq

    rows = {(r["prompt_id"], r["sample_idx"]): r
            for p in sorted((run / f"iter-{k:04d}/logprobs").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()}
    assert rows, f"no logprobs parts in {run} iteration {k}"
    if all(r["old_logprobs"] is None for r in rows.values()):
        for u in pq.read_table(run / f"iter-{k:04d}/update/old_logprobs.parquet").to_pylist():
            rows[(u["prompt_id"], u["sample_idx"])].update({c: u[c] for c in ("old_logprobs", "sampler_gap_mean", "sampler_gap_max")})
    return rows


HEAVY_FIRST = ("test_trl_examples", "test_staleness", "test_agents", "test_lora", "test_ray", "test_e2e", "test_resume",
               "test_environments", "test_judge", "test_tracking", "test_shards")
"""The modules with the longest real-engine runs (a serial run's profile), handed out first: with
a module to a worker, the longest ones go while the other worker works through the rest."""


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each module keeps its order


def pytest_terminal_summary(terminalreporter):
    """One line on the machine, so that a failure seen only on another machine (a CI runner)
    can be tied to its CPU: the reproducibility tests compare bits, which depend on it."""
    from bench.probes import machine_info  # the bench's description of the machine

    m = machine_info()
    workers = getattr(terminalreporter.config.option, "numprocesses", None)
    terminalreporter.write_line(f"machine: {m['cpu']}; {m['cores']} logical CPUs, {m['physical_cores']} cores per socket; "
                                f"{' '.join(m['isa']) or 'no avx2'}; MKL_CBWR={os.environ.get('MKL_CBWR')} "
                                f"OMP_NUM_THREADS={m['omp_num_threads']}"
                                f"{'; xdist workers: %s, one thread each' % workers if workers else ''}")
