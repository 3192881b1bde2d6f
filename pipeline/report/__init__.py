"""Reporting, called by the stages and `iterate` after a manifest exists, never from the write
path: MLflow (tracking), tables (inspect), warnings (diagnostics), status, audit, compare."""
