"""The one base of every config section: unknown keys are errors, each field's docstring is its
documentation (docs/config.md is generated from them), and an assignment is validated as a load is."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
