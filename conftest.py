"""Shared pytest fixtures. Random inputs are fresh on every run; the seed is printed in the
header and can be fixed with RLX_TEST_SEED to replay a failure."""
import os

import numpy as np
import pytest

SEED = int(os.environ.get("RLX_TEST_SEED", int.from_bytes(os.urandom(4), "little")))


def pytest_report_header(config):
    return f"rlx test seed: {SEED} (set RLX_TEST_SEED={SEED} to replay)"


@pytest.fixture
def rng(request):
    """A generator seeded from the run seed and the test's name."""
    return np.random.default_rng([SEED, abs(hash(request.node.nodeid)) % (2**32)])


def pytest_configure(config):
    """The compile cache of a test run lives in a folder of its own: tests neither read what
    another run left nor fill the user's cache."""
    if "RLX_COMPILE_CACHE" not in os.environ:
        import tempfile

        os.environ["RLX_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="rlx-test-compile-cache-")
