"""The driver's rollout actors: started once, kept warm, handed parts one at a time; a part whose
actor dies (killed, or its node lost) goes back to the queue and is re-run on whichever actor is
free, writing the same bytes."""

from __future__ import annotations

import os
from collections import deque
from typing import Callable

from pipeline.errors import GRPOError
from pipeline.store.faults import fault_point
from pipeline.cluster.workers import RolloutWorker


def raise_task_error(err, what: str):
    """A worker's own error (a GRPOError: one line) as the driver's; anything else as Ray gives it."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, GRPOError):
        raise GRPOError(str(cause)) from None
    raise GRPOError(f"{what}: {str(cause or err).strip().splitlines()[-1]}") from err


class RolloutPool:
    def __init__(self, run_uri: str, cc, probe: str, token: str, log: Callable[[str], None], status=None):
        import ray

        self.cc, self.log, self.probe, self.token, self.status = cc, log, probe, token, status
        self.cls = ray.remote(RolloutWorker).options(num_cpus=cc.rollout_cpus, num_gpus=cc.rollout_gpus, max_restarts=0,
                                                   scheduling_strategy="SPREAD")  # one per node where it can
        self.args = (run_uri, max(1, int(cc.rollout_cpus)))
        self.idle: list = []  # ready actors with nothing to do
        self.where: dict = {}  # actor -> {node, host, pid}
        self.starting: dict = {}  # its ready() reference -> actor
        self.inflight: dict = {}  # rollout_part reference -> (actor, part)
        for _ in range(cc.rollout_workers):
            self._start()
        while self.starting:  # every actor passes its checks before any work starts
            self._wait_one()

    def _start(self) -> None:
        actor = self.cls.remote(*self.args)
        self.starting[actor.ready.remote(self.probe, self.token, secrets_left_out())] = actor

    def alive(self) -> int:
        return len(self.idle) + len(self.starting) + len(self.inflight)

    def _top_up(self) -> None:
        """Replace a lost actor where the cluster has room for it now and for a score task besides (a
        lost node's room does not come back; an actor holds its CPUs, and the score tasks need some)."""
        import ray

        room = ray.available_resources().get("CPU", 0) >= self.cc.rollout_cpus + self.cc.score_cpus
        if self.alive() < self.cc.rollout_workers and room:
            self._start()

    def _wait_one(self):
        import ray

        waiting = list(self.inflight) + list(self.starting)
        if not waiting:
            raise GRPOError("cluster: no rollout worker is left (every actor died and the cluster has no room for a new one)")
        done, _ = ray.wait(waiting, num_returns=1, timeout=self.cc.start_timeout_s)
        if not done:
            raise GRPOError(f"cluster: no rollout worker started or finished a part in {self.cc.start_timeout_s:.0f} s "
                            f"(cluster.start_timeout_s); the cluster has {ray.cluster_resources().get('CPU', 0):g} CPUs, "
                            f"{self.cc.rollout_workers} rollout workers want {self.cc.rollout_cpus:g} each")
        ref = done[0]
        if ref in self.starting:
            actor = self.starting.pop(ref)
            try:
                self.where[actor] = ray.get(ref)
                self.idle.append(actor)
                for name in self.where[actor].pop("secrets_missing", []):
                    self.log(f"cluster: {name} is set here but not on node {self.where[actor]['node']}: secrets are not sent "
                             f"through Ray (set it where `ray start` runs there)")
            except ray.exceptions.RayTaskError as err:
                raise_task_error(err, "rollout worker start")
            except ray.exceptions.RayError as err:  # died while starting: its node went away
                self.log(f"cluster: a rollout worker died while starting ({type(err).__name__})")
            return None
        return ref

    def run(self, k: int, parts: list[int], stamp: str) -> list[dict]:
        """Write rollout parts `parts` of iteration k over the actors; one report per part."""
        import ray

        queue, reports = deque(parts), []
        self._top_up()
        while queue or self.inflight:
            while queue and self.idle:
                actor, part = self.idle.pop(0), queue.popleft()
                self.inflight[actor.rollout_part.remote(k, part, stamp)] = (actor, part)
            self.show(k, len(queue))
            ref = self._wait_one()
            if ref is None:
                continue
            actor, part = self.inflight.pop(ref)
            try:
                reports.append(ray.get(ref))
                self.idle.append(actor)
                fault_point("rollout:part", k)  # the resume tests' hook: the driver dies with parts in flight
            except ray.exceptions.RayTaskError as err:
                raise_task_error(err, f"rollout iteration {k} part {part}")
            except ray.exceptions.RayError as err:  # the actor's process or node died: the part goes again
                w = self.where.pop(actor, {})
                self.log(f"rollout iteration {k} part {part}: its worker (node {w.get('node', '?')}, pid {w.get('pid', '?')}) "
                         f"died ({type(err).__name__}); the part is re-run")
                ray.kill(actor, no_restart=True)
                queue.appendleft(part)
                self._top_up()
        self.show(k, 0)
        for ref, actor in list(self.starting.items()):  # a replacement still starting would take CPUs the score tasks need
            ray.kill(actor, no_restart=True)
            del self.starting[ref]
        return reports

    def show(self, k: int, queued: int) -> None:
        """What `grpo status` shows while the driver runs: the parts in flight and the node of each."""
        if self.status is not None:
            parts = {str(p): self.where.get(a, {}).get("node", "?") for a, p in self.inflight.values()}
            self.status({"stage": "rollout", "iteration": k, "in_flight": parts, "queued": queued})

    def nodes(self) -> list[str]:
        return sorted({w["node"] for w in self.where.values()})

    def close(self) -> None:
        import ray

        for actor in [*self.idle, *self.starting.values(), *(a for a, _ in self.inflight.values())]:
            try:
                ray.get(actor.close.remote(), timeout=30)
            except Exception:  # closing is best effort: the actor goes with the driver anyway
                pass
            ray.kill(actor, no_restart=True)


SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
"""A variable whose name holds one of these is a secret: its value never goes into Ray's runtime_env
(which Ray logs on every node, keeps in its GCS and shows in job listings)."""
FORWARDED = ("GRPO_", "HF_", "VLLM_", "TOKENIZERS_PARALLELISM", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR")


def is_secret(name: str) -> bool:
    return any(word in name.upper() for word in SECRET_WORDS)


def forwarded_env(environ=None) -> dict[str, str]:
    """The driver's settings the workers need (GRPO_*, HF_*, VLLM_*, ...), but for its own fault hook
    and any secret (HF_TOKEN, ...: each node reads its own, `secrets_left_out`)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED) and k != "GRPO_FAULT" and not is_secret(k)}


def secrets_left_out(environ=None) -> list[str]:
    """The names of the driver's secrets of the forwarded kinds: not sent, read on each node from its own environment."""
    environ = os.environ if environ is None else environ
    return sorted(k for k in environ if k.startswith(FORWARDED) and is_secret(k))


def key_names(cfg) -> list[str]:
    """The variables holding the API keys of the run's served rewards (a judge, a served reward
    model): every score task needs them in its own node's environment."""
    names = []
    for spec in cfg.rewards:
        name = spec.options().get("api_key_env") if spec.served else None
        if name and name not in names:
            names.append(name)
    return names


def runtime_env(environ=None) -> dict:
    """The runtime_env for `ray.init`: the forwarded variables, merged into the job's own runtime_env
    under `ray job submit` or a KubeRay RayJob (Ray refuses a driver's runtime_env that names a
    variable the job's names too: the job's value wins here, as it is this process's value anyway)."""
    import json

    environ = os.environ if environ is None else environ
    ours = forwarded_env(environ)
    job = environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not job:
        return {"env_vars": ours}
    try:
        job_env = dict((json.loads(job).get("runtime_env") or {}).get("env_vars") or {})
    except (ValueError, AttributeError):
        job_env = {}
    # only what the job's runtime_env lacks: Ray merges the rest (its other fields) itself
    return {"env_vars": {k: v for k, v in ours.items() if k not in job_env}}
