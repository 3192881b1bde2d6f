"""Datasets as the Hub lays them out: a directory or glob of Parquet shards, a `datasets`
save_to_disk directory, one .jsonl / .parquet file, local or through fsspec; the same rows in the
same order however they are split. data.prompt_template builds the prompt from other columns.
The slow test checks that the three layouts give the same rollout parts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import base_config
from pipeline.data.prompts import dataset_columns, load_dataset
from pipeline.errors import GRPOError

ROWS = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}", "id": i} for i in range(10)]


def write_shards(root: Path, rows: list[dict], sizes: list[int], name="train") -> Path:
    """Hub layout: root/main/train-0000i-of-0000n.parquet, rows split by `sizes`."""
    (root / "main").mkdir(parents=True)
    start = 0
    for i, size in enumerate(sizes):
        pq.write_table(pa.Table.from_pylist(rows[start : start + size]), root / "main" / f"{name}-{i:05d}-of-{len(sizes):05d}.parquet")
        start += size
    return root / "main"


def write_saved(root: Path, rows: list[dict], num_shards: int) -> Path:
    from datasets import Dataset

    Dataset.from_list(rows).save_to_disk(str(root), num_shards=num_shards)
    return root


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def layouts(tmp_path) -> dict[str, str]:
    return {
        "jsonl": str(write_jsonl(tmp_path / "train.jsonl", ROWS)),
        "shards": str(write_shards(tmp_path / "hub", ROWS, [4, 3, 3])),
        "glob": str(tmp_path / "hub" / "main" / "train-*.parquet"),
        "saved": str(write_saved(tmp_path / "saved", ROWS, num_shards=3)),
        "one_shard_dir": str(write_shards(tmp_path / "hub1", ROWS, [10])),
    }


def test_every_layout_gives_the_same_rows_in_the_same_order(layouts):
    frames = {name: load_dataset(path, "prompt", "{question}") for name, path in layouts.items()}
    expected = [{"question": r["question"], "answer": r["answer"], "id": r["id"], "prompt": r["question"]} for r in ROWS]
    for name, df in frames.items():
        assert df.to_dicts() == expected, name
        assert dataset_columns(layouts[name]) == ["question", "answer", "id"], name


def test_shards_are_read_in_name_order_not_listing_order(tmp_path):
    root = tmp_path / "hub"
    (root / "main").mkdir(parents=True)
    # written last-first: the reading order is the names' order, the Hub's -0000i-of- numbering
    for i in (2, 1, 0):
        pq.write_table(pa.Table.from_pylist(ROWS[i * 3 : i * 3 + 3]), root / "main" / f"train-{i:05d}-of-00003.parquet")
    assert load_dataset(str(root), "question")["id"].to_list() == list(range(9))


def test_shards_through_fsspec(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    for i, part in enumerate((ROWS[:6], ROWS[6:])):
        with fs.open(f"/grpo-test-shards/main/train-{i:05d}-of-00002.parquet", "wb") as f:
            pq.write_table(pa.Table.from_pylist(part), f)
    try:
        assert load_dataset("memory://grpo-test-shards", "question")["id"].to_list() == list(range(10))
        assert dataset_columns("memory://grpo-test-shards/main/*.parquet") == ["question", "answer", "id"]
    finally:
        fs.rm("/grpo-test-shards", recursive=True)


def test_shards_that_disagree_on_columns_are_one_line_errors_naming_the_file(tmp_path):
    main = write_shards(tmp_path / "hub", ROWS, [5, 5])
    odd = [{**r, "extra": 1} for r in ROWS[:3]]
    pq.write_table(pa.Table.from_pylist(odd), main / "train-00002-of-00003.parquet")
    first, bad = main / "train-00000-of-00002.parquet", main / "train-00002-of-00003.parquet"
    expected = f"{bad}: has column 'extra', unlike {first} (columns: question, answer, id)"
    for read in (lambda: dataset_columns(str(main)), lambda: load_dataset(str(main), "question")):
        with pytest.raises(GRPOError) as err:
            read()
        assert str(err.value) == expected
    pq.write_table(pa.Table.from_pylist([{"question": "q"}]), bad)
    with pytest.raises(GRPOError, match=r"train-00002-of-00003.parquet: lacks column 'answer', unlike "):
        dataset_columns(str(main))


def test_layout_mistakes_are_one_line_errors(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    for path, message in [
        (tmp_path / "empty_dir", "directory holds no .parquet shards and no datasets state.json"),
        (tmp_path / "none-*.parquet", "no files match"),
        (tmp_path / "missing.jsonl", "dataset file not found"),
    ]:
        with pytest.raises(GRPOError) as err:
            dataset_columns(str(path))
        assert str(err.value) == f"{path}: {message}"
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    with pytest.raises(GRPOError, match=r"data.csv: unsupported dataset format .csv"):
        load_dataset(str(tmp_path / "data.csv"), "a")


def test_prompt_template_builds_the_prompt_where_a_row_has_none(tmp_path):
    rows = [{"question": "2 + 2?", "prompt": None}, {"question": "3 + 3?", "prompt": "given"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    df = load_dataset(str(path), "prompt", "Solve: {question}")
    assert df["prompt"].to_list() == ["Solve: 2 + 2?", "given"]
    with pytest.raises(GRPOError, match=r"no column 'problem' for data.prompt_template \(columns: question, prompt\)"):
        load_dataset(str(path), "prompt", "{problem}")


@pytest.mark.slow
def test_shards_save_to_disk_and_jsonl_give_byte_identical_rollout_parts(assets, tmp_path):
    """One small rollout from each layout of the same rows. The parts' rows are byte-identical;
    each Parquet footer also carries its run's stamp (config hash, which names data.train), the
    one thing that differs by design, so it is compared with the stamp taken out."""
    import io

    from pipeline import config as config_mod
    from pipeline.rollout import run_rollout
    from pipeline.run.run import Run, init_run

    rows = [json.loads(line) for line in Path(assets["train"]).read_text().splitlines()[:16]]
    sources = {
        "jsonl": str(write_jsonl(tmp_path / "train.jsonl", rows)),
        "shards": str(write_shards(tmp_path / "hub", rows, [7, 5, 4])),
        "saved": str(write_saved(tmp_path / "saved", rows, num_shards=2)),
    }
    parts = {}
    for name, source in sources.items():
        cfg = base_config(assets, data={"train": source, "eval": None}, rollout={"prompts_per_iter": 4, "groups_per_part": 4})
        run = init_run(str(tmp_path / f"run-{name}"), config_mod.resolve(cfg))
        run_rollout(Run(run.uri), 0)
        (part,) = sorted((tmp_path / f"run-{name}" / "iter-0000" / "rollout").glob("part-*.parquet"))
        table = pq.read_table(part)
        buf = io.BytesIO()
        pq.write_table(table.replace_schema_metadata(None), buf, compression="zstd", write_statistics=False)
        parts[name] = buf.getvalue()
        assert table.num_rows == 4 * 4
    assert parts["shards"] == parts["jsonl"]
    assert parts["saved"] == parts["jsonl"]
