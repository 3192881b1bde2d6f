"""LoRA adapters (PEFT) over one loaded base.

A LoRA run's base is policy/iter-0000 (a plain HF directory); policy/iter-K for K >= 1 holds
only an adapter in PEFT's format (adapter_config.json + adapter_model.safetensors), loadable
with `PeftModel.from_pretrained(base, dir)`. Policy 0 is the base with a zero adapter (LoRA's
B starts at 0), so the base, the policy 0 and the reference compute the same logprobs.

- logprobs: old = base + adapter K, ref = the same loaded model with the adapter disabled.
- update: only the adapter's parameters are trained (and checkpointed).
- rollout: the engine gets policy K as merged weights built in memory (`merged_weights`; `merged_dir`
  writes them to disk only for a replay's policy 0 and `export --merged`) or,
  with rollout.lora_mode vllm_lora, the adapter itself through a LoRARequest.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import GRPOError
from pipeline.store import cache_dir

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_NAME = "policy/iter-0000"  # what a stored adapter names as its base (stable across machines)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def check_targets(model_dir: Path, spec) -> None:
    """Every target_modules entry names at least one linear module of the model (checked on
    the meta device: no weights are read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out_names = {n for n, m in model.named_modules() if m is model.get_output_embeddings()}
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in out_names]
    if spec.target_modules == "all-linear":
        if not linear:
            raise GRPOError(f"train.lora.target_modules all-linear: {model_dir} has no linear layers to adapt")
        return
    for t in spec.target_modules:
        if not any(_matches(n, t) for n in linear):
            names = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise GRPOError(f"train.lora.target_modules {t!r}: matches no linear module of {model_dir} (it has {', '.join(names)})")


def peft_config(spec):
    from peft import LoraConfig

    return LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, bias="none", task_type="CAUSAL_LM",
                      target_modules=spec.target_modules)


def load_base(base_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars between the stages' own progress lines
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.config.use_cache = False
    return model


def policy_model(base_dir: Path, adapter_dir: Path | None, spec, trainable: bool, seed: int = 0):
    """The base with adapter K on it (policy 0: a fresh adapter, which changes nothing)."""
    import torch
    from peft import PeftModel, get_peft_model

    base = load_base(base_dir)
    if adapter_dir is None:
        with torch.random.fork_rng():
            torch.manual_seed(seed)  # LoRA's A is random (B = 0): seeded, so reruns save the same bytes
            model = get_peft_model(base, peft_config(spec))
    else:
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=trainable)
    if not trainable:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
    return model


def frozen_linears_to_bf16(model) -> int:
    """Hold the frozen base's Linear weights in bf16, for a model that runs under bf16 autocast.
    Autocast feeds a Linear bf16(W) whatever W is held in (rounded as `.to` rounds), so the
    forward and the adapter's gradients are the same bits, the base takes half its memory and no
    bf16 copy of it is made per forward. Embeddings, norms, the LM head (fp32 in
    `token_logprobs`) and the adapter stay fp32. Returns how many weights were cast.

    The other frozen weights get memory of their own: loaded, they are views of the checkpoint's
    memory-mapped file, which they would keep mapped with every page the cast read (resident,
    ~0.3 GB of RSS on SmolLM2-135M, for 113 MB of embeddings)."""
    import torch

    keep = {id(model.get_output_embeddings().weight), id(model.get_input_embeddings().weight)}
    n = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if type(module) is torch.nn.Linear and id(w) not in keep and not w.requires_grad and w.dtype == torch.float32:
            module.weight.data = w.data.to(torch.bfloat16)
            n += 1
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad and p.dtype == torch.float32:
                p.data = p.data.clone()
    return n


def set_policy(model, adapter_dir: Path | None) -> None:
    """Give a loaded PeftModel adapter K's weights in place (None: the zero adapter of policy 0)."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    with torch.no_grad():
        if adapter_dir is None:
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.zero_()
            return
        result = set_peft_model_state_dict(model, load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS)))
    if getattr(result, "unexpected_keys", None):
        raise GRPOError(f"{adapter_dir}: adapter does not fit the loaded base (unexpected {result.unexpected_keys[0]})")


class AdapterOff:
    """The reference of a LoRA run: the policy's loaded base with its adapter disabled."""

    def __init__(self, model):
        self.model = model

    @contextmanager
    def active(self):
        with self.model.disable_adapter():
            yield self.model


def save_adapter(model, out: Path, state_dict: dict | None = None) -> None:
    """PEFT's adapter files only, naming the base by its place in the run (not a local path)."""
    cfg = model.peft_config["default"]
    old = cfg.base_model_name_or_path
    cfg.base_model_name_or_path = BASE_NAME
    try:
        with warnings.catch_warnings():  # PEFT looks for the base's config at that name to see if embeddings grew
            warnings.filterwarnings("ignore", message="Could not find a config file")
            model.save_pretrained(str(out), state_dict=state_dict, safe_serialization=True)
    finally:
        cfg.base_model_name_or_path = old
    (Path(out) / "README.md").unlink(missing_ok=True)  # PEFT's model card: not part of the policy
    # PEFT writes target_modules from a set: its order changes with the process's hash seed
    conf_file = Path(out) / ADAPTER_CONFIG
    conf = json.loads(conf_file.read_text())
    if isinstance(conf.get("target_modules"), list):
        conf["target_modules"] = sorted(conf["target_modules"])
    conf_file.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")


def adapter_manifest(base_hash: str) -> dict:
    return {"base": BASE_NAME, "base_policy_hash": base_hash}


def _copy_side_files(src: Path, out: Path) -> None:
    """Tokenizer, chat template and generation settings travel with merged weights."""
    for f in Path(src).iterdir():
        if f.is_file() and not (out / f.name).exists() and f.name != "MANIFEST.json" and not f.name.endswith(".safetensors") \
                and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)


def merged_model(base_dir: Path, adapter_dir: Path):
    """The base with the adapter merged into its weights: W + delta W, as PEFT's merge computes
    it, but into new memory. PEFT adds in place, into base weights that are copy-on-write views
    of the checkpoint's memory-mapped file: a page fault and a page copy per 4 KB (0.8 s of a
    LoRA rollout's hand-over on SmolLM2-135M, against 0.2 s; the same bits, a test compares).
    A variant PEFT merges its own way (DoRA) is left to PEFT."""
    from peft.tuners.lora import LoraLayer

    model = policy_model(base_dir, adapter_dir, None, trainable=False)
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for name in module.active_adapters:
            if name not in module.lora_A:
                continue
            if name in getattr(module, "lora_variant", {}) or module.lora_bias.get(name):
                module.merge(adapter_names=[name])
                continue
            base = module.get_base_layer()
            base.weight.data = base.weight.data + module.get_delta_weight(name)
    return model.unload()


def merged_weights(base_dir: Path, adapter_dir: Path) -> list:
    """The merged model's weights as (name, tensor) pairs named as `merge` would store them (tied
    copies left out): what a rollout engine loads in place, with no merged model on disk."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model = merged_model(base_dir, adapter_dir)
    return list(remove_tied_weights_from_state_dict(model.state_dict(), model).items())


def merge(base_dir: Path, adapter_dir: Path, out: Path) -> None:
    """A plain HF model: the base with the adapter merged into its weights."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = merged_model(base_dir, adapter_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.save_pretrained(str(out), safe_serialization=True)
    _copy_side_files(base_dir, out)


def merged_dir(run, k: int) -> Path:
    """Policy k of a LoRA run as merged weights, in the local cache (built once per policy)."""
    import filelock

    dest = cache_dir() / "merged" / run.policy_hash(k)[:24]
    done = dest / ".complete"
    if done.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(dest) + ".lock"):
        if not done.exists():
            tmp = dest.parent / f".tmp-{uuid.uuid4().hex}"
            try:
                merge(run.policy_dir(0), run.policy_dir(k), tmp)
                tmp.joinpath(".complete").write_text("")
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    _prune_merged(dest)
    return dest


def _prune_merged(keep: Path, n: int = 2) -> None:
    """Merged copies are full-size: keep the newest few."""
    dirs = sorted((d for d in keep.parent.iterdir() if d.is_dir() and (d / ".complete").exists()),
                  key=lambda d: d.stat().st_mtime, reverse=True)
    for d in dirs[n:]:
        if d != keep:
            shutil.rmtree(d, ignore_errors=True)


def vllm_rank(spec, given: int | None) -> int:
    r = given or spec.r
    return next((v for v in VLLM_RANKS if v >= r), r)
