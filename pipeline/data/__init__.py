"""Prompts: where they come from (`sources`: files, Parquet shards, `datasets` directories) and
how a run reads, renders and orders them (`prompts`)."""
