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
`tp` (ranks per replica, default 1), `max_batch` (default 8), `max_tokens` (chat default).
The deployment is named "rlx": a config's `deployments:` entry of that name sets Ray's own
options (ray_actor_options such as num_gpus, autoscaling). Needs the cluster extra:
pip install 'rlx-core[cluster]'.
"""
from __future__ import annotations

import importlib.util

from ..ir.errors import ModelError
from . import ServeDependencyError, create_app, load_models

INSTALL = "pip install 'rlx-core[cluster]'"
DEPLOYMENT = "rlx"
KEYS = {"model": "a model name or path, or a list of them", "backend": "a backend name",
        "profile": "a profile name or .rlx.toml path", "replicas": "a whole number >= 1",
        "tp": "a whole number >= 1", "max_batch": "a whole number >= 1",
        "max_tokens": "a whole number >= 1"}


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
            "max_batch": _count(args, "max_batch", 8), "max_tokens": _count(args, "max_tokens", None)}


def app_builder(args: dict):
    """The Ray Serve application (a `serve run` import path; see the module doc): deployment
    "rlx" with `replicas` replicas, its ASGI ingress the app `rlx serve` runs, built on each
    replica (the models load there; the app's shutdown stops any rank processes)."""
    require()
    from ray import serve

    opts = options(args)

    def build():                                   # runs in each replica
        models, groups = load_models(opts["models"], opts["backend"], opts["profile"], opts["tp"])
        return create_app(models, opts["max_batch"], opts["max_tokens"], groups)

    ingress = serve.ingress(build)()
    return serve.deployment(ingress, name=DEPLOYMENT, num_replicas=opts["replicas"]).bind()


__all__ = ["app_builder", "options", "require", "INSTALL", "DEPLOYMENT"]
