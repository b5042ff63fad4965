"""The memory page's cells say how many runs they hold: a cell whose runs were mostly killed shows
the one run's value and how the others ended, never a range of one run that reads as several."""

from __future__ import annotations

from experiments.report_pages.memory import _read_mib, _speed


def entry(runs: int, killed: int) -> dict:
    stat = {"median": 4.4, "min": 4.4, "max": 4.4}
    return {"runs": runs, "killed": killed, "refused": 0, "timeout": 0, "failed": 0, "exact": True,
            "tokens_per_s": stat, "read_bytes_per_token": {k: v * 2**20 for k, v in stat.items()}}


def test_a_cell_of_one_run_says_so_and_how_the_others_ended():
    assert _speed(entry(3, 2)) == "4.4 (1 run); 2 killed"
    assert _read_mib(entry(3, 2)) == "4"


def test_a_cell_of_several_runs_gives_their_range():
    assert _speed(entry(3, 0)) == "4.4 (4.4–4.4)"
    assert _read_mib(entry(3, 1)) == "4 (4–4)"
