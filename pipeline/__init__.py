"""grpo's library: config, run store, engines, rewards, GRPO math, trainer, tracking.

Nothing here imports Typer; vLLM, DeepSpeed and MLflow are imported inside the functions
that use them so that `grpo --help` stays instant.
"""

import os as _os

# Bitwise-reproducible BLAS. x86 torch wheels compute fp32 matmuls with MKL, which gives the
# same bits run to run on one machine only under Intel's documented conditions: a fixed thread
# count (no dynamic adjustment) and its CNR mode (results independent of the data's alignment,
# which moves with the allocator's history). Set before torch loads MKL; a user's setting wins.
# Neither changed a result or a timing measurably on this project's workloads.
_os.environ.setdefault("MKL_DYNAMIC", "FALSE")
_os.environ.setdefault("MKL_CBWR", "AUTO")

__version__ = "0.1.0"
