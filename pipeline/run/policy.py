"""What a policy is in a run, decided once from its config (`policy_kind`): whole weights
(`FullPolicy`, full fine-tuning) or a LoRA adapter on policy 0 (`LoraPolicy`, `train.lora`).

The stages ask this object instead of branching on `train.lora`: the model the trainer trains and
what its state and a published policy hold (pipeline/update), the weights a rollout engine
samples from (pipeline/rollout.py), the model a replay starts from (pipeline/loop/replay.py), and the
logprob pass's models (`LogprobModels`, used cold by `grpo logprobs` and warm by `iterate`).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.schedule import iteration_plan, old_from_update, uses_ref
from pipeline.store import MANIFEST


def on_logprob_device(model):
    """A logprob-pass model (whole or base + adapter) on the GPU if there is one: the one place
    that decides it (a LoRA old/reference model left on the CPU ran its pass on the host's cores,
    62 s against 4 s, in the first GPU proof)."""
    import torch

    from pipeline.models.kernels import same_kernels_every_run

    same_kernels_every_run()
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def load_model(path):
    """A whole policy (or reference) in fp32 for the logprob pass, on the GPU if there is one."""
    import torch
    from transformers import AutoModelForCausalLM

    return on_logprob_device(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))


class FullPolicy:
    """Every policy K is a whole model directory; the reference is policy 0 (or `ref_model`)."""

    ref_label = "policy/iter-0000"
    ref_in_old = False
    """The reference lives in the old model (a LoRA base with its adapter off): kept with it."""
    frozen_base = False
    """The trainer's state leaves the frozen base out (it is policy 0, stored once): saved without
    frozen parameters and loaded non-strictly."""

    def __init__(self, cfg):
        self.cfg = cfg

    # -- what `grpo init` prints and checks ---------------------------------------------------
    def training_line(self) -> str:
        return "full fine-tuning (every weight)"

    def reference_line(self) -> str:
        """What the reference is when no ref_model is given."""
        return "policy/iter-0000"

    def random_forward(self) -> str | None:
        """Why the trainer's forward is random (its logprobs then need their own pass), or None."""
        return None

    def check_model(self, model_dir: Path) -> None:
        """`grpo init`: the model can be trained as this policy (whole weights: any causal LM)."""

    def trainer_bytes(self, shape, bf16_linears: bool, world: int, fit: int) -> tuple[int, int, int]:
        """(what the trainer keeps per rank: weights, gradients, optimizer state as ZeRO splits them
        over `world` ranks; the fp32 models the logprob pass keeps; what its backward keeps a token and
        layer: the fp32 `fit` x hidden, half under bf16 with a bf16 module), in bytes (pipeline.models.device_budget)."""
        t, P = self.cfg.train, shape.params
        weights, grads, optim = (2 * P, 2 * P, 16 * P) if t.bf16 else (4 * P, 4 * P, 8 * P)
        z = t.zero_stage
        resident = weights // (world if z >= 3 else 1) + grads // (world if z >= 2 else 1) + optim // (world if z >= 1 else 1)
        kept = 4 * P * (int(uses_ref(self.cfg)) + int(not old_from_update(self.cfg)))  # fp32 ref and old models
        return resident, kept, (fit // 2 if bf16_linears and t.bf16 else fit) * shape.hidden  # fp32 module: fp32 residuals

    # -- the trainer ---------------------------------------------------------------------
    def train_model(self, policy_dir: Path, base_dir: Path | None, precision: str):
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)

    def save(self, module, out: Path, src_dir: Path, state_dict: dict | None, later: bool = False):
        """Policy K+1 as a plain HF model directory (`state_dict`: the fp32 master weights, if the
        module's own are not), with `src_dir`'s tokenizer and generation settings. Returns
        {file: sha256} of the files hashed as they were written (the weights, when streamed), or,
        with `later` and streamed weights, the `DeferredWeights` their file is left to."""
        import shutil

        from transformers.utils import logging as hf_logging

        from pipeline.run.weights_file import save_fp32_policy, streamable, write_config

        hf_logging.disable_progress_bar()  # "Writing model shards" per iteration; the stage reports its own progress
        hashed = save_fp32_policy(module, out, state_dict, later) if state_dict is not None else None
        if hashed is None:
            module.save_pretrained(out, safe_serialization=True, **({} if state_dict is None else {"state_dict": state_dict}))
            if state_dict is not None and streamable(state_dict):
                write_config(module, out)  # the weights are fp32 (consolidated) whatever the module's dtype
        for f in src_dir.iterdir():  # tokenizer and generation settings travel with the weights
            if f.is_file() and not (out / f.name).exists() and f.name != MANIFEST and not f.name.endswith(".safetensors"):
                shutil.copy2(f, out / f.name)
        return hashed or {}

    def manifest(self, run) -> dict | None:
        """What a published policy's manifest says about its base (nothing: it is whole)."""
        return None

    # -- sampling --------------------------------------------------------------------------
    def plain_dir(self, run, k: int) -> Path:
        """Policy k's tokenizer, chat template and model config: its own directory (before its weights)."""
        return run.policy_dir(k, weights=False)

    def engine_weights(self, run, k: int) -> tuple[Path, Path | None]:
        """(what the engine holds, named by a directory; the adapter it applies) to sample from policy k."""
        return run.policy_dir(k, weights=False), None

    def engine_tensors(self, run, k: int):
        """None (the engine reads policy k's directory), or a function giving policy k's weights as
        (name, tensor) pairs built in memory (a LoRA policy merged into its base)."""
        return None

    def engine_lora_rank(self) -> int | None:
        return None

    def probe_model(self, run, k: int):
        """Policy k from its stored files, fp32 on the CPU: what an engine's probe is checked against
        (pipeline.run.sampler_proof)."""
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(run.policy_dir(k), dtype=torch.float32).eval()

    # -- replay and export ----------------------------------------------------------------
    def replay_model(self, src, k: int) -> Path:
        """A replay's model: SRC's policy K as whole weights."""
        return src.policy_dir(k).resolve()

    def replay_reference(self, src) -> Path | None:
        """The ref_model a replay of SRC needs to keep SRC's reference (its policy 0), or None when
        the replay's own model already holds it (a LoRA replay: NEW's base, SRC's policy 0)."""
        return src.policy_dir(0).resolve()

    def stored_as_adapter(self, k: int) -> bool:
        """Whether policy k is stored as an adapter on policy 0 rather than as whole weights."""
        return False

    def export(self, run, k: int, out: Path, merged: bool) -> str:
        """Policy k copied to `out` (verified by the caller); what to say about loading it."""
        import shutil

        shutil.copytree(run.policy_dir(k), out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST, ".complete"))
        return f"policy {k} -> {out} (load with AutoModelForCausalLM.from_pretrained('{out}'))"

    # -- the logprob pass ------------------------------------------------------------------
    def load_old(self, run, k: int):
        return load_model(run.policy_dir(k))

    def give_old(self, model, run, k: int) -> None:
        """A loaded old model given policy k's weights in place (every weight: `load_dir_strict`)."""
        from pipeline.models.strict import load_dir_strict

        load_dir_strict(model, run.policy_dir(k), f"logprobs: policy/iter-{k:04d}")
        model.tie_weights()

    def ref_of(self, run, old):
        return load_model(run.ref_dir())


class LoraPolicy(FullPolicy):
    """Policy 0 is the base; every policy K >= 1 is a PEFT adapter on it. The reference is the
    base with the adapter off, in the same loaded model."""

    ref_label = "policy/iter-0000 (adapter off)"
    ref_in_old = True
    frozen_base = True

    def training_line(self) -> str:
        lora = self.cfg.train.lora
        targets = lora.target_modules if isinstance(lora.target_modules, str) else ", ".join(lora.target_modules)
        return f"LoRA r={lora.r} alpha={lora.alpha:g} on {targets} (policies K >= 1 are adapters)"

    def reference_line(self) -> str:
        return "the base with the adapter off"

    def random_forward(self) -> str | None:
        return "LoRA dropout" if self.cfg.train.lora.dropout > 0 else None

    def check_model(self, model_dir: Path) -> None:
        from pipeline.run.lora import check_targets

        check_targets(model_dir, self.cfg.train.lora)

    def trainer_bytes(self, shape, bf16_linears: bool, world: int, fit: int) -> tuple[int, int, int]:
        """The frozen base (its linears in bf16 under bf16 precision) and 16 bytes per adapter
        parameter, on every rank; the old and reference models share the one loaded base. Under bf16
        the backward keeps bf16 tensors and lora_A's own bf16 cast of each adapted linear's input
        (q, k, v, o, gate, up: 6 x hidden; down: intermediate)."""
        P, embed = shape.params, shape.vocab * shape.hidden
        resident = 4 * embed + (2 if bf16_linears else 4) * (P - embed) + 16 * shape.lora_params(self.cfg.train.lora.r)
        kept = 4 * P if not (old_from_update(self.cfg) and not uses_ref(self.cfg)) else 0  # one base for old and ref
        h = shape.hidden
        return resident, kept, (fit // 2 * h + 2 * (6 * h + shape.intermediate)) if bf16_linears else fit * h

    def train_model(self, policy_dir: Path, base_dir: Path | None, precision: str):
        from pipeline.run import lora

        adapter = policy_dir if lora.is_adapter(policy_dir) else None
        model = lora.policy_model(base_dir or policy_dir, adapter, self.cfg.train.lora, trainable=True, seed=self.cfg.seed)
        if precision == "bf16":
            lora.frozen_linears_to_bf16(model)  # the same arithmetic under autocast, half the base's memory
        return model

    def save(self, module, out: Path, src_dir: Path, state_dict: dict | None, later: bool = False) -> dict[str, str]:
        from pipeline.run.lora import save_adapter  # small files: written at once, whatever `later` says

        save_adapter(module, out, state_dict=state_dict)
        return {}  # an adapter is small: hashed when it is published

    def manifest(self, run) -> dict | None:
        from pipeline.run.lora import adapter_manifest

        return adapter_manifest(run.policy_hash(0))

    def plain_dir(self, run, k: int) -> Path:
        """An adapter has no tokenizer or model config of its own: its base's."""
        return run.policy_dir(0) if self.stored_as_adapter(k) else run.policy_dir(k)

    def engine_weights(self, run, k: int) -> tuple[Path, Path | None]:
        """merged: policy k's adapter directory names the merged weights the engine holds, which
        reach it from memory (`engine_tensors`), never through a merged model written to disk."""
        if self.cfg.rollout.lora_mode == "vllm_lora":
            return run.policy_dir(0), run.policy_dir(k) if k > 0 else None
        return run.policy_dir(k), None

    def engine_tensors(self, run, k: int):
        if self.cfg.rollout.lora_mode == "vllm_lora" or k == 0:
            return None
        from pipeline.run.lora import merged_weights

        base, adapter = run.policy_dir(0), run.policy_dir(k)
        return lambda: merged_weights(base, adapter)

    def probe_model(self, run, k: int):
        from pipeline.run.lora import policy_model

        # the base with adapter k, fp32 on the CPU (not the logprob pass's device: a GPU's memory is the engine's)
        return policy_model(run.policy_dir(0), run.policy_dir(k) if k > 0 else None, self.cfg.train.lora, trainable=False,
                            seed=self.cfg.seed)

    def engine_lora_rank(self) -> int | None:
        from pipeline.run.lora import vllm_rank

        return vllm_rank(self.cfg.train.lora, self.cfg.rollout.max_lora_rank) if self.cfg.rollout.lora_mode == "vllm_lora" else None

    def replay_reference(self, src) -> Path | None:
        return None

    def stored_as_adapter(self, k: int) -> bool:
        return k > 0

    def export(self, run, k: int, out: Path, merged: bool) -> str:
        """An adapter with its base_model_name_or_path set to the run's policy 0, or (`merged`) the
        base with the adapter merged in, a plain HF model."""
        import json

        from pipeline.run.lora import ADAPTER_CONFIG, merge

        if not self.stored_as_adapter(k):
            return super().export(run, k, out, merged)
        if merged:
            merge(run.policy_dir(0), run.policy_dir(k), out)
            return f"policy {k} (adapter merged into policy 0) -> {out} (load with AutoModelForCausalLM.from_pretrained('{out}'))"
        super().export(run, k, out, merged)
        base = run.policy_dir(0).resolve()
        conf = json.loads((out / ADAPTER_CONFIG).read_text())
        conf["base_model_name_or_path"] = str(base)
        (out / ADAPTER_CONFIG).write_text(json.dumps(conf, indent=2, sort_keys=True))
        return (f"policy {k} (LoRA adapter) -> {out} (load with PeftModel.from_pretrained(base, '{out}'), base {base}; "
                "--merged for a plain model)")

    def replay_model(self, src, k: int) -> Path:
        """A policy K >= 1 is an adapter: merged into SRC's base (built once per policy in the
        local cache), on which the replay trains a fresh adapter."""
        if k == 0:
            return src.policy_dir(0).resolve()
        from pipeline.run.lora import merged_dir

        return merged_dir(src, k)

    def load_old(self, run, k: int):
        from pipeline.run.lora import policy_model

        return on_logprob_device(policy_model(run.policy_dir(0), run.policy_dir(k) if k > 0 else None, self.cfg.train.lora,
                                              trainable=False, seed=self.cfg.seed))

    def give_old(self, model, run, k: int) -> None:
        from pipeline.run.lora import set_policy

        set_policy(model, run.policy_dir(k) if k > 0 else None)

    def ref_of(self, run, old):
        from pipeline.run.lora import AdapterOff

        return AdapterOff(old)


def policy_kind(cfg) -> FullPolicy:
    """The run's policy object: `LoraPolicy` with `train.lora`, else `FullPolicy`."""
    return LoraPolicy(cfg) if cfg.train.lora is not None else FullPolicy(cfg)


class LogprobModels:
    """The logprob pass's models, as `pipeline.schedule` says iteration k needs them: loaded
    on first use and given policy k's weights in place after that. `grpo logprobs` makes one for
    its iteration (cold); `iterate` keeps one across iterations (warm): the same code either way.
    """

    def __init__(self, run):
        self.run = run
        self.policy = run.policy
        self.old = self.ref = None
        self.old_k: int | None = None

    def for_iteration(self, k: int) -> tuple:
        """(old model or None, reference or None, ref_is_old) for iteration k. None old: the
        update's forward gives the old logprobs (`schedule.old_from_update`). ref_is_old: the
        reference is policy k itself (iteration 0 without a ref_model), the reference returned
        is the old model and its logprobs are the old ones."""
        p, plan = self.policy, iteration_plan(self.run.cfg, k)
        need_old, need_ref = plan.old_pass, plan.ref_pass
        if not need_old and not need_ref:  # no pass at all: nothing is kept
            self.old = self.ref = self.old_k = None
            return None, None, False
        if need_old or (need_ref and p.ref_in_old):  # a LoRA reference is the old model's base
            if self.old is None:
                self.old = p.load_old(self.run, k)
            elif self.old_k != k:
                p.give_old(self.old, self.run, k)
            self.old_k = k
        elif self.old is not None and not p.ref_in_old:  # not needed: its memory goes back
            self.old, self.old_k = None, None
        if need_ref and self.ref is None:
            self.ref = p.ref_of(self.run, self.old)
        if plan.ref_is_old:
            return self.old, self.old, True
        return None if plan.old_from_update else self.old, self.ref if plan.reference else None, False
