"""The numba runner: the NumPy runner's arena and step loop, with each step it can compile
swapped for a numba kernel when the runner is built.

Steps are prepared once per shape specialization: operand layouts come from prototypes
(inputs as contiguous arrays, views replayed on them), so a step knows at build time how
to read each operand and whether its work is large enough for all threads. A step whose op
or dtypes have no numba kernel here (f16/bf16, ints, reduce, gather, ...) keeps the NumPy
backend's kernel; BLAS runs between numba kernels, never inside one.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from rlx_core.backends.base import keeps_last_axis
from rlx_core.backends.numpy import NumpyRunner
from rlx_core.backends.numpy.blas import blas_threads, single_threaded_blas
from rlx_core.ir.numpy_kernels import KERNELS, VIEWS, segments
from rlx_core.ir.errors import BackendError
from rlx_core.ir.lir import LirModule
from rlx_core.ir.ops import MaskKind
from rlx_core.ir.quant import QuantScheme

from . import codegen
from . import kernels as K
from . import quant_kernels
from .deltanet import prepare_causal_conv1d, prepare_gated_delta_rule
from .moe import prepare_moe_experts, prepare_moe_route
from . import cblas
from .cblas import SGEMM
from .simd import LANES
from .resident import release_llvm_pages

FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
GEMV_MAX_M = 1                  # rows up to which a matmul on a [N, K] weight is a numba GEMV
PAR_MIN = codegen.PAR_MIN       # work (elements, or multiply-adds) from which kernels use all threads
DECODE_CHUNK = 32               # fewest keys per task of split-keys attention (decode, pieces)
FEW_QUERIES = 64                # query rows a sequence up to which attention splits the keys, not the rows
ATTN_TILE = 32                  # query rows per head in a task of f32 prefill attention
PREPARE: dict = {}              # op -> prepare(a, outs, protos) -> fn(a, out, *ins) | None


def prepares(*ops):
    def wrap(f):
        for op in ops:
            PREPARE[op] = f
        return f
    return wrap


def _native(*arrays) -> bool:
    """All present arrays share one float dtype a numba kernel computes in."""
    dts = {a.dtype for a in arrays if a is not None}
    return len(dts) == 1 and dts.pop() in FLOATS


def _pick(par, ser, work: int):
    return par if work >= PAR_MIN else ser


def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])


def _rows3(x: np.ndarray) -> np.ndarray:
    """x as [n0, n1, D] with its last two axes kept: a view wherever the leading axes merge,
    which a head-split view of a wider row ([.., S, H, D] of a fused QKV output) allows and
    a matrix of rows does not."""
    return x.reshape(-1, x.shape[-2] if x.ndim > 1 else 1, x.shape[-1])


# --------------------------------------------------------------------------- elementwise
@prepares("binary", "compare", "where", "activation", "cast", "fused_swiglu")
def _single(a, outs, protos, op=None):
    program = ((op, tuple(sorted(a.items())), tuple(range(len(protos)))),)
    return codegen.elementwise_step(program, protos, outs[0])


@prepares("fused_elementwise")
def _region(a, outs, protos, op=None):
    return codegen.elementwise_step(a["program"], protos, outs[0])


# --------------------------------------------------------------------------- row-wise
def _lanes(*rows) -> bool:
    """The float32 vector rows (norms, RoPE) apply: rows of a multiple of 8 elements, each
    array in unit stride along them (checked per run: an input's layout is the caller's)."""
    o = rows[-1]
    return (o.dtype == np.float32 and o.shape[-1] % LANES == 0
            and all(a.strides[-1] == 4 for a in rows))


def _row_scalars(o: np.ndarray, eps: float) -> tuple:
    t = o.dtype.type
    return t(eps), t(o.shape[-1])


@prepares("rms_norm", "fused_residual_rms_norm")
def _rms(a, outs, protos, op=None):
    fused = op == "fused_residual_rms_norm"
    x, r = protos[0], (protos[1] if fused else None)
    w = protos[2 if fused else 1] if len(protos) > (2 if fused else 1) else None
    o = outs[-1]
    if not _native(x, r, w, *outs) or o.size == 0 or (fused and r.shape != x.shape):
        return None
    eps, dd = _row_scalars(o, a["eps"])
    offset = o.dtype.type(a["offset"])
    o3, h3 = _rows3(o), _rows3(outs[0])
    kern = _pick(K.rms_par, K.rms_ser, o.size)
    ones = np.ones(1, o.dtype)

    def operands(x, *rest):
        x3 = _rows3(x)
        r3 = _rows3(rest[0]) if fused else x3
        w_ = rest[-1] if w is not None else ones
        return x3, r3, w_, h3, o3, fused, w is not None, offset, eps, dd, _lanes(x3, r3, w_, h3, o3)
    return codegen.as_step(codegen.bindable(kern, operands))


@prepares("layer_norm", "fused_residual_ln")
def _ln(a, outs, protos, op=None):
    fused = op == "fused_residual_ln"
    x, r = protos[0], (protos[1] if fused else None)
    rest = protos[2 if fused else 1:]
    o = outs[-1]
    if not _native(x, r, *rest, *outs) or o.size == 0 or (fused and r.shape != x.shape):
        return None
    eps, dd = _row_scalars(o, a["eps"])
    o2, h2 = _rows(o), _rows(outs[0])
    kern = _pick(K.ln_par, K.ln_ser, o.size)
    ones = np.ones(1, o.dtype)
    has_g, has_b = len(rest) > 0, len(rest) > 1

    def run(a_, out, x, *ins):
        x2 = _rows(x)
        r2 = _rows(ins[0]) if fused else x2
        aff = ins[1:] if fused else ins
        g, b = aff[0] if has_g else ones, aff[1] if has_b else ones
        kern(x2, r2, g, b, h2, o2, fused, has_g, has_b, eps, dd, _lanes(x2, r2, g, b, h2, o2))
    return run


@prepares("softmax")
def _softmax(a, outs, protos, op=None):
    x, o = protos[0], outs[0]
    if not _native(x, o) or o.size == 0 or a["axis"] % x.ndim != x.ndim - 1:
        return None
    o2 = _rows(o)
    kern = _pick(K.softmax_par, K.softmax_ser, o.size)
    return lambda a_, out, x: kern(_rows(x), o2)


def _table3(t: np.ndarray) -> np.ndarray:
    return t[None] if t.ndim == 2 else t


def _rope_fn(x, cos, o, style):
    """fn(x, cos, sin) writing rope(x) into `o`, or None when not native."""
    if not _native(x, cos, o) or o.size == 0:
        return None
    kern = _pick(K.rope_par, K.rope_ser, o.size)
    inter = style == "interleaved"

    def run(x, c, s):
        c, s = _table3(c), _table3(s)
        vec = not inter and c.shape[-1] % LANES == 0 and _lanes(x, c, s, o)
        kern(x, c, s, o, inter, vec)
    return run


@prepares("rope")
def _rope(a, outs, protos, op=None):
    f = _rope_fn(protos[0], protos[1], outs[0], a["style"])
    return None if f is None else (lambda a_, out, x, c, s: f(x, c, s))


# --------------------------------------------------------------------------- attention
def _attention_fn(a, q, k, v, o, mask):
    """fn(q, k, v, mask, pos) writing attention into `o`, or None when not native."""
    if not _native(q, k, v, o) or o.size == 0:
        return None
    if mask is not None and ((mask.dtype != np.bool_ and mask.dtype.kind != "f") or mask.ndim > 4):
        return None
    kind = MaskKind(a["mask_kind"])
    causal = kind in (MaskKind.CAUSAL, MaskKind.SLIDING_WINDOW)
    window = a["window"] if kind is MaskKind.SLIDING_WINDOW else 0
    nb, nh, sq, d = q.shape
    sk = k.shape[2]
    t = o.dtype.type
    scale, softcap, ninf = t(a["scale"]), t(a["softcap"]), t(-np.inf)
    no_keep, no_bias = np.ones((1, 1, 1, 1), np.bool_), np.zeros((1, 1, 1, 1), o.dtype)
    default_pos = np.full(nb, sk - sq, np.int32)       # a graph's cache_pos type: one kernel for both
    work = nb * nh * sq * sk * max(d, 1)
    kern = _pick(K.attention_par, K.attention_ser, work)
    few = sq <= FEW_QUERIES
    gemm = not few and d > 0 and SGEMM is not None and o.dtype == np.float32 and o.strides[3] == o.itemsize
    if few:              # decode, a prefill piece: split over kv heads and chunks of keys, not query rows
        vec = o.dtype == np.float32 and d % LANES == 0 and v.shape[3] % LANES == 0   # (strided k, v: copied)

        def kern(*args):
            K.attention_split_keys(*args, vec, DECODE_CHUNK, numba.get_num_threads())
    elif gemm:           # prefill: tiles of query rows as two sgemm calls each, on numba's threads
        tiles = _pick(K.attention_gemm_par, K.attention_gemm_ser, work)
        rows = K.attention_tile(ATTN_TILE, sq, sk, nb * k.shape[1], numba.get_num_threads(), causal)

        def kern(*args):
            with single_threaded_blas():
                tiles(*args, rows, *SGEMM)
    is_bool = mask is not None and mask.dtype == np.bool_
    m4 = None if mask is None else (1,) * (4 - mask.ndim) + tuple(mask.shape)
    # a strided q/k/v (a view the buffer plan left: Gemma's v in some layers) would run the
    # scalar kernel compiled for any layout, whose inner loops stay scalar (3x slower). The
    # sgemm tiles copy q themselves and read k and v in place: only each row must be contiguous.
    copy = [not x.flags.c_contiguous for x in (q, k, v)]
    if gemm:
        copy = [False] + [x.strides[3] != x.itemsize or x.strides[2] < x.strides[3] * x.shape[3]
                          for x in (k, v)]

    def run(q, k, v, mask, pos):
        if any(copy):
            q, k, v = (np.ascontiguousarray(x) if c else x for x, c in zip((q, k, v), copy))
        m = None if mask is None else mask.reshape(m4)
        keep = m if is_bool else no_keep
        bias = no_bias if mask is None or is_bool else m.astype(o.dtype, copy=False)
        kern(q, k, v, keep, bias, default_pos if pos is None else pos, o, scale, softcap, causal, window,
             is_bool, mask is not None and not is_bool, ninf)
    return run


# ops whose numba kernels read these inputs through any strides of unit last stride, and those
# that write their output so (the sgemm tiles, the row kernels and decode index each row)
STRIDED_READERS = {"attention": (0, 1, 2)}
STRIDED_WRITERS = ("attention",)


def transposed_outputs(lir: LirModule) -> dict:
    """(node, 0) -> the perm of the planned-view transpose that alone reads that strided
    writer's output: the order its bytes are laid out in (NumbaBackend.planned_layouts)."""
    g = lir.graph
    uses = g.consumers()
    found = {}
    for i, n in enumerate(g.nodes):
        readers = uses.get((i, 0), [])
        if n.op in STRIDED_WRITERS and len(readers) == 1 and readers[0] >= 0:
            t = g.nodes[readers[0]]
            if keeps_last_axis(t) and lir.slots[(readers[0], 0)].home == "view":
                found[(i, 0)] = tuple(t.a["perm"])
    return found


def _split(a, rest):
    rest = list(rest)
    mask = rest.pop(0) if a["has_mask"] else None
    pos = rest.pop(0) if a["has_pos"] else None
    return mask, pos


@prepares("attention")
def _attention(a, outs, protos, op=None):
    q, k, v = protos[:3]
    f = _attention_fn(a, q, k, v, outs[0], _split(a, protos[3:])[0])
    if f is None:
        return None
    return lambda a_, out, q, k, v, *rest: f(q, k, v, *_split(a, rest))


@prepares("fused_attention_block")
def _attention_block(a, outs, protos, op=None):
    q, k, v, cos = protos[:4]
    qr, kr = np.empty(q.shape, q.dtype), np.empty(k.shape, k.dtype)
    rq, rk = _rope_fn(q, cos, qr, a["style"]), _rope_fn(k, cos, kr, a["style"])
    f = _attention_fn(a, qr, kr, v, outs[0], _split(a, protos[5:])[0])
    if f is None or rq is None or rk is None:
        return None

    def run(a_, out, q, k, v, c, s, *rest):
        rq(q, c, s)
        rk(k, c, s)
        f(qr, kr, v, *_split(a, rest))
    return run


def _decode_attention_step(a, rope_a, kv_a, protos, o):
    """A decode attention step that also makes what it reads (RoPE of q and k, the K/V cache
    writes) in one compiled call: protos are (q, k, v, cos, sin, K cache, V cache, pos,
    mask?) as the rope and kv_write nodes read them. None where a layout is not covered."""
    q, k, v, cos, sin, kc, vc, pos = protos[:8]
    mask = protos[8] if a["has_mask"] else None
    if (not _native(q, k, v, cos, kc, vc, o) or q.ndim != 4 or kc.ndim != 4 or q.shape[2] != 1
            or k.shape[2] != 1 or k.shape[:2] != kc.shape[:2] or v.shape[:2] != vc.shape[:2]
            or k.shape[3] != kc.shape[3] or v.shape[3] != vc.shape[3] or cos.ndim not in (2, 3)
            or pos.ndim != 1 or pos.size not in (1, kc.shape[0])):
        return None
    qr = np.empty(q.shape, q.dtype)
    attend = _attention_fn(a, qr, kc, vc, o, mask)
    if attend is None:
        return None
    inter = rope_a["style"] == "interleaved"
    numpy_kv_write = VIEWS["kv_write"]

    def run(a_, out, q, k, v, c, s, kc, vc, pos, *mask):
        if K.rope_kv_write(q, k, v, _table3(c), _table3(s), kc, vc, pos, qr, inter) >= 0:
            numpy_kv_write(kv_a, kc, k, pos)          # raises the NumPy backend's error
        attend(qr, kc, vc, mask[0] if mask else None, pos)
    return run


# --------------------------------------------------------------------------- packed sequences
@prepares("varlen_attention")
def _varlen_attention(a, outs, protos, op=None):
    q, k, v = protos[:3]
    o = outs[0]
    if not _native(q, k, v, o) or o.size == 0:
        return None
    t = o.dtype.type
    scale, ninf = t(a["scale"]), t(-np.inf)
    tokens, heads, d = q.shape
    vec = bool(o.dtype == np.float32 and v.shape[2] % LANES == 0 and o.flags.c_contiguous)

    def run(a_, out, q, k, v, starts, lens):
        st, ln, covered = segments(starts, lens, tokens, "varlen_attention")
        if not covered:
            o.fill(0)
        kern = _pick(K.varlen_par, K.varlen_ser, int((ln * ln).sum()) * heads * max(d, 1))
        kern(q, k, v, st, ln, o, scale, ninf, vec)
    return run


POOL_MODES = {"mean": 0, "cls": 1, "max": 2}


@prepares("segment_pool")
def _segment_pool(a, outs, protos, op=None):
    x, o = protos[0], outs[0]
    if not _native(x, o) or o.size == 0:
        return None
    mode, zero = POOL_MODES[a["mode"]], o.dtype.type(0)

    def run(a_, out, x, starts, lens):
        st, ln, _ = segments(starts, lens, x.shape[0], "segment_pool")
        _pick(K.pool_par, K.pool_ser, x.size)(x, st, ln, o, mode, zero)
    return run


# --------------------------------------------------------------------------- matmul
def _matmul_fn(x, w, o, trans_b: bool, trans_a: bool = False):
    """fn(x, w) writing op(x) @ op(w) into `o`: a numba GEMV for a few rows on an [N, K]
    weight; column blocks of an f32 2-D weight on numba's threads calling cblas_sgemm
    (forward and gradient products alike: BLAS's own threads beside numba's spinning
    workers took 544 ms for a 30 ms gradient product of a 2-layer train step); else BLAS
    through numpy (np.matmul with out=)."""
    m = x.shape[-1] if trans_a else math.prod(x.shape[:-1])
    k = x.shape[0] if trans_a else x.shape[-1]
    if (trans_b and not trans_a and w.ndim == 2 and m <= GEMV_MAX_M and k > 0 and o.size
            and _native(x, w, o) and w.flags.c_contiguous):
        o2 = o.reshape(m, -1)
        kern = _pick(K.gemv_nt_par, K.gemv_nt_ser, o.size * k)
        return lambda x, w: kern(x.reshape(m, k), w, o2)
    blas = KERNELS["matmul"]
    a = {"trans_a": trans_a, "trans_b": trans_b}
    n = o.shape[-1]
    if (w.ndim == 2 and (x.ndim == 2 or not trans_a) and SGEMM is not None and k > 0 and o.size
            and x.dtype == w.dtype == o.dtype == np.float32 and w.flags.c_contiguous
            and o.flags.c_contiguous and n >= 128):
        o2 = o.reshape(m, n)
        by_rows = not trans_a and m > n            # split the longer side (kernels.gemm_rows_par)
        parts = cblas.parts(m if by_rows else n)

        def gemm(x, w):
            if blas_threads() == 1:            # an encoder's data-parallel part: one core each
                return blas(a, [o], x, w)
            x2 = np.ascontiguousarray(x if trans_a else x.reshape(m, k))
            with single_threaded_blas():
                if by_rows:
                    K.gemm_rows_par(x2, w, o2, parts, *SGEMM, trans_b)
                else:
                    K.gemm_par(x2, w, o2, parts, *SGEMM, trans_a, trans_b)
        return gemm
    return lambda x, w: blas(a, [o], x, w)


@prepares("matmul")
def _matmul(a, outs, protos, op=None):
    if a["trans_a"] and protos[0].ndim != 2:
        return None
    f = _matmul_fn(protos[0], protos[1], outs[0], a["trans_b"], a["trans_a"])
    return lambda a_, out, x, w: f(x, w)


@prepares("fused_matmul_bias_act")
def _matmul_epilogue(a, outs, protos, op=None):
    mm = _matmul_fn(protos[0], protos[1], outs[0], a["trans_b"])
    return codegen.with_epilogue(mm, outs[0], protos[2:], a["act"])


PREPARE["dequant_matmul"] = quant_kernels.prepare_dequant_matmul
PREPARE["dequantize"] = quant_kernels.prepare_dequantize
PREPARE["fake_quantize"] = quant_kernels.prepare_fake_quantize
PREPARE.update(gated_delta_rule=prepare_gated_delta_rule, causal_conv1d=prepare_causal_conv1d)
PREPARE.update(moe_experts=prepare_moe_experts, moe_route=prepare_moe_route)


def _kv_layout(a, cache, pos, other):
    """(axis, B, pre, post) of a compiled kv_write, which sees the cache as [B, pre, n, post]
    around the written axis: where that axis is past the batch, cache and `other` share a
    float dtype and there is one position per batch row or one for all; else None."""
    ax, dims = a["axis"] % cache.ndim, cache.shape
    if ax == 0 or not _native(cache, other) or pos.ndim != 1 or pos.size not in (1, dims[0]):
        return None
    return ax, dims[0], math.prod(dims[1:ax]), math.prod(dims[ax + 1:])


def _kv_write_step(a, cache, new, pos):
    """kv_write as one compiled copy (NumPy's takes ~20 numpy calls a token per layer); a
    layout it does not cover keeps NumPy's, whose errors it also reuses."""
    layout = _kv_layout(a, cache, pos, new)
    if layout is None:
        return None
    ax, nb, pre, post = layout
    numpy_kv_write = VIEWS["kv_write"]

    def step(a, cache, new, pos):
        c4 = cache.reshape(nb, pre, cache.shape[ax], post)
        if not np.may_share_memory(c4, cache):
            return numpy_kv_write(a, cache, new, pos)
        if K.kv_write(c4, new.reshape(nb, pre, new.shape[ax], post), pos) >= 0:
            numpy_kv_write(a, cache, new, pos)          # raises the NumPy backend's error
        return cache
    step.returns_cache = True            # its output never moves (NumpyRunner's bound calls)
    return step


def _gathered_write_step(a, ga, cache, table, idx, pos):
    """kv_write(cache, gather(table, idx), pos) as one copy of the chosen rows (Gemma's ring
    prefill: 512 gathered rows were written twice, once to the gather's buffer, once to the
    cache); a layout it does not cover keeps the two steps."""
    layout = _kv_layout(a, cache, pos, table)
    if layout is None:
        return None
    ax, nb, pre, post = layout
    dims = cache.shape
    if (ga["axis"] % table.ndim != ax or table.ndim != cache.ndim or idx.ndim != 1
            or table.shape[:ax] + table.shape[ax + 1:] != dims[:ax] + dims[ax + 1:]):
        return None
    numpy_gather, numpy_kv_write = KERNELS["gather"], VIEWS["kv_write"]

    def step(a, cache, table, idx, pos):
        c4, t4 = cache.reshape(nb, pre, dims[ax], post), table.reshape(nb, pre, table.shape[ax], post)
        if not np.may_share_memory(c4, cache) or K.kv_write_rows(c4, t4, idx, pos) >= 0:
            new = np.empty(dims[:ax] + idx.shape + dims[ax + 1:], table.dtype)
            numpy_gather(ga, [new], table, idx)         # NumPy's steps, and their errors
            numpy_kv_write(a, cache, new, pos)
        return cache
    step.returns_cache = True
    return step


def _glu_step(x, w, o, a):
    """A gate/up dequant_matmul step that writes the SwiGLU of its halves into `o`."""
    glu = quant_kernels.glu_gemv(x, w, o, a["scheme"], a.get("int8_x"))
    if glu is None:
        return None
    step = codegen.as_step(glu)
    step.rounds_x = quant_kernels.rounds_x_itself(a, math.prod(x.shape[:-1]))
    return step


# --------------------------------------------------------------------------- the runner
IN_PLACE_STATE = {"gated_delta_rule": 5, "causal_conv1d": 2}     # op -> its state input


def _written_state(a, state, value):
    """An assign whose state its op wrote in place (NumbaRunner._state_rewrites)."""
    return state


_written_state.returns_cache = True


class NumbaRunner(NumpyRunner):
    """NumpyRunner's arena, values, view steps and run loop; compiled kernels where they apply.

    Fusions happen here, on the built steps: a packed gate/up matmul whose halves only feed a
    SwiGLU computes the SwiGLU in its GEMV (the pair's outputs are never written), an int8
    rounding (fake_quantize) whose every reader is a GEMV that rounds x itself is dropped, and
    a kv_write of a gather (Gemma's ring prefill) copies the chosen rows straight into the
    cache."""
    backend_name = "numba"

    def __init__(self, lir: LirModule, params: dict, states: dict, matmul: str = "f32"):
        self._orders = transposed_outputs(lir)          # (read by laid_out, during the base's init)
        super().__init__(lir, {k: codegen.read_only(v) for k, v in params.items()}, states)
        g = self.graph
        users = g.consumers()
        glu = self._glu_pairs(users)
        attn = self._attention_inputs(users)
        member = {m: i for i, ms in attn.items() for m in ms}
        gathered = {w: gi for w, gi in self._gathered_writes(users).items() if w not in member}
        rewrites = self._state_rewrites(users)
        written = set()           # assign nodes whose state the op before them wrote in place
        held = {}                 # attention node -> its members' steps (a gather -> its own), until needed
        protos = list(self.vals)
        for _, (slot, s) in self.inputs.items():
            protos[slot] = np.zeros(s.dims, s.dtype.np)
        steps, self_rounding, fused = [], set(), set()

        def prepare(i, is_view, fn, a, ins, out):
            node = g.nodes[i]
            if is_view and node.op == "kv_write":
                fn = _kv_write_step(a, *[protos[j] for j in ins]) or fn
                protos[out] = protos[ins[0]]
            elif is_view and getattr(fn, "returns_cache", False):      # a write (assign): not now
                protos[out] = protos[ins[0]]
                if i in written:
                    fn = _written_state
            elif is_view:
                protos[out] = fn(a, *[protos[j] for j in ins])
            elif i in fused:
                return                                       # computed by its gate/up GEMV
            elif node.op in PREPARE:
                if node.op in ("dequant_matmul", "moe_experts") and self._int8_rounded(node.inputs[0]):
                    a = {**a, "int8_x": True}
                elif node.op == "dequant_matmul" and matmul != "f32":
                    a = {**a, "matmul": matmul}
                x = protos[ins[0]]
                made = None
                if i in glu:
                    swiglu, o = glu[i]
                    made = _glu_step(x, protos[ins[1]], o, a)
                    if made is not None:
                        fused.add(swiglu)
                if i in rewrites:
                    a = {**a, "in_place": True}
                if made is None:
                    made = PREPARE[node.op](a, out, [protos[j] for j in ins], op=node.op)
                if made is not None and i in rewrites:
                    written.add(rewrites[i])
                if getattr(made, "rounds_x", False):
                    self_rounding.add(i)
                fn = made or fn
            steps.append((i, is_view, fn, a, ins, out))

        gathers = set(gathered.values())
        for step in self.steps:
            i = step[0]
            if i in member or i in gathers:
                held.setdefault(member.get(i, i), []).append(step)
                continue
            if i in gathered:
                (gather,) = held.pop(gathered[i])
                gins = gather[4]
                fused_ins = [step[4][0], gins[0], gins[1], step[4][2]]
                made = _gathered_write_step(step[3], gather[3], *[protos[j] for j in fused_ins])
                if made is not None:
                    protos[step[5]] = protos[step[4][0]]
                    steps.append((i, True, made, step[3], fused_ins, step[5]))
                    continue
                prepare(*gather)
            if i in attn:
                members = held.pop(i)
                made = self._attention_step(step, attn[i], members, protos)
                if made is not None:
                    steps.append(made)
                    continue
                for m in members:
                    prepare(*m)
            prepare(*step)
        self.steps = self._drop_rounding(lir, steps, self_rounding, users)

    def laid_out(self, lir: LirModule, i: int, k: int, flat: np.ndarray) -> np.ndarray:
        """An attention output read only by a transpose planned as a view: its bytes in the
        transpose's order, so the view is contiguous (NumbaBackend.planned_layouts)."""
        perm = self._orders.get((i, k))
        if perm is None:
            return super().laid_out(lir, i, k, flat)
        dims = lir.graph.nodes[i].outs[k].dims
        return flat.reshape([dims[p] for p in perm]).transpose(np.argsort(perm))

    _loaded = False       # set by the first run, which loads this runner's kernels

    def run(self, inputs: dict) -> dict:
        """NumpyRunner.run; after the first, LLVM's code pages that loading the kernels ran
        leave the process (resident.py)."""
        out = super().run(inputs)
        if not self._loaded:
            self._loaded = True
            release_llvm_pages()
        return out

    def _state_rewrites(self, users: dict) -> dict:
        """Recurrent op node (IN_PLACE_STATE) -> the assign node that writes its new state
        (output 1) back to the state it read, where nothing else reads either: the op then
        writes the state in place (attr "in_place") and the assign copies nothing (a Gated
        DeltaNet layer's state is 1 MB, copied twice a token before)."""
        g = self.graph
        found = {}
        for i, n in enumerate(g.nodes):
            if n.op not in IN_PLACE_STATE or len(n.inputs) <= IN_PLACE_STATE[n.op]:
                continue
            state = tuple(n.inputs[IN_PLACE_STATE[n.op]])
            readers = users.get((i, 1), [])
            if len(readers) != 1 or g.nodes[state[0]].op != "state":
                continue
            w = g.nodes[readers[0]]
            if (w.op == "assign" and [tuple(r) for r in w.inputs] == [state, (i, 1)]
                    and sorted(users.get(state, [])) == sorted([i, readers[0]])):
                found[i] = readers[0]
        return found

    def _int8_rounded(self, ref) -> bool:
        """`ref` is the output of a fake_quantize to int8_b32 (its values are int8 blocks)."""
        n = self.graph.nodes[ref[0]]
        return n.op == "fake_quantize" and QuantScheme.parse(n.a["scheme"]).name == "int8_b32"

    def _attention_inputs(self, users: dict) -> dict:
        """attention node -> its (rope q, rope k, kv_write k, kv_write v) nodes where a decode
        attention (one query row, positions given) reads a RoPE'd q and the K/V caches just
        written at those positions (K RoPE'd by the same tables), nothing else reads what
        those four make, and their steps come right before the attention's: one step then
        makes all of it (_decode_attention_step)."""
        g = self.graph
        order = [i for i, *_ in self.steps]
        found = {}
        for at, nxt in zip(range(len(order)), order[4:]):
            n = g.nodes[nxt]
            if n.op != "attention" or not n.a["has_pos"] or n.outs[0].dims[2] != 1:
                continue
            rq, kw, vw = (r[0] for r in n.inputs[:3])
            rk = g.nodes[kw].inputs[1][0] if g.nodes[kw].op == "kv_write" else None
            group = (rq, rk, kw, vw)
            ops = tuple(g.nodes[m].op if m is not None else None for m in group)
            if ops != ("rope", "rope", "kv_write", "kv_write") or sorted(order[at:at + 4]) != sorted(group):
                continue
            q_rope, k_rope = g.nodes[rq], g.nodes[rk]
            pos = n.inputs[-1]
            if (k_rope.inputs[1:] != q_rope.inputs[1:] or k_rope.a["style"] != q_rope.a["style"]
                    or any(g.nodes[w].inputs[2] != pos or g.nodes[w].a["axis"] % 4 != 2 for w in (kw, vw))
                    or any(users.get((m, 0)) != [user] for m, user in zip(group, (nxt, kw, nxt, nxt)))):
                continue
            found[nxt] = group
        return found

    @staticmethod
    def _attention_step(step, group, members, protos):
        """The attention step `step` with its `group`'s held steps `members` (rope q, rope k,
        kv_write k, kv_write v) folded in, or None."""
        i, _, _, a, ins, out = step
        by_node = {m[0]: m for m in members}
        q_rope, k_rope, k_write, v_write = (by_node[m] for m in group)
        fused_ins = [q_rope[4][0], k_rope[4][0], v_write[4][1], q_rope[4][1], q_rope[4][2],
                     k_write[4][0], v_write[4][0], ins[-1]] + ([ins[3]] if a["has_mask"] else [])
        made = _decode_attention_step(a, q_rope[3], k_write[3], [protos[j] for j in fused_ins], out[0])
        return None if made is None else (i, False, made, a, fused_ins, out)

    def _gathered_writes(self, users: dict) -> dict:
        """kv_write node -> the gather node whose output only it reads (as `new`), where the
        gather's step comes right before the write's (so no buffer changes between them)."""
        g = self.graph
        order = [i for i, *_ in self.steps]
        found = {}
        for gi, wi in zip(order, order[1:]):
            gn, wn = g.nodes[gi], g.nodes[wi]
            if (gn.op == "gather" and wn.op == "kv_write" and wn.inputs[1][0] == gi
                    and users.get((gi, 0)) == [wi]):
                found[wi] = gi
        return found

    def _glu_pairs(self, users: dict) -> dict:
        """dequant_matmul node -> (its fused_swiglu node, that node's output) where the matmul
        (one row, no bias or act) only feeds the SwiGLU's gate (first half of its columns) and
        up (second half), the SwiGLU step comes right after it, and the SwiGLU's output does
        not overlap the weight (the GEMV copies x before it writes)."""
        g = self.graph
        order = [i for i, *_ in self.steps if g.nodes[i].op != "narrow"]
        step_of = {s[0]: s for s in self.steps}
        pairs = {}
        for d, s in zip(order, order[1:]):
            dn, sn = g.nodes[d], g.nodes[s]
            if (dn.op != "dequant_matmul" or sn.op != "fused_swiglu" or len(dn.inputs) != 2
                    or dn.a.get("act", "identity") != "identity"):
                continue
            width = dn.outs[0].dims[-1]
            halves = [g.nodes[r[0]] for r in sn.inputs]
            if (sorted(users.get((d, 0), [])) != sorted(r[0] for r in sn.inputs)
                    or any(users.get(tuple(r)) != [s] for r in sn.inputs)
                    or [(h.op, h.inputs[0][0], h.a.get("axis", 0) % len(h.outs[0].dims), h.a.get("start"),
                         h.a.get("length")) for h in halves]
                    != [("narrow", d, len(h.outs[0].dims) - 1, k * width // 2, width // 2)
                        for k, h in enumerate(halves)]):
                continue
            o, w = step_of[s][5][0], self.vals[step_of[d][4][1]]
            if w is not None and not np.may_share_memory(o, w):
                pairs[d] = (s, o)
        return pairs

    def _drop_rounding(self, lir: LirModule, steps: list, self_rounding: set, users: dict) -> list:
        """Steps without the fake_quantize nodes planned as views of their input x (the backend's
        planned_layouts: every reader rounds x itself, and x's bytes live until the last one);
        those readers read x instead."""
        g = self.graph
        planned = {i for i, n in enumerate(g.nodes) if n.op == "fake_quantize" and lir.slots[(i, 0)].home == "view"}
        for i in planned:               # every one, also those NumpyRunner folded into x already
            if not set(users.get((i, 0), [])) <= self_rounding:
                raise BackendError(f"numba: the int8 rounding %{i} was planned away, but a reader "
                                   "of it does not round x itself")
        source = {i: ins[0] for i, is_view, fn, a, ins, out in steps if i in planned}
        kept = []
        for i, is_view, fn, a, ins, out in steps:
            if i in source:
                continue
            if ins and g.nodes[i].inputs[0][0] in source:
                ins = [source[g.nodes[i].inputs[0][0]]] + list(ins[1:])
            kept.append((i, is_view, fn, a, ins, out))
        return kept


__all__ = ["NumbaRunner", "PREPARE", "prepares", "GEMV_MAX_M"]
