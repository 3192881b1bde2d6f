"""What a run is, one folder: the run itself (run.py: its config, its policies, where each iteration
stands, `grpo init`), how a stage writes its parts into it (parts.py), its kind of policy (policy.py:
whole weights or a LoRA adapter, lora.py), a policy's files (weights_file.py), which policies keep
their weights (retention.py), where policy 0 comes from (gguf_import.py), the date its chat template
reads (template_date.py) and the check that the sampler ran the recorded policy (sampler_proof.py).
It builds on the storage (pipeline/store/) and the models and engines (pipeline/models/), which never
import it."""
