"""Held-out evaluation: its config section (config.py), the estimators and intervals (stats.py), the
figures of an eval record (metrics.py) and the paired comparison of two records (compare.py). The
eval stage itself is pipeline/evaluate.py."""
