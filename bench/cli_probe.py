"""Runs one real `grpo` command (stages.cli.main) with the probes installed, and records where
its process's time went: interpreter start, imports, engine start, the stage's own work.

    python -X importtime -m bench.cli_probe OUT_JSON rollout RUN --iter K

Every module load is booked to "imports" wherever it happens (the lazy `import vllm` inside
engine start included), so "engine start" is the engine and not its import. `-X importtime`
gives the process's total import time as a cross-check.
"""

import time

T_ENTER = time.time()  # noqa: E402 (first thing: the parent's clock started at Popen)

import json  # noqa: E402
import sys  # noqa: E402


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    from bench.probes import Probes, install_import_probe, install_product_probes  # stdlib only

    probes = Probes()
    install_import_probe(probes)
    import stages.cli

    install_product_probes(probes)  # each of pipeline's modules as the stage imports it
    probes.rss.start()
    marks = {"enter": T_ENTER, "main": time.time()}
    sys.argv = ["grpo", *argv]
    code = 0
    try:
        stages.cli.main()
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    marks["done"] = time.time()
    probes.set_phase("exit")
    probes.rss.stop()
    with open(out, "w") as f:
        json.dump({"marks": marks, "probes": probes.report(), "code": code}, f)
    stages.cli.leave(code)  # as `grpo` itself leaves (stages.cli._exit)


if __name__ == "__main__":
    main()
