"""What an sm_90 bulk L2 prefetch (cp.async.bulk.prefetch.L2) costs the kernel that issues it,
and whether the bytes it asks for are still in L2 when a later kernel streams them: the
question behind two decode-step prefetches that each made Qwen3.5-2B decode slower (a graph
branch, then the latency-bound kernels' own launches; benchmarks/README.md, qwen35_gpu).

    python benchmarks/l2_prefetch_gpu.py                # one GPU, sm_90 or later

Every measurement is the median of --reps launches, CUDA events around the kernels timed,
each repetition on bytes no launch touched since a 256 MB sweep (so they start outside L2):
* `bulk prefetch kernel`: a 32-block x 256-thread kernel (rlx_gdn_net's grid at Qwen3.5-2B
  decode) that only issues the bulk prefetches of N MB (16 KB each) and exits: does it last
  until they land? `line prefetch kernel`: the same with one `prefetch.global.L2` a 128-byte line;
* `read cold` / `read hot`: a streaming read of N MB over every SM (a decode GEMV's access
  pattern) on bytes outside L2, and right after reading the same bytes; `after bulk prefetch` /
  `after line prefetch`: after the prefetch kernel and a 20 us wait, `bulk, 8 MB between` also
  with an 8 MB read of other bytes before it: do the prefetched lines make it an L2 read?
"""
from __future__ import annotations

import argparse
import statistics
import sys

SOURCE = r"""
extern "C" __global__ void prefetch(const char* p, long long n) {
  const long long chunk = 16384, chunks = (n + chunk - 1) / chunk;
  for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < chunks;
       c += (long long)gridDim.x * blockDim.x) {
    const long long left = n - c * chunk;
    const unsigned size = (unsigned)(left < chunk ? left : chunk) & ~15u;
    if (size)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + c * chunk), "r"(size) : "memory");
  }
}
extern "C" __global__ void prefetch_lines(const char* p, long long n) {
  for (long long o = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * 128; o < n;
       o += (long long)gridDim.x * blockDim.x * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
}
extern "C" __global__ void stream_read(const uint4* p, long long n16, unsigned* sink) {
  unsigned acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16;
       i += (long long)gridDim.x * blockDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;       // (keeps the loads; never true on zeros)
}
extern "C" __global__ void spin(long long ns) {
  long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""
MB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sizes", default="1,4,16,32", help="MB the prefetch and the read take, comma-separated")
    a = ap.parse_args()
    import cupy as cp

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode()
    if props["major"] < 9:
        print(f"{name}: compute capability {props['major']}.{props['minor']} has no bulk prefetch (sm_90+)")
        return 0
    mod = cp.RawModule(code=SOURCE, options=("-std=c++17",))
    pf, pl, rd, spin = (mod.get_function(n) for n in ("prefetch", "prefetch_lines", "stream_read", "spin"))
    sms = props["multiProcessorCount"]
    sizes = [int(s) for s in a.sizes.split(",")]
    span = 256 * MB                                  # one repetition's bytes, then the next region
    pool = cp.zeros(span * (a.reps + 2) + 256 * MB, cp.uint8)
    sweep = pool[-256 * MB:]
    sink = cp.zeros(1, cp.uint32)
    ev = [cp.cuda.Event() for _ in range(2)]

    def read(buf):
        rd((4 * sms,), (1024,), (buf, cp.int64(buf.nbytes // 16), sink))

    def timed(setup, kernel) -> float:
        """Median microseconds of `kernel(region)` over the repetitions, `setup(region)` before it."""
        out = []
        for r in range(a.reps):
            read(sweep)
            region = pool[r * span:(r + 1) * span]
            setup(region)
            ev[0].record()
            kernel(region)
            ev[1].record()
            ev[1].synchronize()
            out.append(cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3)
        return statistics.median(out)

    nothing = lambda region: None                   # noqa: E731
    print(f"GPU: {name}, {sms} SMs, L2 {props['l2CacheSize'] / MB:.0f} MB; medians of {a.reps}, us")
    empty = timed(nothing, lambda r: pf((32,), (256,), (r, cp.int64(0))))
    print(f"the prefetch kernel asking for nothing: {empty:.1f}")
    print("| MB | bulk prefetch kernel | line prefetch kernel | read cold | read hot | after bulk prefetch | "
          "bulk, 8 MB between | after line prefetch |")
    print("|---|---|---|---|---|---|---|---|")
    for s in sizes:
        n = s * MB

        def prefetch(region, n=n):
            pf((32,), (256,), (region, cp.int64(n)))

        def lines(region, n=n):
            pl((32,), (256,), (region, cp.int64(n)))

        def wait(region):
            spin((1,), (1,), (cp.int64(20_000),))

        def read_n(region, n=n):
            read(region[:n])
        t_pf = timed(nothing, prefetch)
        t_cold = timed(nothing, read_n)
        t_hot = timed(read_n, read_n)
        t_after = timed(lambda r: (prefetch(r), wait(r)), read_n)
        t_between = timed(lambda r: (prefetch(r), wait(r), read(r[128 * MB:136 * MB])), read_n)
        t_pl = timed(nothing, lines)
        t_after_pl = timed(lambda r: (lines(r), wait(r)), read_n)
        cells = (t_pf, t_pl, t_cold, t_hot, t_after, t_between, t_after_pl)
        print(f"| {s} | " + " | ".join(f"{t:.1f}" for t in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
