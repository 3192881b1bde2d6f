"""The loop, one folder: `grpo iterate`'s single loop over iterations (`iterate`) and the steps
of one iteration with its warm engines (`iteration`), the sampler process that runs ahead with
train.max_staleness (`overlap`), and the replays of another run's rollout (`replay`) and eval
(`replay_eval`). What each iteration does is decided in pipeline/schedule.py, never here; the
eval it runs is pipeline/eval/run.py."""
