"""The decode's default torch threads (`engine.threads`): the CPUs the process may use, capped by
its cgroup's CPU quota, read from cpu.max."""

from __future__ import annotations

import os

import torch

from offload_runtime.engine import threads


def test_the_quota_is_read_from_cpu_max(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    for text, cpus in (("max 100000\n", None), ("150000 100000\n", 2), ("50000 100000\n", 1), ("garbage", None)):
        cpu_max.write_text(text)
        assert threads.cpu_quota(cpu_max) == cpus, text
    assert threads.cpu_quota(tmp_path / "absent") is None


def test_decode_threads_are_the_usable_cpus_under_the_quota(monkeypatch):
    usable = len(os.sched_getaffinity(0))
    monkeypatch.setattr(threads, "cpu_quota", lambda path=threads.CPU_MAX: None)
    assert threads.decode_threads() == usable
    monkeypatch.setattr(threads, "cpu_quota", lambda path=threads.CPU_MAX: 1)
    assert threads.decode_threads() == 1
    before = torch.get_num_threads()
    try:
        assert threads.use_decode_threads() == 1 and torch.get_num_threads() == 1
        assert threads.use_decode_threads(2) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
