"""What runs on the cluster's nodes: the rollout actor (one warm engine, policy after policy) and
the score task, each writing one part through the store, as `--shard` workers do (the driver writes
the manifests). Plain classes and functions: pipeline.cluster.executor wraps them with `ray.remote`."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

from pipeline.errors import GRPOError
from pipeline.store import part_name, stage_rel
from pipeline.run.parts import write_part
from pipeline.run.run import Run


def fault(where: str, k: int, part: int) -> None:
    """Test hook for the fault tests: `GRPO_CLUSTER_FAULT=<rollout|score>:<iteration>:<part>[,...]`
    SIGKILLs the worker process that reaches that part, before the part is written (mid-part), once:
    the first kill creates the file `GRPO_CLUSTER_FAULT_ONCE`.<n> (n: the spec's place in the list),
    which stops the next. Unset, it costs one environment lookup."""
    specs = os.environ.get("GRPO_CLUSTER_FAULT", "")
    if not specs:
        return
    for n, spec in enumerate(specs.split(",")):
        if spec.split(":") != [where, str(k), str(part)]:
            continue
        try:
            os.close(os.open(f"{os.environ['GRPO_CLUSTER_FAULT_ONCE']}.{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


def stall(where: str, k: int, part: int) -> None:
    """Test hook for the lost-node tests: `GRPO_CLUSTER_STALL=<point>:<iteration>[,...]` holds each
    part (or the driver, part -1) reaching that point until the file `GRPO_CLUSTER_STALL_RELEASE`.<n>
    exists (n: the spec's place in the list), having written `<that file>.held-<pid>-<part>` (so the
    test knows who holds one). Points: `rollout`, `score` (a worker, its part made, not written),
    `driver-rollout`, `driver-score`, `driver-update` (the driver, before it starts that stage)."""
    specs = os.environ.get("GRPO_CLUSTER_STALL", "")
    if not specs:
        return
    for n, spec in enumerate(specs.split(",")):
        if spec != f"{where}:{k}":
            continue
        release = Path(f"{os.environ['GRPO_CLUSTER_STALL_RELEASE']}.{n}")
        Path(f"{release}.held-{os.getpid()}-{part}").touch()
        deadline = time.time() + 600
        while not release.exists() and time.time() < deadline:
            time.sleep(0.1)


def where_am_i() -> dict:
    """The Ray node (its id's first 8 hex digits), host and process this code runs in."""
    import ray

    return {"node": ray.get_runtime_context().get_node_id()[:8], "host": socket.gethostname(), "pid": os.getpid()}


def check_visible(run: Run, probe: str, token: str) -> None:
    """This worker sees the driver's run directory (the probe file it wrote) and the model."""
    rel = f".cluster/{probe}"
    try:
        seen = run.store.read_bytes(rel).decode()
    except GRPOError:
        seen = None
    if seen != token:
        raise GRPOError(f"{run.store.display()}: not visible from cluster node {socket.gethostname()} (the driver's probe "
                        f"{rel} is missing there); put the run directory on storage every node shares (a shared path or s3://)")
    model = run.cfg.model
    if (model.startswith(("/", "./", "../")) or os.sep in model) and "://" not in model and not Path(model).exists():
        raise GRPOError(f"model {model}: not found on cluster node {socket.gethostname()}; every node needs the model path")


def check_environment(run: Run, secrets: list[str]) -> list[str]:
    """This worker imports the run's reward, tool and environment code (the copies `grpo init` put in
    the run) and has the API keys its served rewards name, each read from this node's own environment
    (never sent through Ray); returns which of the driver's other secrets (`secrets`) it lacks."""
    from pipeline.rewards.contract import resolve, run_code
    from pipeline.store.code import targets

    here = f"on cluster node {socket.gethostname()}"
    with run_code(run, here):
        for target in targets(run.cfg):
            try:
                resolve(target)
            except GRPOError as err:
                raise GRPOError(f"{target} {here}: {err}") from None
    require_keys(run, here)
    return [name for name in secrets if not os.environ.get(name)]


def require_keys(run: Run, here: str, what: str = "") -> None:
    """The API keys the run's served rewards name are set in this node's own environment."""
    from pipeline.cluster.secrets import key_names

    for name in key_names(run.cfg):
        if not os.environ.get(name):
            raise GRPOError(f"{what}the environment variable {name} (a served reward's api_key_env or a ${{NAME}} of its URL) is not set {here}; set it "
                            f"where `ray start` runs there (keys are never sent through Ray)")


class RolloutWorker:
    """A long-lived rollout actor: one engine, given each new policy in place (as `iterate` gives its
    warm engine one), writing the parts it is handed."""

    def __init__(self, run_uri: str, threads: int):
        import torch

        torch.set_num_threads(max(1, threads))
        self.run = Run(run_uri)
        self.engine = None
        self.rollout_inputs: dict = {}  # iteration -> RolloutInputs (prompts rendered once per iteration)

    def ready(self, probe: str, token: str, secrets: list[str]) -> dict:
        """Checks before any work: the run directory and model are visible here, the run's code imports
        and its keys are set here; returns where it runs, and which of `secrets` this node lacks."""
        check_visible(self.run, probe, token)
        missing = check_environment(self.run, secrets)
        self.run.store.write_bytes(f".cluster/{probe}-{os.getpid()}", token.encode())
        return {**where_am_i(), "secrets_missing": missing}

    def rollout_part(self, k: int, part: int, stamp: str) -> dict:
        """Write rollout part `part` of iteration k (skipped when an earlier attempt wrote it from the
        same inputs); returns its timings."""
        from pipeline.rollout import RolloutInputs, engine_settings, generate_part, policy_engine
        from schemas.artifacts import ROLLOUT

        t0 = time.time()
        rel = f"{stage_rel(k, 'rollout')}/{part_name(part)}"
        report = {"part": part, **where_am_i(), "tokens": 0, "engine_s": 0.0, "written": False}
        if self.run.store.table_meta(rel).get("input_hash") != stamp:
            rollout_inputs = self.rollout_inputs.get(k) or RolloutInputs(self.run, k)
            self.rollout_inputs = {k: rollout_inputs}
            t = time.time()
            settings = engine_settings(self.run, rollout_inputs.policy_iter) if self.engine is None else None
            self.engine = policy_engine(self.run, rollout_inputs.policy_iter, self.engine, settings=settings, where=f"rollout iteration {k}")
            report["engine_s"] = time.time() - t
            table = generate_part(rollout_inputs, self.engine, part)
            fault("rollout", k, part)
            stall("rollout", k, part)
            write_part(self.run.store, rel, table, ROLLOUT, stamp, part)
            report.update(tokens=int(sum(table.column("completion_length").to_pylist())), written=True)
        report["seconds"] = time.time() - t0
        return report

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def score_part(run_uri: str, k: int, part: int, stamp: str) -> dict:
    """A score task: score rollout part `part` of iteration k into score part `part`."""
    from pipeline.score import score_table
    from pipeline.run.parts import read_part
    from schemas.artifacts import ROLLOUT, SCORE

    t0 = time.time()
    run = Run(run_uri)
    require_keys(run, f"on cluster node {socket.gethostname()}", f"score iteration {k} part {part}: ")  # read here, never sent
    rel = f"{stage_rel(k, 'score')}/{part_name(part)}"
    written = False
    if run.store.table_meta(rel).get("input_hash") != stamp:
        table = score_table(run, k, read_part(run, k, "rollout", ROLLOUT, part))
        fault("score", k, part)
        stall("score", k, part)
        write_part(run.store, rel, table, SCORE, stamp, part)
        written = True
    return {"part": part, **where_am_i(), "seconds": time.time() - t0, "written": written}
