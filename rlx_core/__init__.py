"""RLX for Python: a small ML compiler and runtime for model builders."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .ir.autodiff import grad, value_and_grad  # noqa: E402
from .ir.dtype import BF16, BOOL, F16, F32, F64, I32, I64, DType  # noqa: E402
from .ir.errors import RlxError  # noqa: E402
from .ir.graph import Builder, Emit, Graph  # noqa: E402
from .ir.ops import MaskKind  # noqa: E402
from .ir.shape import Shape  # noqa: E402
from .pipeline import CompilePipeline, Executable, compile  # noqa: E402
from .plugins.manager import core_version  # noqa: E402  (installs the registry source)
from .profile import CompileProfile  # noqa: E402
from .runtime.train import SGD, Adam, Trainer  # noqa: E402

__version__ = core_version()

if TYPE_CHECKING:
    from .bisection import BisectReport, PassReport
    from .profile import ProfileLike


def load(path_or_name: str, backend: str | None = None, profile: ProfileLike = None, **kw: Any) -> Any:
    """Load a checkpoint (HF folder, GGUF file or a packaged name) as a runnable model: the one its
    architecture's registered recipe builds (a runtime.model.CausalLM, a runtime.encoder.Encoder,
    or a plugin's own model)."""
    from .runtime.model import load as _load

    return _load(path_or_name, backend=backend, profile=profile, **kw)


def bisect(model: Any, backend: str, ref: str = "numpy", input: Any = None, pass_name: str | None = None,
           **kw: Any) -> BisectReport | PassReport:
    """Where `backend` first leaves `ref` on `model` (a path, packaged name or loaded model):
    the first diverging node at each IR level (rlx_core.bisection.bisect). With `pass_name`
    ("all" or a pass), on `backend` alone: the first pass after which the outputs change
    (bisect_passes). Returns a report; print it, or read `.first`."""
    from . import bisection

    if pass_name is not None:
        return bisection.bisect_passes(model, backend, input, pass_name, **kw)
    return bisection.bisect(model, backend, ref, input, **kw)


__all__ = ["DType", "F32", "F16", "BF16", "F64", "I32", "I64", "BOOL", "Graph", "Builder", "Emit",
           "Shape", "MaskKind", "RlxError", "CompileProfile", "CompilePipeline", "Executable",
           "compile", "load", "bisect", "grad", "value_and_grad", "Trainer", "Adam", "SGD", "__version__"]
