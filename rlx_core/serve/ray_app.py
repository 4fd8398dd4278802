"""`rlx serve` as a Ray Serve application: N replicas of the OpenAI-compatible app, each
loading its model(s) (tensor-parallel over `tp` rank processes when asked) in its replica
actor. Ray does the placement, routing and restarts; nothing here is cluster code.

    # serve_config.yaml (serve run serve_config.yaml)
    applications:
      - name: rlx
        route_prefix: /
        import_path: rlx_core.serve.ray_app:app_builder
        args: {model: NAME, backend: numpy, replicas: 2, tp: 1}

or `serve run rlx_core.serve.ray_app:app_builder model=NAME replicas=2`. The args:
`model` (a name or path, or a list of them), `backend`, `profile`, `replicas` (default 1),
`tp` (ranks per replica, default 1), `max_batch` (default 8), `max_tokens` (chat default),
`prefix_cache_mb`, `prefill_chunk`, `stall_budget`, `idle_release_s` and `mixed` (false: `rlx serve
--no-mixed`) (each replica's scheduler: `rlx serve`'s flags).
The deployment is named "rlx": a config's `deployments:` entry of that name sets Ray's own
options (ray_actor_options such as num_gpus, autoscaling). Needs the cluster extra:
pip install 'rlx-core[cluster]'.

Each replica keeps its own scheduler, prefix cache and metrics; GET /metrics on any replica
answers the sum over all of them: every replica pushes its Prometheus text to one small
deployment, "rlx-metrics", every PUSH_S seconds (and right before it answers /metrics), and
that deployment merges the latest text of each replica seen within STALE_S seconds
(ops.merge_metrics: counters, histograms and gauges summed, ratios recomputed from the sums;
rlx_replicas counts them). So another replica's part is at most PUSH_S seconds old.
"""
from __future__ import annotations

import importlib.util
import logging
import threading
import time
import uuid

from ..ir.errors import ModelError
from . import ServeDependencyError, create_app, load_models

INSTALL = "pip install 'rlx-core[cluster]'"
DEPLOYMENT = "rlx"
METRICS_DEPLOYMENT = "rlx-metrics"
PUSH_S = 2.0                 # how often a replica sends its metrics to the hub
STALE_S = 30.0               # a replica not heard from this long is left out of the sum (gone)
log = logging.getLogger("rlx.serve")
KEYS = {"model": "a model name or path, or a list of them", "backend": "a backend name",
        "profile": "a profile name or .rlx.toml path", "replicas": "a whole number >= 1",
        "tp": "a whole number >= 1", "max_batch": "a whole number >= 1",
        "max_tokens": "a whole number >= 1", "prefix_cache_mb": "a number >= 0",
        "prefill_chunk": "a whole number >= 1", "stall_budget": "a number >= 0", "mixed": "true or false",
        "idle_release_s": "a number >= 0"}


def require() -> None:
    """A clean error naming the install command when Ray Serve is missing."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise ServeDependencyError(f"the Ray Serve application needs ray[serve], which comes with the "
                                   f"cluster extra: {INSTALL}")


def _count(args: dict, key: str, default):
    """args[key] as an int >= 1 (serve run passes strings: "2" is 2)."""
    value = args.get(key, default)
    if value is None:
        return None
    text = str(value).strip()
    if isinstance(value, bool) or not (isinstance(value, int) or text.isdigit()) or int(text) < 1:
        raise ModelError(f"rlx Ray Serve app: {key}={value!r}; expected {KEYS[key]}")
    return int(text)


def options(args: dict) -> dict:
    """The builder's args checked: unknown keys and bad values are errors naming the key."""
    if not isinstance(args, dict):
        raise ModelError(f"rlx Ray Serve app: args must be a mapping of {sorted(KEYS)}, got "
                         f"{type(args).__name__}")
    unknown = sorted(set(args) - set(KEYS))
    if unknown:
        raise ModelError(f"rlx Ray Serve app: unknown arg(s) {unknown}; expected: " +
                         ", ".join(f"{k} ({v})" for k, v in KEYS.items()))
    models = args.get("model")
    models = [models] if isinstance(models, str) else models
    if not isinstance(models, (list, tuple)) or not models \
            or not all(isinstance(m, str) and m for m in models):
        raise ModelError(f"rlx Ray Serve app: model={args.get('model')!r}; expected {KEYS['model']}")
    for key in ("backend", "profile"):
        if args.get(key) is not None and not isinstance(args[key], str):
            raise ModelError(f"rlx Ray Serve app: {key}={args[key]!r}; expected {KEYS[key]}")
    return {"models": list(models), "backend": args.get("backend"), "profile": args.get("profile"),
            "replicas": _count(args, "replicas", 1), "tp": _count(args, "tp", 1),
            "max_batch": _count(args, "max_batch", 8), "max_tokens": _count(args, "max_tokens", None),
            "scheduler_options": _scheduler_options(args)}


def _scheduler_options(args: dict) -> dict:
    """prefix_cache_mb, stall_budget and idle_release_s (numbers >= 0), prefill_chunk (a count)
    and mixed (true or false), where given."""
    out = {}
    for key in ("prefix_cache_mb", "stall_budget", "idle_release_s"):
        if args.get(key) is None:
            continue
        value = args[key]
        try:
            number = float(value) if not isinstance(value, bool) else -1.0
        except (TypeError, ValueError):
            number = -1.0
        if not number >= 0 or number == float("inf"):
            raise ModelError(f"rlx Ray Serve app: {key}={value!r}; expected {KEYS[key]}")
        out[key] = number
    if args.get("prefill_chunk") is not None:
        out["prefill_chunk"] = _count(args, "prefill_chunk", None)
    if args.get("mixed") is not None:
        out["mixed"] = _flag(args, "mixed")
    return out


def _flag(args: dict, key: str) -> bool:
    """args[key] as a bool (serve run passes strings: "false" is False)."""
    value = args[key]
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return text == "true"
    raise ModelError(f"rlx Ray Serve app: {key}={value!r}; expected {KEYS[key]}")


class MetricsHub:
    """The "rlx-metrics" deployment: each replica's latest metrics text, merged on request."""

    def __init__(self):
        self.texts: dict = {}

    def push(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def merged(self) -> str:
        from .ops import merge_metrics

        now = time.monotonic()
        return merge_metrics([t for at, t in self.texts.values() if now - at <= STALE_S])


def replica_metrics(app, hub) -> None:
    """Make `app` (in a replica) answer /metrics with the sum over replicas: its text pushed
    to `hub` (a handle of MetricsHub) every PUSH_S seconds from a daemon thread and before
    each answer, which is the hub's merge."""
    replica = uuid.uuid4().hex
    ops = app.state.ops

    async def merge(text: str) -> str:
        await hub.push.remote(replica, text)
        return await hub.merged.remote()

    def pushing():
        while True:
            try:
                hub.push.remote(replica, ops.metrics.text()).result()
            except Exception as e:          # noqa: BLE001  (the hub restarting: the next push retries)
                log.debug("pushing metrics to %s failed: %s", METRICS_DEPLOYMENT, e)
            time.sleep(PUSH_S)

    ops.metrics_merge = merge
    threading.Thread(target=pushing, name="rlx-metrics-push", daemon=True).start()


def app_builder(args: dict):
    """The Ray Serve application (a `serve run` import path; see the module doc): deployment
    "rlx" with `replicas` replicas, its ASGI ingress the app `rlx serve` runs, built on each
    replica (the models load there; the app's shutdown stops any rank processes)."""
    require()
    from ray import serve

    opts = options(args)

    def build():                                   # runs in each replica
        models, groups = load_models(opts["models"], opts["backend"], opts["profile"], opts["tp"])
        app = create_app(models, opts["max_batch"], opts["max_tokens"], groups,
                         scheduler_options=opts["scheduler_options"])
        hub = serve.get_deployment_handle(METRICS_DEPLOYMENT, app_name=serve.get_replica_context().app_name)
        replica_metrics(app, hub)
        return app

    ingress = serve.ingress(build)()
    def deploy(target, name: str, replicas: int, *args, **options):
        return serve.deployment(target, name=name, num_replicas=replicas, **options).bind(*args)

    hub = deploy(MetricsHub, METRICS_DEPLOYMENT, 1, ray_actor_options={"num_cpus": 0})   # (it only adds)
    return deploy(ingress, DEPLOYMENT, opts["replicas"], hub)


__all__ = ["app_builder", "options", "require", "MetricsHub", "replica_metrics", "INSTALL", "DEPLOYMENT",
           "METRICS_DEPLOYMENT"]
