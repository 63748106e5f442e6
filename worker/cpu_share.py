"""How many CPU threads this worker may use: its CPU affinity, capped by its cgroup's CPU quota.

torch sizes its thread pool by the host's cores; in a container limited to 2 CPUs of a 64-core host
that is 64 threads time-sliced onto 2 CPUs' worth of quota, which is much slower than 2 threads.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time the cgroup may use (quota / period), or None when unlimited or unknown.

    cgroup v2 keeps "quota period" (or "max period") in cpu.max; v1 keeps cpu.cfs_quota_us (-1 =
    unlimited) and cpu.cfs_period_us under the cpu controller's directory.
    """
    v2 = root / "cpu.max"
    try:
        if v2.exists():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        for v1 in (root / "cpu", root / "cpu,cpuacct", root):
            quota_file = v1 / "cpu.cfs_quota_us"
            if quota_file.exists():
                quota = int(quota_file.read_text())
                period = int((v1 / "cpu.cfs_period_us").read_text())
                return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None
    return None


def cpu_share(root: Path = CGROUP_ROOT) -> int:
    """The most threads worth running: the CPUs this process may run on, at most its quota rounded
    up, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)
