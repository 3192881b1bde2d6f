"""Parquet schemas of the run's artifacts, one per kind, each versioned.

Writing casts a table to its kind's schema and stamps `grpo.kind` / `grpo.schema_version` into
the Parquet metadata; reading checks both and every declared column, and raises
`SchemaError` naming the file and the offending column. Bump a version whenever a declared
column changes meaning or type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

KIND_KEY = b"grpo.kind"
VERSION_KEY = b"grpo.schema_version"


class SchemaError(ValueError):
    """An artifact does not match its declared schema (message names file and column)."""


@dataclass(frozen=True)
class ArtifactSchema:
    kind: str
    version: int
    schema: pa.Schema
    extra_columns: bool = False
    """Columns beyond the declared ones are allowed (dataset columns, one per reward)."""
    reads: tuple[int, ...] = ()
    """Older versions this grpo still reads (their columns are a subset of this version's)."""
    added: dict[str, int] = field(default_factory=dict)
    """Declared columns introduced after version 1: column -> the version that added it. A part
    of an older version may lack them; `upgrade` gives it them as nulls, so readers see one shape."""
    doc: dict[str, str] = field(default_factory=dict)

    def metadata(self, extra: dict[str, str] | None = None) -> dict[bytes, bytes]:
        meta = {KIND_KEY: self.kind.encode(), VERSION_KEY: str(self.version).encode()}
        for k, v in (extra or {}).items():
            meta[f"grpo.{k}".encode()] = str(v).encode()
        return meta

    def conform(self, table: pa.Table, extra_meta: dict[str, str] | None = None) -> pa.Table:
        """Cast `table` to this schema (declared columns first, extras after) and stamp metadata."""
        missing = [f.name for f in self.schema if f.name not in table.column_names]
        if missing:
            raise SchemaError(f"{self.kind}: missing column {missing[0]!r}")
        extras = [c for c in table.column_names if c not in self.schema.names]
        if extras and not self.extra_columns:
            raise SchemaError(f"{self.kind}: unexpected column {extras[0]!r}")
        cols, fields = [], []
        for f in self.schema:
            try:
                cols.append(table.column(f.name).cast(f.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
                raise SchemaError(f"{self.kind}: column {f.name!r} cannot be cast to {f.type}: {err}") from None
            fields.append(f)
        for name in extras:
            cols.append(table.column(name))
            fields.append(table.schema.field(name))
        schema = pa.schema(fields, metadata=self.metadata(extra_meta))
        return pa.Table.from_arrays(cols, schema=schema)

    def check(self, schema: pa.Schema, where: str) -> None:
        """Raise SchemaError unless `schema` (read from `where`) is this kind at this version."""
        meta = schema.metadata or {}
        kind = meta.get(KIND_KEY, b"").decode()
        if kind != self.kind:
            raise SchemaError(f"{where}: not a {self.kind} artifact (kind {kind or 'missing'!r})")
        version = meta.get(VERSION_KEY, b"").decode()
        if version not in {str(v) for v in (self.version, *self.reads)}:
            raise SchemaError(
                f"{where}: {self.kind} schema version {version or 'missing'}, this grpo reads version {self.version}"
            )
        for f in self.schema:
            if f.name not in schema.names and self.added.get(f.name, 1) > int(version):
                continue  # introduced after this part's version: `upgrade` fills it in
            if f.name not in schema.names:
                raise SchemaError(f"{where}: missing column {f.name!r}")
            got = schema.field(f.name).type
            if got != f.type:
                raise SchemaError(f"{where}: column {f.name!r} has type {got}, expected {f.type}")
        if not self.extra_columns:
            extras = [n for n in schema.names if n not in self.schema.names]
            if extras:
                raise SchemaError(f"{where}: unexpected column {extras[0]!r}")


    def upgrade(self, table: pa.Table) -> pa.Table:
        """A checked part of an older version with the columns added since as nulls (at their
        declared place), so that every reader sees this version's columns."""
        for f in self.schema:
            if f.name not in table.column_names:
                table = table.add_column(self.schema.get_field_index(f.name), f, pa.nulls(table.num_rows, f.type))
        return table


_ids = pa.list_(pa.int32())
_floats = pa.list_(pa.float32())

ROLLOUT = ArtifactSchema(
    kind="rollout",
    # v2: `completion_mask` and `episode`, for multi-turn episodes (tools, environments): the
    # completion is then the whole episode after the prompt, model turns and the tool results
    # between them. Both are null for a single sampled completion, as every v1 row is.
    version=2,
    reads=(1,),
    added={"completion_mask": 2, "episode": 2},
    extra_columns=True,  # the dataset's other columns travel along for the reward functions
    schema=pa.schema(
        [
            pa.field("prompt_id", pa.int64(), nullable=False),  # row of data.train
            pa.field("sample_idx", pa.int32(), nullable=False),  # 0..G-1 within the group
            pa.field("group_idx", pa.int32(), nullable=False),  # position of the prompt in the iteration
            pa.field("prompt", pa.string()),  # rendered prompt text (after the chat template)
            pa.field("prompt_raw", pa.string()),  # the dataset's prompt value, JSON-encoded
            pa.field("prompt_ids", _ids),
            pa.field("completion", pa.string()),
            pa.field("completion_ids", _ids),
            pa.field("sampler_logprobs", _floats),  # the engine's logprob of each sampled token
            pa.field("finish_reason", pa.string()),  # stop | length
            pa.field("truncated", pa.bool_()),
            pa.field("completion_length", pa.int32()),  # tokens the model sampled (an episode: the mask's 1s)
            pa.field("policy_hash", pa.string()),
            # 1 where the model sampled the token, 0 where the episode's context put it there (a
            # tool result, an environment observation, the chat template's glue between turns);
            # len = len(completion_ids). Loss, KL, token counts and the sampler's ratio count the
            # 1s only. null: every token was sampled (a single completion).
            pa.field("completion_mask", pa.list_(pa.int8())),
            # the episode turn by turn, JSON: messages (assistant text, tool calls and their
            # arguments, tool results and errors, timings) and how it ended; null for a single completion
            pa.field("episode", pa.string()),
        ]
    ),
)

SCORE = ArtifactSchema(
    kind="score",
    # v2: optional `extra_<column>` columns (what reward functions logged with log_extra:
    # float64, or string when a value is not a number) and `grpo.reward_metrics` in the
    # metadata ({name: [sum, count]} of log_metric). A v1 part is a v2 part without them.
    version=2,
    reads=(1,),
    extra_columns=True,  # one float64 column `reward_<name>` per reward function, `extra_<column>` per log_extra column
    schema=pa.schema(
        [
            pa.field("prompt_id", pa.int64(), nullable=False),
            pa.field("sample_idx", pa.int32(), nullable=False),
            pa.field("group_idx", pa.int32(), nullable=False),
            pa.field("reward", pa.float64()),  # weighted nansum of the reward columns
            pa.field("advantage", pa.float32()),
            pa.field("group_mean", pa.float64()),
            pa.field("group_std", pa.float64()),
            pa.field("zero_std", pa.bool_()),  # the group's rewards have no spread
            pa.field("train", pa.bool_()),  # false: dropped by dynamic sampling
        ]
    ),
)
REWARD_PREFIX = "reward_"
EXTRA_PREFIX = "extra_"

LOGPROBS = ArtifactSchema(
    kind="logprobs",
    version=1,
    schema=pa.schema(
        [
            pa.field("prompt_id", pa.int64(), nullable=False),
            pa.field("sample_idx", pa.int32(), nullable=False),
            pa.field("old_logprobs", _floats),  # null when the update takes them from its own forward
            pa.field("ref_logprobs", _floats),  # null when no reference pass is needed
            pa.field("sampler_gap_mean", pa.float32()),  # mean |old - sampler| over tokens
            pa.field("sampler_gap_max", pa.float32()),
        ]
    ),
)

OLD_LOGPROBS = "old_logprobs.parquet"
"""iter-K/update/old_logprobs.parquet (a LOGPROBS table, ref_logprobs null): the old logprobs the
update took from its own forward when the logprobs stage skipped that pass (`train.old_logprobs`)."""

ROLLOUT_CORRECTION_METRICS = ("rollout_correction/ratio_mean", "rollout_correction/ratio_min", "rollout_correction/ratio_max",
                              "rollout_correction/clipped_frac")
"""`loss.rollout_correction`'s weight w = old / sampler per optimizer step, over the model's tokens:
mean, min, max (after truncation or masking, as TRL logs it) and the share of tokens truncated or
masked. NaN where the run applies no correction."""

STEP_METRICS = ("loss/policy", "clip/ratio_low", "clip/ratio_high", "clip/ratio_region", "ratio/mean", "kl/mean", "entropy/mean",
                *ROLLOUT_CORRECTION_METRICS)
"""What `pipeline.objective.loss.policy_loss` reports per micro-batch and the update stores per optimizer step."""

UPDATE_METRICS = ArtifactSchema(
    kind="update_metrics",
    # v2: the rollout_correction/* columns (`loss.rollout_correction`); a v1 part reads with them null
    version=2,
    reads=(1,),
    added={name: 2 for name in ROLLOUT_CORRECTION_METRICS},
    schema=pa.schema(
        [
            pa.field("step", pa.int64()),  # global optimizer step (across iterations)
            pa.field("epoch", pa.int32()),
            pa.field("batch", pa.int32()),  # mini-batch index within the epoch
            *(pa.field(name, pa.float64()) for name in STEP_METRICS),
            pa.field("grad_norm", pa.float64()),
            pa.field("lr", pa.float64()),
            pa.field("tokens", pa.int64()),
        ]
    ),
)

EVAL = ArtifactSchema(
    kind="eval",
    version=1,
    extra_columns=True,
    schema=pa.schema(
        [
            pa.field("prompt_id", pa.int64(), nullable=False),
            pa.field("prompt", pa.string()),
            pa.field("completion", pa.string()),
            pa.field("completion_length", pa.int32()),
            pa.field("reward", pa.float64()),
            pa.field("correct", pa.bool_()),
        ]
    ),
)

BY_KIND = {s.kind: s for s in (ROLLOUT, SCORE, LOGPROBS, UPDATE_METRICS, EVAL)}
