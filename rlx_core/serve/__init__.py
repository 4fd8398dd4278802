"""`rlx serve`: an OpenAI-compatible HTTP server over the runtime's Scheduler. Starlette and
uvicorn come with the optional extra `rlx-core[serve]`; nothing else in rlx_core needs them,
and this package imports them only when an app is made."""
from __future__ import annotations

import importlib.util

from ..ir.errors import RlxError

INSTALL = "pip install 'rlx-core[serve]'"


class ServeDependencyError(RlxError):
    """The serve extra is not installed."""


def require() -> None:
    """A clean error naming the install command when Starlette or uvicorn is missing."""
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ServeDependencyError(f"rlx serve needs {' and '.join(missing)}, which come with the "
                                   f"serve extra: {INSTALL}")


def create_app(models: dict, max_batch: int = 8, default_max_tokens: int | None = None):
    """The ASGI app serving `models` (name -> loaded CausalLM or Encoder)."""
    require()
    from .app import create_app as make

    return make(models, max_batch, default_max_tokens)


def run(models: dict, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8,
        log_level: str = "info", default_max_tokens: int | None = None) -> None:
    """Serve until interrupted (uvicorn)."""
    require()
    import uvicorn

    uvicorn.run(create_app(models, max_batch, default_max_tokens), host=host, port=port,
                log_level=log_level)


__all__ = ["create_app", "run", "require", "ServeDependencyError", "INSTALL"]
