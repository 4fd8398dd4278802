"""The composites of the FFT ops (ir/fft.py) and of the collectives over a group of one rank
(ir/composites.py): what they emit, their numerics against numpy.fft in float64 on fresh
random inputs (odd and even lengths, n = 1, every norm, any axis, vectors), run on the NumPy
backend reduced to the primitives; and the clean errors where they cannot apply."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_core.ir.composites import PRIMITIVES, legalize
from rlx_core.ir.dtype import BF16, C64, F16, F32, F64
from rlx_core.ir.errors import BackendError, ShapeError
from rlx_core.ir.fft import NORMS
from rlx_core.ir.graph import Graph
from rlx_core.ir.ops import COLLECTIVES, LEAVES
from rlx_core.pipeline import compile as compile_graph
from rlx_core.testing.parity import primitives_only

FFTS = ("fft", "ifft", "rfft", "irfft")


def _complex(rng, dims):
    return (rng.uniform(-2, 2, dims) + 1j * rng.uniform(-2, 2, dims)).astype(np.complex64)


def _run_on_primitives(g: Graph, inputs: dict) -> np.ndarray:
    """g's output on the NumPy backend less every op with a composite, after checking that
    legalizing g for the primitives leaves nothing else."""
    legal, done = legalize(g, PRIMITIVES)
    assert set(done) & set(FFTS), done
    left = {n.op for n in legal.nodes} - PRIMITIVES - set(LEAVES)
    assert not left, f"legalized graph still holds {sorted(left)}"
    with primitives_only("test-fft-primitives") as name:
        return compile_graph(g, backend=name).run(inputs)["out"]


def _check(got, want, dtype):
    """Within 1e-5 of the largest |reference| (the kit's FFT tolerance)."""
    assert got.dtype == dtype.np and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    scale = max(float(np.abs(want).max()), 1e-30)
    np.testing.assert_allclose(got.astype(np.complex128), want, rtol=1e-5, atol=1e-5 * scale)


# (dims, axis): odd and even lengths, n = 1 and 2, a vector, the axis first, in the middle, last
SHAPES = [((2, 8), -1), ((3, 7), 1), ((1,), 0), ((5,), -1), ((2, 1), 1), ((6, 2, 3), 0),
          ((2, 9, 3), 1), ((2, 3, 2), -1), ((4, 64), -1), ((33, 2), 0)]


@pytest.mark.parametrize("op", ["fft", "ifft"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dims,axis", SHAPES, ids=str)
def test_fft_ifft_composite_is_numpys(rng, op, norm, dims, axis):
    x = _complex(rng, dims)
    g = Graph.define(op, lambda m: m.add(op, (m.input("x", dims, C64),), axis=axis, norm=norm))
    want = getattr(np.fft, op)(x.astype(np.complex128), axis=axis, norm=norm)
    _check(_run_on_primitives(g, {"x": x}), want, C64)


@pytest.mark.parametrize("dt", [F32, F64, F16, BF16], ids=lambda d: d.value)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dims,axis", SHAPES, ids=str)
def test_rfft_composite_is_numpys(rng, dt, norm, dims, axis):
    x = rng.uniform(-2, 2, dims).astype(dt.np)
    g = Graph.define("rfft", lambda m: m.rfft(m.input("x", dims, dt), axis=axis, norm=norm))
    want = np.fft.rfft(x.astype(np.float64), axis=axis, norm=norm)
    _check(_run_on_primitives(g, {"x": x}), want, C64)


# (dims, axis, n given): the default n (2 * (m - 1)) wherever there are m >= 2 frequencies
IRFFT_CASES = [(d, ax, given) for d, ax in SHAPES for given in (True, False) if given or d[ax] > 1]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dims,axis,given", IRFFT_CASES, ids=str)
def test_irfft_composite_is_numpys(rng, norm, dims, axis, given):
    """n = dims[axis] outputs (or the default) from n // 2 + 1 frequencies. The random input
    has imaginary parts at DC and Nyquist, which numpy ignores: so must the composite."""
    n = dims[axis]
    freq = list(dims)
    freq[axis] = n // 2 + 1
    x = _complex(rng, tuple(freq))
    attrs_ = {"axis": axis, "norm": norm, **({"n": n} if given else {})}
    g = Graph.define("irfft", lambda m: m.add("irfft", (m.input("x", tuple(freq), C64),), **attrs_))
    want = np.fft.irfft(x.astype(np.complex128), n=n if given else None, axis=axis, norm=norm)
    _check(_run_on_primitives(g, {"x": x}), want, F32)


def test_fft_of_a_symbolic_length_is_a_shape_error_naming_the_op():
    """The DFT table is a constant [n, n]: a length known only at run time has none."""
    g = Graph.define("f", lambda m: m.fft(m.input("x", (2, "t"), C64)))
    with pytest.raises(ShapeError, match=r"fft needs a static length along axis 1"):
        legalize(g, PRIMITIVES)


@pytest.mark.parametrize("op", COLLECTIVES)
def test_collective_of_one_rank_is_the_identity(rng, op):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    extra = {} if op == "all_reduce" else {"axis": 1}
    g = Graph.define(op, lambda m: m.add(op, (m.input("x", x.shape, F32),), world=1, rank=0, **extra))
    legal, done = legalize(g, PRIMITIVES)
    assert done == [op] and {n.op for n in legal.nodes} <= set(LEAVES)
    with primitives_only("test-one-rank") as name:
        np.testing.assert_array_equal(compile_graph(g, backend=name).run({"x": x})["out"], x)


@pytest.mark.parametrize("op", COLLECTIVES)
def test_collective_of_several_ranks_needs_a_backend_with_collectives(op):
    extra = {} if op == "all_reduce" else {"axis": 1}
    g = Graph.define(op, lambda m: m.add(op, (m.input("x", (2, 4, 4), F32),), world=2, rank=1, **extra))
    with primitives_only("test-no-collectives") as name:
        with pytest.raises(BackendError, match=f"{op} over a group of 2 ranks needs a backend with "
                                               f"collectives"):
            compile_graph(g, backend=name)
