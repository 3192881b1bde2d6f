"""A policy's weights file written in one pass: `write_safetensors` writes what
`safetensors.torch.save_file` would write, byte for byte, and hashes the bytes as they go out
(nothing is read back); `save_fp32_policy` writes the files `save_pretrained` would for given fp32
weights (the trainer's fp32 master, pipeline.update.weights), config.json saying float32, or
leaves the weights file to a `DeferredWeights` whose sha256 is known before it is written (the
background write of `iterate`, pipeline.update.publish).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch

from pipeline.store import atomic_write

SAFETENSORS_DTYPE = {torch.float32: "F32"}


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[bytes, list[str]]:
    """The 8-byte length and JSON header `safetensors` writes for `tensors` (all fp32), and the
    order their bytes follow in: by name, as safetensors sorts tensors of one dtype."""
    order = sorted(tensors)
    head: dict = {"__metadata__": metadata} if metadata else {}
    pos = 0
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        head[name] = {"dtype": SAFETENSORS_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def _chunks(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None):
    """The bytes of the safetensors file of `tensors`, in the order it holds them (no copy of a
    contiguous tensor)."""
    header, order = safetensors_header(tensors, metadata)
    yield header
    for name in order:
        yield memoryview(tensors[name].detach().contiguous().numpy()).cast("B")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write `tensors` (fp32, on the CPU) as one safetensors file and return its sha256, computed
    from the bytes as they are written."""
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for data in _chunks(tensors, metadata):
            h.update(data)
            f.write(data)
    return h.hexdigest()


class DeferredWeights:
    """A safetensors file not written yet, whose sha256 (`hash`) is computed in memory over exactly
    the bytes `write` will put in it (nothing is read back). The tensors must not change until
    `write` returns: the caller keeps the optimizer from stepping them (pipeline.update.publish)."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None):
        self.path, self.tensors, self.metadata = Path(path), tensors, metadata
        self.sha256: str | None = None

    def hash(self) -> str:
        """The file's sha256 (one pass over the tensors in memory, once)."""
        if self.sha256 is None:
            h = hashlib.sha256()
            for data in _chunks(self.tensors, self.metadata):
                h.update(data)
            self.sha256 = h.hexdigest()
        return self.sha256

    def write(self, path: Path | None = None) -> None:
        """The file, at `path` (default: where it was planned), written atomically, it and its
        directory synced before it returns: the policy's MANIFEST.json, written next, must never
        name a file a power loss could leave empty or absent."""
        atomic_write(Path(path or self.path), _chunks(self.tensors, self.metadata), sync_dir=True)


def names_to_write(saved) -> set[str] | None:
    """The tensor names the weights file of `saved` (what saving a policy returned) will hold, where
    it is a `DeferredWeights` not written yet; None where its files are written (read from them)."""
    return set(saved.tensors) if isinstance(saved, DeferredWeights) else None


def streamable(tensors: dict[str, torch.Tensor]) -> bool:
    return all(t.dtype in SAFETENSORS_DTYPE and t.device.type == "cpu" for t in tensors.values())


def save_fp32_policy(module, out: Path, state: dict[str, torch.Tensor], later: bool = False) -> dict[str, str] | DeferredWeights | None:
    """The weights file and config `module.save_pretrained(out, state_dict=state)` would write,
    the weights streamed with their sha256 ({file name: sha256}), config.json saying float32.
    None (nothing written) where that needs save_pretrained itself (a sharded or non-fp32 model).
    `later`: the weights file is neither written nor hashed; its `DeferredWeights` is returned."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers.modeling_utils import remove_tied_weights_from_state_dict, revert_weight_conversion
    from transformers.utils import SAFE_WEIGHTS_NAME

    state = revert_weight_conversion(module, _untied(state, module, remove_tied_weights_from_state_dict))
    if not streamable(state):
        return None
    split = split_torch_state_dict_into_shards(state, filename_pattern=SAFE_WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
                                               max_shard_size="50GB")
    if split.is_sharded:
        return None
    out.mkdir(parents=True, exist_ok=True)
    write_config(module, out)
    tensors = {n: t.contiguous() for n, t in state.items()}
    if later:
        return DeferredWeights(out / SAFE_WEIGHTS_NAME, tensors, {"format": "pt"})
    return {SAFE_WEIGHTS_NAME: write_safetensors(out / SAFE_WEIGHTS_NAME, tensors, {"format": "pt"})}


def _untied(state: dict[str, torch.Tensor], module, remove_tied) -> dict[str, torch.Tensor]:
    """`state` without the tied names transformers' `remove_tied` drops (a tied LM head), decided on
    stand-ins: the fp32 master's tensors are views of one flat buffer, which `remove_tied` takes for
    tensors sharing memory and clones, every one of them (the whole model copied, each iteration)."""
    stand: dict[tuple, torch.Tensor] = {}
    proxy = {n: stand.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()), torch.empty(1))
             for n, t in state.items()}  # one per view: tied names (the same view) share it
    return {n: state[n] for n in remove_tied(proxy, module)}


def write_config(module, out: Path) -> None:
    """config.json (dtype float32: the weights written are the fp32 master whatever the module's
    own dtype) and generation_config.json, as save_pretrained writes them."""
    cfg = module.config
    before = cfg.dtype
    cfg.dtype = "float32"
    cfg.architectures = [module.__class__.__name__]
    try:
        cfg.save_pretrained(out)
    finally:
        cfg.dtype = before
    if module.can_generate() and getattr(module, "generation_config", None) is not None:
        module.generation_config.save_pretrained(out)


def empty_model(config_dir: Path):
    """The causal LM of `config_dir`'s config.json, fp32 on the CPU, in eval mode, its parameters
    empty (`emptied`): `load_strict(..., assign=True)` gives it a policy's tensors themselves, with
    no copy. No random initialisation first (1.9 s of 2 for SmolLM2-135M)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    return emptied(model).eval()


def emptied(model):
    """`model` with every parameter on the meta device (its shape kept, no storage): the tensors it
    held go back to their owner, and `load_strict(..., assign=True)` gives it new ones."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
    return model
