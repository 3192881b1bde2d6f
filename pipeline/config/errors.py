"""Turning what a user wrote into the config tree, and its mistakes into one line: `--set`
overrides (dotted keys, list indices) and validation errors as `source: dotted.key: message`,
with the close key for a typo and the options of a built-in reward.

A floor below `pipeline.config` and above `pipeline.config.rewards`: the root model whose keys a
typo is matched against comes in as an argument (`root`), so nothing here imports the tree's root.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.errors import GRPOError
from pipeline.config.rewards import BUILTIN_MODELS, TAGS, unknown_fn_message, validate_reward


def set_dotted(tree: dict, dotted: str, raw: str) -> None:
    """Apply `--set a.b.c=value`; the value is parsed as YAML (so 1e-5, true, [..] work)."""
    put_dotted(tree, dotted, yaml.safe_load(raw) if raw != "" else "", f"--set {dotted}")


def put_dotted(tree: dict, dotted: str, value, label: str) -> None:
    """Set `a.b.c` in a nested tree to `value`; a number indexes a list (`rewards.1.fn`). A
    section that is absent or null is created; `label` names what set it in an error."""
    keys = dotted.split(".")
    node: dict | list = tree
    for depth, key in enumerate(keys):
        here = ".".join(keys[: depth + 1])
        last = depth == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise GRPOError(f"{label}: {here} is not an entry of the {len(node)}-entry list {'.'.join(keys[:depth])}")
            if last:
                node[int(key)] = value
            else:
                node = node[int(key)]
            continue
        if not isinstance(node, dict):
            raise GRPOError(f"{label}: {'.'.join(keys[:depth])} is not a section")
        if last:
            node[key] = value
        else:
            if node.get(key) is None:  # `lora: null` in a file, refined by `train.lora.r=8`
                node[key] = {}
            node = node[key]


def read_tree(path: str | Path) -> dict:
    """A YAML config file as a plain tree, or a one-line error naming the file (and the line)."""
    path = Path(path)
    if not path.is_file():
        raise GRPOError(f"{path}: config file not found")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        line = getattr(getattr(err, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise GRPOError(f"{path}: not valid YAML{where}") from None
    if not isinstance(tree, dict):
        raise GRPOError(f"{path}: expected a mapping of config keys at the top level")
    return tree


def parse_overrides(sets: list[str] | None) -> list[tuple[str, str]]:
    out = []
    for item in sets or []:
        if "=" not in item:
            raise GRPOError(f"--set {item!r}: expected dotted.key=value")
        key, raw = item.split("=", 1)
        out.append((key.strip(), raw))
    return out


def format_error(err: ValidationError, source: str, root: type[BaseModel] | None, prefix: tuple = (),
                 sources: dict[str, str] | None = None) -> str:
    """The first validation error as one line: `source: dotted.key: message`. A misspelt key is
    matched against the fields of the section it sits in, found by walking `root` (the model that
    was validated; None: no walk) along the error's location. `sources` names where some keys came
    from (`rollout.num_generations` -> `--num-generations 1`): the longest one equal to the error's
    key or a section above it replaces `source`."""
    errors = err.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])  # a typo explains a "missing" too
    loc = list(prefix) + list(first["loc"])
    tag = None
    if len(loc) > 2 and loc[0] == "rewards" and loc[2] in TAGS:
        tag = loc.pop(2)  # the union's tag (the built-in's name) is not a key the user wrote
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
        if tag in BUILTIN_MODELS and loc[2:3] == ["kwargs"] and len(loc) == 4:
            options = list(BUILTIN_MODELS[tag].model_fields["kwargs"].annotation.model_fields)
            msg = f"{tag} has no option {loc[-1]!r} (options: {', '.join(options) or 'none'})"
        else:
            msg += _did_you_mean(loc, root, BUILTIN_MODELS.get(tag) if len(loc) == 3 else None)
    elif first["type"] == "missing":
        msg = "required key is missing"
    elif first["type"] == "union_tag_invalid":
        loc.append("fn")
        msg = unknown_fn_message(first["input"].get("fn") if isinstance(first["input"], dict) else first["input"])
    elif first["type"] == "union_tag_not_found":
        loc.append("fn")
        msg = "required key is missing (a built-in name, module:function or path/to/file.py:function)"
    elif first["type"] == "string_pattern_mismatch" and loc[-1:] == ["fn"]:
        msg = unknown_fn_message(first["input"])
    elif first["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")
    where = ".".join(str(p) for p in loc)
    given = [k for k in sources or {} if where == k or where.startswith(k + ".")]
    source = sources[max(given, key=len)] if given else source
    return f"{source}: {where}: {msg}" if where else f"{source}: {msg}"


def _did_you_mean(loc: list, root: type[BaseModel] | None, section: type[BaseModel] | None = None) -> str:
    """`; did you mean 'lr'?` for a misspelt key, from the fields of the section it sits in
    (found by walking the tree from `root`, or given: a reward entry's model)."""
    import difflib

    if section is None and root is not None:
        section = root
        for part in loc[:-1]:
            if isinstance(part, int) or section is None:
                continue
            field = section.model_fields.get(str(part))
            ann = getattr(field, "annotation", None)
            args = getattr(ann, "__args__", None) or ()
            section = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
    if section is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(section.model_fields), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def reward_spec(tree: dict | Any, index: int = 0) -> Any:
    """Validate one `rewards:` entry outside a whole config (tests, tools); GRPOError naming the key.
    No root to walk: from the config's root, a walk through `rewards` finds no section either (its
    items are an annotated union), so a reward entry's typos are named as in a whole config."""
    try:
        return validate_reward(tree)
    except ValidationError as err:
        raise GRPOError(format_error(err, "rewards", None, prefix=("rewards", index))) from None
