"""The README and docs/ say only what exists: every `grpo` command and option they show, every config
key they name, every relative link and repository path; and docs/config.md is what the config tree
generates now.

Commands and options are read from the Typer app itself, config keys from the pydantic tree
(`pipeline.config.doc.is_key`), so a renamed command, option or key fails here, naming the file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pipeline.config import doc as config_doc
from pipeline.config.rewards import BUILTIN_MODELS

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
# `grpo CMD` as a shell runs it: not `grpo[s3]`, not `grpo-iterate.yml`, not a word inside another
COMMAND = re.compile(r"(?<![\w./-])(?:grpo|stages\.cli)[ \t]+([a-z][\w-]*)([^\n;&|#)`]*)")
OPTION = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
# a dotted key that starts with a top-level section, not a file name (train.jsonl) nor an attribute (cfg.train.lr)
KEY = re.compile(r"(?<![\w./$-])((?:%s)(?:\.(?:[A-Za-z_]\w*|\d+|\*))+)" % "|".join(config_doc.SECTIONS))
FILE_EXT = {"py", "md", "yaml", "yml", "json", "jsonl", "parquet", "txt", "safetensors", "gguf", "db", "toml", "csv", "sh", "png"}
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"^((?:pipeline|stages|schemas|demo|examples|tests|bench|workflows|docs)/[\w./-]*)(?::\w+)?$")


def _split(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(the text with its fenced blocks blanked, [(language, block)]). Quoted output, a code span
    or line starting `error:`, is left out: it quotes what a user got wrong (`train.lrr: unknown key`)."""
    blocks = [(m.group(1).lower(), re.sub(r"(?m)^error:.*$", "", m.group(2))) for m in FENCE.finditer(text)]
    prose = SPAN.sub(lambda m: "" if m.group(1).startswith("error:") else m.group(0), FENCE.sub("", text))
    return prose, blocks


def _code(text: str) -> list[str]:
    """Everything a reader would type: inline code spans and fenced blocks other than YAML."""
    prose, blocks = _split(text)
    return SPAN.findall(prose) + [b for lang, b in blocks if lang not in ("yaml", "yml")]


def _app_options() -> dict[str, set[str]]:
    """Each `grpo` command with the options it takes, from the Typer app."""
    import typer

    from stages.cli import app

    group = typer.main.get_command(app)
    return {name: {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
            for name, cmd in group.commands.items()}


def bad_commands(text: str, commands: dict[str, set[str]]) -> list[str]:
    """`grpo CMD --opt` mentions whose command or option the app lacks."""
    bad = []
    for code in _code(text):
        for m in COMMAND.finditer(code):
            cmd, rest = m.group(1), m.group(2)
            if cmd not in commands:
                bad.append(f"grpo {cmd}: no such command")
                continue
            bad += [f"grpo {cmd} {opt}: no such option" for opt in OPTION.findall(rest) if opt not in commands[cmd]]
    return bad


def _yaml_paths(node, prefix: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield f"{prefix}{k}"
            yield from _yaml_paths(v, f"{prefix}{k}.")
    elif isinstance(node, list) and prefix == "rewards.":
        for i, entry in enumerate(node):
            yield from _yaml_paths(entry, f"{prefix}{i}.")


def _builtin_kwargs(tree: dict) -> list[str]:
    """A built-in reward's kwargs in a YAML block must be its options (a custom function's are free)."""
    bad = []
    for i, entry in enumerate(tree.get("rewards") or []):
        model = BUILTIN_MODELS.get(entry.get("fn")) if isinstance(entry, dict) else None
        if model is not None and isinstance(entry.get("kwargs"), dict):
            options = model.model_fields["kwargs"].annotation.model_fields
            bad += [f"rewards.{i}.kwargs.{k}" for k in entry["kwargs"] if k not in options]
    return bad


def bad_keys(text: str) -> list[str]:
    """Config keys named in `text` (dotted names in prose, code spans and shell blocks; every key of
    a YAML block that is a config fragment) that the config tree does not have."""
    prose, blocks = _split(text)
    # Python blocks are left out: `model.generate(...)` there is an attribute, not a config key
    found = KEY.findall(prose) + [k for lang, b in blocks if lang not in ("yaml", "yml", "python", "py") for k in KEY.findall(b)]
    bad = [k for k in found if k.rsplit(".", 1)[-1] not in FILE_EXT and not config_doc.is_key(k)]
    for lang, block in blocks:
        if lang not in ("yaml", "yml"):
            continue
        tree = yaml.safe_load(block)
        if not isinstance(tree, dict) or not set(tree) & set(config_doc.SECTIONS):
            continue  # not a config fragment (a workflow, a manifest)
        bad += [k for k in _yaml_paths(tree) if not config_doc.is_key(k)] + _builtin_kwargs(tree)
    return sorted(set(bad))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_complete_configs_validate(doc):
    """A YAML block with model, data and rewards is a whole config: it must pass the tree's validation."""
    from pipeline.config import resolve

    whole = [t for lang, b in _split(doc.read_text())[1] if lang in ("yaml", "yml")
             for t in [yaml.safe_load(b)] if isinstance(t, dict) and {"model", "data", "rewards"} <= set(t)]
    for tree in whole:
        resolve(tree, source=f"{doc.name} example")  # GRPOError names the key


def test_docs_exist():
    names = {p.name for p in DOCS}
    assert {"README.md", "config.md", "loss.md", "scale-out.md"} <= names


def test_readme_is_a_newcomers_page():
    """At most 250 lines, today's figures only (a figure is replaced when it is re-measured, not
    kept beside the new one), and every page of docs/ in its index."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md: over 250 lines; move the detail into docs/"
    history = re.findall(r"(?i)\b(?:(?:last|this|previous|next) round|round \d+|earlier (?:run|round)s?|"
                         r"the run before|two rounds ago|before this round)\b", text)
    assert not history, f"README.md: history of earlier runs: {history}"
    linked = {Path(t.split("#", 1)[0]).name for t in LINK.findall(text) if t.startswith("docs/")}
    unlinked = sorted(p.name for p in DOCS[1:] if p.name not in linked)
    assert not unlinked, f"README.md: docs/ pages missing from its index: {unlinked}"


def test_config_reference_is_current():
    """docs/config.md is generated; a key added or changed without regenerating it fails here."""
    current = (REPO / "docs" / "config.md").read_text()
    assert current == config_doc.render(), (
        f"docs/config.md is stale: regenerate it with `{config_doc.REGENERATE}` (or `make docs`)")


def test_config_reference_names_every_key():
    """Every field of the tree has its row, with its docstring (a field without one is a house-style slip)."""
    text = config_doc.render()
    for key in ("rollout.num_generations", "train.lora.target_modules", "advantages.kl_in_reward.horizon",
                "loss.kl_estimator", "rewards.N.kwargs.keyword", "rewards.N.timeout_s", "seed", "tracking.plots_every"):
        assert f"| `{key}` |" in text, key
    assert "| `rollout.num_generations` | integer | `8` | `>= 2`, `<= 1024` | G: completions" in text
    assert "| `train.lora.r` | integer | `16` | `>= 1`, `<= 1024` | Adapter rank. |" in text
    assert "| `rewards.N.kwargs.buffer` | integer | required | `>= 1` |" in text
    assert "| `loss.type` | `grpo` or `bnpo` or `dr_grpo` or `dapo` or `reinforce` | `grpo` |" in text
    empty = [line for line in text.splitlines() if line.startswith("| `") and line.rstrip().endswith("|  |")]
    assert not empty, f"fields without a docstring: {empty}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_commands_exist(doc):
    bad = bad_commands(doc.read_text(), _app_options())
    assert not bad, f"{doc.relative_to(REPO)}: {'; '.join(bad)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_config_keys_exist(doc):
    bad = bad_keys(doc.read_text())
    assert not bad, f"{doc.relative_to(REPO)}: not config keys: {', '.join(bad)}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"(?m)^#{1,6} (.+)$", _split(page.read_text())[0])
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def bad_links(text: str, base: Path) -> list[str]:
    """Relative links (and their #heading) and repository paths in code spans that do not exist;
    `base` is the directory the text's links are relative to."""
    missing = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        page = base / path if path else None
        if page is not None and not page.exists():
            missing.append(f"link {target}")
        elif anchor and page is not None and page.suffix == ".md" and anchor not in _anchors(page):
            missing.append(f"link {target} (no such heading)")
    for span in SPAN.findall(_split(text)[0]):
        m = REPO_PATH.match(span)
        if m and not (REPO / m.group(1)).exists():
            missing.append(f"path {m.group(1)}")
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_and_paths_exist(doc):
    text = doc.read_text()
    same_page = [f"link #{a} (no such heading)" for a in re.findall(r"\]\(#([^)\s]+)\)", text) if a not in _anchors(doc)]
    missing = bad_links(text, doc.parent) + same_page
    assert not missing, f"{doc.relative_to(REPO)}: {', '.join(missing)}"


def test_the_checks_catch_what_drifted():
    """The detectors are honest: a renamed key, command or option is reported, the real ones are not."""
    commands = _app_options()
    good = ("Set `train.lr` and `rollout.num_generations`, e.g. `grpo init runs/x --config c.yaml "
            "--set train.lr=1e-5 --set rewards.1.fn=format`, then `grpo iterate runs/x --more 2`; "
            "see `advantages.*`, `rewards.0.kwargs.keyword`, `data.train` in train.jsonl and "
            "examples/rewards.py, `cfg.train.lrr` (an attribute, not a key), "
            "`error: my.yaml: train.lrr: unknown key; did you mean 'lr'?` (quoted output).\n"
            "```bash\nCUDA_VISIBLE_DEVICES=0 grpo rollout $RUN --shard 0/2 && grpo score $RUN\n"
            "torchrun --standalone -m stages.cli update RUN\n```\n"
            "```yaml\ntrain:\n  lora: {r: 16, alpha: 32}\nrewards:\n  - {fn: contains, kwargs: {keyword: x}}\n"
            "  - {fn: my.py:f, kwargs: {anything: 1}}\n```\n")
    assert bad_keys(good) == []
    assert bad_commands(good, commands) == []

    wrong = ("Set `train.lrr` and rollout.num_generation, `--set loss.kl_coeff=0.1`, `rewards.0.weigth`, "
             "`grpo iterate RUN --iterations 3`, `grpo sync RUN`, and `deepspeed --module stages.cli updat RUN`.\n"
             "```yaml\ntrain:\n  lora: {rank: 8}\nrewards:\n  - {fn: contains, kwargs: {keywrd: x}}\n```\n")
    assert bad_keys(wrong) == ["loss.kl_coeff", "rewards.0.kwargs.keywrd", "rewards.0.weigth",
                               "rollout.num_generation", "train.lora.rank", "train.lrr"]
    assert bad_commands(wrong, commands) == ["grpo iterate --iterations: no such option",
                                             "grpo sync: no such command", "grpo updat: no such command"]

    links = ("[a](docs/loss.md#the-loss-loss-update-stage), [b](https://example.org/x), `pipeline/objective/loss.py`, "
             "`examples/rewards.py:check_answer`; [c](docs/nope.md), [d](docs/loss.md#no-such-heading), `pipeline/nothing.py`")
    assert bad_links(links, REPO) == ["link docs/nope.md", "link docs/loss.md#no-such-heading (no such heading)",
                                      "path pipeline/nothing.py"]
