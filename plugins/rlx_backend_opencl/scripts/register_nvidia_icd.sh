#!/usr/bin/env bash
# Register NVIDIA's OpenCL driver with the OpenCL ICD loader.
#
# Container images often ship the driver's OpenCL library (libnvidia-opencl.so.1, mounted
# with the rest of the driver) without the one-line ICD file that tells the loader about it.
# The registration is that line:
#
#     echo libnvidia-opencl.so.1 > /etc/OpenCL/vendors/nvidia.icd
#
# This script writes it (as root), or, when /etc is not writable, writes the file to a user
# directory and prints the OCL_ICD_VENDORS export that points the loader there.
# Usage: register_nvidia_icd.sh [vendors-dir]      (default /etc/OpenCL/vendors)
set -euo pipefail

lib=libnvidia-opencl.so.1
dir=${1:-/etc/OpenCL/vendors}

entry=$lib
if ! ldconfig -p 2>/dev/null | grep -q "$lib"; then
  # not on the loader path: look where drivers are usually mounted and write the full path
  found=""
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64 \
           /usr/lib/aarch64-linux-gnu /usr/lib /run/nvidia/driver/usr/lib/x86_64-linux-gnu; do
    if [ -e "$d/$lib" ]; then found="$d/$lib"; break; fi
  done
  if [ -z "$found" ]; then
    echo "register_nvidia_icd: $lib not found (is the NVIDIA driver mounted?)" >&2
    exit 1
  fi
  entry=$found
fi

if ! { mkdir -p "$dir" && echo "$entry" > "$dir/nvidia.icd"; } 2>/dev/null; then
  dir=${XDG_CONFIG_HOME:-$HOME/.config}/OpenCL/vendors
  mkdir -p "$dir"
  echo "$entry" > "$dir/nvidia.icd"
  echo "register_nvidia_icd: /etc not writable; wrote $dir/nvidia.icd" >&2
  echo "export OCL_ICD_VENDORS=$dir"
  exit 0
fi
echo "register_nvidia_icd: wrote $dir/nvidia.icd -> $entry" >&2
