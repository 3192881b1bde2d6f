"""`grpo iterate` on a Ray cluster (`cluster.executor: ray`, or `grpo iterate --executor ray`).

    driver (the `grpo iterate` process)             cluster nodes
    rollout: parts not yet written -> queue  ---->  RolloutWorker actors (warm engine, policy k in place)
             manifest (once every part is in) <---  part files, written atomically through the store
    score:   one Ray task per part           ---->  score_part (reward functions, sandboxes, async rewards)
             manifest                        <---  part files
    logprobs, eval: in the driver, with the warm models of local `iterate`: one loop, pipeline.loop.iterate,
             with this module's RaySampler as its sampler
    update:  in the driver (warm trainer), or with cluster.update_workers > 1 on that many
             Ray-placed `grpo update` processes (pipeline/cluster/update.py)

Parts are the ones `--shard` workers write (fixed groups, seeds from the groups), so a Ray run writes
a local run's bytes whatever the number of workers; a part whose worker dies is re-run, and a rerun
of the same command after the driver died resumes from the parts and manifests on storage.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid

from pipeline.cluster.workers import stall
from pipeline.errors import GRPOError
from pipeline.loop.sampler import Sampler
from pipeline.store import IN_FLIGHT, part_name, stage_rel
from pipeline.run.parts import finalize, input_hash
from pipeline.run.run import Run


def driver_record() -> dict:
    """Who drives the run (kept in IN_FLIGHT): pid, host and the process's start time, so that
    `grpo status` can tell a driver that died (SIGKILL leaves the file behind) from one that runs,
    and a pid reused by another process from the driver."""
    import psutil  # a dependency of Ray

    return {"pid": os.getpid(), "host": socket.gethostname(), "started": psutil.Process().create_time()}


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def init_kwargs(address: str | None, skip=()) -> dict:
    """ray.init's arguments: without an address, a Ray instance of this run's own (`address="local"`:
    plain `ray.init()` would join any cluster already started on this machine, unannounced)."""
    from pipeline.cluster.secrets import runtime_env

    return dict(address=address or "local", include_dashboard=False, logging_level="ERROR", log_to_driver=False,
                runtime_env=runtime_env(skip=skip))


def connect(cc, address: str | None, skip=()) -> str:
    """Join the cluster (or start a Ray instance here); one line when nothing answers. `skip`: variables never
    forwarded (a served reward's URL secrets)."""
    try:
        import ray
    except ImportError:
        raise GRPOError('cluster.executor ray: Ray is not installed (pip install -e ".[ray]")') from None

    from pipeline.config.urls import expand, redacted

    address = address or cc.address or os.environ.get("RAY_ADDRESS")
    sent = expand(address, "cluster.address") if address else address  # a ${NAME} read here, never stored
    address = redacted(address) if address else address  # what every line says (RAY_ADDRESS's password too)
    if sent and sent != "auto" and "://" not in sent:  # Ray itself retries an unanswered address for minutes
        host, _, port = sent.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=10).close()
        except (OSError, ValueError) as err:
            raise GRPOError(f"cluster.address {address}: no Ray cluster answers there ({getattr(err, 'strerror', None) or err})") from None
    try:
        ray.init(**init_kwargs(sent, skip))
    except Exception as err:  # Ray raises ConnectionError, RuntimeError, ... for an unreachable cluster
        from pipeline.cluster.secrets import redact

        detail = redact(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
        if "runtime env" in detail:  # answered, but refused this driver's environment
            raise GRPOError(f"cluster.address {address}: the cluster refused this driver's runtime_env ({detail[:200]})") from None
        raise GRPOError(f"cluster.address {address}: no Ray cluster answers there ({detail})") from None
    from pipeline.quiet import ray_notices_to_stderr

    ray_notices_to_stderr()
    return address or "a Ray instance of its own started here"


def preflight(run: Run, cc, held_gpu_on: str | None = None) -> tuple[str, str]:
    """Before any work: the cluster has room for the workers, and a probe file written here through
    the store (read back by each rollout actor) proves the run directory is shared."""
    import ray

    have = dict(ray.cluster_resources())
    if held_gpu_on:  # the driver's own GPU (driver_gpu)
        have["GPU"] = have.get("GPU", 0) - 1
    need_cpu = cc.rollout_workers * cc.rollout_cpus + cc.score_cpus
    if have.get("CPU", 0) < need_cpu:
        raise GRPOError(f"cluster: {have.get('CPU', 0):g} CPUs, but cluster.rollout_workers ({cc.rollout_workers}) x "
                        f"cluster.rollout_cpus ({cc.rollout_cpus:g}) plus a score task's cluster.score_cpus "
                        f"({cc.score_cpus:g}) need {need_cpu:g}")
    if cc.rollout_workers * cc.rollout_gpus > have.get("GPU", 0):
        raise GRPOError(f"cluster: {have.get('GPU', 0):g} GPUs, but cluster.rollout_workers ({cc.rollout_workers}) x "
                        f"cluster.rollout_gpus ({cc.rollout_gpus:g}) need {cc.rollout_workers * cc.rollout_gpus:g}")
    if cc.update_workers > 1:  # the rollout actors stay up (warm) while the update runs
        for unit, each_r, each_u in (("CPU", cc.rollout_cpus, cc.update_cpus), ("GPU", cc.rollout_gpus, cc.update_gpus)):
            need = cc.rollout_workers * each_r + cc.update_workers * each_u
            if need > have.get(unit, 0):
                raise GRPOError(f"cluster: {have.get(unit, 0):g} {unit}s, but the warm rollout actors "
                                f"({cc.rollout_workers} x {each_r:g}) and cluster.update_workers ({cc.update_workers}) x "
                                f"cluster.update_{unit.lower()}s ({each_u:g}) need {need:g}")
    from pipeline.cluster.placement import alive_nodes, spread_problem

    nodes = alive_nodes(ray.nodes())
    if held_gpu_on in nodes:
        nodes[held_gpu_on]["GPU"] -= 1
    problem = spread_problem(nodes, cc)  # the totals fit; each node's share must too
    if problem:
        raise GRPOError(problem)
    token = uuid.uuid4().hex
    probe = f"probe-{token[:12]}"
    run.store.write_bytes(f".cluster/{probe}", token.encode())
    return probe, token


def shared_uri(run: Run) -> str:
    """The run's address as every node names it (a local path made absolute)."""
    return os.path.abspath(run.store.root) if run.store.local else run.store.uri


def missing(run: Run, k: int, stage: str, num_parts: int, stamp: str) -> list[int]:
    sd = stage_rel(k, stage)
    return [p for p in range(num_parts) if run.store.table_meta(f"{sd}/{part_name(p)}").get("input_hash") != stamp]


def worker_record(stage: str, k: int, reports: list[dict], seconds: float) -> dict | None:
    """Which worker wrote each part and in how long, and the straggler: printed, and kept in the
    stage's manifest (`workers`, logged to MLflow as cluster/<stage>/...). None when no part was written."""
    reports = [r for r in reports if r["written"]]
    if not reports:
        return None
    per: dict[str, float] = {}
    for r in reports:
        key = f"{r['node']}/{r['pid']}"
        per[key] = round(per.get(key, 0.0) + r["seconds"], 3)
    slow = max(reports, key=lambda r: r["seconds"])
    log(f"{stage} iteration {k}: {len(reports)} parts on {len(per)} workers in {seconds:.1f}s ("
        + ", ".join(f"{w} {s:.1f}s" for w, s in sorted(per.items()))
        + f"); straggler part {slow['part']} on node {slow['node']} ({slow['seconds']:.1f}s)")
    return {"parts": {part_name(r["part"]): f"{r['node']}/{r['pid']}" for r in sorted(reports, key=lambda r: r["part"])},
            "seconds": dict(sorted(per.items())),
            "straggler": {"part": slow["part"], "worker": f"{slow['node']}/{slow['pid']}", "seconds": round(slow["seconds"], 3)}}


def row_figures(stage: str, record: dict | None) -> dict:
    """The iteration row's share of a worker record."""
    if not record:
        return {}
    return {f"{stage}_straggler_s": record["straggler"]["seconds"], f"{stage}_workers": len(record["seconds"])}


def rollout(run: Run, k: int, pool) -> dict:
    from pipeline.rollout import RolloutInputs

    t0 = time.time()
    rollout_inputs = RolloutInputs(run, k)
    inputs = rollout_inputs.inputs()
    stamp = input_hash(run.cfg_hash, "rollout", k, inputs)
    sd = stage_rel(k, "rollout")
    with run.store.lock(f"{sd}/.lock-shard-0-of-1", f"rollout iteration {k} (ray)"):
        reports = pool.run(k, missing(run, k, "rollout", rollout_inputs.num_parts, stamp), stamp)
    stats = {"engine_start_s": round(sum(r["engine_s"] for r in reports), 6), "tokens": sum(r["tokens"] for r in reports),
             "generate_s": round(sum(r["seconds"] - r["engine_s"] for r in reports), 6)}
    seconds = time.time() - t0
    record = worker_record("rollout", k, reports, seconds)
    finalize(run, k, "rollout", rollout_inputs.num_parts, stamp, inputs, seconds,
             lambda: {**rollout_inputs.manifest_extra(stats), **({"workers": record} if record else {})})
    return row_figures("rollout", record)


def score(run: Run, k: int, cc, uri: str, pool) -> dict:
    """Score tasks over the parts; the driver then writes the manifest through `run_score` (every
    part in place, it writes only the manifest). Batch-scaled advantages need the whole iteration:
    scored here in one piece. While tasks wait, the pool makes room for them (`pool.Room`)."""
    import ray

    from pipeline.cluster.pool import POLL_S, RESUME, Room, raise_task_error
    from pipeline.cluster.workers import score_part
    from pipeline.score import run_score
    from pipeline.run.parts import upstream

    a = run.cfg.advantages
    if run.done(k, "score") or a.scale == "batch" or a.batch_renorm:
        run_score(run, k)
        return {}
    t0 = time.time()
    num_parts = len(run.require(k, "score", "rollout").outputs)
    stamp = input_hash(run.cfg_hash, "score", k, {"rollout": upstream(run, k, "rollout")})
    pending: list = []
    room = Room(pool, [{"CPU": cc.score_cpus}], f"score iteration {k}", lambda line: pool.show(k, len(pending), "score", line))
    room.check(free_now=True)  # none of the stage's tasks holds room yet: what is free now is exact
    while room.since is not None:  # another run holds it: wait, and stop at cluster.place_timeout_s
        time.sleep(POLL_S)
        room.check(free_now=True)
    task = ray.remote(score_part).options(num_cpus=cc.score_cpus, max_retries=3)
    refs = {task.remote(uri, k, p, stamp): p for p in missing(run, k, "score", num_parts, stamp)}
    reports = []
    # placed and run: each task within start_timeout_s + part_timeout_s (Ray does not say which a pending one waits for)
    limit = cc.start_timeout_s + cc.part_timeout_s
    deadline = time.monotonic() + limit
    pending = list(refs)
    pool.show(k, len(pending), "score")
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=min(POLL_S, max(0.0, deadline - time.monotonic())))
        if not done:
            if time.monotonic() < deadline:
                room.check()
                continue
            from pipeline.cluster.placement import alive_nodes, describe

            parts = ", ".join(str(refs[r]) for r in pending)
            raise GRPOError(f"score iteration {k}: parts {parts} not placed and written in {limit:g} s (cluster.start_timeout_s "
                            f"+ part_timeout_s); {describe(alive_nodes(ray.nodes()))}, a score task wants {cc.score_cpus:g} CPUs; "
                            f"{RESUME}")
        ref = done[0]
        try:
            reports.append(ray.get(ref))
        except ray.exceptions.RayTaskError as err:
            raise_task_error(err, f"score iteration {k} part {refs[ref]}")
        except ray.exceptions.RayError as err:
            raise GRPOError(f"score iteration {k} part {refs[ref]}: its worker died 4 times ({type(err).__name__})") from None
        pool.show(k, len(pending), "score")
    record = worker_record("score", k, reports, time.time() - t0)
    run_score(run, k, workers=record, started=t0)
    return row_figures("score", record)


class DriverGPU:
    """Holds one GPU of the driver's node for the driver (an actor that does nothing)."""

    def gpu_ids(self) -> list:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]


def driver_gpu(cc) -> tuple[object | None, str]:
    """On a GPU cluster, one GPU of the driver's node reserved for it (placement.reserve_driver_gpu)
    and made the one it uses where it has not started CUDA yet; the holding actor (or None) and the node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pipeline.cluster.placement import reserve_driver_gpu

    node = ray.get_runtime_context().get_node_id()
    gpus = next((n.get("Resources", {}).get("GPU", 0.0) for n in ray.nodes() if n["NodeID"] == node), 0.0)
    if not reserve_driver_gpu(gpus, cc):
        return None, node
    hold = ray.remote(DriverGPU).options(num_cpus=0, num_gpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    ids = ray.get(hold.gpu_ids.remote(), timeout=cc.start_timeout_s)
    import torch

    if not torch.cuda.is_initialized():
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    log(f"cluster: GPU {','.join(ids)} of the driver's node is reserved for the driver (logprobs, update)")
    return hold, node


class RaySampler(Sampler):
    """The sampler of `pipeline.loop.iterate`'s one loop on a Ray cluster (its interface: ask, wait, drain,
    close): rollouts on the pool's warm actors, evals on the driver's warm engine, each done when
    asked. The loop also hands it the score (Ray tasks) and, with cluster.update_workers > 1, the
    update (Ray-placed processes); `figures(k)` is what iteration k's row gains (straggler, workers)."""

    def __init__(self, run: Run, warm, address: str | None = None):
        from pipeline.cluster.pool import RolloutPool

        self.run, self.warm, self.cc = run, warm, run.cfg.cluster
        self.pool, self.rows, self.closed, self.hold = None, {}, False, None
        from pipeline.cluster.secrets import url_secrets

        where = connect(self.cc, address, url_secrets(run.cfg))
        try:
            self.hold, node = driver_gpu(self.cc)
            probe, token = preflight(run, self.cc, node if self.hold else None)
            self.uri = shared_uri(run)
            driver = driver_record()
            show = lambda body: run.store.write_json(IN_FLIGHT, {**body, "driver": driver})
            show({"stage": "start", "iteration": run.completed_iters(), "in_flight": {}, "queued": 0})
            self.pool = RolloutPool(self.uri, self.cc, probe, token, log, status=show)
        except BaseException:
            self.close()
            raise
        log(f"cluster: {where}; {self.cc.rollout_workers} rollout workers on nodes {', '.join(self.pool.nodes())}")

    def ask(self, kind: str, k: int) -> None:
        from pipeline.eval.run import run_eval
        from pipeline.report import tracking

        run = self.run
        with tracking.reporting(run, k, kind):
            if kind == "rollout" and not run.done(k, "rollout"):
                stall("driver-rollout", k, -1)
                self.rows.setdefault(k, {}).update(rollout(run, k, self.pool))
            elif kind == "eval" and not run.done(k, "eval"):
                run_eval(run, k, self.warm.rollout_engine(k))

    def wait(self, kind: str, k: int) -> None:
        """Nothing to wait for: `ask` ran it."""

    def drain(self) -> None:
        """Nothing is still running."""

    def score(self, k: int) -> None:
        stall("driver-score", k, -1)
        self.rows.setdefault(k, {}).update(score(self.run, k, self.cc, self.uri, self.pool))

    def update(self, k: int) -> bool:
        """Iteration k's update on the cluster where cluster.update_workers > 1 (True); else False:
        the loop's warm trainer does it."""
        from pipeline.cluster.update import update_on_cluster

        stall("driver-update", k, -1)
        if self.cc.update_workers == 1:
            return False
        if not self.run.done(k, "update"):
            self.rows.setdefault(k, {}).update(update_on_cluster(self.run, k, self.cc, self.uri, log, self.pool))
        return True

    def figures(self, k: int) -> dict:
        return self.rows.pop(k, {})

    def close(self) -> None:
        """The actors, the probe files and this process's Ray connection (once). Called while an
        exception (Ctrl-C, an error) unwinds, the actors are killed at once."""
        import ray

        if self.closed:
            return
        self.closed = True
        if self.pool is not None:
            self.pool.close(at_once=sys.exc_info()[0] is not None)
        if self.hold is not None:
            ray.kill(self.hold)
        self.run.store.remove(".cluster", recursive=True)
        ray.shutdown()
