"""Runs on object storage: a real S3-compatible server (moto's server mode) on loopback.

The endpoint is given the way a user gives it, `AWS_ENDPOINT_URL` (botocore, and so s3fs,
honour it), with credentials in `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`. A whole
iteration runs against s3://bucket/run; it is killed midway through a stage and resumed, and
must leave exactly what the same iteration leaves in a local run directory.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, base_config, grpo, write_config

BUCKET = "grpo-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on a free loopback port with one bucket; the AWS_* environment set."""
    import boto3

    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert server.poll() is None and time.time() < deadline, "moto server did not start"
            time.sleep(0.2)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=BUCKET)
        yield env
    server.terminate()
    server.wait(timeout=30)
    log.close()


def lock_body(host: str, pid: int, heartbeat: float) -> bytes:
    return json.dumps({"owner": "someone", "host": host, "pid": pid, "what": "a test", "heartbeat": heartbeat}).encode()


def test_object_lock_excludes_other_machines_and_takes_over_dead_ones(s3, monkeypatch):
    from pipeline.store import lock as lock_mod
    from pipeline.errors import GRPOError
    from pipeline.store.lock import ObjectLock
    from pipeline.store import RunStore

    store = RunStore(f"s3://{BUCKET}/locks")
    path = store.path("stage/.lock")
    with store.lock("stage/.lock", "first"):
        held = json.loads(store.fs.cat_file(path))
        assert held["pid"] == os.getpid() and held["what"] == "first"
        with pytest.raises(GRPOError, match="another grpo process holds this lock"):
            with RunStore(f"s3://{BUCKET}/locks").lock("stage/.lock", "second"):
                pass
    assert not store.exists("stage/.lock")  # released: the object is gone

    # a live holder on another machine is waited for; its heartbeat is fresh
    store.fs.pipe_file(path, lock_body("other-machine|pid:[1]", 4242, time.time()))
    with pytest.raises(GRPOError, match="pid 4242 on other-machine"):
        with store.lock("stage/.lock", "third"):
            pass
    # ... until its heartbeat is older than GRPO_LOCK_STALE_S: then it is presumed dead
    store.fs.pipe_file(path, lock_body("other-machine|pid:[1]", 4242, time.time() - 1000))
    with store.lock("stage/.lock", "fourth"):
        assert json.loads(store.fs.cat_file(path))["what"] == "fourth"

    # a holder on this machine whose process is gone is dead at once
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    store.fs.pipe_file(path, lock_body(lock_mod._host_id(), gone.pid, time.time()))
    with store.lock("stage/.lock", "fifth"):
        assert json.loads(store.fs.cat_file(path))["what"] == "fifth"

    # two workers taking over the same dead lock: the conditional PUT lets exactly one win
    store.fs.pipe_file(path, lock_body("other-machine|pid:[1]", 1, 0.0))
    etag = store.fs.info(path)["ETag"]
    a, b = ObjectLock(store, "stage/.lock", "a", 0), ObjectLock(store, "stage/.lock", "b", 0)
    assert [a._take_over(etag), b._take_over(etag)] == [True, False]
    store.remove("stage/.lock")

    # the holder's heartbeat keeps the lock fresh; a waiting worker gets it after the release
    monkeypatch.setattr(lock_mod, "LOCK_HEARTBEAT_S", 0.05)
    released, seen = threading.Event(), {}

    def hold():
        with store.lock("stage/.lock", "holder"):
            first = json.loads(store.fs.cat_file(path))["heartbeat"]
            deadline = time.time() + 30
            while json.loads(store.fs.cat_file(path))["heartbeat"] == first and time.time() < deadline:
                time.sleep(0.05)
            seen["beat"] = json.loads(store.fs.cat_file(path))["heartbeat"] > first
        released.set()

    t = threading.Thread(target=hold)
    t.start()
    while not store.exists("stage/.lock") and not released.is_set():
        time.sleep(0.01)
    with store.lock("stage/.lock", "waiter", wait=60):
        assert released.is_set()
    t.join()
    assert seen["beat"]


def test_remote_directories_are_staged_once_and_follow_their_manifest(s3, tmp_path):
    from pipeline.store import RunStore

    store = RunStore(f"s3://{BUCKET}/staging")
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / "weights.bin").write_bytes(b"w" * 1000)
    (src / "sub" / "tok.json").write_text("{}")
    store.put_dir(src, "policy/iter-0000")
    store.write_json("policy/iter-0000/MANIFEST.json", {"v": 1})
    local = store.local_dir("policy/iter-0000")
    assert (local / "weights.bin").read_bytes() == b"w" * 1000 and (local / "sub" / "tok.json").read_text() == "{}"
    assert store.local_dir("policy/iter-0000") == local  # cached
    # the same URI with other contents (a run re-created in place): a fresh download
    store.write_bytes("policy/iter-0000/weights.bin", b"v" * 10)
    store.write_json("policy/iter-0000/MANIFEST.json", {"v": 2})
    again = store.local_dir("policy/iter-0000")
    assert again != local and (again / "weights.bin").read_bytes() == b"v" * 10


@pytest.mark.slow
def test_iteration_on_s3_is_killed_resumed_and_matches_a_local_run(s3, assets, tmp_path):
    from pipeline.store import RunStore

    cfg = write_config(tmp_path / "cfg.yaml", base_config(assets, rollout={"engine": "hf", "max_new_tokens": 16, "groups_per_part": 1}))
    uri, local = f"s3://{BUCKET}/run", str(tmp_path / "local")
    env = {"OMP_NUM_THREADS": "1"}
    grpo("init", local, "--config", str(cfg), env=env)
    reference = subprocess.Popen(  # the same iteration on a local disk, alongside
        [sys.executable, "-m", "stages.cli", "iterate", local, "--iters", "1"], cwd=REPO, env={**os.environ, **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    grpo("init", uri, "--config", str(cfg), env=env)

    # killed (SIGKILL) right after score's first part is written
    died = grpo("iterate", uri, "--iters", "1", env={**env, "GRPO_FAULT": "score:part"}, check=False)
    assert died.returncode == -9, died.stderr[-2000:]
    store = RunStore(uri)
    assert store.manifest("iter-0000/rollout") is not None
    assert store.manifest("iter-0000/score") is None  # no manifest: the stage has not happened
    assert store.listdir("iter-0000/score") == [".lock-shard-0-of-1", "part-00000.parquet"]
    assert store.table_meta("iter-0000/score/part-00000.parquet")["input_hash"]  # a whole part, stamped
    first_part = store.fs.info(store.path("iter-0000/score/part-00000.parquet"))["LastModified"]

    resumed = grpo("iterate", uri, "--iters", "1", env=env)
    assert "1 of 1 iterations" in resumed.stdout
    # the dead worker's lock was taken over, the finished part kept, every lock released
    assert store.fs.info(store.path("iter-0000/score/part-00000.parquet"))["LastModified"] == first_part
    assert not [p for p in store.fs.find(store.path()) if p.rsplit("/", 1)[-1].startswith(".lock")]

    out, _ = reference.communicate(timeout=600)
    assert reference.returncode == 0, out[-3000:]
    for stage in ("rollout", "score", "logprobs"):
        mine = store.read_json(f"iter-0000/{stage}/MANIFEST.json")
        theirs = json.loads((Path(local) / "iter-0000" / stage / "MANIFEST.json").read_text())
        assert mine["outputs"] == theirs["outputs"], stage
    mine = store.manifest("iter-0000/update")  # typed
    theirs = json.loads((Path(local) / "iter-0000/update/MANIFEST.json").read_text())
    assert mine.policy_hash == theirs["policy_hash"]
    assert mine.outputs.metrics.sha256 == theirs["outputs"]["metrics.parquet"]["sha256"]
    assert store.read_json("policy/iter-0001/MANIFEST.json")["lineage"]["inputs"]["score"] == store.manifest_hash("iter-0000/score")
