"""The compile cache on disk: what compiling and loading derive from their inputs, kept so that
a second process skips deriving it again (the optimized MIR of a model's graphs, the merges a
GGUF sentencepiece vocabulary implies).

An entry is a file `<root>/<kind>/<key>.rlxc`: one line of JSON header (format, rlx version,
kind, key, byte count and sha256 of the body), then the body. A key digests everything the
derivation read (the graph, the profile, the backend, the source code of rlx_core and of the
backend's package), so an entry cannot go stale; a file that is truncated, altered or written by
another rlx version fails its header check, is reported with a CacheWarning, removed and
rebuilt, never trusted. Bodies are JSON; arrays (a graph's constants) are raw bytes in
`<root>/blobs/<sha256>.bin`, shared by content and checked against their name. No pickle.

RLX_COMPILE_CACHE: `0`/`off` turns the cache off; any other value is its root folder
(default: `compiled` under the RLX cache dir, $RLX_CACHE or the XDG cache dir).
RLX_COMPILE_CACHE_MB: the size the cache is pruned to, least recently used first (1024).
"""
from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import pathlib
import time
import warnings

from .ir.errors import RlxError
from .version import core_version

FORMAT = "rlx-compile-cache/1"
SUFFIX = ".rlxc"
_OFF = ("0", "off", "false", "no")


class CacheWarning(UserWarning):
    """A compile-cache entry was unusable (and is rebuilt) or could not be written."""


def cache_dir() -> str:
    """Where RLX keeps files it derives (assembled models, compiled graphs, generated kernels):
    $RLX_CACHE, else $XDG_CACHE_HOME/rlx, else ~/.cache/rlx."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("RLX_CACHE") or os.path.join(base, "rlx")


def root() -> pathlib.Path | None:
    """The compile cache's folder, or None when it is turned off."""
    v = os.environ.get("RLX_COMPILE_CACHE", "")
    if v.lower() in _OFF:
        return None
    return pathlib.Path(v or os.path.join(cache_dir(), "compiled"))


def key(*parts) -> str:
    """A digest of `parts` (str or bytes), each length-prefixed so that no two lists collide."""
    h = hashlib.sha256()
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def code_fingerprint(package: str) -> str:
    """A digest of the source of an imported package: editing a pass or a kernel changes every
    key that names it (an editable install keeps its version number)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return key(package, "?")
    top = pathlib.Path(next(iter(spec.submodule_search_locations)))
    h = hashlib.sha256()
    for p in sorted(top.rglob("*.py")):
        h.update(str(p.relative_to(top)).encode() + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- entries
def _path(kind: str, k: str) -> pathlib.Path | None:
    r = root()
    return None if r is None else r / kind / f"{k}{SUFFIX}"


def _warn(msg: str) -> None:
    warnings.warn(msg, CacheWarning, stacklevel=3)


def _atomic_write(path: pathlib.Path, data: bytes) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)         # other processes see all of it or nothing
        return True
    except OSError as e:
        _warn(f"compile cache: cannot write {path}: {e} (set RLX_COMPILE_CACHE to a writable "
              f"folder, or to 0 to turn it off)")
        return False


def _header(data: bytes) -> dict | None:
    nl = data.find(b"\n")
    try:
        h = json.loads(data[:nl]) if nl > 0 else None
    except ValueError:
        return None
    return h if isinstance(h, dict) and h.get("format") == FORMAT else None


def read(kind: str, k: str) -> bytes | None:
    """The body of entry (kind, k), or None when there is none or it is unusable."""
    path = _path(kind, k)
    if path is None or not path.exists():
        return None
    try:
        data = path.read_bytes()
    except OSError as e:
        _warn(f"compile cache: cannot read {path}: {e}; rebuilt")
        return None
    h = _header(data)
    body = data[data.find(b"\n") + 1:]
    if h is None:
        why = "not a compile cache entry (no valid header)"
    elif h.get("rlx") != core_version():
        why = f"written by rlx {h.get('rlx')}, this is rlx {core_version()}"
    elif h.get("kind") != kind or h.get("key") != k:
        why = f"header names {h.get('kind')}/{h.get('key')}"
    elif h.get("bytes") != len(body):
        why = f"truncated or padded: {len(body)} bytes, the header says {h.get('bytes')}"
    elif h.get("sha256") != hashlib.sha256(body).hexdigest():
        why = "corrupt: its body does not match the header's sha256"
    else:
        try:
            os.utime(path)            # recently used: pruned last
        except OSError:
            pass
        return body
    _warn(f"compile cache entry {path}: {why}; rebuilt")
    try:
        path.unlink()
    except OSError:
        pass
    return None


def write(kind: str, k: str, body: bytes) -> None:
    path = _path(kind, k)
    if path is None:
        return
    h = {"format": FORMAT, "rlx": core_version(), "kind": kind, "key": k, "bytes": len(body),
         "sha256": hashlib.sha256(body).hexdigest(), "written": time.time()}
    if _atomic_write(path, json.dumps(h, sort_keys=True).encode() + b"\n" + body):
        prune()


def read_json(kind: str, k: str):
    body = read(kind, k)
    return None if body is None else json.loads(body)


def write_json(kind: str, k: str, obj) -> None:
    write(kind, k, json.dumps(obj, separators=(",", ":")).encode())


# --------------------------------------------------------------------------- blobs
def _blob_path(digest: str) -> pathlib.Path | None:
    r = root()
    return None if r is None else r / "blobs" / f"{digest}.bin"


def write_blob(data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    path = _blob_path(digest)
    if path is not None and not path.exists():
        _atomic_write(path, data)
    return digest


def read_blob(digest: str) -> bytes | None:
    path = _blob_path(digest)
    try:
        data = path.read_bytes() if path is not None else None
    except OSError:
        return None
    if data is None:
        return None
    if hashlib.sha256(data).hexdigest() != digest:
        _warn(f"compile cache blob {path}: corrupt (its bytes do not match its name); rebuilt")
        path.unlink(missing_ok=True)
        return None
    try:
        os.utime(path)
    except OSError:
        pass
    return data


# --------------------------------------------------------------------------- graphs
def write_graph(kind: str, k: str, g) -> None:
    """A graph as its IR JSON, with each constant's bytes in a blob."""
    d = g.to_dict()
    for c in d["constants"].values():
        c["blob"] = write_blob(base64.b64decode(c.pop("data")))
    write_json(kind, k, d)


def read_graph(kind: str, k: str):
    """The graph of entry (kind, k), verified by the IR loader, or None."""
    from .ir.errors import SerializeError
    from .ir.serialize import graph_from_dict

    d = read_json(kind, k)
    if d is None:
        return None
    for c in d.get("constants", {}).values():
        data = read_blob(c.pop("blob", ""))
        if data is None:
            return None
        c["data"] = data                # raw bytes: graph_from_dict takes them without base64
    try:
        return graph_from_dict(d, str(_path(kind, k)))
    except SerializeError as e:
        _warn(f"{e}; rebuilt")
        return None


# --------------------------------------------------------------------------- housekeeping
def entries() -> list:
    """Every entry: dict(kind, key, bytes, used (seconds since the epoch), rlx, path)."""
    r = root()
    out = []
    if r is None or not r.exists():
        return out
    for p in sorted(r.glob(f"*/*{SUFFIX}")):
        try:
            st = p.stat()
            with p.open("rb") as f:
                h = _header(f.readline() + b"\n") or {}
        except OSError:
            continue
        out.append({"kind": p.parent.name, "key": p.stem, "bytes": st.st_size, "used": st.st_mtime,
                    "rlx": h.get("rlx", "?"), "path": str(p)})
    return out


def _files(r: pathlib.Path) -> list:
    return [p for p in r.glob("*/*") if p.is_file()]


def size() -> int:
    r = root()
    return 0 if r is None or not r.exists() else sum(p.stat().st_size for p in _files(r))


def clear() -> tuple:
    """Remove every entry and blob: (files removed, bytes freed)."""
    r = root()
    n = freed = 0
    if r is None or not r.exists():
        return n, freed
    for p in _files(r):
        try:
            s = p.stat().st_size
            p.unlink()
            n, freed = n + 1, freed + s
        except OSError:
            pass
    return n, freed


def _limit() -> int:
    v = os.environ.get("RLX_COMPILE_CACHE_MB", "1024")
    try:
        mb = float(v)
    except ValueError:
        mb = -1.0
    if not mb >= 0:
        raise RlxError(f"RLX_COMPILE_CACHE_MB={v!r}: expected a size in megabytes (a number >= 0)")
    return int(mb * 2**20)


def prune(limit: int | None = None) -> None:
    """Keep the cache under RLX_COMPILE_CACHE_MB: the least recently used files go first."""
    r = root()
    if limit is None:
        limit = _limit()
    if r is None or not r.exists():
        return
    files = []
    for p in _files(r):
        try:
            st = p.stat()
        except OSError:
            continue
        files.append((st.st_mtime, st.st_size, p))
    total = sum(s for _, s, _ in files)
    for _, s, p in sorted(files, key=lambda t: t[0]):
        if total <= limit:
            break
        try:
            p.unlink()
            total -= s
        except OSError:
            pass
