"""Models: generation engines (engines: vLLM, HF), LoRA adapters (lora), GGUF import (gguf_import)."""
