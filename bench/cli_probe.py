"""Runs one real `grpo` command (stages.cli.main) with the probes installed, and records where
its process's time went: interpreter start, imports, engine start, the stage's own work.

    python -X importtime -m bench.cli_probe OUT_JSON rollout RUN --iter K

The heavy libraries a stage imports anyway (vLLM for rollout, DeepSpeed for update, ...) are
imported first, on their own clock, so "engine start" is the engine and not its import.
`-X importtime` gives the total import time of the process as a cross-check.
"""

import time

T_ENTER = time.time()  # noqa: E402 (first thing: the parent's clock started at Popen)

import importlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

COMMON = ["numpy", "pyarrow", "pyarrow.parquet", "polars", "fsspec", "pydantic", "yaml", "typer", "mlflow", "mlflow.tracking"]
PREIMPORT = {
    "rollout": ["transformers", "vllm"],
    "score": [],
    "logprobs": ["transformers"],
    "update": ["transformers", "deepspeed"],
}


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    stage = argv[0]
    marks = {"enter": T_ENTER}
    imports = {}
    # torch and pipeline's light modules first (every stage imports them through pipeline.config),
    # then the stage's environment (as the stage sets it), then its heavy libraries
    for mod in ["torch", "pipeline.engines"] + PREIMPORT.get(stage, []) + COMMON:
        t = time.perf_counter()
        importlib.import_module(mod)
        imports[mod] = time.perf_counter() - t
        if mod == "pipeline.engines":
            sys.modules[mod].cpu_env()
    t = time.perf_counter()
    import stages.cli

    imports["stages.cli"] = time.perf_counter() - t
    from bench.probes import Probes, install_product_probes

    probes = Probes()
    install_product_probes(probes)
    probes.rss.start()
    marks["main"] = time.time()
    sys.argv = ["grpo", *argv]
    code = 0
    try:
        stages.cli.main()
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    marks["done"] = time.time()
    probes.rss.stop()
    with open(out, "w") as f:
        json.dump({"marks": marks, "imports": imports, "probes": probes.report(), "code": code}, f)
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
