"""The minimal backend is exactly core's primitive set, and registers like any plugin."""
from rlx_core.ir.composites import PRIMITIVES
from rlx_core.pipeline import select_backend

from rlx_backend_minimal.kernels import KERNELS, VIEWS


def test_its_kernels_are_exactly_the_primitives():
    assert set(KERNELS) | set(VIEWS) == set(PRIMITIVES)
    ops = select_backend("minimal").supported_ops()
    assert ops - {"input", "param", "state", "constant"} == set(PRIMITIVES), sorted(ops)


def test_it_is_never_picked_by_default():
    assert select_backend("minimal").priority < select_backend("numpy").priority
    assert select_backend().name != "minimal"
