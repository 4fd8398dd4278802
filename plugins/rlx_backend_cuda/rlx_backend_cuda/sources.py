"""CUDA C++ sources of the backend's kernels: the .cu files of kernels/, specialized by defines.

Every kernel is plain CUDA C++ compiled by NVRTC through `cupy.RawModule` (once per
specialization, cached by its source text). The hand-written kernels live in kernels/*.cu
(package data, read once), one file per family, cut into parts by lines
`// @part NAME(DEFINES)` that name the macros the part expects: C types (`TX`, `TO`, ...), the
accumulation type `ACC` (float, or double for f64 data), compile-time constants, and code
snippets (`LOAD(v)`, `COMB(a, b)`: function-like, their values wrapped in parentheses).
`render(source, **defines)` writes prelude.cu, a `#define` per value, then the parts, each
after a `#line` so that a compile error names the .cu file and its own line. Defines are
compile-time like the text they replaced: the same kernels, the same code.
"""
from __future__ import annotations

import functools
import importlib.resources
import re
import string

from rlx_core.ir.errors import BackendError

_PART = re.compile(r"^// @part (\w+)\((.*)\)$", re.M)


@functools.cache
def _file(name: str) -> str:
    """The text of kernels/`name`, read once."""
    try:
        return importlib.resources.files(__package__).joinpath("kernels", name).read_text()
    except OSError:
        raise BackendError(f"cuda backend: kernel source file kernels/{name} is missing "
                           f"(an incomplete install of rlx-backend-cuda)") from None


@functools.cache
def _parts(name: str) -> dict:
    """{part: (its first line in the file, {define: macro parameters or ''}, text)} of kernels/`name`."""
    text = _file(name)
    heads = list(_PART.finditer(text))
    parts = {}
    for m, nxt in zip(heads, heads[1:] + [None]):
        defines = dict(re.findall(r"(\w+)(?:\(([^)]*)\))?", m.group(2)))
        first = text.count("\n", 0, m.end()) + 2           # the line after the @part line
        parts[m.group(1)] = (first, defines, text[m.end() + 1:nxt.start() if nxt else None])
    return parts


class Source:
    """A kernel source: parts ("file.cu:part") of kernels/, compiled in this order; `+` joins two."""

    def __init__(self, *parts: str):
        self.parts = parts

    def __add__(self, other: Source) -> Source:
        return Source(*self.parts, *other.parts)

    def __repr__(self) -> str:
        return f"Source({', '.join(map(repr, self.parts))})"

    def _each(self):
        for p in self.parts:
            file, _, name = p.partition(":")
            part = _parts(file).get(name)
            if part is None:
                raise BackendError(f"cuda backend: kernels/{file} has no part {name!r} (its parts: "
                                   f"{', '.join(_parts(file))})")
            yield file, *part

    def defines(self) -> dict:
        """{name: macro parameters ('' for a plain value)} of every define the parts expect, in order."""
        out: dict = {}
        for _, _, defines, _ in self._each():
            for k, v in defines.items():
                out.setdefault(k, v)
        return out

    def text(self) -> str:
        """The parts, each after a #line naming its file and first line."""
        return "".join(f'#line {line} "{file}"\n{text}' for file, line, _, text in self._each())


def _define(name: str, params: str, value) -> str:
    """`#define NAME value`, or `#define NAME(params) (value)`; a line break in the value continues
    the line (so the value can hold neither a // comment nor a preprocessor line)."""
    v = str(value)
    if "//" in v or re.search(r"^\s*#", v, re.M):
        raise BackendError(f"cuda backend: the value of define {name} holds a // comment or a # line: {v!r}")
    v = v.replace("\n", " \\\n")
    return f"#define {name}({params}) ({v})" if params else f"#define {name} {v}"


def render(source: Source | str, **defines) -> str:
    """The compilable text of `source` with these defines, after the prelude. A `str` is source
    generated in Python (codegen.py, rows.py): its `$NAME` placeholders are filled as text."""
    prelude = _file("prelude.cu")
    if isinstance(source, str):
        return prelude + string.Template(source).substitute(**{k: str(v) for k, v in defines.items()})
    want = source.defines()
    missing = ", ".join(n for n in want if n not in defines)
    unknown = ", ".join(n for n in defines if n not in want)
    if missing or unknown:
        raise BackendError(f"cuda backend: kernel source {source} takes the defines {', '.join(want)}; "
                           f"missing: {missing or 'none'}; unknown: {unknown or 'none'}")
    return prelude + "".join(_define(n, p, defines[n]) + "\n" for n, p in want.items()) + source.text()


def error_line(source: str, log: str) -> str:
    """The line that a compile log's first error names, quoted: of a kernels/ file where a #line
    in `source` names it, else of `source` itself ('' when the log names no line)."""
    m = re.search(r"([^\s\"()]*)\((\d+)\): (?:catastrophic )?error", log)
    if not m:
        return ""
    file, n = m.group(1).rsplit("/", 1)[-1], int(m.group(2))
    if f' "{file}"\n' in source:
        lines, where = _file(file).split("\n"), f"kernels/{file} line"
    else:
        lines, where = source.split("\n"), "kernel source line"
    return f"\n  {where} {n}: {lines[n - 1].strip()}" if 1 <= n <= len(lines) else ""


def own_arch(source: str) -> str | None:
    """The target a kernel needs beyond the device's own: sm_90a for Hopper's wgmma (which the
    plain sm_90 target rejects), else None."""
    return "sm_90a" if "wgmma." in source else None


def with_grid_wait(source: str, name: str) -> str:
    """`source` with kernel `name` starting at RLX_GRID_WAIT() (see device.Kernel; on the line of its
    brace, so compile errors keep their line numbers), unless the kernel places it itself
    (after loads of what no earlier kernel writes) or the source lacks the prelude."""
    head = re.search(r'extern "C" __global__ void[^{;]*\b' + re.escape(name) + r"\s*\([^{;]*\)\s*\{", source)
    if head is None or "RLX_GRID_WAIT" in source[head.end():] or "#define RLX_GRID_WAIT" not in source:
        return source
    return source[:head.end()] + " RLX_GRID_WAIT();" + source[head.end():]


# --------------------------------------------------------------------------- rows
RMS_NORM = Source("norm.cu:norm_vec", "norm.cu:rms_norm")
LAYER_NORM = Source("norm.cu:norm_vec", "norm.cu:layer_norm")
# softmax, reduce, argmax and topk: rows.py (core's row kernels in this dialect)
REDUCE_COLS = Source("rows.cu:reduce_cols")
CUMSUM = Source("rows.cu:cumsum")
SOFTMAX_GRAD = Source("grad.cu:softmax_grad")
NORM_GRAD = Source("grad.cu:norm_grad")

# --------------------------------------------------------------------------- indexing ops
GATHER = Source("index.cu:gather")
GATHER_NORM = Source("index.cu:gather_norm")
KV_WRITE = Source("index.cu:kv_write")
COPY_MANY = Source("index.cu:copy_many")
ROPE = Source("rope.cu:row", "rope.cu:rope")
ROPE_VEC = Source("rope.cu:rope_vec")

# --------------------------------------------------------------------------- attention
MASK_FILL = Source("attn.cu:mask", "attn.cu:mask_fill")
ATTN_SPLIT = Source("attn.cu:mask", "attn.cu:vec", "attn.cu:split")
ATTN_SHORT = Source("attn.cu:mask", "attn.cu:vec", "attn.cu:short")
ATTN_DECODE = Source("attn.cu:mask", "attn.cu:vec", "rope.cu:row", "attn.cu:decode")
# its defines without the RoPE and the epilogue (ops.AttnRope, ops.AttnEpilogue)
ATTN_DECODE_PLAIN = dict(ROPE=0, INTERLEAVED=0, TC="float", TN="float", EPI=0, EPI_FN="", EPI_CALL="(o)",
                         TE="float", TY="float")
ATTN_TC = Source("attn.cu:mask", "tc.cu:mma", "attn_tc.cu:common", "attn_tc.cu:tc")
ATTN_WG = Source("attn.cu:mask", "tc.cu:mma", "attn_tc.cu:common", "attn_tc.cu:wg")


def attn_tc_smem(D: int, MT: int) -> int:
    """Dynamic shared memory of ATTN_TC: the K and V tiles and the Q rows (16-bit, padded rows)."""
    return (2 * 64 + 64 * MT) * (D + 8) * 2


def attn_wg_bn(D: int) -> int:
    """Keys of a K / V tile of ATTN_WG at head_dim D: 128; 64 at 256 (O's 128 accumulators a
    thread beside two S tiles within 255 registers; Q and two slots of K and V within 227 KB)."""
    return 64 if D > 128 else 128


def attn_wg_source(D: int, **defines) -> str:
    """ATTN_WG for head_dim D (64, 128 or 256), its wgmma operand lists written out (string
    literals and asm operands, as defines)."""
    def regs(n):
        return '"' + ", ".join(f"%{i}" for i in range(n)) + '"'

    def outs(n):
        return ", ".join(f'"+f"(d[{i}])' for i in range(n))
    bn = attn_wg_bn(D)
    s = bn // 2                                   # S's accumulator registers; then Q's and K's descriptors, the flag
    h = D // 2                                    # O's accumulator registers; then P's four, V's descriptor
    operands = {f"PV_A{i}": f'"{h + i}"' for i in range(4)}
    operands.update(PV_B=f'"{h + 4}"', PV_ONE=f'"{h + 5}"', QK_A=f'"{s}"', QK_B=f'"{s + 1}"', QK_ACC=f'"{s + 2}"')
    return render(ATTN_WG, D=D, BN=bn, BF16=int(defines.get("MMAT") == "bf16"), S_REGS=regs(s), S_OUTS=outs(s),
                  O_REGS=regs(h), O_OUTS=outs(h), **operands, **defines)


def attn_wg_smem(D: int) -> int:
    """Dynamic shared memory of ATTN_WG: Q, two slots of K and V, 1024 bytes of alignment, the mbarriers."""
    return (128 + 4 * attn_wg_bn(D)) * D * 2 + 1024 + 64


# --------------------------------------------------------------------------- matmul helpers
GEMV = Source("gemv.cu:gemv")
GEMV_TC = Source("tc.cu:mma", "gemv.cu:gemv_tc")


MATMUL_NAIVE = Source("gemv.cu:matmul_naive")

# --------------------------------------------------------------------------- packed weights
DQ_COMMON = Source("dq.cu:common")
DQ_QF = Source("dq.cu:qf")
DQ_SCHEMES = {      # each format's decode snippet: one serves every kernel below
    "q4_0": Source("dq.cu:nib", "dq.cu:q4_0"),
    "q4_1": Source("dq.cu:nib", "dq.cu:q4_1"),
    "q5_0": Source("dq.cu:nib", "dq.cu:q5_0"),
    "q5_1": Source("dq.cu:nib", "dq.cu:q5_1"),
    "q8_0": Source("dq.cu:q8_0"),
    "int8": Source("dq.cu:int8"),
    "int4": Source("dq.cu:int4"),
    "q4_k": Source("dq.cu:q4_k_raw", "dq.cu:k45", "dq.cu:q4_k"),
    "q5_k": Source("dq.cu:q5_k_raw", "dq.cu:k45", "dq.cu:q5_k"),
    "q6_k": Source("dq.cu:q6_k"),
}
DQ_GEMV = Source("dq.cu:x4", "dq.cu:q8x", "dq.cu:gemv")
# schemes whose decode GEMV has a tensor-core form (dq.cu's TC): their groups of 8 sub-blocks a
# block (TCG), and tc.cu's mma with the scheme's view
DQ_TC_VIEWS = {k: (groups, Source("tc.cu:mma", f"dq.cu:tc_{k}")) for k, groups in (("q4_k", 1), ("q6_k", 2))}
DQ_DEQUANT = Source("dq.cu:dequant")
# (a scheme's snippet not needed: the rounding of x alone, to floats (rlx_fake_q8) or to the QX
# GEMVs' int8 rows (rlx_quant_q8))
ROUND_Q8 = Source("dq.cu:common", "dq.cu:x4", "dq.cu:q8x", "dq.cu:round_q8")


def dq_source(kernel: Source, kind: str, block: int, **defines) -> str:
    """A packed-weight kernel (DQ_GEMV / DQ_DEQUANT) for scheme `kind` (block: the int
    schemes' block size, their define IB)."""
    source = DQ_COMMON + DQ_SCHEMES[kind] + DQ_QF
    if defines.get("TC"):                   # (bf16 x: the mma's operands)
        source, defines = source + DQ_TC_VIEWS[kind][1], {**defines, "MMAT": "bf16"}
    source += kernel
    return render(source, **defines, **({"IB": block} if "IB" in source.defines() else {}))


def dq_dequant_shape(kind: str, block: int, itemsize: int) -> dict:
    """STAGE, BPT (blocks per tile), THREADS of DQ_DEQUANT: tiles of 4096 weights (one block
    where blocks are larger) staged in shared memory up to 32 KiB, else no staging."""
    bpt = max(1, 4096 // block)
    stage = int(bpt * block * itemsize <= 32768)
    return {"STAGE": stage, "BPT": bpt, "THREADS": min(bpt * dq_parts(kind, block), 512) if stage else 256}


def dq_parts(kind: str, block: int) -> int:
    """Parts per block of a scheme's snippet (its PARTS)."""
    return block // 8 if kind in ("int8", "int4") else {"q4_k": 8, "q5_k": 8, "q6_k": 8}.get(kind, 2)


# --------------------------------------------------------------------------- routed experts, Gated DeltaNet
# (builders and launch shapes: moe.py, deltanet.py)
MOE_SORT = Source("moe.cu:sort")
MOE_DENSE = Source("moe.cu:w", "moe.cu:dense", "moe.cu:gemv")
MOE_PACKED_TAIL = Source("dq.cu:x4", "moe.cu:packed", "moe.cu:gemv")    # after DQ_COMMON + a scheme + DQ_QF
MOE_DENSE1 = Source("moe.cu:w", "moe.cu:dense", "moe.cu:gemv1")           # (one token: no sort)
MOE_PACKED_TAIL1 = Source("dq.cu:x4", "moe.cu:packed", "moe.cu:gemv1")
MOE_COMBINE = Source("moe.cu:w", "moe.cu:combine")
MOE_ROUTE = Source("moe.cu:w", "moe.cu:route")
MOE_GEMM_DENSE = Source("tc.cu:mma", "deltanet.cu:tc_common", "moe.cu:w", "moe.cu:gemm_shape",
                        "moe.cu:gemm_dense", "moe.cu:gemm")
MOE_GEMM_PACKED_TAIL = Source("tc.cu:mma", "deltanet.cu:tc_common", "moe.cu:gemm_shape", "moe.cu:gemm_packed",
                              "moe.cu:gemm")
GDN_RULE = Source("deltanet.cu:rule")
GDN_PREP = Source("deltanet.cu:chunk_prep")
GDN_SCAN = Source("deltanet.cu:chunk_scan")
GDN_TC_PREP = Source("tc.cu:mma", "deltanet.cu:tc_common", "deltanet.cu:tc_prep")
GDN_TC_SCAN = Source("tc.cu:mma", "deltanet.cu:tc_common", "deltanet.cu:tc_scan")
GDN_TC_OUT = Source("tc.cu:mma", "deltanet.cu:tc_common", "deltanet.cu:tc_out")
GDN_NET = Source("gdn_net.cu:net")            # gated_delta_net (deltanet.py)
CONV1D = Source("deltanet.cu:conv")
CONV1D_STATE = Source("deltanet.cu:conv_state")

# Decode attention over a short KV cache (one query row per head): one block per (batch, kv
# head), no split over blocks and so no merge. Its G heads' q rows go to shared memory; each
# thread scores whole keys (all its K rows loaded first, VK-element loads along the row: a
# warp reads 32 consecutive rows); one warp per head turns its row of scores into
# probabilities; then each warp sums P.V over every NW-th key, a lane per D/32 head dims (its
# first value rows were loaded with the keys, later ones 8 at a time), and the warps' sums
# meet in shared memory.


# ----------------------------------------------------------------------------- launch shapes
ATTN_THREADS = 128       # threads of a split-K decode attention block (ops.py may override)
ATTN_LOADS = 2           # vector loads per lane for K and for V in one key tile
# (threads, loads) of a split-K block where the grid has fewer blocks than the GPU has SMs
# (batch-1 decode) and the tile stays within a split's keys (ops.py): one 64-key tile a split
# at head dim 128 in 16-bit floats, so a block waits on memory once, not 4 times. OLMoE-shaped
# decode (16 heads x 128, 640-key cache, bf16, H200): 13.0 -> 10.0 us a launch, Q4_K_M step
# 1.125 -> 1.077 ms
ATTN_SMALL_GRID = (256, 4)


# gated_delta_net: state columns a warp holds, at most (registers: K / 32 x this). Qwen3.5-2B bf16
# decode (H200, 2 blocks a key head): 1.506 ms a token at 8, 1.521 at 16, 1.672 at 32
NET_COLUMNS = 8
NET_WARPS_MAX = 32        # its block, at most (1024 threads)
# blocks sharing a key head's columns, at most (sm_90 clusters). Qwen3.5-2B bf16 decode (16 key heads
# x 128 x 128, H200, 16 columns a warp): 1.581 ms a token at 1, 1.521 at 2, 1.546 at 4, 1.527 at 8;
# with pushed norms and 8 columns a warp (H100): 1.748 at 2, 1.751 at 4, 1.780 at 8
NET_CLUSTER = 2
NET_BLOCK_COLUMNS = 16    # state columns a block of such a cluster holds, at least


def net_cluster(vd: int, r: int, blocks: int, sms: int) -> int:
    """Blocks a key head's r * vd state columns spread over (rlx_gdn_net's CS) where `blocks`
    clusters (key heads x batch rows) leave SMs idle: the most, up to NET_CLUSTER, that keeps
    the grid within one wave and gives each block at least NET_BLOCK_COLUMNS columns, whole
    value heads or an equal part of one."""
    cols = r * vd
    fits = [cs for cs in range(1, NET_CLUSTER + 1)
            if cols % cs == 0 and blocks * cs <= sms and (cs == 1 or cols // cs >= NET_BLOCK_COLUMNS)
            and ((cols // cs) % vd == 0 or vd % (cols // cs) == 0)]
    return max(fits, default=1)


def net_layout(kd: int, vd: int, r: int, width: int, itemsize: int, cs: int = 1) -> dict:
    """rlx_gdn_net's compile-time shape for clusters of cs blocks a key head: warps (NW), state
    columns a warp (VPW), rows a lane (KPL), conv channels a thread (CPT), and whether a warp's
    columns are one aligned run of a head's row within its block's columns (VEC: 16-byte loads)."""
    cols = r * vd // cs
    nw = min(NET_WARPS_MAX, max(2, -(-cols // NET_COLUMNS)))
    vpw = -(-cols // nw)
    vec = int(cols % vpw == 0 and vd % vpw == 0 and (vpw * itemsize) % 16 == 0)
    return dict(NW=nw, VPW=vpw, KPL=-(-kd // 32), CPT=-(-(2 * kd + cols) // (32 * nw)), VEC=vec, CS=cs)


ATTN_SHORT_THREADS = 512
ATTN_SHORT_KEYS = 512           # cache positions up to which the short kernel is used (one key a thread)
ATTN_SHORT_SMEM = 44 * 1024     # bytes of shared memory it may take


def attn_short_shape(g: int, d: int, sk: int, vk: int) -> dict | None:
    """ATTN_SHORT's compile-time shape for G query heads per kv head, head dim d (both K and
    V), a KV cache of sk positions and vk-element K loads; None where it does not apply
    (d not a multiple of 32 or over 256, G over 8, sk over ATTN_SHORT_KEYS, shared memory
    over ATTN_SHORT_SMEM)."""
    nt = ATTN_SHORT_THREADS
    if (d % 32 or d > 256 or g > 8 or d % vk or sk > ATTN_SHORT_KEYS
            or 4 * max(g * sk, nt // 32 * g * d) + 4 * g * d > ATTN_SHORT_SMEM):
        return None
    return dict(NT=nt, G=g, D=d, SK=sk, VK=vk)


ATTN_DECODE_LOADS = 4           # K (and V) row loads a lane issues for its warp's chunk of keys
ATTN_DECODE_CLUSTER = 8         # blocks sharing one (batch, kv head)'s keys (the portable cluster size)
ATTN_DECODE_PREFETCH = 1        # chunks of its keys a warp asks into L2 before its wait for the kernel before
ATTN_DECODE_KEYS = 2048         # cache positions up to which it is used (measured faster than split-K there)
ATTN_DECODE_SMEM = 44 * 1024    # bytes of shared memory it may take
# below ATTN_DECODE_CLUSTER blocks a pair (batch decode: attn_decode_cluster) the split kernel runs instead
# unless this is on: on an H100 the 1B-shape step at batch 8 and 16 was 3% faster, at 4 and 32 2-4% slower
# (one round each, benchmarks/README.md, llm_gpu session 36)
ATTN_DECODE_SMALL_CLUSTERS = False
ATTN_DECODE_HEADS = 1           # query heads a block takes at least, where the GPU has SMs for more blocks


def attn_decode_groups(g: int, clusters_blocks: int, sms: int) -> int:
    """Into how many groups ATTN_DECODE splits a kv head's g query heads (grid z): the largest
    power of two dividing g that leaves a group ATTN_DECODE_HEADS heads or more and the grid
    within one wave of `sms` blocks (clusters_blocks: the blocks of one group for every kv head
    and batch row). Qwen3.5-2B bf16 decode (2 kv heads x 4 query heads, H200): 1.581 ms a
    token at one group, 1.536 at four; Llama q4_k (8 x 4): 0.694 at one, 0.672 at two."""
    n = 1
    while g % (2 * n) == 0 and g // (2 * n) >= ATTN_DECODE_HEADS and clusters_blocks * 2 * n <= sms:
        n *= 2
    return n


def attn_decode_cluster(pairs: int, sms: int) -> int:
    """Blocks ATTN_DECODE gives each of `pairs` (batch row, kv head) pairs: ATTN_DECODE_CLUSTER
    where their clusters fit one wave of `sms` blocks, else the largest power of two that does,
    down to one block a pair at batch decode (pairs over sms: waves of independent blocks)."""
    cl = ATTN_DECODE_CLUSTER
    while cl > 1 and pairs * cl > sms:
        cl //= 2
    return cl


def attn_decode_shape(g: int, d: int, vk: int, pair: bool = False, rope_bytes: int = 0,
                      cl: int | None = None) -> dict | None:
    """ATTN_DECODE's compile-time shape for G query heads per kv head, head dim d (K and V)
    and vk-element row loads: 8 warps a block where the warps' sums fit the shared memory
    (else 4); None where a key row takes no power of two lanes of a warp, G is over 8 or the
    sums do not fit. `pair`: the rows also allow loads of 2 vk elements; a lane then takes
    two loads of a row where one would spread a key over the whole warp (head dim 256 in
    16 bits), so a warp scores two keys at once and the butterflies, exponentials and mask
    reads of a key are shared by 16 lanes, not 32 (Qwen3.5's decode attention: ~9,000
    instructions a warp at 1.1k cached positions). rope_bytes: the shared rows of its RoPE;
    cl: blocks a cluster (attn_decode_cluster; default ATTN_DECODE_CLUSTER as it is at the call)."""
    if pair and d // vk == 32:
        vk *= 2
    lanes = d // vk
    if d % vk or lanes > 32 or lanes & (lanes - 1) or g > 8:
        return None
    # (q and the P.V sums take g * vk registers each)
    loads = ATTN_DECODE_LOADS if g * vk <= 32 else ATTN_DECODE_LOADS // 2
    cl = cl or ATTN_DECODE_CLUSTER
    for nw in (8, 4):               # (the warps' sums, the cluster's pushed sums and maxima, their mbarrier)
        if 4 * (nw * g * d + 2 * nw * g + cl * -(-g * d // cl) + 2 * cl * g) + 8 + rope_bytes <= ATTN_DECODE_SMEM:
            return dict(NT=32 * nw, G=g, D=d, VK=vk, NL=loads, CL=cl,
                        PF=ATTN_DECODE_PREFETCH)
    return None


def attn_split_shape(dk: int, dv: int, vk: int, vv: int, rows: int, accsz: int, threads: int = ATTN_THREADS,
                     loads: int = ATTN_LOADS) -> dict | None:
    """The split-K attention's compile-time shape (sources.ATTN_SPLIT) for head dims dk/dv
    read vk/vv elements per load, `rows` (query, head) rows per kv head, accumulating in
    accsz-byte floats, blocks of `threads` with `loads` vector loads per lane and tile; None when
    the head dims are too large. (Here, not in ops.py, so the kernel catalog can build the same
    shapes without importing the op builders.)"""
    if dk > 512 or dv > 512:
        return None

    def lanes(d, w):          # lanes per key row (a power of two <= 32), loads per lane
        vecs = -(-d // w)
        n = 1
        while n < min(vecs, 32):
            n *= 2
        return n, -(-vecs // n)
    nt = threads
    tpk, nvk = lanes(dk, vk)
    tpv, nvv = lanes(dv, vv)
    # keys per tile: `loads` vector loads per lane for K and for V, each lane group one key
    tile = max(nt // tpk, nt // tpv)
    while tile * 2 * max(tpk * nvk, tpv * nvv) <= nt * loads:
        tile *= 2
    r = 1
    while r < min(rows, 8):
        r *= 2

    def smem(r):              # bytes: two tiles of scores or the warps' sums, row stats, merge weights
        return (max(2 * r * (tile + 1), nt // 32 * r * dv) + 3 * r + nt // 32 * 64) * accsz
    while r > 1 and (smem(r) > 44 * 1024 or r * max(nvk * vk, nvv * vv) > 64):
        r //= 2
    if smem(r) > 48 * 1024:
        return None
    return dict(ROWS=r, NT=nt, TILE=tile, VK=vk, TPK=tpk, NVK=nvk, VV=vv, TPV=tpv, NVV=nvv)
