"""Config: YAML + --set overrides, validated once, one-line errors naming the key; stable hash."""

import subprocess
import sys
from pathlib import Path

import pytest
import pydantic
import yaml

from pipeline import config as config_mod
from pipeline.errors import GRPOError
from pipeline.schedule import uses_ref

MINIMAL = {"model": "m", "data": {"train": "t.jsonl"}, "rewards": [{"fn": "correct"}]}


def write(tmp_path, tree) -> str:
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(tree))
    return str(p)


def test_defaults_fill_in_and_overrides_apply(tmp_path):
    cfg = config_mod.load(write(tmp_path, MINIMAL), ["rollout.num_generations=4", "train.lr=3e-4", "loss.type=dr_grpo"])
    assert cfg.rollout.num_generations == 4
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.loss.type == "dr_grpo"
    assert cfg.advantages.std == "sample" and cfg.loss.clip_eps_low == 0.2
    assert cfg.ref_model_path == "m" and not uses_ref(cfg)


def test_set_can_replace_a_list(tmp_path):
    cfg = config_mod.load(write(tmp_path, MINIMAL), ["rewards=[{fn: format, weight: 2}]"])
    assert [(r.fn, r.weight) for r in cfg.rewards] == [("format", 2.0)]


def test_set_reaches_into_a_list_by_index(tmp_path):
    tree = {**MINIMAL, "rewards": [{"fn": "correct"}, {"fn": "format"}]}
    cfg = config_mod.load(write(tmp_path, tree), ["rewards.1.fn=contains", "rewards.1.kwargs={keyword: x}", "rewards.0.weight=3"])
    assert [(r.fn, r.weight) for r in cfg.rewards] == [("correct", 3.0), ("contains", 1.0)]
    assert cfg.rewards[1].kwargs.keyword == "x"
    with pytest.raises(GRPOError, match=r"--set rewards.2.fn: rewards.2 is not an entry of the 2-entry list rewards"):
        config_mod.load(write(tmp_path, tree), ["rewards.2.fn=correct"])


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["rollout.nope=1"], "rollout.nope: unknown key"),
        (["train.lrr=1"], "train.lrr: unknown key; did you mean 'lr'?"),  # a typo names the close key
        (["rolout.max_new_tokens=1"], "rolout: unknown key; did you mean 'rollout'?"),
        (["rewards.0.wieght=2"], "rewards.0.wieght: unknown key; did you mean 'weight'?"),
        (["rollout.num_generations=1"], "rollout.num_generations"),
        (["train.lr=-1"], "train.lr"),
        (["loss.type=ppo"], "loss.type"),
        (["train.zero_stage=4"], "train.zero_stage"),
        (["train.mini_batch_size=10", "train.grad_accum=3"], "divisible by train.grad_accum"),
        (["bogus"], "--set 'bogus'"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(tmp_path, sets, needle):
    with pytest.raises(GRPOError) as err:
        config_mod.load(write(tmp_path, MINIMAL), sets)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg


def test_unknown_top_level_key_and_missing_required_key(tmp_path):
    with pytest.raises(GRPOError, match=r"cfg.yaml: modle: unknown key"):
        config_mod.load(write(tmp_path, {**MINIMAL, "modle": "x"}))
    tree = dict(MINIMAL)
    del tree["model"]
    with pytest.raises(GRPOError, match=r"model: required key is missing"):
        config_mod.load(write(tmp_path, tree))


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(GRPOError, match="config file not found"):
        config_mod.load(tmp_path / "nope.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("model: [unclosed\n")
    with pytest.raises(GRPOError, match="bad.yaml: not valid YAML"):
        config_mod.load(p)


def test_hash_is_canonical_and_sensitive(tmp_path):
    a = config_mod.load(write(tmp_path, MINIMAL))
    b = config_mod.from_yaml_text(config_mod.to_yaml(a), "roundtrip")
    assert config_mod.config_hash(a) == config_mod.config_hash(b)
    # writing a default explicitly does not change the settings, so not the hash either
    c = config_mod.load(write(tmp_path, {**MINIMAL, "seed": 0}))
    assert config_mod.config_hash(a) == config_mod.config_hash(c)
    d = config_mod.load(write(tmp_path, MINIMAL), ["seed=1"])
    assert config_mod.config_hash(a) != config_mod.config_hash(d)
    assert len(config_mod.config_hash(a)) == 64


@pytest.mark.parametrize("value", ["[1, 0]", "[0, 0]", "[0, .inf]", "[.nan, 1]", "[0]", "[0, 1, 2]", "x"])
def test_a_rewards_range_is_lo_below_hi_both_finite_or_one_line_naming_the_key(tmp_path, value):
    with pytest.raises(GRPOError) as err:
        config_mod.load(write(tmp_path, {**MINIMAL, "rewards": [{"fn": "correct"}, {"fn": "my_rewards.py:score"}]}),
                        [f"rewards.1.range={value}"])
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path / 'cfg.yaml'}: rewards.1.range") and "\n" not in msg, msg


def test_a_rewards_range_left_out_keeps_the_hash_and_one_declared_changes_it(tmp_path):
    """`range` was added after runs existed: an entry without it (None) hashes as an entry written before it
    did (tests/fixtures/old_run's hash is checked below too); a declared range is another run's settings."""
    import hashlib
    import json

    tree = {**MINIMAL, "rewards": [{"fn": "correct"}, {"fn": "my_rewards.py:score"}]}
    a = config_mod.load(write(tmp_path, tree))
    assert a.rewards[1].range is None
    dumped = a.model_dump(mode="json")
    for entry in dumped["rewards"]:
        del entry["range"]  # as a config.yaml written before the option
    b = config_mod.resolve(dumped)
    assert config_mod.config_hash(a) == config_mod.config_hash(b)
    assert '"range"' not in config_mod.canonical(a)
    declared = config_mod.load(write(tmp_path, tree), ["rewards.1.range=[-1, 1]"])
    assert declared.rewards[1].range == (-1.0, 1.0)
    assert config_mod.config_hash(declared) != config_mod.config_hash(a)
    back = config_mod.from_yaml_text(config_mod.to_yaml(declared), "roundtrip")  # config.yaml keeps it
    assert back.rewards[1].range == (-1.0, 1.0) and config_mod.config_hash(back) == config_mod.config_hash(declared)
    assert hashlib.sha256(config_mod.canonical(a).encode()).hexdigest() == config_mod.config_hash(a)
    assert json.loads(config_mod.canonical(declared))["rewards"][1]["range"] == [-1.0, 1.0]


def test_every_field_has_a_docstring():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
                walk(ann)

    walk(config_mod.Config)


def test_cli_help_is_instant_and_lists_every_command():
    """`grpo --help` must not import torch/vLLM/DeepSpeed/MLflow."""
    code = (
        "import sys; from typer.testing import CliRunner; from stages.cli import app;"
        "r = CliRunner().invoke(app, ['--help']); print(r.output);"
        "heavy = [m for m in ('torch', 'vllm', 'deepspeed', 'mlflow', 'transformers', 'polars') if m in sys.modules];"
        "print('HEAVY', heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
    for cmd in ("init", "rollout", "score", "logprobs", "update", "iterate", "status", "eval", "make-model", "make-data", "demo"):
        assert cmd in out, cmd


def test_an_option_added_later_keeps_the_hash_of_runs_made_before_it(tmp_path):
    """A run made before `train.gradient_checkpointing` existed has no such key in its config.yaml;
    at its earlier behaviour (off) the option stays out of the hash, so the run's manifests still
    match its config. Turned on, it changes the hash."""
    import hashlib
    import json

    # a config at every added option's earlier behaviour (loss.rollout_correction's new default is not)
    earlier = yaml.safe_load(yaml.safe_dump(MINIMAL))
    for (*path, key), neutral in config_mod.ADDED_OPTIONS.items():
        section = earlier
        for part in path:
            section = section.setdefault(part, {}) if section is not None else None
        if section is not None:  # an option inside a section that is null at its neutral value (rollout.agent.verifiers)
            section[key] = neutral
    a = config_mod.resolve(earlier)
    tree = a.model_dump(mode="json")
    for (*path, key) in config_mod.ADDED_OPTIONS:
        section = tree
        for part in path:
            section = section.get(part) if section is not None else None
        if section is None:  # inside a null section (or one deleted above as added later itself)
            continue
        assert key in section  # the option exists, filled in with its default
        del section[key]  # as a config written before it
    for entry in tree["rewards"]:
        for key in config_mod.ADDED_REWARD_OPTIONS:
            del entry[key]  # a rewards entry's options added later, likewise
    before = hashlib.sha256(json.dumps(tree, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert config_mod.config_hash(a, legacy=True) == before  # the form the record-only options were hashed in then
    on = config_mod.load(write(tmp_path, MINIMAL), ["train.gradient_checkpointing=true"])
    assert on.train.gradient_checkpointing and config_mod.config_hash(on, legacy=True) != before


def test_a_run_made_before_the_newest_options_reads_to_the_hash_its_manifests_carry():
    """tests/fixtures/old_run/config.yaml was stored by `grpo init` at cf72eda, before
    `train.state_every`: read today (`from_yaml_text`, as a run reads its config), it must hash to
    what its manifests were written with, or `grpo audit` calls the run's config.yaml edited. An
    option added without its earlier behaviour in ADDED_OPTIONS fails here."""
    text = (Path(__file__).parent / "fixtures/old_run/config.yaml").read_text()
    cfg = config_mod.from_yaml_text(text, "old_run/config.yaml")
    assert cfg.train.state_every == 1  # what that run did: a trainer state after every update
    # the form its manifests hold (train.keep_states and keep_policies hashed): such a run keeps it (Run.legacy_hash)
    assert config_mod.config_hash(cfg, legacy=True) == "3d7e99433444ea4467a3bf9524490aa7dbed686c4ade62e774fe2e771210c481"


def test_options_that_change_only_what_the_record_keeps_are_out_of_the_config_hash(tmp_path):
    """train.state_every (how often the trainer state is written), keep_states and keep_policies (what
    stays on disk) change no byte a run computes: any value, one hash. An option that does changes it."""
    base = config_mod.load(write(tmp_path, MINIMAL))
    kept = config_mod.load(write(tmp_path, MINIMAL), ["train.state_every=3", "train.keep_states=4", "train.keep_policies.last=2"])
    assert (kept.train.state_every, kept.train.keep_states, kept.train.keep_policies.last) == (3, 4, 2)
    assert config_mod.config_hash(kept) == config_mod.config_hash(base)
    assert config_mod.config_hash(kept, legacy=True) != config_mod.config_hash(base, legacy=True)  # as runs before hashed them
    assert config_mod.config_hash(config_mod.load(write(tmp_path, MINIMAL), ["train.lr=0.5"])) != config_mod.config_hash(base)


def test_grpo_init_again_with_another_state_every_keeps_the_run_and_records_the_new_value(assets, tmp_path):
    """The same run (one config hash) keeping another record from now on: `grpo init` again with another
    train.state_every is accepted, not refused as a different config, and the run's config.yaml says it."""
    from conftest import base_config
    from pipeline.run.run import Run, init_run

    first = init_run(str(tmp_path / "run"), config_mod.resolve(base_config(assets, train={"state_every": 10})))
    again = init_run(str(tmp_path / "run"), config_mod.resolve(base_config(assets, train={"state_every": 2, "keep_states": 3})))
    assert again.cfg_hash == first.cfg_hash and not again.legacy_hash
    stored = Run(str(tmp_path / "run")).cfg
    assert (stored.train.state_every, stored.train.keep_states) == (2, 3)
    with pytest.raises(GRPOError, match="a run with a different config already exists"):
        init_run(str(tmp_path / "run"), config_mod.resolve(base_config(assets, train={"lr": 0.5})))
    assert Run(str(tmp_path / "run")).cfg.train.lr != 0.5


@pytest.mark.slow
def test_a_run_whose_manifests_hashed_state_every_keeps_that_hash_and_audits_clean(assets, tmp_path, monkeypatch):
    """A run written before train.state_every left the hash (made here with that hash, as the code then
    made it: one iteration, its manifests carrying it) reads to the hash its manifests carry, audits clean,
    and stays one hash: changing state_every is still another config there."""
    from conftest import base_config
    from pipeline.config import tree
    from pipeline.loop.iterate import iterate
    from pipeline.report.audit import audit_run
    from pipeline.run.run import Run, init_run

    cfg = config_mod.resolve(base_config(assets, rollout={"engine": "hf"}, train={"state_every": 10}))
    path = str(tmp_path / "old")
    with monkeypatch.context() as m:
        m.setattr(config_mod, "config_hash", lambda c, legacy=False: tree.config_hash(c, legacy=True))  # the code before
        iterate(init_run(path, cfg), 1)
    run = Run(path)
    assert run.legacy_hash and run.cfg_hash == tree.config_hash(cfg, legacy=True) != tree.config_hash(cfg)
    assert run.manifest(0, "update").config_hash == run.cfg_hash
    report = audit_run(run)
    assert report.problems == [], report.problems
    with pytest.raises(GRPOError, match="a run with a different config already exists"):
        init_run(path, config_mod.resolve(base_config(assets, rollout={"engine": "hf"}, train={"state_every": 2})))
    assert Run(path).cfg.train.state_every == 10


def test_a_ray_run_with_staleness_is_refused_when_the_config_is_read(tmp_path):
    """The Ray executor runs on-policy iterations: the combination is one line at `grpo init`, not an
    error once `grpo iterate` has started."""
    tree = {**MINIMAL, "cluster": {"executor": "ray"}}
    with pytest.raises(GRPOError, match="cluster.executor ray runs on-policy iterations; with train.max_staleness use the local executor"):
        config_mod.load(write(tmp_path, tree), ["train.max_staleness=1"])
    assert config_mod.load(write(tmp_path, tree)).cluster.executor == "ray"
