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


# -- issue 64: a signed data URL's secret is sent, never stored ------------------------------------------------

SIG = "sig-marker-5f3a9c"


@pytest.fixture
def signed(tmp_path):
    """A web server on loopback serving tmp_path/served only to requests whose query holds `sig=SIG` (as a signed
    URL's host does: 403 otherwise); each query it was sent is kept."""
    import functools
    import http.server
    import threading
    from urllib.parse import parse_qs, urlsplit

    served = tmp_path / "served"
    served.mkdir()
    seen = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def _signed(self) -> bool:
            parts = urlsplit(self.path)
            seen.append(parts.query)
            if parse_qs(parts.query).get("sig") != [SIG]:
                self.send_error(403)
                return False
            self.path = parts.path
            return True

        def do_GET(self):
            if self._signed():
                super().do_GET()

        def do_HEAD(self):
            if self._signed():
                super().do_HEAD()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(served)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield served, f"http://127.0.0.1:{server.server_port}", seen
    server.shutdown()


def test_a_data_url_reads_its_secret_from_the_environment_and_a_literal_one_is_refused(signed, tmp_path, monkeypatch):
    """The loader sends `${NAME}`'s value (a URL's ?query is no glob), says the URL as written in its errors (an
    unset variable named; a wrong value masked), and the config refuses a literal secret in data.train,
    data.eval's sets and cluster.address in one line naming the key."""
    from pipeline import config as config_mod
    from pipeline.data import sources

    served, url, seen = signed
    write_jsonl(served / "train.jsonl", ROWS)
    ref = f"{url}/train.jsonl?sig=${{DATA_SIG}}"
    monkeypatch.setenv("DATA_SIG", SIG)
    assert sources.columns(ref) == ["question", "answer", "id"] and sources.read(ref).to_dicts() == ROWS
    assert f"sig={SIG}" in seen
    monkeypatch.setenv("DATA_SIG", "wrong-marker-77")
    with pytest.raises(GRPOError) as info:
        sources.read(ref)
    assert str(info.value).startswith(f"{ref}: cannot read dataset (") and "403" in str(info.value)
    assert "marker" not in str(info.value) and "\n" not in str(info.value)
    monkeypatch.delenv("DATA_SIG")
    with pytest.raises(GRPOError, match=r"the environment variable DATA_SIG is not set"):
        sources.read(ref)

    fix = "which would be stored with the run: write it as ${NAME} and set NAME in the environment (read where it is used, never stored)"
    base = {"model": "m", "data": {"train": "t.jsonl"}, "rewards": [{"fn": "correct"}]}
    for key, value, why in (
            ("data.train", "https://b.s3.amazonaws.com/t.jsonl?X-Amz-Date=1&X-Amz-Signature=abc9", "its query parameter 'X-Amz-Signature' holds a secret"),
            ("data.train", f"{url}/train.jsonl?sig={SIG}", "its query parameter 'sig' holds a secret"),
            ("data.eval", "https://h/e.jsonl?token=tk-marker", "its query parameter 'token' holds a secret"),
            ("data.eval", {"held": {"path": "https://me:pw-marker@h/e.jsonl"}}, "set 'held': holds a user (user:password@)"),
            ("cluster.address", "ray://me:pw-marker@head:10001", "holds a user (user:password@)")):
        section, option = key.split(".")
        tree = json.loads(json.dumps(base))
        tree.setdefault(section, {})[option] = value
        with pytest.raises(GRPOError) as info:
            config_mod.resolve(tree)
        assert str(info.value) == f"config: {key}: {why}, {fix}"
    ok = json.loads(json.dumps(base))
    ok["data"] = {"train": ref, "eval": {"held": {"path": ref}}}
    ok["cluster"] = {"address": "ray://${RAY_USER}:${RAY_PW}@head:10001"}
    config_mod.resolve(ok)  # references are kept as written
    ok["data"]["train"] = "data/#1.jsonl"  # a local path is no URL: a # in it is a file name's
    config_mod.resolve(ok)


def test_a_run_on_a_signed_data_url_keeps_no_trace_of_the_secret(signed, assets, tmp_path):
    """`grpo init` and one `grpo iterate` iteration (rollout, score, eval, MLflow on) with data.train and data.eval
    behind a signed URL and a cluster.address with a password, each `${NAME}`: the server got the secret, and no
    file of the run (config.yaml, manifests, parts, mlflow.db, mlartifacts) and no output line holds it."""
    from conftest import grpo, write_config

    served, url, seen = signed
    lines = Path(assets["train"]).read_text().splitlines()
    (served / "train.jsonl").write_text("\n".join(lines[:32]) + "\n")
    (served / "eval.jsonl").write_text(Path(assets["eval"]).read_text())
    cfg = base_config(assets, tracking={"mlflow": True}, eval={"every": 1, "max_prompts": 4},
                      cluster={"address": "ray://${RAY_USER}:${RAY_PW}@127.0.0.1:1"})  # local executor: recorded, never joined
    cfg["rewards"] = [{"fn": "correct"}]
    cfg["data"] = {**cfg["data"], "train": f"{url}/train.jsonl?sig=${{DATA_SIG}}", "eval": f"{url}/eval.jsonl?sig=${{DATA_SIG}}"}
    run = tmp_path / "run"
    literal = {**cfg, "data": {**cfg["data"], "train": f"{url}/train.jsonl?sig={SIG}"}}
    refused = grpo("init", str(run), "--config", str(write_config(tmp_path / "literal.yaml", literal)), check=False)
    assert refused.returncode != 0 and not run.exists()
    assert "data.train: its query parameter 'sig' holds a secret" in refused.stderr + refused.stdout
    assert SIG not in refused.stderr + refused.stdout
    env = {"DATA_SIG": SIG, "RAY_USER": "ray-user", "RAY_PW": "pw-marker-2b7"}
    said = []
    for args in (("init", str(run), "--config", str(write_config(tmp_path / "cfg.yaml", cfg))), ("iterate", str(run), "--iters", "1")):
        out = grpo(*args, env=env)
        said += [out.stdout, out.stderr]
    assert f"sig={SIG}" in seen and (run / "iter-0000/update/MANIFEST.json").is_file() and (run / "mlflow.db").is_file()
    assert (run / "iter-0000/eval").is_dir()
    assert "sig=${DATA_SIG}" in (run / "config.yaml").read_text() and "${RAY_PW}" in (run / "config.yaml").read_text()
    kept = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "literal.yaml"
            and any(s.encode() in p.read_bytes() for s in (SIG, env["RAY_PW"]))]
    assert kept == [] and not any(s in text for text in said for s in (SIG, env["RAY_PW"]))
    missing = grpo("rollout", str(run), "--iter", "1", check=False)  # a stage in an environment without the variable
    assert missing.returncode != 0 and "the environment variable DATA_SIG is not set" in missing.stderr + missing.stdout
