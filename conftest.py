"""Shared pytest setup. Random inputs are fresh on every run; the seed is printed in the
header and can be fixed with RLX_TEST_SEED to replay a failure. The seed, the `rng` fixture
and the --rlx-backend / --rlx-recipe options are the conformance kit's (rlx_core.testing)."""
import os

pytest_plugins = ("rlx_core.testing",)   # also where rlx-core's pytest11 entry point is not installed


def pytest_report_header(config):
    from rlx_core import testing

    if not testing.active(config):       # the kit prints it itself when one of its options is given
        return testing.seed_header()
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The seed again beside a failure: `-q` (CI's command) prints no header."""
    if exitstatus not in (0, 5):
        from rlx_core import testing

        terminalreporter.write_line(testing.seed_header())


def pytest_configure(config):
    """The compile cache of a test run lives in a folder of its own: tests neither read what
    another run left nor fill the user's cache. Both go to the environment that pytest-xdist's
    workers (started after this) inherit: one seed for the run, the one in the header, and one
    cache folder that the workers share."""
    from rlx_core.testing.session import SEED

    os.environ.setdefault("RLX_TEST_SEED", str(SEED))
    if "RLX_COMPILE_CACHE" not in os.environ:
        import tempfile

        os.environ["RLX_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="rlx-test-compile-cache-")
