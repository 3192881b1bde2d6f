"""The embedded demos: generated data, a tiny locally built model, and the commands that run
them (`grpo demo`, `grpo make-data`, `grpo make-model`). Not the library: `pipeline/` holds only
what a user's own run needs; this package uses it as a user would.
"""
