"""`rlx serve`: an OpenAI-compatible HTTP server over the runtime's Scheduler. Starlette and
uvicorn come with the optional extra `rlx-core[serve]`; nothing else in rlx_core needs them,
and this package imports them only when an app is made (with prometheus-client, for /metrics)."""
from __future__ import annotations

import importlib.util

from ..ir.errors import RlxError

INSTALL = "pip install 'rlx-core[serve]'"


class ServeDependencyError(RlxError):
    """The serve extra is not installed."""


def require() -> None:
    """A clean error naming the install command when Starlette, uvicorn or prometheus-client is missing."""
    missing = [m for m in ("starlette", "uvicorn", "prometheus_client")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise ServeDependencyError(f"rlx serve needs {' and '.join(missing)}, which come with the "
                                   f"serve extra: {INSTALL}")


def load_models(names, backend: str | None = None, profile: str | None = None, tp: int | None = None,
                echo=None, progress: bool = False) -> tuple:
    """(models, groups) to serve: each name loaded here (rlx_core.load); with more than one
    tensor-parallel rank (`tp`, else RLX_TP, else the profile's [parallel] tensor) each
    causal model and encoder also gets its group of supervised rank processes
    (runtime.tp.TensorParallel) that runs it, the one loaded here keeping only its tokenizer
    and config in use (its weights are mapped, not read). `echo(str)` reports each model;
    `progress` shows bars while
    loading. The app stops the groups."""
    import time

    from ..profile import CompileProfile
    from ..runtime.encoder import Encoder
    from ..runtime.model import CausalLM, load
    from ..runtime.tp import TensorParallel, tensor_size

    world = tensor_size(tp, CompileProfile.resolve(profile) if profile else None)
    models, groups = {}, {}
    try:
        for name in names:
            t0 = time.perf_counter()
            m = models[name] = load(name, backend=backend, profile=profile, progress=progress)
            if world > 1 and isinstance(m, (CausalLM, Encoder)):
                groups[name] = TensorParallel({"model": name, "backend": backend, "profile": profile}, world)
            if echo:
                how = f", {world} tensor-parallel ranks (pids {', '.join(map(str, groups[name].pids()))})" \
                    if name in groups else ""
                echo(f"[{name}: {m.config.get('model_type')}, backend {m.backend.name}{how}; loaded in "
                     f"{time.perf_counter() - t0:.1f}s]")
    except BaseException:
        for g in groups.values():
            g.close()
        raise
    return models, groups


def create_app(models: dict, max_batch: int = 8, default_max_tokens: int | None = None,
               groups: dict | None = None, **limits):
    """The ASGI app serving `models` (name -> loaded CausalLM or Encoder); `groups` (name ->
    rlx_core.runtime.tp.TensorParallel) runs those models tensor-parallel; `limits`:
    max_body_mb (a request body's limit, default 8), body_idle_s, max_queue,
    request_timeout, scheduler_options, api_key, cors_origins, metrics_merge and warm (see
    serve.app.create_app)."""
    require()
    from .app import create_app as make

    return make(models, max_batch, default_max_tokens, groups, **limits)


SHUTDOWN_GRACE_S = 10.0      # rlx serve --shutdown-grace: running requests get this long after SIGTERM


def run(models: dict, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8,
        log_level: str = "info", default_max_tokens: int | None = None, groups: dict | None = None,
        shutdown_grace: float = SHUTDOWN_GRACE_S, **limits) -> None:
    """Serve until SIGTERM or SIGINT (uvicorn), then shut down gracefully: new requests get
    503 while those running finish, for up to `shutdown_grace` seconds; the rest are
    cancelled (their streams end with finish_reason "abort" and [DONE])."""
    require()
    from .ops import graceful_server

    app = create_app(models, max_batch, default_max_tokens, groups, **limits)
    graceful_server(app, shutdown_grace, host=host, port=port, log_level=log_level).run()


__all__ = ["create_app", "run", "SHUTDOWN_GRACE_S", "load_models", "require", "ServeDependencyError",
           "INSTALL"]
