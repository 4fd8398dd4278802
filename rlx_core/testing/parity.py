"""The op parity suite's machinery, importable by any plugin's tests.

* `rlx_backend` fixture (and its short name `backend`): a backend's name; the kit's pytest
  plugin makes one test per backend: the one `--rlx-backend` names, else those the test
  module's `RLX_BACKENDS` names, else every registered one (one that is not available here
  is skipped with its reason, never faked).
* `rng` fixture (the plugin's, re-exported): a generator seeded per test from the run's seed
  (random, printed in the header; RLX_TEST_SEED replays it) and the test id, so every run
  draws fresh inputs and a failure reproduces.
* `one_op(...)`: an MIR graph of a single op built with `Builder(name, "mir")`.
* `run_parity(...)`: compile the one-op graph on a backend, poison the executable's arena
  (NaN bytes, then a second run with zero bytes) so a kernel that does not write its whole
  output fails, run, and compare with a float64 reference. An op the backend does not
  implement (after the pipeline legalizes what it can) and a dtype it does not declare
  (`Backend.dtypes`) are skipped with the reason.
* `ref_*`: independent float64 numpy references (never the backends' kernels).

A backend's runner is poisoned through `runner.poison(byte)` when it has that method, else
through a uint8 `runner.arena` (the NumPy runner's); a runner with neither runs unpoisoned
with a warning.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Callable

import attrs
import ml_dtypes
import numpy as np
import pytest

from rlx_core.ir.dtype import BF16, BOOL, F16, F32, F64, DType
from rlx_core.ir.graph import HIR, MIR, Builder
from rlx_core.ir.ops import MaskKind
from rlx_core.pipeline import compile as compile_graph
from rlx_core.profile import CompileProfile, FusionConfig, PassConfig

from .session import rng, selected  # noqa: F401  (rng: the suite's seeded generator)

FLOATS = (F32, F16, BF16, F64)
TOL = {F32: 1e-5, F16: 5e-3, BF16: 1e-2, F64: 1e-10}
POISON_BYTES = (0xFF, 0x00)       # 0xFF: NaN in every float type, -1 in ints; 0x00: False / 0

# One-op graphs are compiled without fusion and with verification after every pass.
PARITY_PROFILE = CompileProfile("parity", FusionConfig(skip=True), PassConfig(verify_each=True))


# ----------------------------------------------------------------------------- fixtures
PRIMITIVES_ONLY = "numpy-primitives"     # the kit's own backend: see `primitives_only`


def check_backend_option(name: str) -> None:
    """`--rlx-backend NAME` must name a backend that runs here (BackendError otherwise)."""
    from rlx_core.pipeline import select_backend

    if name != PRIMITIVES_ONLY:
        select_backend(name)


def backend_params(only=None) -> list:
    """pytest params of the backends to test: `--rlx-backend`'s, else those of `only` (names),
    else every registered one; one not available here is skipped with its reason. The kit's
    PRIMITIVES_ONLY backend is a param only where named."""
    from rlx_core.pipeline import available_backends

    want = selected("rlx_backend")
    if want == PRIMITIVES_ONLY or (not want and only is not None and PRIMITIVES_ONLY in only):
        out = [pytest.param(PRIMITIVES_ONLY, id=PRIMITIVES_ONLY)]
    else:
        out = []
    for b, ok, why in available_backends():
        if (want and b.name != want) or (only is not None and b.name not in only):
            continue
        marks = () if ok else (pytest.mark.skip(reason=f"backend {b.name!r} is not available: {why}"),)
        out.append(pytest.param(b.name, id=b.name, marks=marks))
    return out


@pytest.fixture
def rlx_backend(request):
    """The name of the backend under test (parametrized by the kit's pytest plugin); the
    kit's PRIMITIVES_ONLY backend is registered for the test's duration."""
    if not hasattr(request, "param"):
        raise pytest.UsageError("the rlx_backend fixture is parametrized by the rlx_core.testing "
                                "pytest plugin: load it with -p rlx_core.testing")
    if request.param == PRIMITIVES_ONLY:
        with primitives_only() as name:
            yield name
    else:
        yield request.param


@pytest.fixture
def backend(rlx_backend) -> str:
    """The suite's name for `rlx_backend`."""
    return rlx_backend


@contextlib.contextmanager
def numpy_without(ops, name: str = "numpy-without"):
    """While the block runs, backend `name` is the NumPy backend without kernels for `ops`:
    the pipeline legalizes those with a composite (rlx_core.ir.composites), as for a backend
    that never had them."""
    from rlx_core.backends.numpy import NumpyBackend
    from rlx_core.plugins import hookimpl, register_plugin, unregister_plugin

    class Lacking(NumpyBackend):
        priority = -100

        def supported_ops(self) -> set:
            return super().supported_ops() - set(ops)

    Lacking.name = name

    class Plugin:
        @hookimpl
        def rlx_register_backends(self, register):
            register(Lacking())

    register_plugin(Plugin(), name=f"parity-{name}")
    try:
        yield name
    finally:
        unregister_plugin(f"parity-{name}")


def primitives_only(name: str = PRIMITIVES_ONLY):
    """`numpy_without` every op that has a composite (rlx_core.ir.composites): the NumPy
    backend reduced to the primitives (and the optional ops), so every other op runs as its
    composite. `pytest --rlx-backend=numpy-primitives` runs the whole suite so."""
    from rlx_core.ir.composites import COMPOSITES

    return numpy_without(set(COMPOSITES), name)


# ----------------------------------------------------------------------------- inputs
@attrs.frozen
class Arg:
    """One leaf of a one-op graph: `data` is float64/int/bool host data, exactly
    representable in `dtype` (use `rand`); kind is input or state."""
    name: str
    data: np.ndarray
    dtype: DType
    kind: str = "input"

    @property
    def dims(self) -> tuple:
        return tuple(self.data.shape)


def exact(x, dtype) -> np.ndarray:
    """Round host data to `dtype` and back, so the reference sees exactly what the kernel sees."""
    dt = DType.parse(dtype)
    return np.asarray(x).astype(dt.np).astype(np.float64 if dt.is_float else dt.np)


def rand(rng, dims, dtype=F32, lo=None, hi=None) -> np.ndarray:
    """Uniform floats in [lo, hi) (default [-2, 2)), ints in [lo, hi] (default [-9, 9],
    unsigned [0, 9]), or fair bools."""
    dt = DType.parse(dtype)
    if dt is BOOL:
        return rng.random(dims) < 0.5
    if dt.is_int:
        lo = (0 if dt.np.kind == "u" else -9) if lo is None else int(lo)
        hi = 9 if hi is None else int(hi)
        return rng.integers(lo, hi + 1, size=dims).astype(dt.np)
    return exact(rng.uniform(-2.0 if lo is None else lo, 2.0 if hi is None else hi, size=dims), dt)


def arg(rng, name, dims, dtype=F32, **kw) -> Arg:
    return Arg(name, rand(rng, dims, dtype, **kw), DType.parse(dtype))


# ----------------------------------------------------------------------------- graphs
def one_op(op: str, args: list, attrs_: dict | None = None, name: str | None = None,
           level: str = MIR):
    """A graph holding leaves for `args` and one `op` node whose outputs are the graph's."""
    m = Builder(name or f"parity_{op}", level)
    vals = []
    for a in args:
        leaf = m.state if a.kind == "state" else m.input
        vals.append(leaf(a.name, a.dims, a.dtype))
    out = m.add(op, tuple(vals), **(attrs_ or {}))
    outs = out if isinstance(out, tuple) else (out,)
    for k, v in enumerate(outs):
        m.output(f"out{k}", v)
    return m.build()


def poison(runner, byte: int) -> bool:
    """Fill the runner's scratch memory with `byte`; False when the runner cannot be poisoned."""
    if hasattr(runner, "poison"):
        runner.poison(byte)
        return True
    arena = getattr(runner, "arena", None)
    if arena is None:
        return False
    arena.view(np.uint8).fill(byte)
    return True


def compile_on(g, backend: str, profile=None, params=None):
    return compile_graph(g, profile=profile or PARITY_PROFILE, backend=backend, params=params)


def run_poisoned(exe, inputs: dict, env: dict | None = None, byte: int = 0xFF,
                 states: dict | None = None) -> dict:
    """Run `exe` once with its arena poisoned with `byte` (states reset to `states` first)."""
    if states:
        for k, v in states.items():
            exe.states[k] = exe.backend.to_device(np.array(v))
        exe._runners.clear()                     # a runner holds the state buffers it saw
    if env is None:
        env = exe._bind_dims(inputs)
    runner = exe.runner(env)
    if not poison(runner, byte):
        warnings.warn(f"runner of backend {exe.backend.name!r} cannot be poisoned "
                      "(no poison(byte) and no uint8 arena); outputs are unchecked for holes")
    out = exe.run(inputs)
    return {k: exe.backend.to_host(v) for k, v in out.items()}


def assert_close(out, ref, dtype: DType, what: str = "", tol: float | None = None,
                 scale: float | None = None) -> None:
    """`out` equals `ref` within `tol` (default TOL of the dtype) relative to `scale` (default
    the largest |ref|), exactly for other dtypes. The error starts with `what` (pytest's
    summary line)."""
    out = np.asarray(out)
    dtype = DType.parse(dtype)
    assert out.dtype == dtype.np, f"{what}: output dtype {out.dtype}, expected {dtype.np}"
    ref = np.asarray(ref)
    assert out.shape == ref.shape, f"{what}: output shape {out.shape}, expected {ref.shape}"
    try:
        if dtype.is_float:
            tol = TOL[dtype] if tol is None else tol
            o = out.astype(np.float64)
            r = ref.astype(np.float64)
            if scale is None:
                finite = r[np.isfinite(r)]
                scale = float(np.max(np.abs(finite))) if finite.size else 0.0
            np.testing.assert_allclose(o, r, rtol=tol, atol=tol * max(scale, 1e-30))
        else:
            np.testing.assert_array_equal(out, ref.astype(out.dtype))
    except AssertionError as e:
        raise AssertionError(f"{what}{e}") from None


def assert_greedy_agrees(got, want, logits, tol: float, what: str = "") -> None:
    """Greedy tokens `got` equal the reference's `want` (rows of prompt + new tokens) up to the
    first position where they differ, and there the token chosen is within `tol` of the
    reference's best by the reference's own logits: a near tie, which another host's rounding
    (its BLAS kernels, its summation order) may break the other way; the continuations after it
    legitimately differ. `logits(prefix)`: the reference's logits for a [1, n] prefix (its last
    position's are used: a model's `logits` will do); `tol`: the bound on the two
    implementations' logit difference."""
    got, want = np.atleast_2d(np.asarray(got)), np.atleast_2d(np.asarray(want))
    assert got.shape == want.shape, f"{what}: token rows {got.shape}, expected {want.shape}"
    for row, (g, w) in enumerate(zip(got, want)):
        differ = np.flatnonzero(g != w)
        if differ.size == 0:
            continue
        i = int(differ[0])
        ref = np.asarray(logits(w[None, :i]), np.float64)
        ref = ref.reshape(-1, ref.shape[-1])[-1]
        margin = float(ref[w[i]] - ref[g[i]])
        assert margin <= tol, (f"{what}: row {row} position {i}: token {g[i]}, the reference's {w[i]} is "
                               f"ahead by {margin:.3g} in its logits (> {tol:g}, no near tie); "
                               f"tokens {g.tolist()}, reference {w.tolist()}")


def lacking_ops(g, backend, profile) -> list:
    """The ops of `g` that `backend` has no kernel for once lowered by the profile's policy
    and legalized (fused ops it lacks become primitives): what it does not claim to run."""
    from rlx_core.ir.lower import legalize, lower

    have = backend.runnable_ops()          # (control flow: core runs it where the backend lacks it)
    mir = lower(g, profile.fusion.policy) if g.level == HIR else g
    mir, _ = legalize(mir, have)
    return sorted({n.op for n in mir.nodes if n.op != "custom" and n.op not in have})


def _signature(args: list) -> str:
    return ", ".join(f"{a.name}: {a.dtype.value}{list(a.dims)}" for a in args)


def run_parity(backend: str, op: str, args: list, attrs_: dict | None, ref, *,
               tol: float | None = None, out_dtypes=None, level: str = MIR, profile=None,
               check=None, magnitude=None) -> list:
    """Compile one `op` on `args`, run it poisoned twice, compare every output with
    `ref(*float64 inputs)` (a value or a tuple). `magnitude(*float64 inputs)`: what the
    tolerance is relative to where the outputs can cancel (a sum of products: the sum of
    |terms|), else the largest |reference|. Returns the outputs of the NaN-poisoned run."""
    g = one_op(op, args, attrs_, level=level)
    from rlx_core.pipeline import select_backend

    b = select_backend(backend)
    profile = profile or PARITY_PROFILE
    lacking = lacking_ops(g, b, profile)
    if lacking:
        pytest.skip(f"backend {backend!r} does not implement op(s) {lacking} (for {op})")
    used = {a.dtype for a in args} | {g.shape_of(r).dtype for _, r in g.outputs}
    undeclared = sorted(dt.value for dt in used if dt not in b.dtypes)
    if undeclared:
        pytest.skip(f"backend {backend!r} does not declare dtype(s) {undeclared} (Backend.dtypes)")
    exe = compile_on(g, backend, profile)
    inputs = {a.name: a.data for a in args if a.kind == "input"}
    states = {a.name: a.data.astype(a.dtype.np) for a in args if a.kind == "state"}
    host = [a.data.astype(np.float64) if a.dtype.is_float else a.data for a in args]
    want = ref(*host)
    want = want if isinstance(want, tuple) else (want,)
    scale = None if magnitude is None else float(magnitude(*host))
    names = [n for n, _ in g.outputs]
    shapes = [g.shape_of(r) for _, r in g.outputs]
    first = None
    for byte in POISON_BYTES:
        got = run_poisoned(exe, inputs, byte=byte, states={k: v.copy() for k, v in states.items()})
        for k, (name, s) in enumerate(zip(names, shapes)):
            dt = out_dtypes[k] if out_dtypes else s.dtype
            what = (f"op {op} {attrs_ or {}} on backend {backend!r}: output {name} ({dt.value}) of "
                    f"({_signature(args)}), arena poisoned with 0x{byte:02X}")
            if check is not None:
                check(k, got[name], want[k], dt, what)
            else:
                assert_close(got[name], want[k], dt, what, tol, scale=scale)
        first = first or [got[n] for n in names]
    return first


# ----------------------------------------------------------------------------- references
def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


REF_ACT: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "relu": lambda x: np.where(x > 0, x, 0 * x),
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "tanh": np.tanh, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x), "neg": lambda x: -x, "abs": np.abs,
    "sin": np.sin, "cos": np.cos, "recip": lambda x: 1.0 / x, "identity": lambda x: x,
    "quick_gelu": lambda x: x / (1.0 + np.exp(-1.702 * x)),
}


def ref_binary(op, a, b):
    if op == "div" and np.asarray(a).dtype.kind in "iu" and np.asarray(b).dtype.kind in "iu":
        return np.floor_divide(a, b)
    return {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
            "max": np.maximum, "min": np.minimum, "pow": np.power}[op](a, b)


def ref_compare(op, a, b):
    return {"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[op]


def ref_reduce(op, x, axes, keepdims=False):
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    f = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[op]
    return f(x, axis=axes, keepdims=keepdims)


def ref_softmax(x, axis=-1):
    """The op's meaning: -inf entries take no weight; a row of -inf gives zeros, not NaN."""
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0))
    s = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(s == 0, 1, s)


def ref_layer_norm(x, g=None, b=None, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps)
    if g is not None:
        y = y * g
    if b is not None:
        y = y + b
    return y


def ref_rms_norm(x, w=None, eps=1e-6, offset=0.0):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * (w + offset)


def _rows_vjp(jac, x, g):
    """sum_i g_i dy_i/dx_j row by row over the last axis, from each row's explicit Jacobian."""
    xr, gr = x.reshape(-1, x.shape[-1]), g.reshape(-1, x.shape[-1])
    return np.stack([jac(i, xr[i]).T @ gr[i] for i in range(len(xr))]).reshape(x.shape)


def ref_softmax_grad(y, g, axis=-1):
    """The Jacobian diag(y) - y y^T of each softmax row, applied to g."""
    yt, gt = np.moveaxis(y, axis, -1), np.moveaxis(g, axis, -1)
    yr = yt.reshape(-1, yt.shape[-1])
    dx = _rows_vjp(lambda i, row: np.diag(yr[i]) - np.outer(yr[i], yr[i]), yt, gt)
    return np.moveaxis(dx, -1, axis)


def ref_rms_norm_grad(x, w, g, eps=1e-6, offset=0.0):
    d = x.shape[-1]

    def jac(i, row):
        inv = 1 / np.sqrt(row @ row / d + eps)
        return (w + offset)[:, None] * (inv * np.eye(d) - np.outer(row, row) * inv ** 3 / d)
    lead = tuple(range(x.ndim - 1))
    return _rows_vjp(jac, x, g), (g * ref_rms_norm(x, eps=eps)).sum(lead)


def ref_layer_norm_grad(x, gamma, g, eps=1e-5):
    d = x.shape[-1]

    def jac(i, row):
        c = row - row.mean()
        inv = 1 / np.sqrt(c @ c / d + eps)
        n = c * inv
        return gamma[:, None] * (inv * (np.eye(d) - 1 / d) - np.outer(n, n) * inv / d)
    lead = tuple(range(x.ndim - 1))
    return _rows_vjp(jac, x, g), (g * ref_layer_norm(x, eps=eps)).sum(lead), g.sum(lead)


def ref_rope(x, cos, sin, style="half"):
    """Element by element: pair (i, i+R/2) (half) or (2i, 2i+1) (interleaved) of the first R dims."""
    x = np.asarray(x, np.float64)
    out = x.copy()
    bsz, heads, seq, _ = x.shape
    half = cos.shape[-1]
    for b in range(bsz):
        for s in range(seq):
            c = cos[s] if cos.ndim == 2 else cos[b, s]
            sn = sin[s] if sin.ndim == 2 else sin[b, s]
            for i in range(half):
                j, k = (i, i + half) if style == "half" else (2 * i, 2 * i + 1)
                x1, x2 = x[b, :, s, j], x[b, :, s, k]
                out[b, :, s, j] = x1 * c[i] - x2 * sn[i]
                out[b, :, s, k] = x2 * c[i] + x1 * sn[i]
    return out


def ref_keep(kind, bsz, sq, sk, window=0, pos=None):
    """[B, Sq, Sk] keep-mask of a causal / sliding-window kind (all True otherwise)."""
    keep = np.ones((bsz, sq, sk), bool)
    kind = MaskKind(kind)
    if kind in (MaskKind.CAUSAL, MaskKind.SLIDING_WINDOW):
        for b in range(bsz):
            for i in range(sq):
                qp = (int(pos[b]) if pos is not None else sk - sq) + i
                for j in range(sk):
                    ok = j <= qp
                    if kind is MaskKind.SLIDING_WINDOW:
                        ok = ok and j > qp - window
                    keep[b, i, j] = ok
    return keep


def ref_mask_fill(scores, mask=None, pos=None, *, mask_kind="causal", window=0):
    bsz, heads, sq, sk = scores.shape
    keep = np.broadcast_to(ref_keep(mask_kind, bsz, sq, sk, window, pos)[:, None], scores.shape).copy()
    s = np.array(scores, np.float64)
    if mask is not None:
        if mask.dtype == np.bool_:
            keep &= np.broadcast_to(mask, scores.shape)
        else:
            s = s + mask
    return np.where(keep, s, -np.inf)


def _ref_head_probs(q, k, mask, pos, scale, mask_kind, window, softcap):
    """(b, h, kv head, probabilities, softcap's tanh or None) per (batch, head); GQA by index."""
    bsz, heads, sq, _ = q.shape
    kvh, sk = k.shape[1], k.shape[2]
    keep = ref_keep(mask_kind, bsz, sq, sk, window, pos)
    for b in range(bsz):
        for h in range(heads):
            kh = h // (heads // kvh)
            s = (q[b, h] @ k[b, kh].T) * scale
            t = np.tanh(s / softcap) if softcap else None
            s = t * softcap if softcap else s
            kp = keep[b].copy()
            if mask is not None:
                mb = np.broadcast_to(mask, (bsz, heads, sq, sk))[b, h]
                if mask.dtype == np.bool_:
                    kp &= mb
                else:
                    s = s + mb
            yield b, h, kh, ref_softmax(np.where(kp, s, -np.inf), -1), t


def ref_attention(q, k, v, mask=None, pos=None, *, scale, mask_kind="causal", window=0, softcap=0.0):
    """Per (batch, head): scores, softcap, mask, softmax, weighted sum; GQA by head index."""
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for b, h, kh, p, _ in _ref_head_probs(q, k, mask, pos, scale, mask_kind, window, softcap):
        out[b, h] = p @ v[b, kh]
    return out


def ref_attention_grad(q, k, v, g, mask=None, pos=None, *, scale, mask_kind="causal", window=0,
                       softcap=0.0):
    """(dq, dk, dv) by the chain rule per (batch, head): dv = P^T g, each softmax row's explicit
    Jacobian applied to g v^T, the softcap's derivative, the scale; GQA summed per kv head."""
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b, h, kh, p, t in _ref_head_probs(q, k, mask, pos, scale, mask_kind, window, softcap):
        dv[b, kh] += p.T @ g[b, h]
        ds = ref_softmax_grad(p, g[b, h] @ v[b, kh].T) * scale
        ds = ds * (1 - t * t) if t is not None else ds
        dq[b, h] = ds @ k[b, kh]
        dk[b, kh] += ds.T @ q[b, h]
    return dq, dk, dv


def ref_varlen_attention(q, k, v, starts, lens, *, scale):
    """Each segment's tokens as one batch of ref_attention (no mask); other tokens zero."""
    out = np.zeros(q.shape[:2] + (v.shape[-1],))
    for s, n in zip(np.asarray(starts).tolist(), np.asarray(lens).tolist()):
        if n:
            qs, ks, vs = (np.swapaxes(t[s:s + n], 0, 1)[None] for t in (q, k, v))
            out[s:s + n] = np.swapaxes(ref_attention(qs, ks, vs, scale=scale, mask_kind="none")[0], 0, 1)
    return out


def ref_segment_pool(x, starts, lens, *, mode):
    out = np.zeros((len(starts), x.shape[-1]))
    for i, (s, n) in enumerate(zip(np.asarray(starts).tolist(), np.asarray(lens).tolist())):
        if n:
            seg = x[s:s + n]
            out[i] = seg.sum(0) / n if mode == "mean" else seg[0] if mode == "cls" else seg.max(0)
    return out


def ref_topk(x, k, axis=-1):
    xm = np.moveaxis(x, axis, -1)
    idx = np.argsort(-xm, axis=-1, kind="stable")[..., :k]
    vals = np.take_along_axis(xm, idx, -1)
    return np.moveaxis(vals, -1, axis), np.moveaxis(idx, -1, axis)


def ref_cumsum(x, axis=-1):
    xm = np.moveaxis(np.array(x), axis, -1)
    out = np.zeros_like(xm)
    acc = np.zeros(xm.shape[:-1], xm.dtype)
    for i in range(xm.shape[-1]):
        acc = acc + xm[..., i]
        out[..., i] = acc
    return np.moveaxis(out, -1, axis)


def ref_kv_write(cache, new, pos, axis=2):
    out = np.array(cache)
    s = new.shape[axis]
    for b in range(cache.shape[0]):
        idx = [b] + [slice(None)] * (cache.ndim - 1)
        idx[axis] = slice(int(pos[b]), int(pos[b]) + s)
        out[tuple(idx)] = new[b]
    return out


def ref_matmul(a, b, trans_a=False, trans_b=False):
    a = np.swapaxes(a, -1, -2) if trans_a else a
    b = np.swapaxes(b, -1, -2) if trans_b else b
    return np.matmul(a, b)


def ref_swiglu(g, u):
    return REF_ACT["silu"](g) * u


def ref_elementwise(program, *ins):
    """Interpret a fused_elementwise program with the references above."""
    slots = list(ins)
    for op, items, args in program:
        a = dict(items)
        xs = [slots[i] for i in args]
        if op == "binary":
            r = ref_binary(a["op"], *xs)
        elif op == "compare":
            r = ref_compare(a["op"], *xs)
        elif op == "where":
            r = np.where(*xs)
        elif op == "activation":
            r = REF_ACT[a["fn"]](xs[0])
        elif op == "cast":
            dt = DType.parse(a["dtype"])
            r = exact(xs[0], dt) if dt.is_float else np.trunc(xs[0]).astype(dt.np)
        elif op == "fused_swiglu":
            r = ref_swiglu(*xs)
        else:  # pragma: no cover - a program step the reference does not know
            raise AssertionError(f"no reference for elementwise step {op}")
        slots.append(r)
    return slots[-1]


def bf16(x):
    return np.asarray(x).astype(ml_dtypes.bfloat16)


__all__ = [n for n in dir() if not n.startswith("_")]
