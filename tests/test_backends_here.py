"""One place per installed backend that says whether it works on this host (issue 41): either
availability() is (False, reason) with a reason, or the conformance kit's smallest case (an f32
add against float64, outputs poisoned) passes on it. A backend that claims to be available and
cannot run a kernel fails here, not deep inside other tests."""
import pytest

from rlx_core.ir.dtype import F32
from rlx_core.plugins import registry
from rlx_core.testing import ops_suite


@pytest.mark.parametrize("name", sorted(registry().backends))
def test_unavailable_with_a_reason_or_runs_the_smallest_kit_case(name, rng):
    ok, why = registry().backends[name].availability()
    if not ok:
        assert isinstance(why, str) and why.strip(), f"backend {name!r} is unavailable without a reason"
        pytest.skip(f"backend {name!r} is not available here: {why}")
    ops_suite.test_binary(name, rng, "add", F32)
