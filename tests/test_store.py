"""Run store and schemas: round trips, rejection of wrong schema/version, manifests, and the
rule that a stage without its manifest has not happened."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import GRPOError
from pipeline.run.parts import Shard, part_groups, n_parts
from pipeline.store import RunStore, sha256_bytes
from schemas.artifacts import LOGPROBS, ROLLOUT, SCORE


def logprobs_rows(n=3):
    return pa.table(
        {
            "prompt_id": list(range(n)),
            "sample_idx": [0] * n,
            "old_logprobs": [[-0.5, -1.0]] * n,
            "ref_logprobs": [None] * n,
            "sampler_gap_mean": [0.0] * n,
            "sampler_gap_max": [0.0] * n,
        }
    )


def test_write_casts_stamps_and_reads_back(tmp_path):
    store = RunStore(tmp_path)
    info = store.write_table("iter-0000/logprobs/part-00000.parquet", logprobs_rows(), LOGPROBS, meta={"input_hash": "abc"})
    assert info.rows == 3
    assert info.sha256 == sha256_bytes((tmp_path / "iter-0000/logprobs/part-00000.parquet").read_bytes())
    t = store.read_table("iter-0000/logprobs/part-00000.parquet", LOGPROBS)
    assert t.schema.field("prompt_id").type == pa.int64()  # cast from Python ints
    assert t.schema.field("sample_idx").type == pa.int32()
    assert t.column("old_logprobs").to_pylist()[0] == [-0.5, -1.0]
    assert store.table_meta("iter-0000/logprobs/part-00000.parquet")["input_hash"] == "abc"


def test_same_table_same_bytes(tmp_path):
    store = RunStore(tmp_path)
    a = store.write_table("a.parquet", logprobs_rows(), LOGPROBS)
    b = store.write_table("b.parquet", logprobs_rows(), LOGPROBS)
    assert a.sha256 == b.sha256


def test_reading_a_wrong_kind_or_version_names_the_file(tmp_path):
    store = RunStore(tmp_path)
    store.write_table("x/part.parquet", logprobs_rows(), LOGPROBS)
    with pytest.raises(GRPOError, match=r"x/part.parquet: not a score artifact"):
        store.read_table("x/part.parquet", SCORE)
    t = pq.read_table(tmp_path / "x/part.parquet")
    meta = dict(t.schema.metadata)
    meta[b"grpo.schema_version"] = b"99"
    pq.write_table(t.replace_schema_metadata(meta), tmp_path / "x/v99.parquet")
    with pytest.raises(GRPOError, match=r"v99.parquet: logprobs schema version 99, this grpo reads version 1"):
        store.read_table("x/v99.parquet", LOGPROBS)
    # a declared column with the wrong type
    bad = t.set_column(2, "old_logprobs", pa.array(["a", "b", "c"]))
    pq.write_table(bad.replace_schema_metadata(meta | {b"grpo.schema_version": b"1"}), tmp_path / "x/type.parquet")
    with pytest.raises(GRPOError, match=r"type.parquet: column 'old_logprobs' has type string"):
        store.read_table("x/type.parquet", LOGPROBS)


def test_write_refuses_missing_and_unexpected_columns(tmp_path):
    store = RunStore(tmp_path)
    with pytest.raises(GRPOError, match="missing column 'sampler_gap_max'"):
        store.write_table("p.parquet", logprobs_rows().drop(["sampler_gap_max"]), LOGPROBS)
    with pytest.raises(GRPOError, match="unexpected column 'extra'"):
        store.write_table("p.parquet", logprobs_rows().append_column("extra", pa.array([1, 2, 3])), LOGPROBS)
    assert not (tmp_path / "p.parquet").exists()


def test_rollout_keeps_dataset_columns_as_extras(tmp_path):
    store = RunStore(tmp_path)
    row = {
        "prompt_id": 1, "sample_idx": 0, "group_idx": 0, "prompt": "p", "prompt_raw": '"p"', "prompt_ids": [1, 2],
        "completion": "c", "completion_ids": [3], "sampler_logprobs": [-0.1], "finish_reason": "stop",
        "truncated": False, "completion_length": 1, "policy_hash": "h", "completion_mask": None, "episode": None,
        "answer": "1 + 1 = 2\n#### 2",
    }
    store.write_table("r.parquet", pa.Table.from_pylist([row]), ROLLOUT)
    t = store.read_table("r.parquet", ROLLOUT)
    assert t.column("answer").to_pylist() == ["1 + 1 = 2\n#### 2"]


def test_a_version_1_rollout_part_reads_with_the_columns_added_since_as_nulls(tmp_path):
    """Runs written before episodes existed (rollout v1: no completion_mask, no episode) still read."""
    store = RunStore(tmp_path)
    row = {
        "prompt_id": 1, "sample_idx": 0, "group_idx": 0, "prompt": "p", "prompt_raw": '"p"', "prompt_ids": [1, 2],
        "completion": "c", "completion_ids": [3, 4], "sampler_logprobs": [-0.1, -0.2], "finish_reason": "stop",
        "truncated": False, "completion_length": 2, "policy_hash": "h", "answer": "2",
    }
    v1 = ROLLOUT.conform(pa.Table.from_pylist([row | {"completion_mask": None, "episode": None}])).drop(["completion_mask", "episode"])
    meta = dict(v1.schema.metadata) | {b"grpo.schema_version": b"1"}
    pq.write_table(v1.replace_schema_metadata(meta), tmp_path / "v1.parquet")
    t = store.read_table("v1.parquet", ROLLOUT)
    assert t.column_names[: len(ROLLOUT.schema)] == ROLLOUT.schema.names  # the added columns at their declared place
    assert t.column("completion_mask").to_pylist() == [None] and t.column("episode").to_pylist() == [None]
    assert t.column("answer").to_pylist() == ["2"]
    # a version-2 part must have them
    pq.write_table(v1.replace_schema_metadata(meta | {b"grpo.schema_version": b"2"}), tmp_path / "v2.parquet")
    with pytest.raises(GRPOError, match=r"v2.parquet: missing column 'completion_mask'"):
        store.read_table("v2.parquet", ROLLOUT)


def test_corrupt_parquet_is_a_one_line_error(tmp_path):
    store = RunStore(tmp_path)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(GRPOError, match=r"bad.parquet: not a readable Parquet file"):
        store.read_table("bad.parquet", LOGPROBS)


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    store = RunStore(tmp_path)
    store.write_bytes("d/f.txt", b"one")
    store.write_bytes("d/f.txt", b"two")
    assert (tmp_path / "d/f.txt").read_bytes() == b"two"
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["f.txt"]


def test_lock_refuses_a_second_holder(tmp_path):
    store = RunStore(tmp_path)
    with store.lock("s/.lock", "score iteration 0"):
        with pytest.raises(GRPOError, match="another grpo process holds this lock"):
            with store.lock("s/.lock", "score iteration 0"):
                pass
    with store.lock("s/.lock", "score iteration 0"):  # released: free again
        pass


def test_shards_cover_every_part_once():
    for n in (1, 2, 3):
        shards = [Shard(i, n) for i in range(n)]
        owners = [[s for s in shards if s.owns(p)] for p in range(7)]
        assert all(len(o) == 1 for o in owners)
    assert n_parts(10, 4) == 3 and list(part_groups(2, 10, 4)) == [8, 9]
    assert Shard.parse("1/3") == Shard(1, 3)
    for bad in ("3/3", "x", "1/0"):
        with pytest.raises(GRPOError, match="--shard"):
            Shard.parse(bad)


def test_stage_killed_between_parts_and_manifest_is_not_done(make_run):
    """Parts without a manifest are leftovers: the stage is not done, and a rerun does not
    count a part computed from different inputs."""
    from pipeline.run.parts import run_parts
    from pipeline.run.run import Run

    run = Run(make_run())
    calls = []

    def make_part(p):
        calls.append(p)
        return logprobs_rows(2)

    class Killed(Exception):
        pass

    def dying_part(p):
        if p == 1:
            raise Killed
        return make_part(p)

    with pytest.raises(Killed):
        run_parts(run, 0, "logprobs", LOGPROBS, 2, Shard(), {"x": 1}, dying_part)
    assert (run.store.path("iter-0000/logprobs/part-00000.parquet"))
    assert not run.done(0, "logprobs")
    # a stale part from other inputs is rewritten, the matching one is kept
    m = run_parts(run, 0, "logprobs", LOGPROBS, 2, Shard(), {"x": 1}, make_part)
    assert calls == [0, 1] and run.done(0, "logprobs")
    for name, out in m.outputs.items():
        data = run.store.read_bytes(f"iter-0000/logprobs/{name}")
        assert out.sha256 == sha256_bytes(data) and out.rows == 2
    assert m.rows == 4
    # done means done: a rerun does nothing
    assert run_parts(run, 0, "logprobs", LOGPROBS, 2, Shard(), {"x": 1}, make_part) == m
    assert calls == [0, 1]


def test_sharded_workers_write_the_manifest_once_all_parts_are_in(make_run):
    from pipeline.run.parts import run_parts
    from pipeline.run.run import Run

    run = Run(make_run())
    assert run_parts(run, 0, "logprobs", LOGPROBS, 3, Shard(0, 2), {}, lambda p: logprobs_rows(1)) is None
    assert not run.done(0, "logprobs")
    m = run_parts(run, 0, "logprobs", LOGPROBS, 3, Shard(1, 2), {}, lambda p: logprobs_rows(1))
    assert m is not None and sorted(m.outputs) == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert json.loads((run.store.path("iter-0000/logprobs/MANIFEST.json") and open(run.store.path("iter-0000/logprobs/MANIFEST.json")).read()))["rows"] == 3


def test_manifests_are_typed_and_versioned(tmp_path):
    """A manifest is read through its declared model: an old version, a missing field or a
    field of the wrong type is a one-line error naming the file and the field."""
    import json

    from pipeline.errors import GRPOError
    from schemas.manifests import FileEntry, PartsManifest

    store = RunStore(str(tmp_path / "run"))
    m = PartsManifest(stage="score", iteration=0, schema_version=1, config_hash="c", seed=0, input_hash="h",
                      inputs={}, outputs={"part-00000.parquet": FileEntry(sha256="s", bytes=3, rows=2)}, rows=2,
                      timings={"seconds": 1.0})
    written = store.write_manifest("iter-0000/score", m)
    read = store.manifest("iter-0000/score")
    assert read == written and read.outputs["part-00000.parquet"].rows == 2 and read.created is not None
    path = tmp_path / "run" / "iter-0000" / "score" / "MANIFEST.json"
    body = json.loads(path.read_text())
    for edit, message in [
        (lambda b: b.pop("manifest_version"), "no manifest_version (written by a grpo before manifests were versioned); this grpo reads version 1"),
        (lambda b: b.update(manifest_version=2), "manifest version 2; this grpo reads version 1"),
        (lambda b: b.pop("rows"), "rows: required key is missing"),
        (lambda b: b["outputs"]["part-00000.parquet"].update(bytes="three"), "outputs.part-00000.parquet.bytes: Input should be a valid integer, unable to parse string as an integer"),
        (lambda b: b.update(colour="red"), "colour: unknown key"),
    ]:
        bad = json.loads(json.dumps(body))
        edit(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(GRPOError) as err:
            store.manifest("iter-0000/score")
        assert str(err.value) == f"{path}: {message}"
    path.write_text("{not json")
    with pytest.raises(GRPOError, match=r"MANIFEST.json: not valid JSON$"):
        store.manifest("iter-0000/score")
