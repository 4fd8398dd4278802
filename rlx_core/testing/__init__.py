"""rlx_core.testing: the conformance kit for RLX plugins, and the pytest plugin that runs it.

    pytest --rlx-backend=NAME --pyargs rlx_core.testing   # the op parity suite on backend NAME
    pytest --rlx-backend=numpy-primitives --pyargs rlx_core.testing   # ... on NumPy reduced to
                                                          # the primitives: every composite tested
    pytest --rlx-recipe=NAME --pyargs rlx_core.testing    # a recipe's conformance checks

or, in a plugin's own tests, one file that pulls a suite in (`RLX_BACKENDS` / `RLX_RECIPES`
name what it runs on; without them: every registered backend / recipe):

    from rlx_core.testing.ops_suite import *  # noqa: F401,F403
    RLX_BACKENDS = ("mybackend",)

Modules: `parity` (one-op graphs, poisoned runs, float64 references), `ops_suite` (a test for
every op of the table), `recipes` (tiny models and the checks a recipe must pass),
`recipe_suite` (those checks as tests).

This module is the pytest plugin (entry point `pytest11`, so installed it is loaded in every
pytest run): it adds the two options and an `rng` fixture, parametrizes the kit's
`rlx_backend` / `rlx_recipe` fixtures where a test uses them, and collects the suites only
when an option asks for them. Inputs are random on every run; the seed is printed in the
header (when an option is given) and RLX_TEST_SEED replays it.
"""
from __future__ import annotations

import pathlib

import pytest

# the kit's modules are imported lazily (by tests), after this: their asserts report values
pytest.register_assert_rewrite("rlx_core.testing.parity", "rlx_core.testing.ops_suite",
                               "rlx_core.testing.recipes", "rlx_core.testing.recipe_suite")

from .session import clear, plugins_env, rng, seed_header, select, selected  # noqa: E402,F401  (fixtures)

HERE = pathlib.Path(__file__).resolve().parent
# option -> (the suite module it collects, the test module variable that narrows it)
SUITES = {"rlx_backend": ("ops_suite.py", "RLX_BACKENDS"), "rlx_recipe": ("recipe_suite.py", "RLX_RECIPES")}


def active(config) -> bool:
    """Whether one of the kit's options was given."""
    return any(config.getoption(opt, None) for opt in SUITES)


def pytest_addoption(parser):
    group = parser.getgroup("rlx", "RLX conformance kit (rlx_core.testing)")
    group.addoption("--rlx-backend", dest="rlx_backend", metavar="NAME", default=None,
                    help="Run the op parity suite (and the recipe checks) on backend NAME only.")
    group.addoption("--rlx-recipe", dest="rlx_recipe", metavar="NAME", default=None,
                    help="Run the conformance checks of recipe NAME (a recipe or model type) only.")


def pytest_configure(config):
    """Check the names the options give (here, so a typo stops the run before collection)."""
    from rlx_core.ir.errors import RlxError

    for opt in SUITES:
        name = config.getoption(opt, None)
        select(opt, name)
        if not name:
            continue
        if opt == "rlx_backend":
            from .parity import check_backend_option as check
        else:
            from .recipes import check_recipe_option as check
        try:
            check(name)
        except RlxError as e:
            raise pytest.UsageError(f"--{opt.replace('_', '-')}={name}: {e}") from None


def pytest_unconfigure(config):
    clear()


def pytest_report_header(config):
    if active(config):
        return seed_header()
    return None


def pytest_collect_file(file_path, parent):
    """The kit's suite modules, when their option is given (they match no test file pattern)."""
    if file_path.parent != HERE or parent.session.isinitpath(file_path):
        return None
    for opt, (module, _) in SUITES.items():
        if file_path.name == module and parent.config.getoption(opt, None):
            return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_generate_tests(metafunc):
    """One test per backend / recipe for tests using the kit's `rlx_backend` / `rlx_recipe`
    fixtures (directly, or through the op suite's `backend`)."""
    for fixture, (_, narrow) in SUITES.items():
        if fixture not in metafunc.fixturenames:
            continue
        only = getattr(metafunc.module, narrow, None)
        if fixture == "rlx_backend":
            from .parity import backend_params as params
        else:
            from .recipes import recipe_params as params
        metafunc.parametrize(fixture, params(only), indirect=True)
