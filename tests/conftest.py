"""The core suite's setup: its OpenCL programs are built unoptimized.

The parity suite (test_ops.py) builds ~1,200 small OpenCL programs, and on PoCL (the CPU
device CI has) LLVM's optimizer is most of each build's time: test_ops' 1,248 OpenCL cases
took 181 s from a cold PoCL cache with the default build, 92 s with `-cl-opt-disable`. These
tests check what the kernels compute, not how fast, so they build without optimization; the
OpenCL plugin's own tests (plugins/rlx_backend_opencl/tests) keep the default build, and a
value of RLX_OPENCL_BUILD_OPTIONS set by the caller wins."""
import os

import pytest

BUILD_OPTIONS = "RLX_OPENCL_BUILD_OPTIONS"


@pytest.fixture(autouse=True)
def opencl_builds_unoptimized(monkeypatch):
    if BUILD_OPTIONS not in os.environ:
        monkeypatch.setenv(BUILD_OPTIONS, "-cl-opt-disable")
