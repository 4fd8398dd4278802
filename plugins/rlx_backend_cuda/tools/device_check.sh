#!/usr/bin/env bash
# One device session: install, run the CUDA tests, the shared op suite on cuda, the benchmark.
# Logs go to $OUT. Knobs: TESTS=0/1, OPS=0/1, BENCH=0/1, BENCH_ARGS, *_TIMEOUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/rlx_out}; mkdir -p "$OUT"
EXTRA=""; [ -d plugins/rlx_blocks_llama ] && EXTRA="-e plugins/rlx_blocks_llama"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/rlx_backend_cuda $EXTRA > "$OUT/pip.log" 2>&1 \
  || { echo "pip install failed"; tail -20 "$OUT/pip.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c "from rlx_core.pipeline import available_backends as a; print([(b.name, ok, why) for b, ok, why in a()])"
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-220}" python3 -m pytest plugins/rlx_backend_cuda/tests -q -rf --tb=short \
    -p no:cacheprovider -n "${NPROC:-6}" > "$OUT/test_cuda.log" 2>&1
  echo "== test_cuda rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/test_cuda.log" | head -40; tail -3 "$OUT/test_cuda.log"
fi
if [ "${OPS:-1}" = 1 ] && [ -f tests/test_ops.py ]; then
  timeout "${OPS_TIMEOUT:-120}" python3 -m pytest tests/test_ops.py -k cuda -q -rf --tb=short \
    -p no:cacheprovider -n "${NPROC:-6}" > "$OUT/test_ops.log" 2>&1
  echo "== test_ops rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/test_ops.log" | head -30; tail -3 "$OUT/test_ops.log"
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-270}" python3 benchmarks/llm_gpu.py --json "$OUT/bench.json" ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1
  echo "== bench rc=$?"; tail -40 "$OUT/bench.log"
fi
