"""The `grpo` command line: one thin module per command, joined in `stages.cli`."""
