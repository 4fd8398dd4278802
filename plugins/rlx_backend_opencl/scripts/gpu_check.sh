#!/usr/bin/env bash
# The GPU checks of the OpenCL backend on an NVIDIA machine, from the repository root:
# register the NVIDIA ICD, list the OpenCL devices, run the plugin tests and the shared
# parity suite on the NVIDIA device (also with f16 storage forced on), then the benchmark.
# Needs pyopencl (and rlx-core + this plugin installed) in the python it runs with: $PYTHON.
set -uo pipefail
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-python3}
bash plugins/rlx_backend_opencl/scripts/register_nvidia_icd.sh || exit 1
"$PY" - <<'EOF'
import pyopencl as cl
for p in cl.get_platforms():
    for d in p.get_devices():
        ext = d.extensions.split()
        print(f"{p.name.strip()} | {d.name.strip()} | {d.version.strip()} | fp16={'cl_khr_fp16' in ext} "
              f"fp64={'cl_khr_fp64' in ext}")
EOF
export RLX_OPENCL_DEVICE=${RLX_OPENCL_DEVICE:-nvidia}
rc=0
"$PY" -m pytest plugins/rlx_backend_opencl/tests -q -p no:cacheprovider || rc=1
"$PY" -m pytest tests -q -p no:cacheprovider -k opencl || rc=1
RLX_OPENCL_FP16=1 "$PY" -m pytest tests/test_ops.py -q -p no:cacheprovider -k "opencl and f16" || rc=1
"$PY" benchmarks/opencl.py --reps 20 || rc=1
exit $rc
