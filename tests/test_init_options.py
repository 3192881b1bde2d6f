"""`grpo init` from options, as TRL users start a run: the same settings given as options, as a
YAML file, or half and half make the same run (same config.yaml, same config hash), through the
real command line; each option sets its key; precedence defaults < file < options < --set; and
the mistakes particular to options are one `error:` line, exit 1, no run directory."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from conftest import REPO, grpo, init_error_line

import pydantic

from pipeline import config as config_mod
from pipeline.config.options import OPTIONS, from_command_line, reward_entry
from pipeline.preview import machine_precision

REWARDS_PY = "def accuracy(prompts, completions, answer, **kwargs):\n    return [float(answer in str(c)) for c in completions]\n"


@pytest.fixture
def files(tmp_path) -> Path:
    """A data set with a `question` column and a TRL-style reward function file, in tmp_path."""
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(8)]
    for name in ("train.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    return tmp_path


def settings(model: str, root: Path) -> dict:
    """Every option's setting, as a config tree (away from its default)."""
    return {
        "model": model,
        "data": {"train": str(root / "train.jsonl"), "eval": str(root / "eval.jsonl"), "prompt_column": "question"},
        "rollout": {"engine": "hf", "num_generations": 4, "prompts_per_iter": 6, "max_new_tokens": 48, "temperature": 0.7},
        "rewards": [{"fn": "my_rewards.py:accuracy"}, {"fn": "correct"}, {"fn": "format", "weight": 0.5}],
        "train": {"mini_batch_size": 8, "lr": 3e-5, "total_iters": 20, "lora": {"r": 8}},
        "loss": {"type": "dapo", "kl_coef": 0.02},
        "seed": 3,
    }


def as_options(model: str, root: Path) -> list[str]:
    """The same settings as `grpo init` options (values as a user types them)."""
    return [
        "--model", model, "--data", str(root / "train.jsonl"), "--eval-data", str(root / "eval.jsonl"),
        "--prompt-column", "question", "--engine", "hf", "--num-generations", "4", "--prompts-per-iter", "6",
        "--max-new-tokens", "48", "--temperature", "0.7",
        "--reward", "my_rewards.py:accuracy", "--reward", "correct", "--reward", "format=0.5",
        "--mini-batch-size", "8", "--lr", "3e-5", "--total-iters", "20", "--lora-rank", "8",
        "--loss-type", "dapo", "--kl-coef", "0.02", "--seed", "3",
    ]


def hash_line(out: str) -> str:
    return re.search(r"ready \(config ([0-9a-f]{12})\)", out).group(1)


def test_options_only_make_the_same_run_as_yaml_and_as_both(files, smollm2):
    """Three `grpo init`s of one run's settings: all YAML, all options, half and half."""
    model = smollm2["dir"]
    args = as_options(model, files)
    assert {a for a in args if a.startswith("--")} == set(OPTIONS)  # every option is exercised
    (files / "all.yaml").write_text(yaml.safe_dump(settings(model, files)))
    half = settings(model, files)
    del half["rollout"], half["train"]["lr"], half["train"]["lora"], half["rewards"]  # these come as options
    (files / "half.yaml").write_text(yaml.safe_dump(half))
    from_yaml = grpo("init", "yaml", "--config", "all.yaml", cwd=files)
    from_options = grpo("init", "options", *args, cwd=files)
    mixed = grpo("init", "mixed", "--config", "half.yaml", "--engine", "hf", "--num-generations", "4", "--prompts-per-iter", "6",
                 "--max-new-tokens", "48", "--temperature", "0.7", "--lr", "3e-5", "--lora-rank", "8",
                 "--reward", "my_rewards.py:accuracy", "--reward", "correct", "--reward", "format=0.5", cwd=files)
    text = (files / "yaml/config.yaml").read_text()
    assert (files / "options/config.yaml").read_text() == text == (files / "mixed/config.yaml").read_text()
    assert hash_line(from_yaml.stdout) == hash_line(from_options.stdout) == hash_line(mixed.stdout)
    cfg = config_mod.from_yaml_text(text, "config.yaml")
    from pipeline.store import canonical_hash
    from pipeline.store.code import code_hash
    from pipeline.run.run import Run

    code = Run(str(files / "options")).code  # my_rewards.py, copied into the run: its hash is in the run's
    assert list(code) == ["my_rewards.py"] and code == Run(str(files / "yaml")).code
    assert hash_line(from_options.stdout) == canonical_hash({"config": config_mod.config_hash(cfg), "code": code_hash(code)})[:12]
    assert text == config_mod.to_yaml(cfg)  # the resolved config, written as a --config run's is
    # the plan: 6 prompts x 4 = 24 completions; ceil(24 / 8) = 3 steps, x 20 iterations = 60; micro-batch 8 / 1 / 1
    dtype = "bfloat16" if machine_precision("auto") == "bf16" else "float32"
    for line in ("completions      24 per iteration = 6 prompts x 4 generations (at most 1,152 new tokens)",
                 "optimizer steps  3 per iteration = 1 epoch x ceil(24 / 8); 60 over train.total_iters 20",
                 "micro-batch      8 completions per rank = 8 / grad_accum 1 / 1 process",
                 f"precision        {machine_precision('auto')} (auto, on this machine); engine hf in {dtype}",
                 "reference pass   every iteration, on the base with the adapter off (loss.kl_coef 0.02)",
                 "training         LoRA r=8 alpha=32 on all-linear (policies K >= 1 are adapters)"):
        assert f"  {line}\n" in from_options.stdout, line


def test_init_from_options_imports_no_torch(files, smollm2):
    """Full fine-tuning: nothing at init needs torch (the plan reads the CPU's flags itself)."""
    probe = ("import atexit, sys\natexit.register(lambda: print('HEAVY', [m for m in ('torch', 'vllm', 'deepspeed', 'transformers') "
             "if m in sys.modules]))\nsys.argv = ['grpo'] + sys.argv[1:]\nfrom stages.cli import main\nmain()\n")
    out = subprocess.run([sys.executable, "-c", probe, "init", str(files / "run"), "--model", smollm2["dir"], "--data",
                          str(files / "train.jsonl"), "--prompt-column", "question", "--reward", "correct"],
                         cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout and "plan:" in out.stdout


# -- each option's key, precedence ---------------------------------------------------------

REQUIRED = {"--model": "m", "--data": "t.jsonl", "--reward": ["correct"]}

# (option, value as Typer passes it, the key it must set, the value read back); a golden table,
# written out here on purpose rather than read from OPTIONS
MAPPING = [
    ("--model", "my-model", "model", "my-model"),
    ("--data", "d.jsonl", "data.train", "d.jsonl"),
    ("--eval-data", "e.jsonl", "data.eval", "e.jsonl"),
    ("--prompt-column", "question", "data.prompt_column", "question"),
    ("--engine", "hf", "rollout.engine", "hf"),
    ("--num-generations", 5, "rollout.num_generations", 5),
    ("--prompts-per-iter", 3, "rollout.prompts_per_iter", 3),
    ("--max-new-tokens", 100, "rollout.max_new_tokens", 100),
    ("--temperature", 0.6, "rollout.temperature", 0.6),
    ("--mini-batch-size", 4, "train.mini_batch_size", 4),
    ("--lr", 2e-6, "train.lr", 2e-6),
    ("--total-iters", 9, "train.total_iters", 9),
    ("--lora-rank", 4, "train.lora.r", 4),
    ("--loss-type", "dr_grpo", "loss.type", "dr_grpo"),
    ("--kl-coef", 0.1, "loss.kl_coef", 0.1),
    ("--seed", 11, "seed", 11),
]


def read(cfg, dotted: str):
    for key in dotted.split("."):
        cfg = getattr(cfg, key)
    return cfg


@pytest.mark.parametrize("flag, value, key, expected", MAPPING, ids=[m[0] for m in MAPPING])
def test_each_option_sets_its_key(flag, value, key, expected):
    cfg = from_command_line(None, {**REQUIRED, flag: value})
    assert read(cfg, key) == expected
    default = from_command_line(None, REQUIRED)
    assert read(default, key) != expected if key != "train.lora.r" else default.train.lora is None
    changed = {k for k in ("model", "data", "rollout", "train", "loss", "seed") if getattr(cfg, k) != getattr(default, k)}
    assert changed == {key.split(".")[0]}  # nothing else moved


def test_the_mapping_table_covers_every_option():
    assert {m[0] for m in MAPPING} | {"--reward"} == set(OPTIONS)
    assert {m[0]: m[2] for m in MAPPING} == {f: k for f, k in OPTIONS.items() if f != "--reward"}


@pytest.mark.parametrize("text, entry", [
    ("correct", {"fn": "correct"}),
    ("format=0.5", {"fn": "format", "weight": 0.5}),
    ("my_rewards.py:accuracy=2", {"fn": "my_rewards.py:accuracy", "weight": 2.0}),
    ("pkg.mod:fn=-1e-1", {"fn": "pkg.mod:fn", "weight": -0.1}),
    ("dir/r.py:fn", {"fn": "dir/r.py:fn"}),
])
def test_reward_values(text, entry):
    assert reward_entry(text) == entry


def test_rewards_replace_the_files_list_in_order(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"model": "m", "data": {"train": "t.jsonl"},
                                                     "rewards": [{"fn": "correct"}, {"fn": "format"}]}))
    cfg = from_command_line(tmp_path / "c.yaml", {"--reward": ["format=0.25", "contains"]},
                            ["rewards.1.kwargs.keyword=hello", "rewards.0.name=fmt"])  # --set refines below --reward
    assert [(r.fn, r.weight, r.column) for r in cfg.rewards] == [("format", 0.25, "fmt"), ("contains", 1.0, "contains")]
    assert cfg.rewards[1].kwargs.keyword == "hello"


def test_precedence_defaults_file_options_set(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "model": "from-file", "data": {"train": "t.jsonl"}, "rewards": [{"fn": "correct"}],
        "rollout": {"num_generations": 4, "temperature": 0.9}, "train": {"lr": 1e-4, "lora": None},
    }))
    cfg = from_command_line(tmp_path / "c.yaml", {"--num-generations": 6, "--lora-rank": 2},
                            ["rollout.temperature=0.5", "train.lora.alpha=4"])
    assert cfg.model == "from-file" and cfg.train.lr == 1e-4  # file over defaults
    assert cfg.rollout.num_generations == 6  # option over file
    assert cfg.rollout.temperature == 0.5  # --set over file
    assert (cfg.train.lora.r, cfg.train.lora.alpha) == (2, 4.0)  # option fills the file's null section, --set refines it
    assert cfg.rollout.max_new_tokens == 64 and cfg.seed == 0  # defaults where nobody spoke


def test_help_states_the_configs_defaults_and_choices():
    """The defaults and choices the option help quotes are the config model's (no drift)."""
    from stages import options

    helps = {}
    for alias in vars(options).values():
        info = typing.get_args(alias)[1] if typing.get_origin(alias) is typing.Annotated else None
        if getattr(info, "rich_help_panel", None) == options._RUN:
            helps[(*info.param_decls, info.default)[0]] = info.help  # in Annotated, Typer reads the flag from `default`
    assert set(helps) == set(OPTIONS)
    fields = {}
    for flag, key in OPTIONS.items():
        model, *path, name = [config_mod.Config, *key.split(".")]
        for part in path:
            annotation = model.model_fields[part].annotation
            model = next(a for a in (annotation, *typing.get_args(annotation)) if isinstance(a, type) and issubclass(a, pydantic.BaseModel))
        fields[flag] = model.model_fields[name]
    checked = 0
    for flag, text in helps.items():
        assert text.startswith(OPTIONS[flag] + ":"), flag
        quoted = re.search(r"\(default ([^:)]+)", text)
        if quoted:
            default = fields[flag].default
            assert (float(quoted.group(1)) == default) if isinstance(default, (int, float)) else quoted.group(1) == default, flag
            checked += 1
        choices = typing.get_args(fields[flag].annotation)
        if choices and all(isinstance(c, str) for c in choices):
            assert re.findall(r"\b[a-z_]+\b", text.split(":", 1)[1].split("(")[0].replace(" or ", " ")) == list(choices), flag
            checked += 1
    assert checked == 14


# -- mistakes ------------------------------------------------------------------------------

@pytest.fixture
def init_error(files, capsys, monkeypatch):
    """init_error(*args) -> the one error line of `grpo init RUN *args` (asserts exit 1, no run dir)."""
    monkeypatch.chdir(files)

    def run(*args) -> str:
        return init_error_line(capsys, files / "run", *args)

    return run


def test_a_missing_piece_without_a_config(init_error):
    assert init_error("--data", "train.jsonl", "--reward", "correct") == "grpo init: missing --model (give it, or --config FILE)"
    assert init_error() == "grpo init: missing --model, --data, --reward (give them, or --config FILE)"
    assert init_error("--lr", "1e-4") == "grpo init: missing --model, --data, --reward (give them, or --config FILE)"


def test_an_option_and_a_set_of_the_same_key_conflict(init_error):
    base = ["--model", "m", "--data", "train.jsonl", "--reward", "correct"]
    assert init_error(*base, "--num-generations", "4", "--set", "rollout.num_generations=6") == (
        "--num-generations and --set rollout.num_generations both set rollout.num_generations; give one of them")
    assert init_error(*base, "--lora-rank", "8", "--set", "train.lora=null") == (
        "--lora-rank and --set train.lora both set train.lora.r; give one of them")
    assert init_error(*base, "--set", "rewards=[{fn: format}]") == "--reward and --set rewards both set rewards; give one of them"


def test_a_bad_value_names_the_option_it_came_from(init_error, files):
    base = ["--model", "m", "--data", "train.jsonl", "--prompt-column", "question"]
    assert init_error(*base, "--reward", "correct", "--num-generations", "1") == (
        "--num-generations 1: rollout.num_generations: Input should be greater than or equal to 2")
    assert init_error(*base, "--reward", "correct", "--engine", "tgi") == "--engine tgi: rollout.engine: Input should be 'vllm' or 'hf'"
    assert init_error(*base, "--reward", "correct", "--loss-type", "ppo").startswith("--loss-type ppo: loss.type: Input should be 'grpo', ")
    assert init_error(*base, "--reward", "format", "--reward", "corect").startswith(
        "--reward corect: rewards.1.fn: 'corect' is not a built-in reward (built-ins: correct, format,")
    assert init_error(*base, "--reward", "format=half") == "--reward format=half: expected NAME or NAME=WEIGHT with a number after '=', got 'half'"
    assert init_error(*base, "--reward", "contains") == "--reward contains: rewards.0.kwargs.keyword: required key is missing"
    assert init_error(*base, "--reward", "my_rewards.py:acuracy") == "rewards[0].fn 'my_rewards.py:acuracy': no function 'acuracy' in my_rewards.py"
    assert init_error("--model", "m", "--data", "missing.jsonl", "--reward", "correct") == "data.train: missing.jsonl: dataset file not found"


def test_an_option_that_conflicts_with_the_file(init_error, files):
    (files / "c.yaml").write_text(yaml.safe_dump({"model": "m", "ref_model": "r", "data": {"train": "train.jsonl"},
                                                  "rewards": [{"fn": "correct"}]}))
    assert init_error("--config", "c.yaml", "--lora-rank", "8") == (
        "c.yaml: train.lora: the reference is the base with the adapter off; leave ref_model unset")
    assert init_error("--config", "c.yaml", "--reward", "format", "--eval-data", "eval.jsonl") == (
        "c.yaml: eval.reward 'correct': no reward named so (rewards: format)")
