#!/usr/bin/env bash
# The GPU work sessions without a device queued, most needed first, each part under a time
# limit so that one device call (10 minutes at most) returns what ran: the cuda tests with the
# opt-in switches on (RLX_CUDA_ATTN_ROPE, RLX_CUDA_ATTN_EPILOGUE, RLX_CUDA_L2_PREFETCH), then
# the A/Bs that decide whether they become the default (benchmarks/README.md, qwen35_gpu
# section). Run from the repository root with the packages installed; OUT (optional) is a
# folder for the A/B logs.
#   bash benchmarks/gpu_queue.sh            # everything (its limits add up to 590 s)
#   bash benchmarks/gpu_queue.sh ab         # the A/Bs only
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
T=plugins/rlx_backend_cuda/tests
ON="RLX_CUDA_ATTN_ROPE=1 RLX_CUDA_ATTN_EPILOGUE=1 RLX_CUDA_L2_PREFETCH=1"
P="RLX_CUDA_L2_PREFETCH=1"
NOPRUNE="RLX_BENCH_SET=rlx_backend_cuda.runner.PRUNABLE=()"
PYTEST="python3 -m pytest -q -o addopts= -p no:cacheprovider"
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${1:-all}" != ab ]; then
  echo "== cuda tests, switches on"
  env $ON timeout 90 $PYTEST $T/test_attn_rope.py $T/test_l2_prefetch.py $T/test_kernel_paths.py \
    $T/test_early_loads.py $T/test_gdn_net_cuda.py $T/test_dry_build.py 2>&1 | tail -8
  env $ON timeout 60 $PYTEST plugins/rlx_blocks_qwen35/tests -k "cuda or gpu or GPU" 2>&1 | tail -5
  timeout 30 $PYTEST $T/test_cuda.py -k "greedy_fetch or graph_replay or profiler" 2>&1 | tail -3
fi
echo "== Qwen3.5 decode A/B"
timeout 230 python3 benchmarks/gpu_ab.py --rounds 2 --timeout 75 --config base= \
  --config "attn=RLX_CUDA_ATTN_ROPE=1 RLX_CUDA_ATTN_EPILOGUE=1" \
  --config "all=$P RLX_CUDA_ATTN_ROPE=1 RLX_CUDA_ATTN_EPILOGUE=1" \
  -- python3 benchmarks/qwen35_gpu.py --sides rlx --prefill= --new 64 --reps 3 2>&1 \
  | tee "$OUT/ab_qwen35.log" | tail -12
echo "== Llama-1B q4_k decode A/B"
timeout 90 python3 benchmarks/gpu_ab.py --rounds 1 --timeout 60 --config base= \
  --config "rope=RLX_CUDA_ATTN_ROPE=1" \
  --config "both=$P RLX_CUDA_ATTN_ROPE=1" -- python3 benchmarks/llm_gpu.py --rlx-only --engine runtime \
  --prompt 512 --new 64 --packed q4_k --check-layers 0 2>&1 | tee "$OUT/ab_llama.log" | tail -10
echo "== Llama-1B batch 32: the unfetched logits' launches skipped or not"
timeout 90 python3 benchmarks/gpu_ab.py --rounds 1 --timeout 85 --config "noprune=$NOPRUNE" --config base= \
  -- python3 benchmarks/llm_gpu.py --batch 32 --sides rlx --prompt 512 --new 64 2>&1 \
  | tee "$OUT/ab_batch.log" | tail -8
