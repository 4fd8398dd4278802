"""rlx-core's version, at the bottom floor: the plugin registry, the CLI and the compile cache
all name it."""
from __future__ import annotations

import importlib.metadata as md


def core_version() -> str:
    """rlx-core's installed version."""
    try:
        return md.version("rlx-core")
    except md.PackageNotFoundError:    # run from a source tree that was never installed
        return "0+unknown"
