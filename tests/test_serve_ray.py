"""`rlx serve` as a Ray Serve application (rlx_core.serve.ray_app, issue 19): a local Ray
instance on loopback with 4 logical CPUs, the app builder's deployment with 2 replicas of a
tiny random LLaMA on the numpy backend; the official `openai` client gets the text the
model generates in this process (what one `rlx serve` gives: tests/test_serve*.py), from
concurrent requests, and /metrics sums both replicas' counters. The test shuts Serve and
Ray down. Skipped without ray[serve]."""
from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

from rlx_core.ir.errors import ModelError

for mod in ("openai", "starlette", "uvicorn"):
    pytest.importorskip(mod)

from tiny_models import tiny_llama_folder  # noqa: E402

TIMEOUT = 60
PROMPTS = ["w3 w5 w7", "w9 w1", "w20 w21 w22 w23", "w40"]


def sample(text: str, name: str, **labels) -> float | None:
    """The value of the Prometheus sample `name` with exactly `labels` in `text`."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def test_builder_args_are_checked():
    from rlx_core.serve.ray_app import options

    assert options({"model": "m", "replicas": "2", "tp": 1}) == {
        "models": ["m"], "backend": None, "profile": None, "replicas": 2, "tp": 1, "max_batch": 8,
        "max_tokens": None, "scheduler_options": {}}
    assert options({"model": "m", "prefix_cache_mb": "64", "prefill_chunk": 128, "stall_budget": "0.25",
                    "idle_release_s": 60})["scheduler_options"] == {
        "prefix_cache_mb": 64.0, "prefill_chunk": 128, "stall_budget": 0.25, "idle_release_s": 60.0}
    for value, mixed in (("false", False), (False, False), ("True", True)):
        assert options({"model": "m", "mixed": value})["scheduler_options"] == {"mixed": mixed}
    for bad, what in (({"model": "m", "replica": 2}, r"unknown arg\(s\) \['replica'\]"),
                      ({"model": "m", "replicas": "0"}, r"replicas='0'; expected a whole number >= 1"),
                      ({"model": "m", "tp": "two"}, r"tp='two'"),
                      ({"model": ""}, r"model=''"), ({}, r"model=None"),
                      ({"model": "m", "backend": 3}, r"backend=3"),
                      ({"model": "m", "prefix_cache_mb": "lots"}, r"prefix_cache_mb='lots'; expected a number"),
                      ({"model": "m", "prefix_cache_mb": -1}, r"prefix_cache_mb=-1"),
                      ({"model": "m", "prefill_chunk": 0}, r"prefill_chunk=0"),
                      ({"model": "m", "stall_budget": "-1"}, r"stall_budget='-1'; expected a number >= 0"),
                      ({"model": "m", "idle_release_s": "soon"}, r"idle_release_s='soon'; expected a number >= 0"),
                      ({"model": "m", "mixed": "no"}, r"mixed='no'; expected true or false")):
        with pytest.raises(ModelError, match=what):
            options(bad)


def test_two_replicas_answer_like_one_server(tmp_path):
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'rlx-core[cluster]')")
    import openai
    import ray
    from ray import serve

    import rlx_core
    from rlx_core.serve.ray_app import DEPLOYMENT, app_builder

    folder = tiny_llama_folder(tmp_path / "tiny")
    ref = rlx_core.load(folder, backend="numpy", progress=False)
    want = [ref.generate(p, max_new_tokens=5 + i) for i, p in enumerate(PROMPTS)]

    with socket.socket() as s:                    # a free loopback port for Serve's proxy
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app_builder({"model": folder, "backend": "numpy", "replicas": 2}), name="rlx",
                  route_prefix="/")
        status = serve.status().applications["rlx"]
        assert status.deployments[DEPLOYMENT].replica_states == {"RUNNING": 2}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=TIMEOUT)
        assert [m.id for m in client.models.list()] == [folder]
        got: dict = {}

        def ask(i):
            got[i] = client.completions.create(model=folder, prompt=PROMPTS[i], max_tokens=5 + i,
                                               temperature=0).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert got == dict(enumerate(want))
        # /metrics on any replica sums both replicas' (each pushes its own to "rlx-metrics")
        deadline, text = time.monotonic() + TIMEOUT, ""
        while time.monotonic() < deadline:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT).read().decode()
            if "rlx_replicas 2.0" in text and sample(text, "rlx_requests_total", endpoint="/v1/completions",
                                                     status="200") == len(PROMPTS):
                break
            time.sleep(0.5)
        assert "rlx_replicas 2.0" in text, text
        assert sample(text, "rlx_requests_total", endpoint="/v1/completions", status="200") == len(PROMPTS)
        new_tokens = sum(5 + i for i in range(len(PROMPTS)))
        assert sample(text, "rlx_generation_tokens_total", model=folder) == new_tokens
        assert sample(text, "rlx_batch_size", model=folder) == 16           # 2 replicas x max_batch 8
    finally:
        serve.shutdown()
        ray.shutdown()
