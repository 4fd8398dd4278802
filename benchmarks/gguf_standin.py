"""A GGUF file's stand-in for a machine it cannot travel to (the GPU machine takes 64 MiB of
files a call; the packaged SmolLM2 Q4_1 is 98 MB): `cut` keeps its header (metadata, tokenizer,
chat template, tensor table: 1.8 MB for SmolLM2) and a JSON table of its tensors; `fill` writes,
from the two, a GGUF of the same header, tensor types and shapes with seeded random weights.
Both engines load it and do the same arithmetic on it as on the original (a speed race: with
`ignore_eos` the greedy tokens differ but their count does not).

    python benchmarks/gguf_standin.py cut MODEL.gguf OUT.head       # writes OUT.head and OUT.head.json
    python benchmarks/gguf_standin.py fill OUT.head MODEL.gguf [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np


def cut(gguf: str, head: str) -> None:
    """Write `gguf`'s header bytes to `head` and its tensor table to `head`.json."""
    from gguf import GGUFReader

    r = GGUFReader(gguf)
    with open(gguf, "rb") as f, open(head, "wb") as out:
        out.write(f.read(r.data_offset))
    table = [{"name": t.name, "type": t.tensor_type.name, "shape": [int(n) for n in t.shape],
              "offset": int(t.data_offset), "bytes": int(t.n_bytes)} for t in r.tensors]
    with open(head + ".json", "w") as f:
        json.dump({"source": os.path.basename(gguf), "bytes": os.path.getsize(gguf), "tensors": table}, f)


def _f16(x: float, n: int) -> np.ndarray:
    """n copies of x as float16 bytes, one row of 2 per block."""
    return np.full(n, x, np.float16).view(np.uint8).reshape(n, 2)


def weights(kind: str, shape: list, nbytes: int, rng: np.random.Generator) -> bytes:
    """`nbytes` of random weights of GGML type `kind` and GGUF shape `shape` (row length first):
    a 1-D tensor (a norm's gain) near 1, a matrix uniform in +-sqrt(3 / row length) (unit
    variance through a matmul)."""
    if len(shape) == 1:
        values = 1.0 + 0.02 * rng.standard_normal(shape[0])
        a = 0.0
    else:
        a = math.sqrt(3.0 / shape[0])
        values = None
    if kind in ("F32", "F16"):
        dtype = np.float32 if kind == "F32" else np.float16
        if values is None:
            values = rng.uniform(-a, a, math.prod(shape))
        data = values.astype(dtype).tobytes()
    elif kind in ("Q8_0", "Q4_0", "Q4_1"):
        if values is not None:
            raise SystemExit(f"gguf_standin: a 1-D tensor of type {kind}: not supported")
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]     # bytes per block of 32 weights
        n = nbytes // size
        scale = {"Q8_0": _f16(a / 127, n), "Q4_0": _f16(a / 8, n),      # q * d; (q - 8) * d; q * d + m
                 "Q4_1": np.hstack([_f16(2 * a / 15, n), _f16(-a, n)])}[kind]
        low, high = (-127, 128) if kind == "Q8_0" else (0, 256)        # int8 in +-127; two nibbles
        quants = rng.integers(low, high, (n, size - scale.shape[1]), np.int16).astype(np.uint8)
        data = np.hstack([scale, quants]).tobytes()
    else:
        raise SystemExit(f"gguf_standin: tensor type {kind} is not supported (F32, F16, Q8_0, Q4_0, Q4_1)")
    if len(data) != nbytes:
        raise SystemExit(f"gguf_standin: {kind} {shape}: made {len(data)} bytes, the table says {nbytes}")
    return data


def fill(head: str, out: str, seed: int = 0) -> None:
    """Write `out`: `head`'s header, then each tensor of `head`.json's table at its offset,
    random (`weights`), the gaps between them zero."""
    with open(head + ".json") as f:
        table = json.load(f)
    rng = np.random.default_rng(seed)
    with open(head, "rb") as f, open(out, "wb") as o:
        o.write(f.read())
        for t in table["tensors"]:
            o.seek(t["offset"])
            o.write(weights(t["type"], t["shape"], t["bytes"], rng))
        o.truncate(table["bytes"])


def main(argv: list | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    c = sub.add_parser("cut", help="GGUF -> its header (+ .json)")
    c.add_argument("gguf")
    c.add_argument("head")
    f = sub.add_parser("fill", help="header (+ .json) -> GGUF with random weights")
    f.add_argument("head")
    f.add_argument("out")
    f.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.verb == "cut":
        cut(a.gguf, a.head)
    else:
        fill(a.head, a.out, a.seed)
    print(f"gguf_standin {a.verb}: wrote {a.head if a.verb == 'cut' else a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
