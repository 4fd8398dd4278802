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

The root may be any folder the user names, so the cache touches only what it wrote: it creates
the root with a marker file (`rlx-compile-cache.json`) first, adopts an existing folder only when
it is empty (or holds nothing but entries by the cache's own names: a cache from before the
marker), refuses any other folder with an RlxError naming what it found, and its pruning and
`clear` remove only files named as its entries, blobs and their temporaries.

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
import re
import time
import warnings

from .ir.errors import RlxError
from .version import core_version

FORMAT = "rlx-compile-cache/1"
SUFFIX = ".rlxc"
MARKER = "rlx-compile-cache.json"
_MARKER_BODY = {"marker": "rlx-compile-cache",
                "note": "RLX's compile cache: it removes only the entries and blobs it wrote here"}
# what the cache writes under its root, relative to it: entries, blobs, and their temporaries
_KIND, _KEY, _DIGEST = r"[a-z][a-z0-9_]*", r"[A-Za-z0-9_-]+", r"[0-9a-f]{64}"
_OWN = re.compile(rf"(?:{_KIND}/{_KEY}\{SUFFIX}|blobs/{_DIGEST}\.bin)(?:\.\d+\.tmp)?")
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


# --------------------------------------------------------------------------- the root
def _marked(r: pathlib.Path) -> bool:
    try:
        with open(r / MARKER, "rb") as f:
            return json.loads(f.read(4096)).get("marker") == _MARKER_BODY["marker"]
    except (OSError, ValueError, AttributeError):
        return False


def _foreign(r: pathlib.Path, limit: int = 3) -> list:
    """Up to `limit` things in folder `r` the cache would not have written (links, files not
    named as its entries and blobs, folders below its kind folders)."""
    found = []
    for e in _scan(r):
        if e.is_dir(follow_symlinks=False):
            for f in _scan(e.path):
                rel = f"{e.name}/{f.name}"
                if f.is_symlink() or not f.is_file() or not _OWN.fullmatch(rel):
                    found.append(rel)
        elif e.name != MARKER and not e.name.startswith(MARKER + "."):   # another process's marker
            found.append(e.name)
        if len(found) >= limit:
            break
    return found[:limit]


def _scan(folder) -> list:
    try:
        with os.scandir(folder) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:
        return []


def _claimed(create: bool = False) -> pathlib.Path | None:
    """The root, once it is the cache's own: a folder with its marker, or one it may adopt (empty,
    or holding only entries by its names), marked first when `create`. None when the cache is off,
    when the folder does not exist and `create` is false, or when it cannot be written (warned).
    RlxError for a folder holding anything else: the cache never mixes with files it did not write."""
    r = root()
    if r is None or _marked(r):
        return r
    if r.exists() and not r.is_dir():
        _refuse(r, "is not a folder")
    foreign = _foreign(r)
    if foreign:
        _refuse(r, f"holds files the cache did not write ({', '.join(foreign)})")
    if not create:
        return r if r.exists() else None
    body = json.dumps(_MARKER_BODY, indent=1).encode() + b"\n"
    return r if _atomic_write(r / MARKER, body) else None


def _refuse(r: pathlib.Path, what: str):
    raise RlxError(f"compile cache folder {r} {what}; the cache uses only a folder it created (marked "
                   f"by {MARKER}) or an empty one, and removes only its own entries: set "
                   f"RLX_COMPILE_CACHE to a new or empty folder, or to 0 to turn the cache off")


# --------------------------------------------------------------------------- entries
def _path(kind: str, k: str, create: bool = False) -> pathlib.Path | None:
    r = _claimed(create)
    if r is None:
        return None
    if not _OWN.fullmatch(f"{kind}/{k}{SUFFIX}"):
        raise RlxError(f"compile cache: entry {kind}/{k}: a kind must match {_KIND} and a key {_KEY}")
    return r / kind / f"{k}{SUFFIX}"


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
    path = _path(kind, k, create=True)
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
def _blob_path(digest: str, create: bool = False) -> pathlib.Path | None:
    """Where blob `digest` lives; None when the cache is off or `digest` (read from an entry)
    is not a sha256 in hex, so no entry can name a file outside the blobs."""
    if not isinstance(digest, str) or not re.fullmatch(_DIGEST, digest):
        return None
    r = _claimed(create)
    return None if r is None else r / "blobs" / f"{digest}.bin"


def write_blob(data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    path = _blob_path(digest, create=True)
    if path is not None and not path.exists():
        _atomic_write(path, data)
    return digest


def read_blob(digest: str) -> bytes | None:
    path = _blob_path(digest)
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
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
def _own_files(r: pathlib.Path) -> list:
    """The files under `r` named as the cache's entries, blobs and their temporaries (no links):
    all that pruning and `clear` ever remove."""
    return [pathlib.Path(f.path) for e in _scan(r) if e.is_dir(follow_symlinks=False)
            for f in _scan(e.path)
            if f.is_file(follow_symlinks=False) and _OWN.fullmatch(f"{e.name}/{f.name}")]


def entries() -> list:
    """Every entry: dict(kind, key, bytes, used (seconds since the epoch), rlx, path)."""
    r = _claimed()
    out: list[dict] = []
    if r is None:
        return out
    for p in _own_files(r):
        if p.suffix != SUFFIX:
            continue
        try:
            st = p.stat()
            with p.open("rb") as f:
                h = _header(f.readline() + b"\n") or {}
        except OSError:
            continue
        out.append({"kind": p.parent.name, "key": p.stem, "bytes": st.st_size, "used": st.st_mtime,
                    "rlx": h.get("rlx", "?"), "path": str(p)})
    return out


def _sizes(r: pathlib.Path | None) -> list:
    """(mtime, bytes, path) of each of the cache's own files under `r`."""
    out = []
    for p in _own_files(r) if r is not None else []:
        try:
            st = p.stat()
        except OSError:
            continue
        out.append((st.st_mtime, st.st_size, p))
    return out


def size() -> int:
    return sum(s for _, s, _ in _sizes(_claimed()))


def clear() -> tuple:
    """Remove every entry and blob (and nothing else): (files removed, bytes freed)."""
    n = freed = 0
    for _, s, p in _sizes(_claimed()):
        try:
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
    """Keep the cache under RLX_COMPILE_CACHE_MB: the least recently used entries and blobs go first."""
    if limit is None:
        limit = _limit()
    files = _sizes(_claimed())
    total = sum(s for _, s, _ in files)
    for _, s, p in sorted(files, key=lambda t: t[0]):
        if total <= limit:
            break
        try:
            p.unlink()
            total -= s
        except OSError:
            pass
