"""`rlx serve` under load: N concurrent streaming clients (the official openai package),
each asking a different greedy chat completion of --new tokens; aggregate generated
tokens/s and time to first token (median, p90) per N. The server is started here as a
subprocess (`rlx serve MODEL --backend B --max-batch max(N)`) on a free loopback port and
stopped at the end.

    python benchmarks/serve.py [--model smollm2] [--backend numba|cuda] [--clients 1 8 32]
                               [--new 32] [--json out.json]

On a CPU keep it small (--clients 1 4 --new 16); on the GPU: --backend cuda.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def hardware(backend: str) -> str:
    from hardware import cpu_name

    cpu = f"{cpu_name()} ({os.cpu_count()} logical cores)"
    if backend == "cuda":
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
            return f"{gpu}; host {cpu}"
        except (OSError, IndexError, subprocess.SubprocessError):
            return f"GPU (nvidia-smi unavailable); host {cpu}"
    return cpu


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, backend: str | None, max_batch: int, port: int, wait: float) -> subprocess.Popen:
    rlx = os.path.join(os.path.dirname(sys.executable), "rlx")
    cmd = [rlx, "serve", model, "--port", str(port), "--max-batch", str(max_batch), "--log-level", "warning"]
    if backend:
        cmd += ["--backend", backend]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"rlx serve exited: {proc.stderr.read()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return proc
        except OSError:
            time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"rlx serve did not answer within {wait:.0f} s")


def one_client(client, model: str, i: int, new: int, out: list) -> None:
    t0 = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Tell me a story about the number {i}."}],
        max_tokens=new, temperature=0, stream=True, stream_options={"include_usage": True})
    for ch in stream:
        if first is None and ch.choices and ch.choices[0].delta.content:
            first = time.perf_counter() - t0
        if ch.usage:
            tokens = ch.usage.completion_tokens
    out.append({"ttft_s": first, "tokens": tokens, "total_s": time.perf_counter() - t0})


def round_of(client, model: str, n: int, new: int) -> dict:
    out: list = []
    threads = [threading.Thread(target=one_client, args=(client, model, i, new, out)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if len(out) != n:
        raise SystemExit(f"{n - len(out)} of {n} clients failed")
    ttft = sorted(r["ttft_s"] for r in out if r["ttft_s"] is not None)
    tokens = sum(r["tokens"] for r in out)
    return {"clients": n, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_median_s": statistics.median(ttft) if ttft else None,
            "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default=None, help="default: rlx's default backend")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new", type=int, default=32, help="tokens per request")
    ap.add_argument("--wait", type=float, default=300, help="seconds to wait for the server to load")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import openai

    port = free_port()
    proc = start_server(a.model, a.backend, max(a.clients), port, a.wait)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=600)
        round_of(client, a.model, 1, 4)                                    # warm up: compile
        round_of(client, a.model, max(a.clients), 4)                       # and the largest bucket
        rows = [round_of(client, a.model, n, a.new) for n in a.clients]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    hw = hardware(a.backend or "")
    print(f"rlx serve {a.model} (backend {a.backend or 'default'}), {a.new} new tokens per request, "
          f"greedy, streaming; {hw}; Python {platform.python_version()}")
    print(f"{'clients':>8} {'tokens/s':>10} {'TTFT median':>12} {'TTFT p90':>10} {'wall s':>8}")
    base = rows[0]["tokens_per_s"]
    for r in rows:
        print(f"{r['clients']:>8} {r['tokens_per_s']:>10.1f} {r['ttft_median_s'] * 1e3:>10.0f}ms "
              f"{r['ttft_p90_s'] * 1e3:>8.0f}ms {r['wall_s']:>8.2f}   ({r['tokens_per_s'] / base:.2f}x of "
              f"{rows[0]['clients']} client{'s' if rows[0]['clients'] > 1 else ''})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "backend": a.backend, "hardware": hw, "new": a.new, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
