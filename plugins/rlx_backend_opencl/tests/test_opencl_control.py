"""Control flow (if_, while_, scan: bodies as runners of their own, control.py) and
dense_solve (one work-group per matrix) on OpenCL against float64 numpy references, on fresh
random inputs with the arenas (the bodies' too) poisoned first: data-dependent trip counts,
scans with consts, carries, several xs and ys in both directions, nested bodies, both
branches of if_, the recurrences of ir/recurrence.py against the numpy backend, and solves
(vector and matrix right-hand sides, batched, pivoting, ill-conditioned, singular)."""
from __future__ import annotations

import numpy as np
import pytest
from test_opencl import RAW, ocl, run_cl  # noqa: F401

import rlx_core
from rlx_backend_opencl import runner as R
from rlx_core import Graph
from rlx_core.ir.dtype import BOOL, F16, F32, F64, I64
from rlx_core.ir.errors import BackendError
from rlx_core.ir.recurrence import gated_delta_rule, selective_scan
from rlx_core.testing.parity import exact

TOL = {F32: 2e-5, F64: 1e-12}


@pytest.fixture(params=[F32, F64], ids=lambda d: d.value)
def dt(request, ocl):
    if request.param not in ocl.dtypes:
        pytest.skip(f"device {ocl.device.name} has no {request.param.value}")
    return request.param


def run(ocl, build, inputs):
    return run_cl(rlx_core.compile(Graph.define("g", build), profile=RAW, backend=ocl), inputs)


def close(got, want, dt, tol=None):
    tol = TOL[dt] if tol is None else tol
    assert got.shape == np.shape(want) and got.dtype == dt.np
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol,
                               atol=tol * max(np.abs(want).max(), 1.0))


# ------------------------------------------------------------------ while_ / scan / if_
def test_while_data_dependent_trip_count(ocl, rng, dt):
    """Double x until its max reaches the limit, counting trips (doubling and max are exact,
    so the count matches the float64 loop's): 0 trips up to about 20."""
    def build(m):
        x, lim = m.input("x", (5,), dt), m.input("lim", (), dt)
        n, y = m.while_((m.constant(np.array(0, np.int64)), x),
                        lambda b, lim, n, y: b.compare(b.max(y, (0,)), lim, "lt"),
                        lambda b, lim, n, y: (n + 1, y * 2.0), consts=(lim,))
        return {"n": n, "y": y}
    ex = rlx_core.compile(Graph.define("g", build), profile=RAW, backend=ocl)
    for scale in (1e-6, 0.01, 1.0, 100.0):
        x, lim = exact(rng.uniform(0, scale, 5), dt), exact(rng.uniform(1, 2), dt)
        n, y = 0, x.copy()
        while y.max() < lim:
            n, y = n + 1, y * 2
        got = run_cl(ex, {"x": x.astype(dt.np), "lim": np.array(lim, dt.np)})
        assert int(got["n"]) == n
        close(got["y"], y, dt, tol=0)


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_vs_python_loop(ocl, rng, dt, reverse):
    """Two consts, a float and an int carry, two xs, two ys (one from the int carry)."""
    T = 6

    def build(m):
        w, bias, h0 = m.input("w", (3, 3), dt), m.input("bias", (3,), dt), m.input("h0", (3,), dt)
        us, vs = m.input("us", (T, 3), dt), m.input("vs", (T,), dt)

        def step(b, w, bias, h, n, u, v):
            h2 = b.tanh(b.reshape(b.matmul(w, b.reshape(h, (3, 1))), (3,)) + u * v + bias)
            return h2, n + 1, h2 * v, b.cast(n, dt)
        (h, n), (ys, ns) = m.scan(step, init=(h0, m.constant(np.array(0, np.int64))), xs=(us, vs),
                                  consts=(w, bias), reverse=reverse)
        return {"h": h, "n": n, "ys": ys, "ns": ns}
    feed = {"w": rng.standard_normal((3, 3)) * 0.6, "bias": rng.standard_normal(3),
            "h0": rng.standard_normal(3), "us": rng.standard_normal((T, 3)), "vs": rng.standard_normal(T)}
    feed = {k: exact(v, dt) for k, v in feed.items()}
    got = run(ocl, build, {k: v.astype(dt.np) for k, v in feed.items()})
    h, ys, ns = feed["h0"], np.zeros((T, 3)), np.zeros(T)
    for n, t in enumerate(range(T - 1, -1, -1) if reverse else range(T)):
        ns[t] = n
        h = np.tanh(feed["w"] @ h + feed["us"][t] * feed["vs"][t] + feed["bias"])
        ys[t] = h * feed["vs"][t]
    assert int(got["n"]) == T
    close(got["h"], h, dt)
    close(got["ys"], ys, dt)
    close(got["ns"], ns, dt, tol=0)


def test_scan_inside_while(ocl, rng, dt):
    """A while_ whose body runs a scan (its init a carry, its xs a const of the while_)."""
    def build(m):
        xs, y0, trips = m.input("xs", (5, 4), dt), m.input("y0", (4,), dt), m.input("trips", (), I64)

        def body(b, xs, trips, k, y):
            (s,), _ = b.scan(lambda c, s, x: (s * 0.5 + x * c.tanh(s),), init=(y,), xs=(xs,))
            return k + 1, b.tanh(s)
        k, y = m.while_((m.constant(np.array(0, np.int64)), y0),
                        lambda b, xs, trips, k, y: b.compare(k, trips, "lt"), body, consts=(xs, trips))
        return {"k": k, "y": y}
    xs, y0 = exact(rng.standard_normal((5, 4)), dt), exact(rng.standard_normal(4), dt)
    trips = int(rng.integers(0, 4))
    got = run(ocl, build, {"xs": xs.astype(dt.np), "y0": y0.astype(dt.np),
                           "trips": np.array(trips, np.int64)})
    y = y0
    for _ in range(trips):
        s = y
        for x in xs:
            s = s * 0.5 + x * np.tanh(s)
        y = np.tanh(s)
    assert int(got["k"]) == trips
    close(got["y"], y, dt, tol=1e-4 if dt is F32 else None)


def test_if_inside_scan(ocl, rng, dt):
    """Each step takes the branch its row's sum picks (rows of both signs): both branches run."""
    def build(m):
        h0, xs = m.input("h0", (3,), dt), m.input("xs", (8, 3), dt)

        def step(b, h, x):
            h2 = b.if_(b.compare(b.sum(x, (0,)), 0.0, "gt"), (h, x), lambda c, h, x: h * 0.5 + x,
                       lambda c, h, x: c.tanh(h - x))
            return h2, h2 * h2
        (h,), (ys,) = m.scan(step, init=(h0,), xs=(xs,))
        return {"h": h, "ys": ys}
    h0 = exact(rng.standard_normal(3), dt)
    xs = exact(rng.uniform(0.1, 1, (8, 3)) * np.resize([1, -1], 8)[rng.permutation(8), None], dt)
    got = run(ocl, build, {"h0": h0.astype(dt.np), "xs": xs.astype(dt.np)})
    h, ys = h0, []
    for x in xs:
        h = h * 0.5 + x if x.sum() > 0 else np.tanh(h - x)
        ys.append(h * h)
    close(got["h"], h, dt)
    close(got["ys"], np.array(ys), dt)


def test_if_both_branches(ocl, rng, dt):
    """Two outputs of different shapes; the untaken branch is not run (its log of negatives
    would give NaN)."""
    def build(m):
        p, x, y = m.input("p", (), BOOL), m.input("x", (2, 3), dt), m.input("y", (3,), dt)
        a, b = m.if_(p, (x, y), lambda c, x, y: (c.act(x, "log") * y, c.tanh(y)),
                     lambda c, x, y: (x - y, y * y))
        return {"a": a, "b": b}
    ex = rlx_core.compile(Graph.define("g", build), profile=RAW, backend=ocl)
    for taken in (True, False, True):
        x, y = rng.uniform(0.5, 2, (2, 3)), rng.standard_normal(3)
        x = exact(x if taken else -x, dt)
        y = exact(y, dt)
        got = run_cl(ex, {"p": np.array(taken), "x": x.astype(dt.np), "y": y.astype(dt.np)})
        want = (np.log(x) * y, np.tanh(y)) if taken else (x - y, y * y)
        close(got["a"], want[0], dt)
        close(got["b"], want[1], dt)


def _mamba(rng):
    Bn, L, D, N = 2, 7, 3, 4
    return dict(u=rng.standard_normal((Bn, L, D)), delta=rng.uniform(0.05, 0.5, (Bn, L, D)),
                A=-rng.uniform(0.5, 2.0, (D, N)), B=rng.standard_normal((Bn, L, N)),
                C=rng.standard_normal((Bn, L, N)), D=rng.standard_normal(D),
                z=rng.standard_normal((Bn, L, D)), h0=rng.standard_normal((Bn, D, N)))


def _delta(rng):
    Bn, L, H, K, V = 2, 6, 2, 3, 4
    k = rng.standard_normal((Bn, L, H, K))
    return dict(q=rng.standard_normal((Bn, L, H, K)), k=k / np.linalg.norm(k, axis=-1, keepdims=True),
                v=rng.standard_normal((Bn, L, H, V)), g=-rng.uniform(0.01, 1.0, (Bn, L, H)),
                beta=rng.uniform(0.1, 0.9, (Bn, L, H)), s0=rng.standard_normal((Bn, H, K, V)))


@pytest.mark.parametrize("fn,draw", [(selective_scan, _mamba), (gated_delta_rule, _delta)],
                         ids=["selective_scan", "gated_delta_rule"])
def test_recurrences_vs_numpy(ocl, rng, dt, fn, draw):
    """The recurrences (scans over transposed views, several carries) against the numpy
    backend running the same graph in float64."""
    feed = draw(rng)

    def graph(dtype):
        def build(m):
            out, state = fn(m, **{k: m.input(k, v.shape, dtype) for k, v in feed.items()})
            return {"out": out, "state": state}
        return Graph.define("rec", build)
    want = rlx_core.compile(graph(F64), profile=RAW, backend="numpy").run(feed)
    got = run_cl(rlx_core.compile(graph(dt), profile=RAW, backend=ocl),
                 {k: exact(v, dt).astype(dt.np) for k, v in feed.items()})
    for k in ("out", "state"):
        close(got[k], want[k], dt, tol=1e-4 if dt is F32 else None)


# ------------------------------------------------------------------ dense_solve
SOLVE_CASES = {"vector": ((5, 5), (5,)), "matrix": ((5, 5), (5, 3)),
               "batch_vector": ((2, 3, 6, 6), (2, 3, 6)), "batch_matrix": ((4, 7, 7), (4, 7, 2)),
               "large": ((2, 70, 70), (2, 70, 3))}


@pytest.fixture(params=["local", "scratch"])
def path(request, monkeypatch):
    """[A | B] in local memory, or (no local memory allowed) in a global scratch."""
    if request.param == "scratch":
        monkeypatch.setattr(R, "SOLVE_LOCAL_CAP", 0)
    return request.param


def _solve(ocl, path, a, b, dt):
    """Compile and run dense_solve on OpenCL (checking the path the runner took)."""
    g = Graph.define("solve", lambda m: m.dense_solve(m.input("a", a.shape, dt), m.input("b", b.shape, dt)))
    ex = rlx_core.compile(g, profile=RAW, backend=ocl)
    feed = {"a": a.astype(dt.np), "b": b.astype(dt.np)}
    runner = ex.runner(ex._bind_dims(feed))
    assert (runner._scratch_bytes >= a.size * dt.itemsize) == (path == "scratch")
    return run_cl(ex, feed)["out"]


def _solve_tol(ocl, a, dt):
    """Relative to max|x|: a backward-stable solve's forward error, n * cond(a) * eps of the
    compute dtype (f64 where the device has it, like numpy.linalg; else f32), plus the
    output's rounding to `dt`."""
    eps = np.finfo(np.float64 if ocl.device.fp64 else np.float32).eps
    return 4 * a.shape[-1] * float(np.linalg.cond(a).max()) * eps + 2 * float(np.finfo(dt.np).eps)


@pytest.mark.parametrize("case", list(SOLVE_CASES))
def test_dense_solve(ocl, rng, dt, path, case):
    """Gaussian random matrices (pivoting matters; one has a zero leading entry)."""
    ad, bd = SOLVE_CASES[case]
    a, b = exact(rng.standard_normal(ad), dt), exact(rng.standard_normal(bd), dt)
    a.reshape(-1, *ad[-2:])[0, 0, 0] = 0.0
    got = _solve(ocl, path, a, b, dt)
    want = np.linalg.solve(a, b[..., None])[..., 0] if len(bd) < len(ad) else np.linalg.solve(a, b)
    close(got, want, dt, tol=_solve_tol(ocl, a, dt))


@pytest.mark.parametrize("cond", [1e3, 1e6, 1e10])
def test_dense_solve_ill_conditioned(ocl, rng, dt, cond):
    """a = U diag(s) V^T with singular values spread over `cond`: the error stays within the
    bound that grows with the condition number (and f32 results are f64 solves rounded)."""
    if cond * np.finfo(np.float64 if ocl.device.fp64 else np.float32).eps > 1e-2:
        pytest.skip(f"cond {cond:g} is beyond f32, the compute dtype on {ocl.device.name}")
    n = 8
    u, _ = np.linalg.qr(rng.standard_normal((3, n, n)))
    v, _ = np.linalg.qr(rng.standard_normal((3, n, n)))
    a = exact(u * np.logspace(0, -np.log10(cond), n)[None, None, :] @ v.transpose(0, 2, 1), dt)
    b = exact(rng.standard_normal((3, n, 2)), dt)
    got = _solve(ocl, "local", a, b, dt)
    close(got, np.linalg.solve(a, b), dt, tol=_solve_tol(ocl, a, dt))


def test_dense_solve_f16(ocl, rng, monkeypatch):
    """f16 solves like the other dtypes and rounds once on the store: RLX_OPENCL_FP16 opts in."""
    monkeypatch.setenv("RLX_OPENCL_FP16", "1")
    a = exact(rng.standard_normal((3, 4, 4)) + 4 * np.eye(4), F16)
    b = exact(rng.standard_normal((3, 4)), F16)
    got = _solve(ocl, "local", a, b, F16)
    want = np.linalg.solve(a, b[..., None])[..., 0]
    close(got, want, F16, tol=_solve_tol(ocl, a, F16))


def test_singular_matrix_is_a_backend_error_like_numpy(ocl, rng):
    """A zero column makes matrix 1 of the batch exactly singular: numpy's LinAlgError is a
    BackendError on the numpy backend; OpenCL raises one naming the op, the matrix and the
    column, and the executable runs again cleanly afterwards."""
    g = Graph.define("solve", lambda m: m.dense_solve(m.input("a", (3, 5, 5), F32),
                                                      m.input("b", (3, 5), F32)))
    a = rng.standard_normal((3, 5, 5)).astype(np.float32)
    b = rng.standard_normal((3, 5)).astype(np.float32)
    bad = a.copy()
    col = int(rng.integers(0, 5))
    bad[1, :, col] = 0
    with pytest.raises(BackendError, match="Singular matrix"):
        rlx_core.compile(g, backend="numpy").run({"a": bad, "b": b})
    ex = rlx_core.compile(g, profile=RAW, backend=ocl)
    with pytest.raises(BackendError, match=rf"node %\d+ \(dense_solve\): singular matrix \(matrix 1 "
                                           rf"of the batch has a zero pivot in column {col}\)"):
        ex.run({"a": bad, "b": b})
    got = ex.run({"a": a, "b": b})["out"]
    close(got, np.linalg.solve(a.astype(np.float64), b.astype(np.float64)[..., None])[..., 0], F32,
          tol=_solve_tol(ocl, a.astype(np.float64), F32))


def test_singular_matrix_inside_a_scan_body(ocl, rng):
    """A body's error flag is read with the graph's: the singular step raises, naming the op."""
    def build(m):
        a_s, b0 = m.input("as", (4, 3, 3), F32), m.input("b0", (3,), F32)
        (x,), _ = m.scan(lambda c, x, a: (c.tanh(c.dense_solve(a, x)),), init=(b0,), xs=(a_s,))
        return x
    ex = rlx_core.compile(Graph.define("g", build), profile=RAW, backend=ocl)
    a_s = (rng.standard_normal((4, 3, 3)) + 3 * np.eye(3)).astype(np.float32)
    b0 = rng.standard_normal(3).astype(np.float32)
    x = b0.astype(np.float64)
    for a in a_s.astype(np.float64):
        x = np.tanh(np.linalg.solve(a, x))
    close(ex.run({"as": a_s, "b0": b0})["out"], x, F32, tol=1e-5)
    a_s[2] = 0
    with pytest.raises(BackendError, match=r"\(dense_solve\): singular matrix"):
        ex.run({"as": a_s, "b0": b0})
