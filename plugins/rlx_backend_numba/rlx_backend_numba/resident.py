"""LLVM's machine code leaves this process's resident memory once kernels are loaded.

Why: numba links every kernel through libllvmlite (a 170 MB library). Loading kernels from
the disk cache runs tens of MB of its code (SmolLM2 on numba: 50 MB of its text resident
after the first token, of a 291 MB peak-RSS budget), and those pages stay counted in the
process's RSS although a decode loop never runs them again. They are clean pages of a file
mapping: MADV_DONTNEED drops them from this process, and the kernel maps them back from the
page cache if LLVM runs again. A mapping that is writable or holds anything written to it
(the relocated data after the dynamic loader's pass) is never touched: dropping those would
lose the writes.
"""
from __future__ import annotations

import ctypes
import os
import sys

LIBRARY = "libllvmlite"
_MADV_DONTNEED = 4


def mappings(smaps: str, library: str = LIBRARY) -> list:
    """Every mapping of `library` in /proc/<pid>/smaps text: {"range": (start, end), "perms":
    "r-xp", ...}, plus its kB fields ("Rss", "Anonymous", ...) as ints."""
    found, cur = [], None
    for line in smaps.splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            named = len(head) > 5 and os.path.basename(head[5]).startswith(library)
            cur = {"range": tuple(int(x, 16) for x in head[0].split("-")), "perms": head[1]} if named else None
            if cur is not None:
                found.append(cur)
        elif cur is not None and len(head) >= 2 and head[0].endswith(":") and head[1].isdigit():
            cur[head[0][:-1]] = int(head[1])
    return found


def clean_mappings(smaps: str, library: str = LIBRARY) -> list:
    """(start, end) of every mapping of `library` in /proc/<pid>/smaps text that is not
    writable and has no anonymous or privately dirtied page: the ones safe to drop."""
    return [m["range"] for m in mappings(smaps, library)
            if "w" not in m["perms"] and not m.get("Anonymous") and not m.get("Private_Dirty")]


def release_llvm_pages() -> int:
    """Drop LLVM's clean code pages from this process (Linux; elsewhere nothing): the bytes
    of the mappings dropped, 0 when there was nothing to do or /proc was not readable."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        with open("/proc/self/smaps") as f:
            ranges = clean_mappings(f.read())
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return sum(end - start for start, end in ranges
               if madvise(start, end - start, _MADV_DONTNEED) == 0)


__all__ = ["clean_mappings", "mappings", "release_llvm_pages"]
