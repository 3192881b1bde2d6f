"""Running `grpo iterate` on a Ray cluster (`cluster.executor: ray`): rollout parts on long-lived
actors that keep their engines warm, score parts as Ray tasks, logprobs and update on the driver.
Ray is imported only inside this package, and only when the ray executor runs."""
