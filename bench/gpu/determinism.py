"""Is the HF engine's sampling on CUDA the same from one process to the next? (The proof's
`compare-full` step found two identical bf16 runs' iteration-0 rollouts differ from token ~70 on.)

    python -m bench.gpu.determinism OUT          (on the GPU machine, after run.sh's install)

Builds the proof's real-size model, then samples the proof's first rollout (16 prompts x 8,
256 new tokens, bf16) in fresh processes, twice per process, per mode:
  default  as the engine runs today
  det      CUBLAS_WORKSPACE_CONFIG=:4096:8 + torch.use_deterministic_algorithms(True) + no TF32
and writes, per process, the sha256 of each generation's token ids and of its logprobs."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def child(model: str, mode: str, out: str) -> None:
    if mode == "det":
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    import torch

    if mode == "det":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = False
    from pipeline.config.rollout import RolloutConfig
    from pipeline.models.hf_engine import HFEngine

    eng = HFEngine(Path(model), RolloutConfig(engine="hf", num_generations=8, max_new_tokens=int(os.environ.get("DET_TOKENS", "256"))), 1024, 0, precision="bf16")
    tok = eng.tokenizer
    prompts = [json.loads(l)["prompt"] for l in (Path(model).parent / "det-prompts.jsonl").read_text().splitlines()]
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True) for p in prompts]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]  # a BatchEncoding or a list
    got = []
    for rep in range(2):
        t = time.time()
        groups = eng.generate(ids, list(range(100, 100 + len(ids))), 8)
        toks = [s.token_ids for g in groups for s in g]
        lps = [s.logprobs for g in groups for s in g]
        got.append({"rep": rep, "seconds": round(time.time() - t, 2),
                    "ids": hashlib.sha256(json.dumps(toks).encode()).hexdigest()[:16],
                    "logprobs": hashlib.sha256(json.dumps(lps).encode()).hexdigest()[:16],
                    "tokens": toks})
    Path(out).write_text(json.dumps({"mode": mode, "dtype": eng.dtype, "gens": got}))


def main(out: Path) -> int:
    from bench.gpu import assets

    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("DET_WORK", "/tmp/grpo-det"))
    work.mkdir(exist_ok=True)
    model = work / "model"
    if not (model / "config.json").is_file():
        assets.build_model(model, assets.SIZES[os.environ.get("DET_SIZE", "real")]["shape"])
    assets.write_data(work / "det-prompts.jsonl", 16)
    results = []
    for mode in ("default", "default", "det", "det"):
        f = work / f"{mode}-{len(results)}.json"
        t = time.time()
        p = subprocess.run([sys.executable, "-m", "bench.gpu.determinism", "child", str(model), mode, str(f)],
                           capture_output=True, text=True)
        if p.returncode:
            print(p.stdout[-2000:], p.stderr[-3000:], flush=True)
            return 1
        r = json.loads(f.read_text())
        results.append(r)
        print(mode, round(time.time() - t, 1), "s", [(g["ids"], g["logprobs"], g["seconds"]) for g in r["gens"]], flush=True)
    base = results[0]["gens"][0]["tokens"]
    for r in results:
        for g in r["gens"]:
            diverge = [next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(base, g["tokens"])]
            g["rows_equal_to_first"] = sum(d is None for d in diverge)
            g["first_divergence"] = min((d for d in diverge if d is not None), default=None)
            del g["tokens"]
    (out / "determinism.json").write_text(json.dumps(results, indent=1))
    for r in results:
        print(r["mode"], [(g["ids"], g["rows_equal_to_first"], g["first_divergence"]) for g in r["gens"]])
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "child":
        child(*sys.argv[2:5])
    else:
        sys.exit(main(Path(sys.argv[1])))
