"""What of the driver's environment reaches the workers, and how: settings by value in Ray's
`runtime_env`, secrets by name only (each node reads its own value), merged with a job's own
`runtime_env` under `ray job submit`; and error text with every secret's value masked."""

from __future__ import annotations

import os


SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "AUTH")
"""A variable one of whose `_`-separated words ends in one of these (HF_TOKEN, GRPO_JUDGE_API_KEY,
AWS_SECRET_ACCESS_KEY; not TOKENIZERS_PARALLELISM) is a secret: its value never goes into Ray's
runtime_env (which Ray logs on every node, keeps in its GCS and shows in job listings)."""
FORWARDED = ("GRPO_", "HF_", "VLLM_", "TOKENIZERS_PARALLELISM", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR")


def is_secret(name: str) -> bool:
    return any(part.endswith(SECRET_WORDS) for part in name.upper().split("_"))


def forwarded_env(environ=None, skip=()) -> dict[str, str]:
    """The driver's settings the workers need (GRPO_*, HF_*, VLLM_*, ...), but for its own fault hook
    and any secret (HF_TOKEN, ...: each node reads its own, `secrets_left_out`; `skip`: the variables a
    URL references, `url_secrets`, whatever their names)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items()
            if k.startswith(FORWARDED) and k != "GRPO_FAULT" and not is_secret(k) and k not in skip}


def secrets_left_out(environ=None) -> list[str]:
    """The names of the driver's secrets of the forwarded kinds: not sent, read on each node from its own environment."""
    environ = os.environ if environ is None else environ
    return sorted(k for k in environ if k.startswith(FORWARDED) and is_secret(k))


def key_names(cfg) -> list[str]:
    """The variables holding the API keys of the run's served rewards (a judge, a served reward
    model, an OpenRLHF server): `api_key_env` and every `${NAME}` of their URLs
    (pipeline/config/urls.py); every score task needs them in its own node's environment."""
    from pipeline.config.urls import names as url_names

    names = []
    for spec in cfg.rewards:
        if not spec.served:
            continue
        opts = spec.options()
        for name in [opts.get("api_key_env"), *url_names(opts.get("url") or opts.get("base_url") or "")]:
            if name and name not in names:
                names.append(name)
    return names


def url_secrets(cfg) -> set[str]:
    """The variables the run's served rewards' URLs, its data URLs (data.train, data.eval) and cluster.address
    reference: secrets whatever their names, so never forwarded by value (`forwarded_env`): a node that reads
    the data needs the variable set in its own environment, as a served reward's node does."""
    from pipeline.config.urls import names as url_names

    served = {n for spec in cfg.rewards if spec.served
              for n in url_names(spec.options().get("url") or spec.options().get("base_url") or "")}
    sets = [cfg.data.train, cfg.cluster.address or ""] + [s.path for s in cfg.eval_sets()]  # data URLs, the cluster's
    return served | {n for location in sets for n in url_names(location)}


def runtime_env(environ=None, skip=()) -> dict:
    """The runtime_env for `ray.init`: the forwarded variables, merged into the job's own runtime_env
    under `ray job submit` or a KubeRay RayJob (Ray refuses a driver's runtime_env that names a
    variable the job's names too: the job's value wins here, as it is this process's value anyway)."""
    import json

    environ = os.environ if environ is None else environ
    ours = forwarded_env(environ, skip)
    job = environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not job:
        return {"env_vars": ours}
    try:
        job_env = dict((json.loads(job).get("runtime_env") or {}).get("env_vars") or {})
    except (ValueError, AttributeError):
        job_env = {}
    # only what the job's runtime_env lacks: Ray merges the rest (its other fields) itself
    return {"env_vars": {k: v for k, v in ours.items() if k not in job_env}}


def redact(text: str, environ=None) -> str:
    """`text` with the value of every secret-named variable of this process (pool.is_secret) masked, and
    every secret a URL's `${NAME}` read here (pipeline/config/urls.py)."""
    from pipeline.config.urls import mask

    environ = os.environ if environ is None else environ
    for name, value in environ.items():
        if is_secret(name) and len(value) >= 4:
            text = text.replace(value, "***")
    return mask(text)
