"""The run's configuration, one folder: a section per module (`data`, `rollout` with `agents`,
`rewards` with `judge`, `advantages`, `loss`, `train`, `eval`, `cluster`) on the one `base.Section`,
the root tree and its load/hash (`tree`), every rule across sections (`rules`), the one-line
errors (`errors`), `grpo init`'s options (`options`) and docs/config.md's generator (`doc`).
It imports nothing of the pipeline above it: reading a run's config never loads torch."""

from pipeline.config.tree import (ADDED_OPTIONS, ADDED_REWARD_OPTIONS, RECORD_ONLY, Config, canonical, config_hash, from_yaml_text, load,  # noqa: F401
                                  record_only, resolve, to_yaml)
