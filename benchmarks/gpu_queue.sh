#!/usr/bin/env bash
# The GPU work a session without a device queued (session 28), each part under a time limit
# so that one device call (10 minutes at most) returns what ran. Here first, to unpack the
# trees the A/Bs compare (the device gets the working tree, not the repository's history):
#   bash benchmarks/gpu_queue.sh prep
# then on the device, after the install, with carry [".device"]:
#   bash benchmarks/gpu_queue.sh tests int8     # the int8 rounding's GPU tests and its A/B (~540 s)
#   bash benchmarks/gpu_queue.sh attn           # the decode attention's prefetch A/B (~250 s)
#   bash benchmarks/gpu_queue.sh gemvtc         # batch 4-64: the tensor-core GEMV against cuBLAS (~330 s)
#   bash benchmarks/gpu_queue.sh batch          # where batch 32's decode step goes (~240 s)
# int8: Llama-1B q4_k decode with int8 activations, the tree before (four quant_q8 launches a
# layer), with the GEMVs' Q8 rounding alone, HEAD, and HEAD without QX 2 (benchmarks/README.md,
# llm_gpu_gguf section, session 28). attn: Qwen3.5-2B decode with the next chunk's K and V (exp)
# or K alone (expk) loaded while a chunk is scored (qwen35_gpu section). batch: the batch-1 and
# batch-32 steps' kernels (issue 49's batch-32 target: which of cuBLAS's GEMMs, the attention and
# the small launches holds the 3.0x). OUT (optional): a folder
# for the logs. Remove this file once its parts have run.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
T=plugins/rlx_backend_cuda/tests
D=$PWD/.device
PYTEST="python3 -m pytest -q -o addopts= -p no:cacheprovider"
tree() { echo "$1=PYTHONPATH=$D/$1/plugins/rlx_backend_cuda"; }
for part in "$@"; do
  case $part in
  prep)
    for t in base:81e122b q8:44bfc5d exp:exp/attn-pipeline expk:exp/attn-pipeline-k; do
      rm -rf "$D/${t%%:*}" && mkdir -p "$D/${t%%:*}"
      git archive "${t#*:}" plugins/rlx_backend_cuda | tar -x -C "$D/${t%%:*}"
    done ;;
  tests)
    nvidia-smi --query-gpu=name --format=csv,noheader
    echo "== cuda tests: int8 activations, GEMV norms, early loads, tensor-core attention"
    timeout 150 $PYTEST $T/test_int8_gemv.py $T/test_gemv_fusion.py $T/test_early_loads.py -k "not emulated" \
      2>&1 | tail -6
    timeout 60 $PYTEST $T/test_cuda.py -k "attention_tc and not emulated" 2>&1 | tail -3
    timeout 90 $PYTEST $T/test_gemv_tc.py $T/test_matmul_strategy.py -k "not emulated" 2>&1 | tail -3 ;;
  int8)
    echo "== Llama-1B q4_k decode, int8 activations"
    timeout 330 python3 benchmarks/gpu_ab.py --rounds 1 --timeout 80 --config "$(tree base)" \
      --config "$(tree q8)" --config head= \
      --config "noqx2=RLX_BENCH_SET=rlx_backend_cuda.ops.QX_ROUND_MAX=0" \
      -- python3 benchmarks/llm_gpu.py --rlx-only --engine runtime --check-layers 0 --prompt 512 --new 64 \
      --packed q4_k,q4_k+int8 2>&1 | tee "$OUT/ab_int8.log" | tail -12 ;;
  attn)
    echo "== Qwen3.5-2B decode, the attention's prefetch"
    timeout 250 python3 benchmarks/gpu_ab.py --rounds 2 --timeout 70 --config base= --config "$(tree exp)" \
      --config "$(tree expk)" -- python3 benchmarks/qwen35_gpu.py --sides rlx --prefill= --new 64 --reps 3 \
      2>&1 | tee "$OUT/ab_attn.log" | tail -10 ;;
  gemvtc)
    echo "== Llama-1B bf16 decode at batch 4-64: cuBLAS (blas) or the tensor-core GEMV (tc)"
    timeout 330 python3 benchmarks/gpu_ab.py --rounds 1 --timeout 150 --config blas= --config "tc=RLX_CUDA_GEMV_TC=1" \
      -- python3 benchmarks/llm_gpu.py --batch 4 8 32 64 --sides rlx --new 32 --reps 1 \
      2>&1 | tee "$OUT/ab_gemvtc.log" | tail -12 ;;
  batch)
    echo "== Llama-1B bf16 decode at batch 1 and 32, kernel by kernel"
    timeout 240 python3 benchmarks/llm_gpu.py --batch 1 32 --sides rlx --new 32 --reps 1 --decode-kernels \
      2>&1 | tee "$OUT/batch_kernels.log" | tail -40 ;;
  *) echo "gpu_queue.sh: unknown part $part (prep, tests, int8, attn, gemvtc, batch)"; exit 2 ;;
  esac
done
