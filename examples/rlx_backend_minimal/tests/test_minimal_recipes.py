"""The conformance kit's recipe checks (rlx_core.testing.recipe_suite) on the minimal backend,
for every registered recipe: fused against composed, a padded batch against each row alone,
decode with the KV cache against recompute. The kit runs them on `--rlx-backend`'s backend;
here the module selects the minimal one (as `pytest --rlx-backend=minimal` would)."""
import pytest

from rlx_core.testing import session
from rlx_core.testing.recipe_suite import *  # noqa: F401,F403


@pytest.fixture(autouse=True)
def on_minimal():
    before = session.selected("rlx_backend")
    session.select("rlx_backend", "minimal")
    yield
    session.select("rlx_backend", before)
