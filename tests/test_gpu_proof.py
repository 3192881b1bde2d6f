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
