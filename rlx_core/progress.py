"""Progress bars for compiling: one per graph compiled and one per shape specialization, on
stderr, for work that asks for one (`rlx_core.load(progress=True)`, the default, and so the CLI).

A bar appears only once its work has lasted DELAY seconds, so small graphs never flash one,
and it is erased when done: a chat or a generation stream stays clean. It is drawn only
where it can redraw in place (stderr a terminal, or Jupyter), never into a log or a pipe.
It counts the finished stages of the work and names the running one; `detail()` names a
step inside it (a compile pass).
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from typing import Any

DELAY = 0.5
_CURRENT: contextvars.ContextVar[_Stages | None] = contextvars.ContextVar("rlx_progress", default=None)


class _Stages:
    """The stages of one piece of work; its tqdm bar is made once the work has lasted DELAY."""

    def __init__(self, desc: str, total: int):
        self.desc, self.total, self.done, self.name = desc, total, -1, ""
        self.bar: Any = None            # a tqdm bar (untyped), made once the work outlasts DELAY
        self.t0 = time.monotonic()

    def stage(self, name: str) -> None:
        self.done, self.name = self.done + 1, name
        self._show(name)

    def detail(self, text: str) -> None:
        self._show(f"{self.name}: {text}")

    def _show(self, postfix: str) -> None:
        if self.bar is None:
            if time.monotonic() - self.t0 < DELAY:
                return
            self.bar = tqdm_class()(total=self.total, desc=self.desc, file=sys.stderr, leave=False,
                                    bar_format="{desc}: stage {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
            self.bar.start_t -= time.monotonic() - self.t0      # elapsed since the work began
        self.bar.n = max(self.done, 0)
        self.bar.set_postfix_str(postfix)        # (redraws)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def tqdm_class():
    """tqdm.auto's bar (a Jupyter widget in a notebook, else text) without its asyncio mixin:
    importing asyncio costs ~40 ms of every start, and no bar here is iterated with async for."""
    import warnings

    from tqdm.std import TqdmExperimentalWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=TqdmExperimentalWarning)
        from tqdm.autonotebook import tqdm
    return tqdm


def _redraws() -> bool:
    """Whether a bar on stderr redraws in place: a terminal, or a Jupyter kernel (tqdm.auto
    draws a widget there)."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) or "ipykernel" in sys.modules


@contextlib.contextmanager
def task(desc: str, stages: int, enabled: bool = True):
    """The work inside the block, of `stages` stages, shows a bar when `enabled` (a disabled
    task hides any outer one's): `stage(name)` starts the next stage, `detail(text)` names a
    step inside it."""
    work = _Stages(desc, stages) if enabled and _redraws() else None
    token = _CURRENT.set(work)
    try:
        yield
    finally:
        _CURRENT.reset(token)
        if work is not None:
            work.close()


def stage(name: str) -> None:
    """Start stage `name` of the current work's bar (nothing outside a task)."""
    work = _CURRENT.get()
    if work is not None:
        work.stage(name)


def detail(text: str) -> None:
    """Name a step of the running stage (nothing outside a task)."""
    work = _CURRENT.get()
    if work is not None:
        work.detail(text)


__all__ = ["task", "stage", "detail", "DELAY"]
