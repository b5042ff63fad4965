"""The random-read curve: measured on a real file with real threads, the depth chosen by its
rule, kept in the hardware profile, and read back by `--transfer-workers auto`."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from cli.args import add_runtime_args, runtime_options
from offload_runtime.planning.hardware import HardwareProfile, Processor, load_profile
from offload_runtime.planning.link_profile import (LinkProfileError, ReadCurve, chosen_depth, measure_random_reads,
                                                   profiled_depth)

CPU = Processor(peak_flops=1e11, memory_bandwidth=1e10, memory_bytes=1e9)


def curve(rates: tuple[float, ...], depths: tuple[int, ...] = (1, 2, 4, 8, 16)) -> ReadCurve:
    return ReadCurve(1000, depths, rates, tuple((r,) for r in rates), chosen_depth(depths, rates))


def test_the_chosen_depth_is_the_smallest_within_five_percent_of_the_best():
    assert chosen_depth((1, 2, 4, 8, 16), (0.5, 1.0, 1.2, 1.25, 1.1)) == 4  # 1.2 >= 0.95 * 1.25
    assert chosen_depth((1, 2, 4, 8, 16), (0.5, 1.0, 1.18, 1.25, 1.1)) == 8  # 1.18 < 1.1875
    assert chosen_depth((1, 2), (1.0, 0.9)) == 1


def test_rates_between_measured_depths_are_the_depth_below():
    c = curve((1.0, 2.0, 3.0), (1, 2, 4))
    assert c.rates_up_to(5) == (1.0, 2.0, 2.0, 3.0, 3.0) and c.rate == 3.0 and c.depth == 4


def test_a_measured_curve_keeps_every_repeat_and_its_median(tmp_path):
    probe = tmp_path / "probe.bin"
    probe.write_bytes(bytes(range(256)) * 4096)  # 1 MiB: 64 reads of 16 KiB
    c = measure_random_reads(probe, 16 * 1024, depths=(1, 4), repeats=3, reads=8)
    assert c.depths == (1, 4) and all(len(r) == 3 for r in c.repeats) and c.source == str(probe)
    assert all(rate == sorted(r)[1] > 0 for rate, r in zip(c.bytes_per_s, c.repeats))
    assert c.depth == chosen_depth(c.depths, c.bytes_per_s)


def test_without_a_file_a_temporary_one_is_read_and_removed(tmp_path):
    c = measure_random_reads(None, 64 * 1024, depths=(2,), repeats=1, reads=4, directory=tmp_path, file_bytes=2**20)
    assert c.depth == 2 and c.expert_bytes == 64 * 1024 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("depths", [(0,), (1, 65), (True,)])
def test_a_queue_depth_out_of_range_is_refused(tmp_path, depths):
    with pytest.raises(LinkProfileError, match="out of range: give depths in 1..64"):
        measure_random_reads(None, 4096, depths=depths, directory=tmp_path)


def test_the_profile_keeps_the_curve_and_the_hrm_link_reads_at_the_chosen_depth(tmp_path):
    c = curve((4e8, 8e8, 1.2e9, 1.25e9, 1.1e9))
    profile = HardwareProfile("probe", cpu=CPU, disk_to_cpu=1.4e9, random_reads=c)
    path = profile.save(tmp_path / "profile.json")
    assert load_profile(path) == profile and json.loads(path.read_text())["random_reads"]["depth"] == 4
    assert profile.link_bandwidth == 1.2e9  # not the sequential 1.4e9
    assert dataclasses.replace(profile, random_reads=None).link_bandwidth == 1.4e9
    assert profiled_depth(path) == 4


def test_transfer_workers_auto_takes_the_profiled_depth(tmp_path):
    path = HardwareProfile("probe", cpu=CPU, random_reads=curve((1.0, 3.0, 3.0), (1, 2, 4))).save(tmp_path / "p.json")
    parser = argparse.ArgumentParser()
    add_runtime_args(parser, "transfer_workers")
    args = parser.parse_args(["--transfer-workers", "auto", "--link-profile", str(path)])
    assert runtime_options(args).transfer_workers == 2
    assert runtime_options(parser.parse_args(["--transfer-workers", "3"])).transfer_workers == 3
