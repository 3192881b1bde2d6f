"""Models: generation engines (engines: vLLM, HF), the forward's tokens and logprobs (tokens, packing, fused),
strict weight loading (strict), and how they use the machine (device_budget, engine_memory)."""
