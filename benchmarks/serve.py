"""`rlx serve` under load: N concurrent streaming clients (the official openai package),
each asking a different greedy chat completion of --new tokens; aggregate generated
tokens/s and time to first token (median, p90) per N. The server is started here as a
subprocess (`rlx serve MODEL --backend B --max-batch max(N)`) on a free loopback port and
stopped at the end.

    python benchmarks/serve.py [--model smollm2] [--backend numba|cuda] [--clients 1 8 32]
                               [--new 32] [--json out.json]

On a CPU keep it small (--clients 1 4 --new 16); on the GPU: --backend cuda.

--soak: mixed abusive and normal traffic for --soak-seconds (default 600) from
--soak-workers threads against the server (its own process, 127.0.0.1 only): bodies over
the limit (declared and sent), a huge Content-Length with a tiny body, bodies cut short,
JSON nested 100,000 deep, multi-MB prompts, clients that leave mid-request (streaming or
not) after asking for thousands of tokens, fields the server refuses; between them normal
greedy requests (completion, chat, streamed chat) whose answers must never change. Reports
the server's resident memory (RSS) after loading, after warm-up, at its peak and at the end
(after the load went away), every answer's status, any changed greedy answer, and how long
GET /v1/models (polled twice a second) waited meanwhile.
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


def start_server(model: str, backend: str | None, max_batch: int, port: int, wait: float,
                 extra: tuple = ()) -> subprocess.Popen:
    rlx = os.path.join(os.path.dirname(sys.executable), "rlx")
    cmd = [rlx, "serve", model, "--host", "127.0.0.1", "--port", str(port), "--max-batch", str(max_batch),
           "--log-level", "warning", *extra]
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


# ============================================================================ --soak
NORMAL = [("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a color."}],
                                    "max_tokens": 8, "temperature": 0}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to five."}],
                                    "max_tokens": 8, "temperature": 0, "stream": True})]


def rss_mb(pid: int) -> float:
    """The resident memory of process `pid` in MB (Linux: /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise SystemExit(f"no VmRSS for pid {pid}")


class Peak(threading.Thread):
    """Samples a process's RSS every `every` seconds until stop(); .peak in MB."""

    def __init__(self, pid: int, every: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.every, self.peak, self._halt = pid, every, 0.0, threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.peak = max(self.peak, rss_mb(self.pid))
            except (OSError, SystemExit):
                return
            self._halt.wait(self.every)

    def stop(self) -> float:
        self._halt.set()
        self.join(5)
        return self.peak


def http(port: int, head: bytes, body: bytes = b"", *, leave_after: float | None = None,
         timeout: float = 300) -> tuple:
    """One raw HTTP/1.1 exchange on 127.0.0.1: (status or what happened, body bytes). With
    `leave_after`, the client closes its socket that many seconds after sending (a client
    that leaves): ("left", b"")."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(head)
            for i in range(0, len(body), 1 << 20):
                s.sendall(body[i:i + (1 << 20)])
        except (BrokenPipeError, ConnectionResetError):
            pass                                   # the server answered early and closed
        if leave_after is not None:
            time.sleep(leave_after)
            return "left", b""
        data = b""
        try:
            while True:
                part = s.recv(1 << 16)
                if not part:
                    break
                data += part
        except ConnectionResetError:
            if not data:
                return "reset", b""
    head_, _, rest = data.partition(b"\r\n\r\n")
    try:
        return int(head_.split(b" ", 2)[1]), rest
    except (IndexError, ValueError):
        return "no answer", b""


def request_head(path: str, length: int | None, extra: str = "") -> bytes:
    cl = f"Content-Length: {length}\r\n" if length is not None else ""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{cl}{extra}"
            "Connection: close\r\n\r\n").encode()


def post(port: int, path: str, body: dict, **kw) -> tuple:
    data = json.dumps(body).encode("utf-8", "surrogatepass")
    return http(port, request_head(path, len(data)), data, **kw)


def answer_text(status, body: bytes) -> str | None:
    """A normal request's text (a streamed one's chunks joined; HTTP/1.1 chunked framing
    undone), or None when it did not succeed."""
    if status != 200:
        return None
    text = body.decode("utf-8", "replace")
    if "data: " in text:
        parts = []
        for line in text.split("\n"):
            if line.startswith("data: {"):
                ch = json.loads(line[6:])
                for c in ch.get("choices", []):
                    parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
        return "".join(parts)
    if not text.lstrip().startswith("{"):          # chunked transfer: size lines around the JSON
        text = text[text.index("{"):text.rindex("}") + 1]
    c = json.loads(text)["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


def abuses(model: str, limit: int) -> dict:
    """name -> (fn(port) -> status or what happened, the statuses that are right)."""
    big_prompt = {"model": model, "prompt": "hello " * ((limit - 200) // 6), "max_tokens": 4}

    def oversize_sent(port):
        data = b'{"model": "' + b"x" * (limit + (1 << 20)) + b'"}'
        return http(port, request_head("/v1/completions", len(data)), data)[0]

    def oversize_chunked(port):
        piece = b"x" * (1 << 20)
        body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(limit // len(piece) + 2))
        return http(port, request_head("/v1/completions", None, "Transfer-Encoding: chunked\r\n"),
                    body + b"0\r\n\r\n")[0]

    def leave(port, stream):
        body = {"model": model, "prompt": "Write a very long story.", "max_tokens": 3000, "temperature": 0.8,
                "seed": 1, "stream": stream}
        return post(port, "/v1/completions", body, leave_after=1.0)[0]

    return {
        "declared 200 MB": (lambda p: http(p, request_head("/v1/completions", 200 << 20))[0], {413}),
        "over the limit, sent": (oversize_sent, {413, "reset"}),
        "over the limit, chunked": (oversize_chunked, {413, "reset"}),
        "huge length, tiny body": (lambda p: http(p, request_head("/v1/chat/completions", 10**15), b"{}")[0],
                                   {413}),
        "body cut short, client gone": (lambda p: http(p, request_head("/v1/completions", 5000),
                                                        b'{"model": "', leave_after=0.2)[0], {"left"}),
        "JSON 100,000 deep": (lambda p: http(p, request_head("/v1/completions", 100000), b"[" * 100000)[0],
                              {400}),
        "multi-MB prompt": (lambda p: post(p, "/v1/completions", big_prompt)[0], {400}),
        "left mid-decode (3000 tokens)": (lambda p: leave(p, False), {"left"}),
        "left mid-stream (3000 tokens)": (lambda p: leave(p, True), {"left"}),
        "lone surrogate": (lambda p: post(p, "/v1/chat/completions", {"model": model, "messages": [
            {"role": "user", "content": "hi \ud800"}]})[0], {400}),
        "seed -1, min_p, unknown key": (lambda p: max(post(p, "/v1/completions", dict(
            {"model": model, "prompt": "hi"}, **kw))[0] for kw in ({"seed": -1}, {"min_p": 0.1}, {"x": 1})),
                                        {400}),
    }


def soak(a) -> None:
    port, limit = free_port(), int(a.max_body_mb * 2**20)
    proc = start_server(a.model, a.backend, a.soak_workers, port, a.wait,
                        ["--max-body-mb", str(a.max_body_mb)])
    try:
        loaded = rss_mb(proc.pid)
        want = {}
        for path, body in NORMAL:                       # warm-up: compile, and the answers to keep
            for _ in range(2):
                got = answer_text(*post(port, path, dict(body, model=a.model)))
                if got is None:
                    raise SystemExit(f"warm-up {path} failed")
                want.setdefault(json.dumps(body), got)
        warm = rss_mb(proc.pid)
        peak = Peak(proc.pid)
        peak.start()
        counts: dict = {}
        wrong: list = []
        lock = threading.Lock()
        acts = list(abuses(a.model, limit).items())
        deadline = time.monotonic() + a.soak_seconds

        def note(name, status, ok):
            with lock:
                counts.setdefault(name, {}).setdefault(str(status), 0)
                counts[name][str(status)] += 1
                if not ok:
                    wrong.append(f"{name}: {status}")

        def worker(k):
            i = k
            while time.monotonic() < deadline:
                path, body = NORMAL[i % len(NORMAL)]      # a normal request between abuses
                st, out = post(port, path, dict(body, model=a.model))
                got = answer_text(st, out)
                note(f"normal {path}{' (stream)' if body.get('stream') else ''}", st,
                     got == want[json.dumps(body)])
                name, (fn, right) = acts[i % len(acts)]
                try:
                    st = fn(port)
                except OSError as e:
                    st = type(e).__name__
                note(name, st, st in right)
                i += a.soak_workers

        waits: list = []

        def models_poll():                              # GET /v1/models must not wait on the rest
            while time.monotonic() < deadline:
                t = time.perf_counter()
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=120).read()
                waits.append(time.perf_counter() - t)
                time.sleep(0.5)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(a.soak_workers)]
        threads.append(threading.Thread(target=models_poll))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ran = time.monotonic() - t0
        after = [answer_text(*post(port, path, dict(body, model=a.model))) == want[json.dumps(body)]
                 for path, body in NORMAL]
        time.sleep(a.settle)                              # then the load has gone away
        end = rss_mb(proc.pid)
        top = max(peak.stop(), end)
        alive = proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"rlx serve {a.model} (backend {a.backend or 'default'}, --max-body-mb {a.max_body_mb:g}) soak: "
          f"{ran:.0f} s, {a.soak_workers} clients; {hardware(a.backend or '')}; "
          f"Python {platform.python_version()}")
    print(f"RSS MB: loaded {loaded:.0f}, after warm-up {warm:.0f}, peak {top:.0f}, end {end:.0f} "
          f"({end / warm:.2f}x warm-up, {a.settle:g} s after the load)")
    if waits:
        print(f"GET /v1/models during the soak: {len(waits)} answers, median "
              f"{statistics.median(waits) * 1e3:.0f} ms, longest {max(waits) * 1e3:.0f} ms")
    for name, by in counts.items():
        print(f"  {name:<40} " + ", ".join(f"{k}: {v}" for k, v in sorted(by.items())))
    changed = [w for w in wrong if w.startswith("normal")]
    print(f"normal greedy answers changed: {len(changed)}; after the soak all equal: {all(after)}; "
          f"unexpected answers: {len(wrong) - len(changed)}; server alive: {alive}")
    for w in wrong[:20]:
        print("  ", w)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "backend": a.backend, "seconds": ran, "rss_mb": {
                "loaded": loaded, "warm": warm, "peak": top, "end": end}, "models_wait_s": waits,
                "counts": counts, "wrong": wrong,
                "after_equal": after, "alive": alive}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default=None, help="default: rlx's default backend")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new", type=int, default=32, help="tokens per request")
    ap.add_argument("--wait", type=float, default=300, help="seconds to wait for the server to load")
    ap.add_argument("--json", default=None)
    ap.add_argument("--soak", action="store_true", help="mixed abusive and normal traffic (see above)")
    ap.add_argument("--soak-seconds", type=float, default=600)
    ap.add_argument("--soak-workers", type=int, default=3, help="concurrent soak clients")
    ap.add_argument("--max-body-mb", type=float, default=8, help="the server's --max-body-mb")
    ap.add_argument("--settle", type=float, default=10, help="seconds after the soak before the end RSS")
    a = ap.parse_args()
    if a.soak:
        soak(a)
        return
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
