"""The whole op parity suite of the conformance kit (rlx_core.testing) on the minimal backend:
every op of the table against a float64 reference, the fused ones legalized into the backend's
primitives, control flow run by core from the host."""
from rlx_core.testing.ops_suite import *  # noqa: F401,F403

RLX_BACKENDS = ("minimal",)
