#!/usr/bin/env bash
# The GPU work still queued (session 30), each part under a time limit so that one device call
# (10 minutes at most) returns what ran. Here first, to unpack the tree the A/B compares against
# (the device gets the working tree, not the repository's history):
#   bash benchmarks/gpu_queue.sh prep
# then on the device, after the install, with carry [".device"]:
#   bash benchmarks/gpu_queue.sh rope rows     # ~420 s
#   bash benchmarks/gpu_queue.sh q4k           # ~200 s
# rope: on the H200, against main before this session's changes (bc36702): the RoPE's vector
# path (rope.cu:rlx_rope_row_vec; 0.986x on an H100), the final norm computed by the GEMVs
# around it through the last-token narrow, and the first norm by the embedding gather and its
# GEMV (neither measured): Qwen3.5-2B decode (issue 45's ratio) and Llama-1B q4_k / bf16
# (benchmarks/README.md, qwen35_gpu section, session 30). First the GPU tests of the three
# (test_gemv_fusion.py's blocks read the final norm through that narrow; one runs on embeddings).
# rows: two rows of W a warp in the plain decode GEMVs (ops.GEMV_ROWS 2: four 16-byte loads a
# lane in flight, as the gate/up pair has; the in-projection runs at 3.05 TB/s against gate/up's
# 3.36). q4k: where the packed GEMV's time goes (issue 49: q4_k decode is 3.99x its packed floor,
# streaming ~1 TB/s; its weight reads, not its launches, hold it): ncu's speed-of-light, memory
# and warp-state sections of three rlx_dq_gemv launches inside the step (report in OUT).
# OUT (optional): a folder for the logs. Remove this file once its parts have run.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
D=$PWD/.device
BASE="base=PYTHONPATH=$D/base/plugins/rlx_backend_cuda"
ROWS2="rows2=RLX_BENCH_SET=rlx_backend_cuda.ops.GEMV_ROWS=2"
QWEN="python3 benchmarks/qwen35_gpu.py --sides rlx --prefill= --new 64 --reps 3"
LLAMA="python3 benchmarks/llm_gpu.py --rlx-only --engine runtime --check-layers 0 --prompt 512 --new 64"
LLAMA="$LLAMA --packed q4_k"
for part in "$@"; do
  case $part in
  prep)
    rm -rf "$D/base" && mkdir -p "$D/base"
    git archive bc36702 plugins/rlx_backend_cuda | tar -x -C "$D/base" ;;
  rope)
    nvidia-smi --query-gpu=name --format=csv,noheader
    T=plugins/rlx_backend_cuda/tests
    timeout 120 python3 -m pytest -q -o addopts= -p no:cacheprovider $T/test_gemv_fusion.py \
      $T/test_rope_norm.py $T/test_attn_rope.py -k "not emulated" 2>&1 | tail -2
    echo "== Qwen3.5-2B and Llama-1B decode: the RoPE's vector path and the final norm's fold, against before"
    timeout 200 python3 benchmarks/gpu_ab.py --rounds 2 --timeout 60 --config "$BASE" --config head= \
      -- $QWEN 2>&1 | tee "$OUT/ab_rope_qwen.log" | tail -4
    timeout 150 python3 benchmarks/gpu_ab.py --rounds 1 --timeout 70 --config "$BASE" --config head= \
      -- $LLAMA 2>&1 | tee "$OUT/ab_rope_llama.log" | tail -5 ;;
  rows)
    echo "== two rows of W a warp in the plain decode GEMVs"
    timeout 200 python3 benchmarks/gpu_ab.py --rounds 2 --timeout 60 --config head= --config "$ROWS2" \
      -- $QWEN 2>&1 | tee "$OUT/ab_rows_qwen.log" | tail -4 ;;
  q4k)
    echo "== the packed (q4_k) decode GEMV under ncu"
    timeout 300 ncu --clock-control none --graph-profiling node -k regex:rlx_dq_gemv --launch-skip 20 -c 3 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      -o "$OUT/dq_gemv" -f $LLAMA --new 4 --reps 1 > "$OUT/ncu_q4k.log" 2>&1
    tail -5 "$OUT/ncu_q4k.log"
    KEEP="rlx_dq_gemv|Duration|Throughput|Achieved Occupancy|Registers|Warp Cycles|Stall"
    ncu --import "$OUT/dq_gemv.ncu-rep" --page details 2>&1 | grep -E "$KEEP" | head -40 ;;
  *) echo "gpu_queue.sh: unknown part $part (prep, rope, rows, q4k)"; exit 2 ;;
  esac
done
