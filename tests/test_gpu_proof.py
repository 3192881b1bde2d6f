"""The GPU proof's own pieces that run here (docs/gpu.md): its tokenizer covers every id the model
can sample, and its report reads the figures back from what the GPU machine returned."""

from __future__ import annotations

import json

from bench.gpu import assets, report


def test_the_proof_tokenizer_has_the_model_vocabulary_and_round_trips_text():
    tok = assets.build_tokenizer(151936)
    assert len(tok) == 151936  # every id a 151,936-way LM head samples decodes
    text = "Write 3 sentences about owls for a child aged 7."
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([151000, 5, 70000]) != ""
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_report_reads_each_runs_status_document_from_the_log():
    status = {"run": "/tmp/grpo-gpu/runs/lora", "iterations": [{"logprobs/sampler_gap_mean": 0.01,
                                                              "rollout_correction/clipped_seq_frac": 0.0},
                                                             {"logprobs/sampler_gap_mean": 0.03}]}
    log = ("$ python3 -m stages.cli status /tmp/grpo-gpu/runs/full --format json\n{\n \"run\": \"full\"\n}\n"
           "== full: ok\n$ python3 -m stages.cli status /tmp/grpo-gpu/runs/lora --format json\n"
           + json.dumps(status, indent=2) + "\n== lora: ok\n")
    got = report.status_from_log(log, "lora")
    assert got == status
    assert report.gap(got) == (0.02, 0.0)  # the mean over iterations: (0.01 + 0.03) / 2
    assert report.status_from_log(log, "lora-again") is None


def test_report_checks_each_runs_memory_estimate_against_its_measured_peak():
    steps = {"full": {"estimate": {"trainer_peak_gib": 22.66}, "max_allocated_gib": 22.1},  # 1.03 x
             "lora": {"estimate": {"trainer_peak_gib": 34.1}, "max_allocated_gib": 14.5},  # the first lease's 2.35 x
             "full-again": {"estimate": {"trainer_peak_gib": 20.0}, "max_allocated_gib": 22.1}}  # below what ran
    line = report.memory_line(steps)
    assert "full 22.7 / 22.1 GiB = 1.03 x (met)" in line
    assert "lora 34.1 / 14.5 GiB = 2.35 x (NOT met)" in line
    assert "full-again 20.0 / 22.1 GiB = 0.90 x (NOT met)" in line
    assert report.memory_line({}).endswith("no run measured.")


def _write_parts(pack_dir, parts: list[bytes], whole: bytes | None = None):
    """A pack's parts and parts.sha256 as `python -m bench.gpu pack` writes them."""
    import hashlib

    pack_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"{hashlib.sha256(whole if whole is not None else b''.join(parts)).hexdigest()}  pack.tar.xz"]
    for k, data in enumerate(parts):
        (pack_dir / f"part-{k:02d}").write_bytes(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  part-{k:02d}")
    (pack_dir / "parts.sha256").write_text("\n".join(lines) + "\n")


def _run_sh(tree, stash, out):
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench/gpu/run.sh"
    env = {**os.environ, "GRPO_GPU_PARTS": str(stash), "OUT": str(out), "GRPO_GPU_SITE": str(tree / "site"), "PY": "false"}
    return subprocess.run(["bash", str(script), "small", "10"], cwd=tree, env=env, capture_output=True, text=True)


def test_run_sh_stores_each_calls_part_outside_the_tree_until_every_part_has_come(tmp_path):
    """The device calls' shared script: a call with one part of two moves it out of its tree copy to
    the folder that outlives the call, names the part still to come and starts nothing; a part whose
    bytes are not the ones parts.sha256 names is dropped and asked for again."""
    stash, out = tmp_path / "stash", tmp_path / "out"
    first = tmp_path / "call1"
    _write_parts(first / ".gpu-pack", [b"first half", b"second half"])
    (first / ".gpu-pack" / "part-01").unlink()  # this call carries part-00 only
    p = _run_sh(first, stash, out)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 of 2 parts here; still to send: part-01" in p.stdout
    assert not (first / ".gpu-pack" / "part-00").exists() and (stash / "part-00").read_bytes() == b"first half"
    assert not (out / "gpu.json").exists()
    second = tmp_path / "call2"  # part-01 arrives, but not the bytes the pack was made of
    _write_parts(second / ".gpu-pack", [b"first half", b"second half"])
    (second / ".gpu-pack" / "part-00").unlink()
    (second / ".gpu-pack" / "part-01").write_bytes(b"something else")
    p = _run_sh(second, stash, out)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "part-01 is not the part parts.sha256 names" in p.stdout and "still to send: part-01" in p.stdout
    assert not (stash / "part-01").exists()


def test_run_sh_refuses_parts_that_join_into_another_pack(tmp_path):
    """Every part checks, but the joined bytes are not the pack's: the call stops before installing."""
    stash, out, call = tmp_path / "stash", tmp_path / "out", tmp_path / "call"
    _write_parts(call / ".gpu-pack", [b"a", b"b"], whole=b"not ab")
    p = _run_sh(call, stash, out)
    assert p.returncode == 3
    assert "is not the pack's" in p.stdout
    assert not (call / "site" / ".grpo-pack").exists()


def test_pack_strips_what_hopper_does_not_load_and_each_call_fits_the_limit(tmp_path):
    import zipfile

    from bench.gpu import pack

    wheel = tmp_path / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    keep = {"vllm/__init__.py": b"x" * 100, "vllm/_C_stable_libtorch.abi3.so": b"c" * 300,
            "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"3" * 200}
    drop = {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"2" * 400, "vllm/vllm-rs": b"r" * 50,
            "vllm/third_party/deep_gemm/_C.so": b"d" * 70}
    record = "".join(f"{n},sha256=x,{len(d)}\n" for n, d in {**keep, **drop}.items()) + "vllm-0.26.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in {**keep, **drop}.items():
            z.writestr(n, d)
        z.writestr("vllm-0.26.0.dist-info/RECORD", record)
    slim = tmp_path / "slim" / wheel.name
    slim.parent.mkdir()
    kept, dropped = pack.slim_vllm(wheel, slim)
    assert dropped == 520 and kept == 600 + len(record) - sum(len(f"{n},sha256=x,{len(d)}\n") for n, d in drop.items())
    with zipfile.ZipFile(slim) as z:
        assert set(z.namelist()) == {*keep, "vllm-0.26.0.dist-info/RECORD"}
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        rec = z.read("vllm-0.26.0.dist-info/RECORD").decode()
    assert "fa3" in rec and "fa2" not in rec and "vllm-rs" not in rec and "deep_gemm" not in rec
    tree = 3 * 2**20
    assert tree + pack.part_bytes(tree) + pack.MARGIN == pack.CALL_LIMIT
    calls = pack.device_calls(3)
    assert {c["command"] for c in calls} == {"bash bench/gpu/run.sh real"}  # one command, pasted three times
    assert [c["carry"] for c in calls] == [[f".gpu-pack/part-0{k}", ".gpu-pack/parts.sha256"] for k in range(3)]
    assert "3. run(command='bash bench/gpu/run.sh real', carry=['.gpu-pack/part-02'" in pack.render_calls(3)


def test_the_proof_reads_the_keywords_each_engine_passes_to_vllm():
    """The vllm_api step checks these against the installed vLLM's LLM and EngineArgs; here, that it
    finds the pipeline's keywords, those passed through `**dict(...)` expansions included."""
    from pathlib import Path

    from bench.gpu import proof

    got = proof.llm_kwargs(Path(proof.ROOT) / "pipeline/models/vllm_engine.py")
    assert {"model", "dtype", "seed", "logprobs_mode", "gpu_memory_utilization"} <= got
    assert {"kv_cache_memory_bytes", "enable_sleep_mode", "enable_lora", "max_lora_rank"} <= got  # from ** expansions
    assert proof.ORDER[:5] == ["vllm_api", "full", "full-vllm", "trl", "full-again"]  # the must-haves first
    assert set(proof.NEED_S) == set(proof.ORDER)


def test_report_compares_grpo_with_trl_on_each_engine_and_says_when_trl_fell_back():
    rows = [{"seconds": 30.0}, {"seconds": 9.0}, {"seconds": 11.0}]  # after the first: 10 s
    steps = {"full": {"rows": rows}, "full-vllm": {"rows": [{"seconds": 60.0}, {"seconds": 4.0}, {"seconds": 6.0}]},
             "trl": {"trl": "1.16.0", "generation": "hf generate", "cycle_s": [20.0, 10.0, 12.0]},
             "trl-vllm": {"trl": "1.16.0", "generation": "hf generate", "fallback": "hf generate",
                          "vllm_error": "Traceback ...\nRuntimeError: no CUDA", "cycle_s": [20.0, 11.0, 11.0]}}
    lines = report.trl_lines(steps)
    assert any("(trl-vllm)" in line and "vLLM colocate failed: RuntimeError: no CUDA" in line for line in lines)
    full = next(line for line in lines if line.startswith("grpo full ("))
    assert "10.0 s per iteration = 0.91 x TRL with HF generate" in full and "(bound 1.0 x TRL's HF-generate time: met)" in full
    assert "vLLM colocate" not in full  # a fallback is not TRL's vLLM time
    vllm = next(line for line in lines if line.startswith("grpo full-vllm"))
    assert "5.0 s per iteration = 0.45 x TRL with HF generate" in vllm and "met" in vllm
    steps["trl-vllm"] = {"trl": "1.16.0", "generation": "vllm colocate", "cycle_s": [30.0, 4.0]}
    vllm = next(line for line in report.trl_lines(steps) if line.startswith("grpo full-vllm"))
    assert "1.25 x TRL with vLLM colocate" in vllm
