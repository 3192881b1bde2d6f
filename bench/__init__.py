"""`make bench` / `python -m bench [--quick]`: grpo's speed, measured side by side with the bare
engines and with TRL's GRPOTrainer in one run on one machine, reported as ratios.

Writes bench/results.md (the table, the machine, the load) and bench/results.json; scratch
(models, data, runs) goes to bench/work/. See docs/bench.md for what is measured and how.
"""
