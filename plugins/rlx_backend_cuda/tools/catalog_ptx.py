"""The PTX of every kernel catalog entry (nvcc -ptx, no GPU needed), to show that a change to
the sources leaves the compiled code as it was: run it before and after, then compare.

    python tools/catalog_ptx.py DIR             # DIR/<n>.ptx and DIR/index.json
    python tools/catalog_ptx.py --diff OLD NEW  # entries whose PTX differs, by catalog name

The PTX is compared without its header comment (the compiler's build and version lines)."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def dump(out: str) -> int:
    """Write each catalog entry's source (as device.kernel compiles it) and PTX under `out`;
    the number of entries that failed to compile."""
    from rlx_backend_cuda import kernels_catalog, sources

    os.makedirs(out, exist_ok=True)
    index, fails = [], 0
    for i, (name, src, kname) in enumerate(kernels_catalog.catalog()):
        src = sources.with_grid_wait(src, kname)
        cu, ptx = os.path.join(out, f"{i}.cu"), os.path.join(out, f"{i}.ptx")
        with open(cu, "w") as f:
            f.write(src)
        r = subprocess.run(["nvcc", "-std=c++17", f"-arch={sources.own_arch(src) or 'sm_90'}", "-ptx", "-o", ptx, cu],
                           capture_output=True, text=True)
        if r.returncode:
            fails += 1
            print("FAIL", name, r.stderr[-2000:], flush=True)
        index.append(name)
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f)
    print(f"{len(index) - fails} compiled, {fails} failed")
    return fails


def _entries(d: str) -> dict:
    """{(name, k-th entry of that name): PTX without its header comment}"""
    with open(os.path.join(d, "index.json")) as f:
        names = json.load(f)
    seen: dict = {}
    out = {}
    for i, name in enumerate(names):
        seen[name] = seen.get(name, 0) + 1
        p = os.path.join(d, f"{i}.ptx")
        if os.path.exists(p):
            with open(p) as f:
                out[(name, seen[name])] = "\n".join(ln for ln in f.read().split("\n") if not ln.startswith("//"))
    return out


def diff(old: str, new: str) -> int:
    """Print the entries of both directories whose PTX differs, and those in one only; their count."""
    a, b = _entries(old), _entries(new)
    differ = [k for k in a if k in b and a[k] != b[k]]
    for k in differ:
        print("DIFFERS", *k)
    for k in a.keys() - b.keys():
        print("only in", old, *k)
    for k in b.keys() - a.keys():
        print("only in", new, *k)
    print(f"{sum(1 for k in a if k in b) - len(differ)} identical, {len(differ)} differ")
    return len(differ)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--diff"] and len(sys.argv) == 4:
        sys.exit(1 if diff(sys.argv[2], sys.argv[3]) else 0)
    if len(sys.argv) == 2:
        sys.exit(1 if dump(sys.argv[1]) else 0)
    sys.exit(__doc__)
