#!/usr/bin/env python3
"""Type-check rlx_core with mypy against a baseline that may only shrink (issue 43).

    python scripts/typecheck.py            run mypy; fail on any error not in the baseline
    python scripts/typecheck.py --update   shrink the baseline to today's errors (refuses to grow it)
    python scripts/typecheck.py --reset    write today's errors as the baseline, growing it if need be:
                                           for creating it, or re-creating it after a mypy upgrade; the
                                           growth shows in the commit's diff for review

The baseline (.ci/mypy-baseline.txt) keeps one line per error, "file: [code] message", sorted, with
no line numbers, so an edit that only moves code does not churn it; a line repeats once per error.
The configuration (packages, strictness, untyped third-party libraries) is pyproject.toml's
[tool.mypy].
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / ".ci" / "mypy-baseline.txt"
HEADER = ("# mypy's errors on rlx_core that are tolerated for now; may only shrink.\n"
          "# Regenerate with: .venv/bin/python scripts/typecheck.py --update\n")

# mypy's line: "path:LINE[:COL]: error: message  [code]"; notes and the summary do not match
_ERROR = re.compile(r"^(?P<path>[^:\s][^:]*):\d+(?::\d+)?: error: "
                    r"(?P<msg>.*?)(?:  \[(?P<code>[a-z0-9-]+)\])?$")
# a message that names another line ("already defined on line 42") would churn like a line number
_LINE_REF = re.compile(r"\bline \d+\b")


class TypecheckError(Exception):
    """mypy could not check (a crash, a syntax error, a bad configuration) or a baseline is unreadable."""


def normalize(mypy_output: str) -> Counter[str]:
    """mypy's error lines as a multiset of "file: [code] message", line numbers dropped."""
    errors: Counter[str] = Counter()
    for line in mypy_output.splitlines():
        m = _ERROR.match(line.rstrip())
        if m:
            msg = _LINE_REF.sub("line N", m["msg"])
            errors[f"{m['path']}: [{m['code'] or 'error'}] {msg}"] += 1
    return errors


def read_baseline(path: Path) -> Counter[str]:
    """The committed baseline's errors; a missing file is an empty baseline (no error tolerated)."""
    if not path.exists():
        return Counter()
    return Counter(line for line in path.read_text().splitlines() if line and not line.startswith("#"))


def write_baseline(path: Path, errors: Counter[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER + "".join(f"{e}\n" for e in sorted(errors.elements())))


def compare(baseline: Counter[str], current: Counter[str]) -> tuple[Counter[str], Counter[str]]:
    """(new, gone): errors beyond the baseline's count of each, and baseline errors no longer seen."""
    return current - baseline, baseline - current


def run_mypy() -> str:
    """mypy on rlx_core as pyproject.toml configures it: its report, or TypecheckError if it
    could not check."""
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
                          cwd=ROOT, capture_output=True, text=True)
    # 0: clean, 1: type errors found; anything else (2: blocking error, a crash) means nothing was checked
    if proc.returncode not in (0, 1):
        raise TypecheckError(f"mypy exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    if proc.returncode == 1 and not normalize(proc.stdout):
        raise TypecheckError(f"mypy reported failure without an error line:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def _listing(title: str, errors: Counter[str]) -> str:
    return f"{title} ({sum(errors.values())}):\n" + "".join(f"  {e}\n" for e in sorted(errors.elements()))


def check(mypy_output: str, baseline_path: Path, mode: str = "check") -> int:
    """Compare mypy's report with the baseline; mode "check", "update" (shrink only) or "reset".
    Prints what it found; returns the exit status."""
    current = normalize(mypy_output)
    if mode == "reset":
        write_baseline(baseline_path, current)
        print(f"typecheck: baseline {baseline_path.name} written with {sum(current.values())} errors")
        return 0
    new, gone = compare(read_baseline(baseline_path), current)
    if new:
        print(_listing("typecheck: FAILED, errors not in the baseline", new)
              + "Fix them (the baseline may only shrink).")
        if mode == "update":
            print("typecheck: --update refuses to grow the baseline; it is unchanged.")
        return 1
    if mode == "update":
        write_baseline(baseline_path, current)
        print(f"typecheck: baseline shrunk by {sum(gone.values())} to {sum(current.values())} errors")
        return 0
    if gone:
        print(_listing("typecheck: passed; fixed since the baseline", gone)
              + "Shrink the baseline: .venv/bin/python scripts/typecheck.py --update (and commit it)")
    else:
        print(f"typecheck: passed ({sum(current.values())} baseline errors remain)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--update", action="store_true", help="shrink the baseline to today's errors")
    group.add_argument("--reset", action="store_true", help="write today's errors as the baseline (may grow)")
    parser.add_argument("--baseline", type=Path, default=BASELINE, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    mode = "reset" if args.reset else "update" if args.update else "check"
    try:
        return check(run_mypy(), args.baseline, mode)
    except TypecheckError as e:
        print(f"typecheck: FAILED: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
