"""Rewards: the TRL reward contract (contract), the built-ins (builtins) and their typed options (config),
async and batched calls (calls), answer checking (answers), the code sandbox (sandbox)."""
