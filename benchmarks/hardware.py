"""What every benchmark prints about the machine it ran on."""
import os
import platform


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def pin(threads: int) -> str:
    """Pin this process to `threads` cores when it may run on more; returns a description."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return "not pinned (no sched_setaffinity)"
    if len(allowed) > threads:
        os.sched_setaffinity(0, allowed[:threads])
        return f"pinned to cores {allowed[:threads]} of {len(allowed)}"
    return f"all {len(allowed)} cores"


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (a busy machine's timings are not comparable)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def stats(ts: list) -> tuple:
    """(min, median) of timings."""
    s = sorted(ts)
    return s[0], s[len(s) // 2]
