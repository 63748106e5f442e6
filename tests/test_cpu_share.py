"""A worker's thread budget follows its container's CPU limit (cgroup v1 and v2 files)."""

from __future__ import annotations

import os

from kvfleet.worker.cpu_share import cgroup_cpu_quota, cpu_share


def test_cgroup_v2_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_cgroup_v1_quota(tmp_path):
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    (cpu / "cfs_quota_us").write_text("x")  # unrelated file names are ignored
    (cpu / "cpu.cfs_quota_us").write_text("300000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == 3.0
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None


def test_the_share_is_the_affinity_capped_by_the_quota_rounded_up(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert cpu_share(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one thread
    assert cpu_share(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{(affinity + 8) * 100000} 100000\n")  # above the cpuset
    assert cpu_share(tmp_path) == affinity
