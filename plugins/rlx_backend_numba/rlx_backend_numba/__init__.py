"""RLX backend on numba: a compiled, multithreaded CPU backend.

Elementwise regions are generated from the op table (codegen.py), row-wise ops, attention
and the decode GEMV are hand-written parallel kernels (kernels.py); large matmuls stay on
BLAS, except packed ones on a CPU with AMX (amx.py: tiles, to f32 accuracy). Every other
op, and f16/bf16 or integer steps, run on the NumPy backend's kernels inside the same arena.
Above numpy in priority, so installing it makes it the default CPU backend; `backend="numpy"`
still selects the embedded one.

Threads: RLX_NUM_THREADS (else every core numba sees). Kernels compile once per machine
into RLX_NUMBA_CACHE (default: `numba` in the RLX cache dir) and numba's own cache.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys

from rlx_core.backends.base import Backend, Runner, best_time, kernel_path, strided_transposes
from rlx_core.backends.numpy import NumpyBackend
from rlx_core.ir.errors import BackendError
from rlx_core.ir.lir import LirModule
from rlx_core.plugins.hookspecs import hookimpl

__version__ = "0.1.0"
ADOPT_MIN_BYTES = 8 << 20        # file-mapped weights from this size are copied (NumbaBackend.adopt)


def requested_threads(value=None) -> int | None:
    """The thread count asked for (`value`, else RLX_NUM_THREADS), or None for every core."""
    raw = os.environ.get("RLX_NUM_THREADS", "") if value is None else value
    if raw in ("", None, 0):
        return None
    try:
        n = int(raw)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or str(raw).strip() not in (str(n), f"+{n}"):
        raise BackendError(f"RLX_NUM_THREADS (numba backend threads) must be a positive integer, "
                           f"got {raw!r}")
    return n


def set_threads(n: int | None = None) -> int:
    """Set numba's thread count (RLX_NUM_THREADS, else all it has); returns the count."""
    want = requested_threads(n)
    # OpenMP workers spin briefly after a kernel, then sleep: spinning without end takes the
    # cores from BLAS's threads (a 0.2 ms LayerNorm took 8 ms on 2 loaded cores), sleeping at
    # once makes every kernel wake them (a decode token of ~250 kernels: 67 vs 29 ms on 2 AMD
    # EPYC cores). libgomp reads these when numba first loads it, at the first parallel kernel.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "30000")
    if want is not None and "numba" not in sys.modules and "NUMBA_NUM_THREADS" not in os.environ:
        os.environ["NUMBA_NUM_THREADS"] = str(want)          # numba reads it when first imported
    import numba

    top = numba.config.NUMBA_NUM_THREADS
    if want is not None and want > top:
        raise BackendError(f"RLX_NUM_THREADS={want} exceeds the {top} threads numba started with "
                           f"(NUMBA_NUM_THREADS); set it before numba is first imported")
    numba.set_num_threads(want or top)
    return want or top


class NumbaBackend(Backend):
    name = "numba"
    priority = 15                 # above numpy (10), below GPU backends (opencl on a GPU 20, cuda 30)
    target = "numba"              # every fusion group (passes/fusion.py: unknown targets get all)

    def __init__(self):
        self._threads_set = False
        self._loaded = False
        self.matmul = "f32"         # packed prefill matmuls: "f32" (AMX tiles where present, to f32
                                    # accuracy), "blas" (f32 BLAS), "bf16" (rounded, AMX tiles)

    def availability(self) -> tuple:
        try:
            requested_threads()
            import numba  # noqa: F401  (importable now, not only when first asked)

            if not self._threads_set:
                set_threads()
                self._threads_set = True
        except BackendError as e:
            return False, str(e)
        except Exception as e:   # ImportError, or an llvmlite that does not load
            return False, f"numba is not importable: {type(e).__name__}: {e} (pip install numba)"
        return True, ""

    def kernel_paths(self) -> list:
        """The kernels this CPU leaves on or off (AMX tiles, VNNI and AVX-512 lanes)."""
        from . import amx, simd

        return [
            kernel_path("AMX bf16 tiles (packed-weight prefill)", amx.missing(),
                        "f32 BLAS runs the products"),
            kernel_path("int8 dot products (VNNI) for activations = \"int8\"",
                        "" if simd.VNNI else "this CPU has neither AVX-VNNI nor AVX-512 VNNI",
                        "the int8 GEMV (x of up to 8 rows) runs without their instruction, more rows as f32 "
                        "products of the rounded x"),
            kernel_path("16-lane AVX-512 kernels", "" if simd.AVX512 else "this CPU has no AVX-512 F/BW",
                        "8-lane AVX2 kernels run instead"),
        ]

    def configure(self, config) -> "NumbaBackend":
        """`[backend] threads` sets numba's thread count (process-wide, like RLX_NUM_THREADS);
        `[backend] matmul` holds for the runners compiled through what this returns (a copy of
        this backend where it differs)."""
        super().configure(config)
        if config.threads:
            set_threads(config.threads)
            self._threads_set = True
        if config.matmul == self.matmul:
            return self
        b = copy.copy(self)
        b.matmul = config.matmul
        return b

    def supported_ops(self) -> set:
        """Every op with a NumPy kernel: numba kernels where they apply, numpy's elsewhere."""
        return NumpyBackend().supported_ops()

    def expression_renderers(self) -> tuple:
        """numba's generated kernels, and numpy's kernels for what they do not cover."""
        from rlx_core.ir.numpy_kernels import NUMPY

        from .codegen import NUMBA

        return (NUMBA, NUMPY)

    def supports_custom(self, name: str) -> bool:
        """A custom op with a NumPy kernel: it runs on numpy arrays in this backend's arena."""
        from rlx_core.ir.custom import custom_ops

        op = custom_ops().get(name)
        return op is not None and "numpy" in op.kernels

    def data_parallel(self) -> int:
        """As the NumPy backend: a BLAS-bound batch (an encoder's) runs as one part per BLAS
        thread, side by side, each part's BLAS single-threaded (on 2 cores, MiniLM's 32
        sentences: 112 -> 93 ms idle, 490 -> 104 ms loaded)."""
        return NumpyBackend().data_parallel()

    def parallel_scope(self):
        return NumpyBackend().parallel_scope()

    @contextlib.contextmanager
    def part_scope(self):
        """numba's kernels on one thread in this part's thread (the count is thread-local):
        each part has a core of its own, and a prange kernel would wake a second worker at
        every launch (MiniLM's 13 LayerNorms on 2 cores: 0.87 -> 0.78 ms a part with both
        parts running, 1.74 -> 0.83 ms for a part run alone)."""
        import numba

        n = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            yield
        finally:
            numba.set_num_threads(n)

    def copy_bandwidth(self, nbytes: int = 1 << 27) -> float:
        """A parallel numba copy's bytes per second (read + written), best of 5: the kernels run
        on every thread, so a one-thread numpy copy would understate what they can reach."""
        import numpy as np

        from .kernels import copy_par

        src = np.ones(nbytes // 8, np.float64)
        dst = np.empty_like(src)
        return 2 * src.nbytes / best_time(lambda: copy_par(src, dst))

    def adopt(self, array):
        """A large weight read from a file mapping (an LM head in a GGUF) is copied into NumPy's
        memory, which NumPy backs with transparent huge pages (168 MB of them for Gemma 3), and
        the file's pages leave this process: a decode GEMV streams it with fewer TLB misses
        (Gemma 3's 178 MB LM head, Intel Xeon: 10.9 -> 8.6 ms alone, decode 24 -> 21 ms a
        token, the same peak RSS). Small ones stay mapped: copies of them came from malloc's heap,
        whose freed holes among them stayed resident (Gemma 3: +21 MB), for little gain."""
        import numpy as np

        from rlx_core.pipeline import read_only_mapping, release_file_pages

        if array.nbytes < ADOPT_MIN_BYTES or not read_only_mapping(array):
            return array
        copy = np.empty_like(array)
        step = max(1, (4 << 20) // max(array[:1].nbytes, 1))       # 4 MB at a time: the file's
        for i in range(0, len(array), step):                      # pages go as the copy grows
            copy[i:i + step] = array[i:i + step]
            release_file_pages(array[i:i + step])
        return copy

    def planned_layouts(self, g) -> tuple:
        """The int8 roundings its matmuls and MoE steps do themselves, planned as views of
        their input (quant_kernels.redundant_roundings), and the transposes around attention:
        an encoder's q, k and v heads then come straight from its fused QKV matmul's rows, and
        an attention read by its output transpose alone writes its rows in that order
        (NumbaRunner.laid_out), the contiguous rows the output projection reads (DINOv2-S's
        call copied 48 such transposes, 2.5% of it)."""
        from .moe import rounds_x_itself
        from .quant_kernels import redundant_roundings
        from .runner import STRIDED_READERS, STRIDED_WRITERS

        return (redundant_roundings(g, {"moe_experts": rounds_x_itself})
                | strided_transposes(g, STRIDED_READERS, STRIDED_WRITERS), frozenset(), frozenset())

    def compile(self, lir: LirModule, params: dict, states: dict) -> Runner:
        ok, why = self.availability()
        if not ok:
            raise BackendError(f"backend 'numba' is not available here: {why}")
        from .runner import NumbaRunner

        if not self._loaded:
            self._load_code_generator()
        return NumbaRunner(lir, params, states, matmul=self.matmul)

    def _load_code_generator(self) -> None:
        """numba's first kernel load in a process sets up its code generator, which runs tens of
        MB of LLVM's code once (resident.py). Done here, before the runner's weights and arena
        exist, and released after, those pages never add to the model's peak RSS."""
        import numpy as np

        from .kernels import copy_par
        from .resident import release_llvm_pages

        copy_par(np.zeros(1), np.zeros(1))
        release_llvm_pages()
        self._loaded = True


@hookimpl
def rlx_register_backends(register):
    register(NumbaBackend())


__all__ = ["NumbaBackend", "rlx_register_backends", "set_threads", "requested_threads"]
