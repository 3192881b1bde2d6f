"""Exact state: an environment instance's attributes as JSON that decodes to equal values of the
same types, with the same bytes whatever the interpreter's hash seed.

The score stage runs in its own process (and `grpo replay` long after), so the instances reward
functions get are rebuilt from what the episode record holds: a `set` must come back a set, a tuple
a tuple, `{1: "x"}` with an int key, `np.int64(42)` a numpy integer. JSON holds None, bools, ints,
finite floats, strings, lists and objects with string keys; everything else is a tagged object
`{"$": tag, ...}` (a plain JSON object never has a "$" key):

    {"$": "float", "value": "nan" | "inf" | "-inf"}
    {"$": "tuple" | "list"?, "items": [...]}   tuple; set and frozenset (items in canonical order:
    {"$": "set" | "frozenset", "items": [...]}  sorted by their encoded JSON, not the hash seed)
    {"$": "dict", "items": [[key, value], ...]} a dict whose keys are not all strings in sorted
                                                 order (insertion order kept; records are written
                                                 with sorted keys, which would reorder a plain one)
    {"$": "bytes" | "bytearray", "base64": str}
    {"$": "numpy", "dtype": str, "value": v}     a numpy scalar (bool/int/uint/float: its value;
    {"$": "numpy", "dtype": str, "base64": str}  others: its bytes)
    {"$": "ndarray", "dtype": str, "shape": [...], "values": [...] | "base64": str}
    {"$": "ref", "name": "module:qualname"}      a class or function importable by its name
    {"$": "object", "class": "module:qualname", "state": ...}   an instance (dataclasses,
                                                 __slots__ classes, plain classes): the state its
                                                 __getstate__ returns, restored by its __setstate__
                                                 or as pickle does (__dict__ update, slot setattr)
    {"$": "reduce", "fn": ref, "args": [...], "state": ..., "list": [...], "dict": [...]}
                                                 anything pickle stores by __reduce_ex__
                                                 (Counter, deque, defaultdict, datetime, Decimal, enums)

What pickle could not store either (a lock, an open file, a sqlite connection, a generator, a
lambda, a class defined inside a function) stops the rollout with one line naming the attribute
(`Class.attribute`), its type and the way out: define `__getstate__`/`__setstate__` on the class.
"""

from __future__ import annotations

import base64
import copyreg
import importlib
import json
import math
import sys
import types
from typing import Any

from pipeline.errors import GRPOError

CODEC = 1
"""The encoding's version, stored beside the state in the episode record (absent: the old untagged attributes)."""

_NUMERIC = "biuf"  # numpy kinds stored as values (bool, int, uint, float): readable and exact


class Unstorable(Exception):
    def __init__(self, path: str, value: Any, why: str = ""):
        super().__init__(path)
        self.path, self.value, self.why = path, value, why


def _type_name(value: Any) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _ref_name(obj: Any, path: str) -> str:
    """module:qualname of a class or function that importing by that name gives back, else Unstorable."""
    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qual or "<" in qual:
        raise Unstorable(path, obj, "it cannot be imported by name (a lambda, or defined inside a function)")
    try:
        found = resolve(f"{module}:{qual}")
    except Exception:  # noqa: BLE001
        found = None
    if found is not obj:
        raise Unstorable(path, obj, f"{module}:{qual} does not import back to it")
    return f"{module}:{qual}"


def resolve(name: str) -> Any:
    module, _, qual = name.partition(":")
    obj = sys.modules.get(module) or importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _canonical(encoded: Any) -> tuple[str, str]:
    return (json.dumps(encoded, sort_keys=True, ensure_ascii=False, separators=(",", ":")),
            json.dumps(encoded, ensure_ascii=False, separators=(",", ":")))


def _numpy(value: Any, path: str) -> dict | None:
    np = sys.modules.get("numpy")
    if np is None or not isinstance(value, (np.generic, np.ndarray)):
        return None
    if type(value) is not np.ndarray and not isinstance(value, np.generic):
        return None  # a subclass (matrix, masked array): pickle's way keeps its type
    dt = value.dtype
    numeric = dt.kind in _NUMERIC and dt.itemsize <= 8  # longdouble has no exact Python value
    if dt.hasobject or dt.names is not None:
        raise Unstorable(path, value, f"numpy dtype {dt} (objects or fields)")
    if isinstance(value, np.generic):
        if numeric:
            return {"$": "numpy", "dtype": dt.str, "value": _encode(value.item(), path)}
        return {"$": "numpy", "dtype": dt.str, "base64": base64.b64encode(value.tobytes()).decode()}
    out = {"$": "ndarray", "dtype": dt.str, "shape": list(value.shape)}
    if numeric:
        out["values"] = [_encode(v, path) for v in value.ravel().tolist()]
    else:
        out["base64"] = base64.b64encode(np.ascontiguousarray(value).tobytes()).decode()
    return out


def _encode(value: Any, path: str, seen: tuple = ()) -> Any:
    t = type(value)
    if value is None or t in (bool, int, str):
        return value
    if t is float:
        return value if math.isfinite(value) else {"$": "float", "value": repr(value)}
    if id(value) in seen:
        raise Unstorable(path, value, "it contains itself (a reference cycle)")
    seen = (*seen, id(value))
    if t is list:
        return [_encode(v, f"{path}[{i}]", seen) for i, v in enumerate(value)]
    if t is tuple:
        return {"$": "tuple", "items": [_encode(v, f"{path}[{i}]", seen) for i, v in enumerate(value)]}
    if t in (set, frozenset):
        items = sorted((_encode(v, f"{path}{{...}}", seen) for v in value), key=_canonical)
        return {"$": t.__name__, "items": items}
    if t is dict:
        return _dict(value, path, seen)
    if t in (bytes, bytearray):
        return {"$": t.__name__, "base64": base64.b64encode(value).decode()}
    arr = _numpy(value, path)
    if arr is not None:
        return arr
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return {"$": "ref", "name": _ref_name(value, path)}
    reducer = copyreg.dispatch_table.get(t)
    try:
        rv = reducer(value) if reducer else value.__reduce_ex__(4)
    except Exception as err:  # noqa: BLE001  (what pickle says: "cannot pickle '_thread.lock' object")
        raise Unstorable(path, value, str(err).splitlines()[0] if str(err) else "") from None
    if isinstance(rv, str) or len(rv) < 2:
        raise Unstorable(path, value, "its __reduce__ names a global")
    fn, args, state, listitems, dictitems = (*rv, None, None, None)[:5]
    if fn is copyreg.__newobj__ and tuple(args) == (t,) and listitems is None and dictitems is None:
        return {"$": "object", "class": _ref_name(t, path), "state": object_state(state, path, seen)}
    out = {"$": "reduce", "fn": _encode(fn, path, seen), "args": [_encode(a, path, seen) for a in args],
           "state": _encode(state, path, seen)}
    if listitems is not None:
        out["list"] = [_encode(v, path, seen) for v in listitems]
    if dictitems is not None:
        out["dict"] = [[_encode(k, path, seen), _encode(v, path, seen)] for k, v in dictitems]
    return out


def _dict(value: dict, path: str, seen: tuple, attrs: bool = False) -> dict:
    """A plain JSON object when its keys are strings already in sorted order, else the items in order."""
    name = (lambda k: f"{path}.{k}") if attrs else (lambda k: f"{path}[{k!r}]")
    keys = list(value)
    if all(type(k) is str for k in keys) and "$" not in value and keys == sorted(keys):
        return {k: _encode(v, name(k), seen) for k, v in value.items()}
    return {"$": "dict", "items": [[_encode(k, name(k), seen), _encode(v, name(k), seen)] for k, v in value.items()]}


def object_state(state: Any, path: str, seen: tuple = ()) -> Any:
    """What an instance's __getstate__ returned (its __dict__; (__dict__ or None, slot values) with
    __slots__; or the class's own), its attributes named `path.attribute` in errors."""
    if type(state) is dict:
        return _dict(state, path, seen, attrs=True)
    if type(state) is tuple and len(state) == 2 and all(s is None or type(s) is dict for s in state):
        return {"$": "tuple", "items": [None if s is None else _dict(s, path, seen, attrs=True) for s in state]}
    return _encode(state, f"{path}.__getstate__()", seen)


def encode(value: Any, path: str, instance: bool = False) -> Any:
    """`value` as JSON-able data that `decode` turns back into an equal value of the same types.
    `path` names the value in the one-line error (e.g. `Wordle.board`). instance=True: `value` is
    the state an instance's __getstate__ returned (see object_state)."""
    try:
        return object_state(value, path) if instance else _encode(value, path)
    except Unstorable as err:
        why = f" ({err.why})" if err.why else ""
        owner = path.split(".")[0].split("[")[0]
        raise GRPOError(f"environment state {err.path}: a {_type_name(err.value)} cannot be stored exactly{why}, so reward "
                        f"functions could not get it back; define __getstate__/__setstate__ on {owner} to store what "
                        f"rebuilds it (or keep it out of the instance's attributes)") from None


def encode_result(value: Any, tool: str) -> Any:
    """A tool's list result (TRL keeps it a list in the tool message) in this encoding, for the episode
    record; one line naming the tool when an item cannot be stored exactly."""
    try:
        return _encode(value, f"{tool}()")
    except Unstorable as err:
        raise GRPOError(f"tool {tool!r} returned a list holding a {_type_name(err.value)} at {err.path}, which the episode "
                        "record cannot store exactly; return a string, or a list of plain values") from None


def decode(data: Any) -> Any:
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v) for v in data]
    tag = data.get("$")
    if tag is None:
        return {k: decode(v) for k, v in data.items()}
    if tag == "float":
        return float(data["value"])
    if tag in ("tuple", "set", "frozenset"):
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(v) for v in data["items"])
    if tag == "dict":
        return {decode(k): decode(v) for k, v in data["items"]}
    if tag in ("bytes", "bytearray"):
        raw = base64.b64decode(data["base64"])
        return raw if tag == "bytes" else bytearray(raw)
    if tag in ("numpy", "ndarray"):
        import numpy as np

        dt = np.dtype(data["dtype"])
        if tag == "numpy":
            return dt.type(decode(data["value"])) if "value" in data else np.frombuffer(base64.b64decode(data["base64"]), dt)[0]
        if "values" in data:
            return np.array([decode(v) for v in data["values"]], dtype=dt).reshape(data["shape"])
        return np.frombuffer(base64.b64decode(data["base64"]), dt).reshape(data["shape"]).copy()
    if tag == "ref":
        return resolve(data["name"])
    if tag == "object":
        cls = resolve(data["class"])
        return set_state(cls.__new__(cls), decode(data["state"]))
    if tag == "reduce":
        obj = decode(data["fn"])(*[decode(a) for a in data["args"]])
        if data["state"] is not None:
            set_state(obj, decode(data["state"]))
        for v in data.get("list", []):
            obj.append(decode(v))
        for k, v in data.get("dict", []):
            obj[decode(k)] = decode(v)
        return obj
    raise GRPOError(f"environment state: unknown tag {tag!r} (written by a newer grpo?)")


def set_state(obj: Any, state: Any) -> Any:
    """Restore `state` as pickle does: the class's __setstate__, else __dict__ update and slot values."""
    setstate = getattr(type(obj), "__setstate__", None)  # on the type: an instance __getattr__ is not asked
    if setstate is not None:
        setstate(obj, state)
        return obj
    slots = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slots = state
    if state:
        obj.__dict__.update(state)
    for name, value in (slots or {}).items():
        object.__setattr__(obj, name, value)  # frozen dataclasses too, as pickle does
    return obj


def describe(data: Any, width: int = 120) -> str:
    """The stored (encoded) form as Python would print the decoded value, without importing anything: for `grpo inspect`."""
    text = _show(data)
    return text if len(text) <= width else text[: width - 4] + " ..."


def _show(d: Any) -> str:
    if d is None or isinstance(d, (bool, int, float, str)):
        return repr(d)
    if isinstance(d, list):
        return "[" + ", ".join(_show(v) for v in d) + "]"
    tag = d.get("$")
    if tag is None:
        return "{" + ", ".join(f"{k!r}: {_show(v)}" for k, v in d.items()) + "}"
    if tag == "float":
        return f"float({d['value']!r})"
    if tag == "tuple":
        items = [_show(v) for v in d["items"]]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if tag in ("set", "frozenset"):
        body = "{" + ", ".join(_show(v) for v in d["items"]) + "}"
        return (body if d["items"] else "set()") if tag == "set" else f"frozenset({body if d['items'] else ''})"
    if tag == "dict":
        return "{" + ", ".join(f"{_show(k)}: {_show(v)}" for k, v in d["items"]) + "}"
    if tag in ("bytes", "bytearray"):
        raw = base64.b64decode(d["base64"])
        return repr(raw) if tag == "bytes" else f"bytearray({raw!r})"
    if tag == "numpy":
        return f"np.{_dtype_name(d['dtype'])}({_show(d['value']) if 'value' in d else '...'})"
    if tag == "ndarray":
        return f"array(shape={tuple(d['shape'])}, dtype={_dtype_name(d['dtype'])}" + \
            (f", values={_show(d['values'])})" if "values" in d else ")")
    if tag == "ref":
        return d["name"].rpartition(":")[2]
    if tag == "object":
        state, name = d["state"], d["class"].rpartition(":")[2]
        if isinstance(state, dict) and state.get("$") == "tuple":  # (dict or None, slots)
            parts = [p for p in state["items"] if isinstance(p, dict)]
            state = {k: v for p in parts for k, v in (_pairs(p))}
        if isinstance(state, dict) and (state.get("$") in (None, "dict")):
            return f"{name}(" + ", ".join(f"{k}={_show(v)}" for k, v in _pairs(state)) + ")"
        return f"{name}({_show(state)})"
    if tag == "reduce":
        fn = d["fn"]["name"].rpartition(":")[2] if isinstance(d["fn"], dict) and d["fn"].get("$") == "ref" else "?"
        inner = [_show(a) for a in d["args"]]
        if "list" in d:
            inner.append("[" + ", ".join(_show(v) for v in d["list"]) + "]")
        if "dict" in d:
            inner.append("{" + ", ".join(f"{_show(k)}: {_show(v)}" for k, v in d["dict"]) + "}")
        if d["state"] is not None:
            inner.append(f"state={_show(d['state'])}")
        return f"{fn}(" + ", ".join(inner) + ")"
    return repr(d)


def _pairs(d: dict) -> list[tuple[str, Any]]:
    if d.get("$") == "dict":
        return [(k if isinstance(k, str) else _show(k), v) for k, v in d["items"]]
    return list(d.items())


def _dtype_name(dtype: str) -> str:
    try:
        import numpy as np

        return np.dtype(dtype).name
    except Exception:  # noqa: BLE001
        return dtype
