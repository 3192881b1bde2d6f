"""The update on N Ray-placed processes (`cluster.update_workers` > 1).

Ray places the launch, not the training loop: a placement group of N bundles (update_cpus and
update_gpus each), one small actor per bundle, and each actor runs `grpo update RUN --iter K` as a
child process with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set as torchrun sets
them (rank 0's node address and a port free there). So the update is the code `torchrun` runs and
tests/test_multiprocess_update.py checks: DeepSpeed's own process group (gloo on CPUs, NCCL on
GPUs), its resume points, rank 0 writing the policy and the manifest. Ray Train's TorchTrainer
would run the loop inside its own session, with its own process-group setup, reporting and
checkpoints beside the ones the update already has (and the `ray[train]` extra): a second way to
resume and record the same work.

A rank whose process dies takes the whole update with it (a process group cannot lose a member);
the update is then run again from its start (it is deterministic, and rank 0 publishes only at
its end), at most `ATTEMPTS` times.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pipeline.errors import GRPOError
from pipeline.run.run import Run

ATTEMPTS = 3


def _die_with_parent() -> None:
    """In the child: SIGKILL when the actor that started it goes (Linux; ray.kill gives no time to clean up)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class UpdateRank:
    """One rank's launcher: where it runs, and the `grpo update` child process it starts."""

    def where(self) -> dict:
        import ray

        from pipeline.update.distributed import free_port

        return {"ip": ray.util.get_node_ip_address(), "port": free_port(), "node": ray.get_runtime_context().get_node_id()[:8],
                "pid": os.getpid()}

    def update(self, run_uri: str, k: int, rank: int, world: int, master: dict, threads: int) -> dict:
        t0 = time.time()
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",  # Ray shows each its own GPU
               "MASTER_ADDR": master["ip"], "MASTER_PORT": str(master["port"]), "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.run([sys.executable, "-m", "stages.cli", "update", run_uri, "--iter", str(k)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False,
                              preexec_fn=_die_with_parent)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        return {"rank": rank, "returncode": proc.returncode, "seconds": time.time() - t0, "pid": os.getpid(),
                "error": errors[-1] if errors else (proc.stderr.strip().splitlines() or [""])[-1]}


def update_on_cluster(run: Run, k: int, cc, uri: str, log, pool) -> dict:
    """Iteration k's update on `cc.update_workers` Ray-placed processes; returns the row's figures.
    While the processes wait to be placed, the rollout pool makes room for them (`pool.Room`)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pipeline.cluster.pool import POLL_S, RESUME, Room

    n, t0 = cc.update_workers, time.time()
    bundles = [{"CPU": cc.update_cpus, **({"GPU": cc.update_gpus} if cc.update_gpus else {})}] * n
    room = Room(pool, bundles, f"update iteration {k}", lambda line: pool.show(k, 0, "update", line))
    for attempt in range(1, ATTEMPTS + 1):
        room.check()
        pg = placement_group(bundles, strategy="PACK")
        actors = []
        try:
            placed_by = time.monotonic() + cc.place_timeout_s  # room.check() stops the run sooner where it fits nowhere
            while not pg.wait(timeout_seconds=POLL_S):
                if time.monotonic() >= placed_by:  # it fits the nodes' totals: what holds the room is outside this run
                    raise GRPOError(f"cluster: no room for {n} update workers of {cc.update_cpus:g} CPUs and {cc.update_gpus:g} "
                                    f"GPUs in {cc.place_timeout_s:g} s (cluster.place_timeout_s), though the nodes' totals hold them: "
                                    f"work outside this run (a second run's warm actors?) holds the room; give each run its own "
                                    f"nodes: {RESUME}")
                room.check()
            cls = ray.remote(UpdateRank)
            actors = [cls.options(num_cpus=cc.update_cpus, num_gpus=cc.update_gpus, max_restarts=0,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
                      for i in range(n)]
            master = ray.get(actors[0].where.remote(), timeout=cc.start_timeout_s)
            threads = max(1, int(cc.update_cpus))
            pending = [a.update.remote(uri, k, rank, n, master, threads) for rank, a in enumerate(actors)]
            reports = []
            while pending:  # the first rank to fail ends the attempt: the others would wait on it
                done, pending = ray.wait(pending, num_returns=1, timeout=cc.part_timeout_s)
                if not done:
                    raise GRPOError(f"update iteration {k}: no rank ended in {cc.part_timeout_s:g} s (cluster.part_timeout_s); {RESUME}")
                reports.append(ray.get(done[0]))
                if reports[-1]["returncode"] != 0:  # the others fail soon after (their peer is gone): whose fault?
                    late, _ = ray.wait(pending, num_returns=len(pending), timeout=30) if pending else ([], [])
                    reports += ray.get(late)
                    break
        except ray.exceptions.GetTimeoutError:  # placed, but its first rank's actor did not start in time
            log(f"update iteration {k}: the update workers did not start in {cc.start_timeout_s:g} s "
                f"(cluster.start_timeout_s); attempt {attempt} of {ATTEMPTS}")
            continue
        except ray.exceptions.RayError as err:  # a rank's actor or node died: the update goes again from its start
            log(f"update iteration {k}: a worker died ({type(err).__name__}); attempt {attempt} of {ATTEMPTS}")
            continue
        finally:
            for a in actors:
                ray.kill(a, no_restart=True)
            remove_placement_group(pg)
        failed = [r for r in reports if r["returncode"] != 0]
        if not failed and run.done(k, "update"):
            log(f"update iteration {k}: {n} processes in {time.time() - t0:.1f}s ("
                + ", ".join(f"rank {r['rank']} {r['seconds']:.1f}s" for r in reports) + ")")
            return {"update_workers": n}
        first = min(failed, key=lambda r: r["rank"]) if failed else reports[0]
        if any(r["returncode"] < 0 for r in failed):  # killed by a signal: like a lost worker
            log(f"update iteration {k}: rank {first['rank']} was killed ({first['returncode']}); attempt {attempt} of {ATTEMPTS}")
            continue
        why = first["error"].removeprefix("error: ") or f"exit {first['returncode']}"
        raise GRPOError(f"update iteration {k} on {n} processes: rank {first['rank']} failed: {why}")
    raise GRPOError(f"update iteration {k}: its {n} processes failed {ATTEMPTS} times (a worker or node kept dying)")
