"""Held-out evaluation, one folder: the eval stage (run.py: k samples per prompt, scored, recorded as
parts; the figures a run's status shows), the estimators (stats.py) and their intervals (intervals.py), the figures of
an eval record (metrics.py) and the paired comparison of two records (compare.py). Its config
section is pipeline/config/eval.py; replaying a recorded eval with other rewards is
pipeline/loop/replay_eval.py."""
