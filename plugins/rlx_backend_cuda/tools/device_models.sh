#!/usr/bin/env bash
# Second half of a two-call device session: the SmolLM2 GGUF travels in two halves
# (.dev1 in the first call, .dev2 in this one; the package is too big for one carry).
# Runs the GPU model checks for the CUDA and OpenCL backends and the OpenCL benchmark.
set -u
export PYTHONUNBUFFERED=1 RLX_SMOLLM2_GGUF=/tmp/smol.gguf RLX_OPENCL_DEVICE=nvidia
cat /tmp/smol.partaa .dev2/smol.partab > /tmp/smol.gguf
[ "$(md5sum /tmp/smol.gguf | cut -c1-32)" = "$(cat .dev2/smol.md5)" ] || { echo "GGUF halves do not match"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/rlx_blocks_llama \
  -e plugins/rlx_backend_cuda -e plugins/rlx_backend_opencl > /tmp/pip.log 2>&1 || tail -5 /tmp/pip.log
bash plugins/rlx_backend_opencl/scripts/register_nvidia_icd.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "=== cuda: SmolLM2 fp32 greedy vs numpy, f16/bf16 top-1"
timeout 300 python3 -m pytest -q -s -p no:cacheprovider plugins/rlx_backend_cuda/tests/test_smollm2_gpu.py 2>&1 | grep -E "agreement|passed|failed|Error|error" | tail -8
echo "=== opencl (NVIDIA): models"
timeout 200 python3 -m pytest -q -p no:cacheprovider plugins/rlx_backend_opencl/tests/test_models_opencl.py 2>&1 | tail -3
echo "=== opencl benchmark"
timeout 200 python3 benchmarks/opencl.py --reps 20 2>&1 | tail -14
