"""grpo's library: config, run store, engines, rewards, GRPO math, trainer, tracking.

Nothing here imports Typer; vLLM, DeepSpeed and MLflow are imported inside the functions
that use them so that `grpo --help` stays instant.
"""

__version__ = "0.1.0"
