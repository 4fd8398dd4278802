#!/usr/bin/env bash
# The GPU work still queued (sessions 28-29), each part under a time limit so that one device
# call (10 minutes at most) returns what ran. Here first, to unpack the trees the A/B compares
# (the device gets the working tree, not the repository's history):
#   bash benchmarks/gpu_queue.sh prep
# then on the device, after the install, with carry [".device"]:
#   bash benchmarks/gpu_queue.sh tests attn     # tensor-core attention tests; the prefetch A/B (~310 s)
#   bash benchmarks/gpu_queue.sh batch          # batch 16-64: reductions and attention split finer (~260 s)
#   bash benchmarks/gpu_queue.sh gemvtc         # the tensor-core GEMV's parallel tail against cuBLAS (~260 s)
# attn: Qwen3.5-2B decode with the next chunk's K and V (exp) or K alone (expk) loaded while a
# chunk is scored (benchmarks/README.md, qwen35_gpu section). batch: Llama-1B batch 16-64 as
# built, with ops.ROW_BLOCKS_PER_SM 8 (the logit sum's and argmax's rows in 32 chunks at batch
# 32, not 8), and with ops.ATTN_BLOCKS_PER_SM 8 (the split attention's keys in 5 parts at batch
# 32, not 2: each block walks 4 tiles of 32 keys, not 9, one after another) (llm_gpu section,
# session 29). OUT (optional): a folder for the logs. Remove this file once
# its parts have run.
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
    for t in exp:exp/attn-pipeline expk:exp/attn-pipeline-k; do
      rm -rf "$D/${t%%:*}" && mkdir -p "$D/${t%%:*}"
      git archive "${t#*:}" plugins/rlx_backend_cuda | tar -x -C "$D/${t%%:*}"
    done ;;
  tests)
    nvidia-smi --query-gpu=name --format=csv,noheader
    echo "== cuda tests: tensor-core attention"
    timeout 60 $PYTEST $T/test_cuda.py -k "attention_tc and not emulated" 2>&1 | tail -3
    echo "== cuda tests: split-K attention, its tiles' loads in turn and a tile ahead; the tensor-core GEMV"
    timeout 120 $PYTEST $T/test_cuda.py -k "decode_attention_kernels and split" 2>&1 | tail -3
    timeout 90 $PYTEST $T/test_gemv_tc.py -k "not emulated" 2>&1 | tail -2 ;;
  attn)
    echo "== Qwen3.5-2B decode, the attention's prefetch"
    timeout 250 python3 benchmarks/gpu_ab.py --rounds 2 --timeout 70 --config base= --config "$(tree exp)" \
      --config "$(tree expk)" -- python3 benchmarks/qwen35_gpu.py --sides rlx --prefill= --new 64 --reps 3 \
      2>&1 | tee "$OUT/ab_attn.log" | tail -10 ;;
  batch)
    echo "== Llama-1B bf16 decode at batch 16-64: reductions and attention in more blocks"
    timeout 440 python3 benchmarks/gpu_ab.py --rounds 1 --timeout 80 --config base= \
      --config "rows8=RLX_BENCH_SET=rlx_backend_cuda.ops.ROW_BLOCKS_PER_SM=8" \
      --config "attn8=RLX_BENCH_SET=rlx_backend_cuda.ops.ATTN_BLOCKS_PER_SM=8" \
      --config "pipe=RLX_BENCH_SET=rlx_backend_cuda.sources.ATTN_SPLIT_PIPE=1" \
      --config "pipe+attn8=RLX_BENCH_SET=rlx_backend_cuda.sources.ATTN_SPLIT_PIPE=1,rlx_backend_cuda.ops.ATTN_BLOCKS_PER_SM=8" \
      -- python3 benchmarks/llm_gpu.py --batch 16 32 64 --sides rlx --new 16 --reps 1 \
      2>&1 | tee "$OUT/ab_batch.log" | tail -10 ;;
  gemvtc)
    echo "== Llama-1B bf16 decode at batch 4-64: cuBLAS (blas) or the tensor-core GEMV (tc)"
    timeout 260 python3 benchmarks/gpu_ab.py --rounds 1 --timeout 120 --config blas= \
      --config "tc=RLX_CUDA_GEMV_TC=1" \
      -- python3 benchmarks/llm_gpu.py --batch 4 32 64 --sides rlx --new 16 --reps 1 \
      2>&1 | tee "$OUT/ab_gemvtc.log" | tail -10 ;;
  *) echo "gpu_queue.sh: unknown part $part (prep, tests, attn, batch, gemvtc)"; exit 2 ;;
  esac
done
