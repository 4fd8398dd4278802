"""A/B of switches and tuning constants on one benchmark command: each configuration (a set of
environment variables: RLX_CUDA_* switches, RLX_BENCH_SET constants) runs the command in its own
process, the configurations taking turns for `--rounds` rounds (so a drift of the machine falls
on all of them alike); every "rlx ...: decode X ms/token" line the command prints is collected,
and the table gives each line's median per configuration and its ratio to the first one.

    python benchmarks/gpu_ab.py --config base= --config "nofold=RLX_BENCH_SET=rlx_backend_cuda.ops.EPILOGUE_OPS=()" \\
        --config "cluster4=RLX_BENCH_SET=rlx_backend_cuda.sources.NET_CLUSTER=4" \\
        -- python benchmarks/qwen35_gpu.py --sides rlx --prefill= --new 64 --reps 3
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

# "rlx q4_k: decode X ms/token", "rlx batch 32: decode X ms/step" (llm_gpu.py), "decode after ..: RLX X
# ms/token" (qwen35_gpu.py's report)
DECODE = re.compile(r"^(rlx[^:\n]*?):? decode:? ([0-9.]+) ms/(?:token|step)"
                    r"|^(decode) after [^:\n]*: RLX ([0-9.]+) ms/token", re.M)
HARDWARE = re.compile(r"^[^\n]*(?:GPU: |; device )[^\n]*$", re.M)


def parse_config(spec: str) -> tuple:
    """"name=VAR=value VAR2=value2" -> (name, {VAR: value, ...}); "name=" is no variables."""
    name, eq, rest = spec.partition("=")
    if not eq or not name:
        raise SystemExit(f"--config {spec!r}: expected NAME=[VAR=VALUE ...]")
    env = {}
    for item in rest.split():
        var, eq, value = item.partition("=")
        if not eq or not var:
            raise SystemExit(f"--config {spec!r}: {item!r} is no VAR=VALUE")
        env[var] = value
    return name, env


def decode_lines(text: str) -> dict:
    """{label: ms per token} of the "rlx ...: decode X ms/token" lines in a command's output."""
    return {(a or c).strip(): float(b or d) for a, b, c, d in DECODE.findall(text)}


def table(configs: list, runs: dict) -> list:
    """Markdown rows: each label's median per configuration, and its ratio to the first's."""
    labels = sorted({label for per in runs.values() for out in per for label in out})
    names = [n for n, _ in configs]
    rows = ["| line | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label in labels:
        med = {n: statistics.median(v) if (v := [o[label] for o in runs[n] if label in o]) else None
               for n in names}
        base = med[names[0]]
        cells = []
        for n in names:
            m = med[n]
            ratio = f" ({m / base:.3f}x)" if m is not None and base and n != names[0] else ""
            cells.append("-" if m is None else f"{m:.3f}{ratio}")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", required=True,
                    help="NAME=[VAR=VALUE ...], the first the base")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the benchmark command")
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        raise SystemExit("no command: give it after --")
    configs = [parse_config(c) for c in a.config]
    runs: dict = {n: [] for n, _ in configs}
    hardware = ""
    for r in range(a.rounds):
        for name, env in configs:
            try:
                p = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                                   timeout=a.timeout)
            except subprocess.TimeoutExpired as e:      # (its output so far may come as bytes)
                print(f"round {r + 1} {name}: not done within --timeout {a.timeout:g} s", flush=True)
                text = [t.decode(errors="replace") if isinstance(t, bytes) else t or ""
                        for t in (e.stdout, e.stderr)]
                p = subprocess.CompletedProcess(cmd, -1, *text)
            got = decode_lines(p.stdout)
            hardware = hardware or next(iter(HARDWARE.findall(p.stdout)), "")
            print(f"round {r + 1} {name}: rc {p.returncode} {got}", flush=True)
            if p.returncode or not got:
                print(p.stdout[-1500:] + p.stderr[-1500:], flush=True)
            runs[name].append(got)
    print(hardware or "(the command named no hardware)")
    print(f"command: {' '.join(cmd)}; {a.rounds} rounds; configurations: "
          + "; ".join(f"{n}: {' '.join(f'{k}={v}' for k, v in e.items()) or '(none)'}" for n, e in configs))
    print("\n".join(table(configs, runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
