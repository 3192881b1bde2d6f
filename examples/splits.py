"""What the example task generators (times_problems.py, word_problems.py) share: writing the
train and held-out splits as .jsonl, and their command line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_splits(out: Path, splits: tuple[list[dict], list[dict]]) -> tuple[Path, Path]:
    """OUT/train.jsonl and OUT/eval.jsonl, one JSON row a line."""
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, rows in zip(paths, splits):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def cli(write, doc: str) -> None:
    """`python examples/GENERATOR.py OUT_DIR [--train N] [--eval N] [--seed S]`."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(*write(a.out, a.train, a.eval, a.seed))
