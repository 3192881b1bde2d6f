"""The published policy is the optimizer's fp32 master under every weight precision and ZeRO stage.

After one optimizer step of a DeepSpeed trainer (train.bf16 off and on x ZeRO 0-3, one process),
`save_policy` writes policy K+1. Its config.json must say float32 and its tensors must equal the
fp32 master as DeepSpeed itself gives it back: its own consolidation of the checkpoint
(`get_fp32_state_dict_from_zero_checkpoint`, ZeRO >= 1), the `fp32_groups` of its optimizer's state
dict (bf16, ZeRO 0: FP16_UnfusedOptimizer, where the module holds bf16 copies) or the module's own
parameters (fp32, ZeRO 0: torch's AdamW steps them). Where the weights were streamed (ZeRO 0-2),
the weights file is byte-identical to what `save_pretrained` writes for the same tensors and its
recorded sha256 is that of the file's bytes, also where `iterate` computes the sha256 first, in
memory, and writes the file later (its background write).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

CASES = [(bf16, zero) for bf16 in (False, True) for zero in (0, 1, 2, 3)]


def _one_step(trainer) -> None:
    from pipeline.update.distributed import local_rank_env

    with local_rank_env():
        _step(trainer.engine)


def _step(engine) -> None:
    engine.train()
    ids = torch.randint(0, engine.module.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    engine.set_gradient_accumulation_boundary(True)
    loss = engine(input_ids=ids).logits.float().logsumexp(-1).mean()
    engine.backward(loss, scale_wrt_gas=False)
    engine.step()


def _reference(trainer, ckpt, bf16: bool, zero: int) -> dict[str, torch.Tensor]:
    """The fp32 master as DeepSpeed gives it back, by parameter name."""
    module = trainer.engine.module
    if zero >= 1:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="state")
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    if bf16:
        groups = trainer.engine.optimizer.state_dict()["fp32_groups"]
        return dict(zip(names, [t for g in groups for t in g], strict=True))
    return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("bf16,zero", CASES)
def test_published_policy_is_the_fp32_master(assets, tmp_path, bf16, zero):
    from safetensors.torch import load_file

    from pipeline import config as config_mod
    from pipeline.store import hash_file
    from pipeline.update.trainer import Trainer
    from pipeline.update.weights import fp32_masters, master_state_dict
    from tests.conftest import base_config

    cfg = config_mod.resolve(base_config(assets, train={"bf16": bf16, "zero_stage": zero, "lr": 1e-3}))
    trainer = Trainer(cfg, Path(assets["model"]), None)
    try:
        _one_step(trainer)
        ckpt, out = tmp_path / "state", tmp_path / "policy"
        trainer.save_state(ckpt)
        hashed = trainer.save_policy(out, Path(assets["model"]), ckpt)
        config = json.loads((out / "config.json").read_text())
        assert config["dtype"] == "float32", config["dtype"]
        got = load_file(out / "model.safetensors")
        ref = _reference(trainer, ckpt, bf16, zero)
        assert set(ref) <= set(got) | {"lm_head.weight"}
        for name, t in ref.items():
            if name in got:
                assert got[name].dtype == torch.float32
                assert torch.equal(got[name], t.float().reshape(got[name].shape)), name
        if bf16:  # the module's own weights are bf16 roundings: the master is not them
            module = dict(trainer.engine.module.named_parameters())
            assert any(not torch.equal(got[n], module[n].detach().float()) for n in got if n in module)
        masters = fp32_masters(trainer.engine, trainer.world, zero)
        assert (masters is None) == (zero == 3)  # ZeRO 0-2 in one process: no consolidation
        if masters is not None:
            assert hashed == {"model.safetensors": hash_file(out / "model.safetensors")}
            ref_dir = tmp_path / "save_pretrained"
            trainer.engine.module.save_pretrained(ref_dir, state_dict=master_state_dict(trainer.engine.module, masters))
            assert (out / "model.safetensors").read_bytes() == (ref_dir / "model.safetensors").read_bytes()
            # iterate's background write: the sha256 computed from memory (on its thread); the file written later, the same bytes
            from pipeline.run.weights_file import DeferredWeights

            later = tmp_path / "later"
            deferred = trainer.save_policy(later, Path(assets["model"]), ckpt, later=True)
            assert isinstance(deferred, DeferredWeights) and {deferred.path.name: deferred.hash()} == hashed
            assert not (later / "model.safetensors").exists() and (later / "config.json").read_bytes() == (out / "config.json").read_bytes()
            deferred.write()
            assert (later / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
            assert [p.name for p in later.iterdir() if p.name.startswith(".tmp-")] == []
    finally:
        trainer.close()


def test_the_background_weights_file_is_on_disk_before_it_returns(tmp_path, monkeypatch):
    """`DeferredWeights.write` runs on iterate's background thread, and the policy's MANIFEST.json
    follows it: the file is synced under its temporary name before the rename, and the directory
    after it, so a power loss cannot leave a manifest naming an empty or absent file."""
    from pipeline.run.weights_file import DeferredWeights
    from pipeline.store import hash_file

    real, synced = os.fsync, []

    def fsync(fd: int) -> None:  # the real sync, recording what it synced and whether the file had its name yet
        real(fd)
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), (tmp_path / "model.safetensors").exists()))

    monkeypatch.setattr(os, "fsync", fsync)
    w = DeferredWeights(tmp_path / "model.safetensors", {"b": torch.ones(3), "a": torch.arange(4.0)}, {"format": "pt"})
    w.write()
    assert hash_file(tmp_path / "model.safetensors") == w.hash()
    assert len(synced) == 2, synced
    (file, named_before), (folder, named_after) = synced
    assert Path(file).parent == tmp_path and Path(file).name.startswith(".tmp-") and not named_before
    assert folder == str(tmp_path) and named_after
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_a_policy_being_written_is_named_at_once_and_waited_for_by_its_readers(assets, tmp_path):
    """pipeline.run.inflight: while `iterate`'s thread writes policy K+1, its hash is answered at once
    (the rollout's parts stamp it) and its tokenizer directory is there, but whoever asks whether it
    exists (or reads its weights) waits for the write; a failed write is raised there, once."""
    import threading

    from pipeline import config as config_mod
    from pipeline.errors import GRPOError
    from pipeline.run import inflight
    from pipeline.store import policy_rel
    from pipeline.run.run import init_run, policy_manifest
    from tests.conftest import base_config

    run = init_run(str(tmp_path / "run"), config_mod.resolve(base_config(assets)))
    release, wrote = threading.Event(), []

    def write() -> None:
        assert release.wait(60)
        run.store.put_dir(run.policy_dir(0), policy_rel(1))
        wrote.append(run.store.write_manifest(policy_rel(1), policy_manifest(run.policy_dir(0), 1, source="test")).policy_hash)

    inflight.start(run.store.root, 1, lambda p: write(), policy_hash="f" * 64)
    assert run.policy_hash(1) == "f" * 64 and run.writing(1) is not None
    assert run.policy_dir(1, weights=False) == run.store.local_dir(policy_rel(1))  # not waited for
    answers: list = []
    reader = threading.Thread(target=lambda: answers.append(run.policy_done(1)))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and answers == [] and wrote == []  # it waits: the write cannot have finished
    release.set()
    reader.join(60)
    assert answers == [True] and run.writing(1) is None and run.policy_hash(1) == wrote[0]

    def fail() -> None:
        raise GRPOError("policy/iter-0002: write failed: No space left on device")

    inflight.start(run.store.root, 2, lambda p: fail(), policy_hash="e" * 64)
    with pytest.raises(GRPOError, match="No space left"):
        run.policy_dir(2)
    assert not run.policy_done(2)  # raised once; the policy is missing


def test_any_error_of_a_background_write_is_one_line_naming_the_policy(tmp_path):
    """Whatever the background write of policy K raises (a bug, a library's error, not only an
    OSError) is raised where the policy is next waited for as the one line the CLI prints, naming
    the policy's directory, the original kept as its cause; a Ctrl-C or an exit stays what it was."""
    from pipeline.errors import GRPOError
    from pipeline.run import inflight

    root = str(tmp_path / "run")

    def fail(err: BaseException):
        def write(p) -> None:
            raise err
        return write

    bug = KeyError("model.embed_tokens.weight")
    inflight.start(root, 3, fail(bug))
    with pytest.raises(GRPOError) as got:
        inflight.settle(root, 3, "files")
    assert str(got.value) == (f"{os.path.realpath(root)}/policy/iter-0003: its background write failed: "
                              "KeyError: 'model.embed_tokens.weight'")
    assert got.value.__cause__ is bug
    inflight.start(root, 4, fail(ValueError("first line\n  more detail")))
    with pytest.raises(GRPOError, match=r"policy/iter-0004: its background write failed: ValueError: first line$"):
        inflight.settle(root, None, "files")  # whichever write of the run is in flight
    ours = GRPOError("policy/iter-0005: write failed: No space left on device")
    for err in (ours, SystemExit(3), KeyboardInterrupt()):  # as they were raised
        inflight.start(root, 5, fail(err))
        with pytest.raises(type(err)) as got:
            inflight.settle(root, 5, "files")
        assert got.value is err
    assert inflight.get(root, 3) is inflight.get(root, 4) is inflight.get(root, 5) is None  # each raised once


def test_an_engine_reloading_a_policy_from_its_files_waits_for_their_background_write(make_run):
    """A sleeping engine reloads the policy it holds from its directory when it wakes (vLLM's level-2
    sleep, or its CPU release of the weights), also where `iterate` handed it that policy's weights
    in memory and its file is still being written in the background. An engine of a run's policies
    (`policy_engine`) waits for the write before it reads the files; shown on the HF engine, whose
    load from a directory goes through the same hook."""
    import shutil
    import threading

    from pipeline.rollout import policy_engine
    from pipeline.run import inflight
    from pipeline.run.run import Run
    from pipeline.store import policy_rel

    run = Run(make_run(rollout={"engine": "hf"}))
    engine = policy_engine(run, 0)
    target, release = run.store.local_dir(policy_rel(1)), threading.Event()

    def write(p) -> None:
        assert release.wait(60)
        shutil.copytree(run.policy_dir(0), target)  # the files of a policy equal to policy 0

    inflight.start(run.store.root, 1, write)
    loaded: list = []

    def reload() -> None:
        try:
            engine.load(target)
            loaded.append(engine.model_dir)
        except Exception as err:  # noqa: BLE001 - asserted below
            loaded.append(err)

    reader = threading.Thread(target=reload)
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and loaded == []  # it waits: the files cannot be there yet
    release.set()
    reader.join(60)
    assert loaded == [target] and inflight.get(run.store.root, 1) is None


def test_a_policy_written_by_another_process_is_neither_called_interrupted_nor_re_created(assets, tmp_path):
    """While `iterate`'s background write of policy K+1 runs (update K done, the policy's MANIFEST.json
    not yet written), a second process sees no policy. It must not say the write was interrupted (whose
    advice, `grpo update --iter K`, would re-create the policy into the directory being written) nor
    re-create it (a second `grpo iterate` does so at its start): the write's lock tells the two apart."""
    import shutil
    import subprocess
    import sys

    from pipeline import config as config_mod
    from pipeline.run import inflight
    from pipeline.run.run import init_run
    from tests.conftest import REPO, base_config

    run = init_run(str(tmp_path / "run"), config_mod.resolve(base_config(assets)))
    (tmp_path / "run/iter-0000/update").mkdir(parents=True)
    (tmp_path / "run/iter-0000/update/MANIFEST.json").write_text("{}")  # update 0 done, as the writer sees it
    shutil.copytree(tmp_path / "run/policy/iter-0000", tmp_path / "run/policy/iter-0001",  # its directory, before the weights
                    ignore=shutil.ignore_patterns("MANIFEST.json", "*.safetensors"))
    audit = "from pipeline.report.audit import audit_run; print([p for p in audit_run(run).problems if 'policy/iter-0001:' in p])"

    def other_process(code: str) -> str:
        out = subprocess.run([sys.executable, "-c", "from pipeline.run.run import Run\nfrom pipeline.errors import GRPOError\n"
                              f"run = Run({run.uri!r})\ntry:\n    {code}\nexcept GRPOError as e:\n    print(e)"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip()

    lock = inflight.acquire(run.store.root, 1)  # as `record.publish` takes it for policy 1
    try:
        said = other_process("run.policy_hash(1)")
        assert "another grpo process" in said and "interrupted" not in said, said
        said = other_process("from pipeline.update.publish import restore_policy; restore_policy(run, 0)")
        assert said.endswith("another grpo process is writing policy 1 (its `grpo iterate`'s background write); wait for it or stop it"), said
        said = other_process(audit)
        assert "no MANIFEST.json: policy not written yet: another grpo process" in said, said
    finally:
        lock.release()
    said = other_process("run.policy_hash(1)")  # nobody writes it: a kill stopped the write
    assert "its write was interrupted (update 0 is done)" in said, said
    said = other_process(audit)  # and audit says so, with what re-creates it
    assert "no MANIFEST.json: policy missing, its write was interrupted (update 0 is done)" in said, said


def test_export_of_a_policy_whose_write_did_not_finish_is_one_line(assets, tmp_path):
    """A kill inside `iterate`'s background write leaves update K done and policy K+1's directory
    without its weights and MANIFEST.json; `grpo export` then crashed reading the missing manifest
    (AttributeError: 'NoneType' object has no attribute 'files'), as it did for any missing --iter."""
    from tests.conftest import base_config, grpo, write_config

    R = str(tmp_path / "run")
    grpo("init", R, "--config", str(write_config(tmp_path / "config.yaml", base_config(assets))))
    (tmp_path / "run/policy/iter-0001").mkdir()
    (tmp_path / "run/policy/iter-0001/config.json").write_text("{}")  # written before the weights, as publish puts it
    (tmp_path / "run/policy/iter-0001/.tmp-0-model.safetensors").write_bytes(b"\0" * 64)  # the kill's half-written file
    out = grpo("export", R, str(tmp_path / "out"), "--iter", "1", check=False)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("error: ") and "policy/iter-0001: policy missing" in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_iterations_row_is_shown_once_its_record_is_safe_or_with_its_writes_failure(make_run, monkeypatch):
    """`iterate` writes policy K+1 in the background while rollout K+1 runs: iteration K's row (what the
    table prints) waits for that write. Policy 1's write is held until the row would be shown, so a row
    shown before it is caught: when row 0 shows, policy 1's MANIFEST.json is on disk. Policy 2's write
    fails: row 1 shows after the write ended, the write's one line raised right after it."""
    import errno
    import threading

    from pipeline.errors import GRPOError
    from pipeline.loop.iterate import iterate
    from pipeline.run.run import Run
    from pipeline.run.weights_file import DeferredWeights
    from pipeline.store import policy_rel

    run = Run(make_run(rollout={"engine": "hf"}))
    shown: list = []
    asked = {k: threading.Event() for k in (1, 2)}  # row k-1 asked to be shown (set by the table's callback)
    real_write = DeferredWeights.write

    def write(self, path=None) -> None:
        k = int(Path(path).parent.name.removeprefix("iter-"))
        asked[k].wait(3)  # a row shown early is shown while this write has not finished (with the fix: 3 s, then on)
        if k == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(self, path)

    def on_iteration(row: dict) -> None:
        k = row["iteration"]
        w = run.writing(k + 1)
        shown.append((k, run.store.exists(f"{policy_rel(k + 1)}/MANIFEST.json"), w is None or not w.thread.is_alive()))
        asked[k + 1].set()

    monkeypatch.setattr(DeferredWeights, "write", write)
    with pytest.raises(GRPOError) as err:
        iterate(run, 2, on_iteration=on_iteration)
    assert str(err.value) == f"{run.store.display(policy_rel(2))}: write failed: No space left on device"
    assert shown == [(0, True, True), (1, False, True)]  # row 1 with the failure of its write, not before it ended
    assert run.done(1, "update") and not run.policy_done(2)  # the update recorded, its policy to re-create (restore_policy)


@pytest.mark.slow
def test_a_row_shown_at_the_next_iterations_start_is_not_timed_in_that_iteration(make_run, monkeypatch):
    """Iteration 0's row is shown (`on_iteration`, which the bench uses for minutes of baselines) once
    policy 1's write has finished: here during rollout 1, so the row shows right after it. The
    callback's time (1000 s on the loop's clock) is in neither iteration 1's rollout nor its seconds."""
    import threading
    import types

    from pipeline.loop import iterate as iterate_mod
    from pipeline.loop import iteration as iteration_mod
    from pipeline.loop.iterate import iterate
    from pipeline.run.run import Run
    from pipeline.run.weights_file import DeferredWeights

    run = Run(make_run(rollout={"engine": "hf", "weight_sync": "memory"}))
    offset = [0.0]
    clock = types.SimpleNamespace(time=lambda: time.time() + offset[0])
    monkeypatch.setattr(iterate_mod, "time", clock)
    monkeypatch.setattr(iteration_mod, "time", clock)
    rollout_1, written, real_write, real_rollout = threading.Event(), threading.Event(), DeferredWeights.write, iterate_mod.run_rollout

    def write(self, path=None) -> None:
        assert rollout_1.wait(120), "rollout 1 never started"  # policy 1's write ends during rollout 1
        real_write(self, path)

    def rollout(r, k, **kw):
        if k == 1:
            rollout_1.set()
            w = r.writing(1)
            assert w is not None  # policy 1's write is in flight as rollout 1 starts
            w.files.result(timeout=120)  # and has ended before rollout 1 samples: its row shows right after it
        return real_rollout(r, k, **kw)

    shown = []

    def on_iteration(row: dict) -> None:
        shown.append(row["iteration"])
        offset[0] += 1000.0

    monkeypatch.setattr(DeferredWeights, "write", write)
    monkeypatch.setattr(iterate_mod, "run_rollout", rollout)
    rows = iterate(run, 2, on_iteration=on_iteration)
    assert shown == [0, 1]
    assert rows[1]["timings"]["rollout"] < 1000 and rows[1]["seconds"] < 1000, rows[1]
    assert rows[0]["seconds"] < 1000


@pytest.mark.slow
def test_the_loops_wait_for_the_record_is_a_timed_line_of_the_iteration(make_run, monkeypatch):
    """`iterate` waits for the record of update K in one place before update K+1 (that update changes
    the tensors the file is written from) and once at its end, and the seconds waited are the
    iteration's `record` timing. With rollout.weight_sync memory, and the old logprobs taken from the
    update's own forward (one optimizer step per epoch), nothing before update 1 reads policy 1's files;
    its write is held until the loop waits for it, so iteration 1's wait is not empty; policy 2's is
    waited for at the loop's end, into the last row's timing."""
    import threading

    from pipeline.loop.iterate import iterate
    from pipeline.run.run import Run
    from pipeline.run.weights_file import DeferredWeights
    from pipeline.update import record

    run = Run(make_run(rollout={"engine": "hf", "weight_sync": "memory"}, train={"mini_batch_size": 16}))
    waiting, waited_for = threading.Event(), []
    real_settle, real_write = record.settle_before_update, DeferredWeights.write

    def settle(r, k):
        if r.writing(k if k is not None else r.completed_iters()) is not None:  # a write in flight: the loop waits here
            waited_for.append(k)
            waiting.set()
        return real_settle(r, k)

    def write(self, path=None) -> None:
        assert waiting.wait(120), "the loop never waited for the record"
        waiting.clear()
        real_write(self, path)

    monkeypatch.setattr(record, "settle_before_update", settle)
    monkeypatch.setattr(DeferredWeights, "write", write)
    rows = iterate(run, 2)
    assert waited_for == [1, 2]  # before update 1 (policy 1's write), and at the end (policy 2's)
    assert [sorted(r["timings"]) for r in rows] == [["logprobs", "record", "rollout", "score", "update"]] * 2
    assert rows[0]["timings"]["record"] == 0.0 and rows[1]["timings"]["record"] > 0.0
    assert sum(rows[1]["timings"].values()) <= rows[1]["seconds"]
    assert run.policy_done(2) and run.done(1, "update") and run.writing(2) is None
