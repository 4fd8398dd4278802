"""The kernel choices the cuda backend makes by the GPU it finds (wgmma only on sm_90, mma.sync
from sm_80, programmatic dependent launch from sm_90 with a driver that has it) and by its
switches, as `rlx plugins` lists them: a fallback names its reason and what runs instead. The
GPU is a stand-in (device.probe replaced), so this runs without one."""
from __future__ import annotations

import json
import types

import pytest
from click.testing import CliRunner

from rlx_backend_cuda import _BACKEND, device, set_config
from rlx_core.cli import main

INT8_GEMV = 'int8-activation decode GEMV (dp4a; [precision] activations = "int8")'
ATTN_ROPE = "RoPE inside the cluster decode attention"
ATTN_EPILOGUE = "output gate inside the cluster decode attention"
GEMV_TC = "tensor-core GEMV for 3-64 decode rows (mma.sync)"
# off by default: measured no faster (the first two), slower (the GEMV)
OPT_IN = {ATTN_ROPE: "attn_rope", ATTN_EPILOGUE: "attn_epilogue", GEMV_TC: "gemv_tc"}


@pytest.fixture
def gpu(monkeypatch):
    """gpu(cc, hip=False, launch_ex=True): the backend sees that GPU (and a driver with or
    without cuLaunchKernelEx)."""
    def use(cc, hip=False, launch_ex=True):
        info = {"name": "stand-in", "cc": cc, "hip": hip, "sms": 8, "total_mem": 1 << 30}
        monkeypatch.setattr(device, "probe", lambda: (True, "", info))
        drv = types.SimpleNamespace(**({"cuLaunchKernelEx": object()} if launch_ex else {}))
        monkeypatch.setattr(device, "driver", lambda: drv)
        return {p["path"]: p for p in _BACKEND.kernel_paths()}
    return use


def test_hopper_takes_every_path(gpu):
    """Every path but the opt-in ones, off by default; those too once switched on."""
    from rlx_backend_cuda.values import CONFIG

    paths = gpu((9, 0))
    assert all(p["on"] and p["reason"] == "" for n, p in paths.items() if n not in OPT_IN), paths
    for name, switch in OPT_IN.items():
        assert not paths[name]["on"] and f"RLX_CUDA_{switch.upper()}=1" in paths[name]["reason"], paths[name]
    was = {s: CONFIG[s] for s in OPT_IN.values()}
    set_config(**{s: True for s in OPT_IN.values()})
    try:
        assert all(p["on"] for p in gpu((9, 0)).values())
        assert not gpu((8, 9))[ATTN_ROPE]["on"] and "sm_89" in gpu((8, 9))[ATTN_ROPE]["reason"]
    finally:
        set_config(**was)
    assert {"wgmma + TMA attention", "tensor-core attention (mma.sync)", "programmatic dependent launch"} <= set(paths)


@pytest.mark.parametrize("cc", [(8, 0), (8, 9), (10, 0), (12, 0)])
def test_wgmma_only_on_sm90(gpu, cc):
    paths = gpu(cc)
    wg = paths["wgmma + TMA attention"]
    sm = f"sm_{cc[0]}{cc[1]}"
    assert not wg["on"] and "sm_90" in wg["reason"] and sm in wg["reason"], wg
    assert "mma.sync attention runs instead" in wg["reason"]
    assert paths["tensor-core attention (mma.sync)"]["on"]
    assert paths["programmatic dependent launch"]["on"] is (cc >= (9, 0))
    assert device.wgmma_missing(cc, False) and not device.mma_missing(cc, False)


@pytest.mark.parametrize("cc", [(8, 0), (8, 9), (9, 0), (10, 0)])
def test_cluster_decode_attention_from_sm90(gpu, cc):
    """Thread-block clusters (sm_90 and later, sm_100 too): the decode attention between the
    short kernel's 512 positions and 2048; before sm_90 the split attention, the GPU named."""
    p = gpu(cc)["cluster decode attention (KV caches of 513-2048 positions, few batch rows)"]
    assert p["on"] is (cc >= (9, 0)), p
    if not p["on"]:
        assert f"sm_{cc[0]}{cc[1]}" in p["reason"] and "split attention runs instead" in p["reason"], p
    assert "ROCm" in device.cluster_missing((9, 0), True)


def test_before_sm80_the_cuda_core_kernels_run(gpu):
    paths = gpu((7, 5))
    for name in ("tensor-core attention (mma.sync)", "wgmma + TMA attention",
                 "tensor-core Gated DeltaNet prefill and MoE grouped GEMM (mma.sync)", GEMV_TC):
        assert not paths[name]["on"] and "sm_75" in paths[name]["reason"], paths[name]
    assert "CUDA-core split attention runs instead" in paths["wgmma + TMA attention"]["reason"]


def test_rocm_and_a_driver_without_launch_ex(gpu):
    paths = gpu((9, 4), hip=True)
    assert not any(p["on"] for n, p in paths.items() if "mma" in n or "dependent" in n), paths
    assert "ROCm" in paths["wgmma + TMA attention"]["reason"]
    i8 = paths[INT8_GEMV]
    assert not i8["on"] and "ROCm" in i8["reason"] and "a kernel rounds x" in i8["reason"], i8
    dep = gpu((9, 0), launch_ex=False)["programmatic dependent launch"]
    assert not dep["on"] and "cuLaunchKernelEx" in dep["reason"], dep


def test_switches_name_themselves(gpu):
    from rlx_backend_cuda.values import CONFIG

    was = {k: CONFIG[k] for k in ("wg_attention", "gemv_fusion", "decode_attention", "int8_gemv")}
    set_config(wg_attention=False, gemv_fusion=False, decode_attention=False, int8_gemv=False)
    try:
        paths = gpu((9, 0))
    finally:
        set_config(**was)
    for name, switch in (("wgmma + TMA attention", "wg_attention"),
                         ("residual norms inside the decode GEMVs", "gemv_fusion"),
                         ("cluster decode attention (KV caches of 513-2048 positions, few batch rows)",
                          "decode_attention"), (INT8_GEMV, "int8_gemv")):
        assert not paths[name]["on"] and f"set_config({switch}=False)" in paths[name]["reason"], paths[name]
    assert paths["tensor-core attention (mma.sync)"]["on"]


def test_rlx_plugins_lists_them(gpu):
    gpu((8, 0))
    r = CliRunner().invoke(main, ["plugins"])
    assert r.exit_code == 0, r.output
    assert "wgmma + TMA attention: off (it needs sm_90" in r.output and "this GPU is sm_80" in r.output
    assert "tensor-core attention (mma.sync): on" in r.output
    r = CliRunner().invoke(main, ["plugins", "--json"])
    cuda = next(b for b in json.loads(r.output)["backends"] if b["name"] == "cuda")
    assert cuda["available"] and any(p["path"] == "wgmma + TMA attention" and not p["on"]
                                     for p in cuda["kernel_paths"])
