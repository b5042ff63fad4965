"""Bad input and faults on the newer surfaces, in process and fast: sizes that overflow, a damaged
tuned-settings file, `tune` that can run nothing or is stopped, the trace under a memory cap, the
prefix cache beside the memory, and empty request fields. (The command-line table of bad input is
tests/test_bad_input.py.)"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from cli import args as cli_args
from cli.main import main
from offload_runtime.engine import tuned as tuned_module
from offload_runtime.engine.tuned import load_tuned, save_tuned, tuned_path, tuned_settings
from offload_runtime.planning import tune as tune_module
from offload_runtime.server.app import serve_config
from offload_runtime.server.service import _load_within
from prescient import capped_run
from prescient.budget import Budget, parse_bytes, parse_memory
from prescient.capped_run import CGROUP_ROOT
from prescient.errors import CapacityError, ServerSettingsError, StoppedBySignal

HUNDREDS_OF_DIGITS = "9" * 400


@pytest.mark.parametrize("text", [f"{HUNDREDS_OF_DIGITS}GiB", f"{HUNDREDS_OF_DIGITS}B", "1152921504606846977B"])
def test_a_memory_size_beyond_any_machine_is_one_line_naming_it(text):
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        cli_args.memory(text)
    message = str(refused.value)
    assert "\n" not in message and len(message) < 300
    assert re.search(r"memory size '(9{20}\.\.\.9{17}GiB' \(403|9{20}\.\.\.9{19}B' \(401|1152921504606846977B)", message)
    assert "above 1 EiB" in message


@pytest.mark.parametrize("text, expected", [
    (f"{HUNDREDS_OF_DIGITS}%", r"memory share '9{20}\.\.\..*%' \(401 characters\) is not in \(0%, 100%\]"),
    ("0.0000001B", r"memory size '0.0000001B' is zero"),
    ("1e400GiB", r"cannot read a memory size from '1e400GiB'"),
])
def test_other_memory_sizes_that_cannot_be_are_refused_by_name(text, expected):
    with pytest.raises(CapacityError, match=expected):
        parse_memory(text)


@pytest.mark.parametrize("text", [f"{HUNDREDS_OF_DIGITS}slots", f"{HUNDREDS_OF_DIGITS}GiB", f"{HUNDREDS_OF_DIGITS}%"])
def test_a_budget_beyond_any_machine_is_refused_by_name(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"budget '9{20}\.\.\..*' \(40\d characters\) is larger"):
        cli_args.budget(text)


def test_a_byte_size_beyond_any_machine_is_a_value_error_and_exact_below():
    with pytest.raises(ValueError, match="above 1 EiB"):
        parse_bytes(f"{HUNDREDS_OF_DIGITS}GiB")
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(f"{2**60}B") == 2**60


@pytest.mark.parametrize("read, text, expected", [
    (cli_args.positive_int, "9" * 400, r"^999999999999\.\.\. \(400 digits\) is too large: at most 2\*\*63-1$"),
    (cli_args.non_negative_int, str(2**63), r"^9223372036854775808 is too large"),
    (cli_args.seed, str(2**64), r"is not a seed: give a whole number from -2\*\*63 to 2\*\*64-1"),
    (cli_args.seed, str(-2**63 - 1), r"is not a seed"),
    (cli_args.threads, "0", r"0 is not a number of threads in 1\.\.4096"),
    (cli_args.threads, str(2**31), r"is not a number of threads in 1\.\.4096"),
])
def test_counts_seeds_and_threads_beyond_what_torch_takes_are_refused(read, text, expected):
    """Each once ended in an OverflowError or ValueError from torch ("Overflow when unpacking long")."""
    with pytest.raises(argparse.ArgumentTypeError, match=expected):
        read(text)


def test_the_largest_counts_and_seeds_still_read():
    assert cli_args.positive_int(str(2**63 - 1)) == 2**63 - 1 and cli_args.seed(str(2**64 - 1)) == 2**64 - 1
    assert cli_args.seed("-1") == -1 and cli_args.threads("4096") == 4096


@pytest.mark.parametrize("amount", [float("nan"), float("inf")])
def test_a_budget_of_nan_or_infinity_is_refused(amount):
    with pytest.raises(CapacityError, match="is not a finite number"):
        Budget(amount, "slots")


DAMAGED_TUNED = {  # what a tuned-settings file holds -> what the one warning must say
    "settings null": ('{"best": [{"memory": 1073741824, "settings": null}]}', r"entry .* is not a memory size with its"),
    "size 1e400": ('{"best": [{"memory": 1e400, "settings": {}}]}', r'memory size "1e400" is not a number of bytes'),
    "size 0": ('{"best": [{"memory": 0, "settings": {}}]}', r"memory size 0 is not a number of bytes"),
    "size NaN": ('{"best": [{"memory": NaN, "settings": {}}]}', r"memory size nan is not a number of bytes"),
    "best null": ('{"best": null}', r'no list of measured sizes \("best"\)'),
    "a list": ("[1, 2]", r'no list of measured sizes \("best"\)'),
    "an entry not an object": ('{"best": [7]}', r"entry 7 is not a memory size"),
    "a setting of the wrong type": ('{"best": [{"memory": 1073741824, "settings": {"transfer_workers": "many"}}]}',
                                    r"settings at 1073741824 bytes do not hold: transfer_workers must be a whole"),
    "not JSON": ('{"best": [', r"not JSON"),
}


@pytest.fixture
def tuned_home(tmp_path, monkeypatch, caplog):
    """A tuned-file folder of the test's own, the tuned module's messages captured."""
    monkeypatch.setenv("PRESCIENT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tuned_module.log, "disabled", False)
    caplog.set_level(logging.INFO, logger=tuned_module.log.name)
    return tmp_path / "cache"


@pytest.mark.parametrize("text, expected", DAMAGED_TUNED.values(), ids=DAMAGED_TUNED.keys())
def test_a_damaged_tuned_file_is_ignored_in_one_line_naming_it_and_why(tiny_moe_dir, tuned_home, caplog, text,
                                                                       expected):
    model = tiny_moe_dir("mixtral")
    path = tuned_path(model)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert tuned_settings(model, 2**30) == {}  # the built-in defaults
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "\n" not in warnings[0], warnings
    assert re.search(expected, warnings[0]) and "built-in defaults" in warnings[0]


def test_a_tune_over_a_damaged_tuned_file_replaces_it(tiny_moe_dir, tuned_home):
    model = tiny_moe_dir("mixtral")
    path = tuned_path(model)
    path.parent.mkdir(parents=True)
    path.write_text('{"best": [7, {"memory": null}]}')
    save_tuned(model, {"best": [{"memory": 2**30, "settings": tune_module.starting_settings(None)}]})
    assert sorted(load_tuned(model).best) == [2**30]


def test_generate_with_memory_over_a_damaged_tuned_file_runs_the_defaults(tiny_moe_dir, tuned_home, tmp_path,
                                                                          caplog):
    model = tiny_moe_dir("mixtral")
    argv = ["generate", "--model", str(model), "--prompt", "def f(x):", "--max-new-tokens", "3", "--memory", "4GiB"]
    main([*argv, "--json", str(tmp_path / "defaults.json")])
    tuned_path(model).parent.mkdir(parents=True)
    tuned_path(model).write_text(DAMAGED_TUNED["settings null"][0])
    main([*argv, "--json", str(tmp_path / "damaged.json")])
    read = [json.loads((tmp_path / name).read_text()) for name in ("defaults.json", "damaged.json")]
    assert read[0]["token_ids"] == read[1]["token_ids"] and len(read[1]["token_ids"]) >= 3
    assert read[0]["settings"] == read[1]["settings"]
    assert sum("ignoring the tuned configuration" in r.getMessage() for r in caplog.records) == 1


def refused_decode(directory, prompts, new_tokens, predictor, options, timeout_s):
    raise CapacityError(f"--memory {options.memory / 2**30:.2f} GiB cannot hold this model: the smallest memory "
                        "that works is 0.39 GiB (405MiB)")


def killed_decode(directory, prompts, new_tokens, predictor, options, timeout_s):
    return {"tokens_per_s": [0.0] * len(prompts), "stats": {}, "memory_plan": None, "killed": True}


@pytest.mark.parametrize("decode, why", [(refused_decode, r"the smallest memory that works is 0.39 GiB"),
                                         (killed_decode, r"every calibration decode was killed")],
                         ids=["refused", "killed"])
def test_tune_where_no_size_runs_exits_2_in_one_line_and_keeps_nothing(tiny_moe_dir, tuned_home, tmp_path,
                                                                        monkeypatch, capsys, caplog, decode, why):
    model = tiny_moe_dir("mixtral")
    for name in ("decode_capped", "decode_in_child"):
        monkeypatch.setattr(tune_module, name, decode)
    monkeypatch.setattr(tune_module, "calibration_prompts", lambda: ["def f(x):"])
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "--model", str(model), "--memory", "10MiB,20MiB", "--new-tokens", "2", "--repeats", "1",
              "--json", str(tmp_path / "tune.json")])
    errors = [r.getMessage() for r in caplog.records if r.getMessage().startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1, errors
    assert re.search(r"^error: tune measured nothing and kept nothing: no size ran \(0.01 GiB, 0.02 GiB\): at the "
                     rf"largest, .*{why}.*; give --memory sizes the model can run in$", errors[0]), errors
    assert "kept as this machine's default" not in capsys.readouterr().out
    assert not tuned_path(model).exists() and not (tmp_path / "tune.json").exists()


def capped_groups() -> list[Path]:
    """The cgroups `run_capped` made for this process and left behind, where `make_group` makes them."""
    own = capped_run._own_cgroups()
    parents = {CGROUP_ROOT, CGROUP_ROOT / "memory"}
    if "memory" in own:
        parents.add(CGROUP_ROOT / "memory" / own["memory"].lstrip("/"))
    if "" in own:
        parents.add(CGROUP_ROOT / own[""].lstrip("/").rsplit("/", 1)[0])
    return [path for parent in parents for path in parent.glob(f"prescient-capped-{os.getpid()}-*")]


def test_a_capped_run_stopped_by_sigterm_kills_and_reaps_its_session_and_removes_its_cgroup(tmp_path):
    """As `tune` and `bench --memory` are stopped mid-decode: the run (its own session, its own
    cgroup) must not outlive the command."""
    pid_file = tmp_path / "pid"
    argv = ["sh", "-c", f"echo $$ > {pid_file}.part && mv {pid_file}.part {pid_file} && exec sleep 60"]
    made = []

    def stop_when_started() -> None:
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        made.extend(capped_groups())
        os.kill(os.getpid(), signal.SIGTERM)

    def stopped(signum, _frame):
        raise StoppedBySignal(signum)

    previous = signal.signal(signal.SIGTERM, stopped)
    threading.Thread(target=stop_when_started, daemon=True).start()
    try:
        with pytest.raises(StoppedBySignal):
            capped_run.run_capped(argv, 256 * 2**20, timeout_s=60)
    finally:
        signal.signal(signal.SIGTERM, previous)
    pid = int(pid_file.read_text())
    try:
        with pytest.raises(ProcessLookupError):  # gone and reaped: a zombie would still take signal 0
            os.kill(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert len(made) == (capped_run.cgroup_kind() != "none") and capped_groups() == []


@pytest.mark.parametrize("prefix_cache", [2 * 2**30, 2**30])
def test_a_prefix_cache_not_below_the_memory_is_refused_naming_both(tiny_moe_dir, prefix_cache):
    with pytest.raises(ServerSettingsError) as refused:
        serve_config(tiny_moe_dir("mixtral"), memory=2**30, prefix_cache_bytes=prefix_cache)
    assert str(refused.value).startswith(f"--prefix-cache {prefix_cache / 2**30:.2f} GiB ({prefix_cache} bytes) is not "
                                         "below --memory 1.00 GiB (1073741824 bytes)")


def test_a_prefix_cache_that_leaves_too_little_memory_says_it_took_its_share(tiny_moe_dir):
    config = serve_config(tiny_moe_dir("mixtral"), memory=2**30, prefix_cache_bytes=1000 * 2**20)
    with pytest.raises(CapacityError, match=r"^--memory 1.00 GiB \(1073741824 bytes\) holds the prefix cache's 0.98 GiB "
                                            r"\(1048576000 bytes\) beside the model: .*smallest memory that works .*; "
                                            r"give a smaller --prefix-cache or more --memory$"):
        _load_within(config.model_dir, None, config.options, config.prefix_cache_bytes)


def test_bench_serve_stopped_before_its_server_is_ready_stops_the_server(monkeypatch):
    """`prescient bench-serve` waits up to 600 s for its `prescient serve` child: a SIGTERM meanwhile
    must end the child too (it was left serving)."""
    import subprocess

    from experiments import bench_serve
    from offload_runtime.engine.options import RuntimeOptions

    started = []
    real_popen = subprocess.Popen

    def popen(_args, **_kwargs):
        started.append(real_popen(["sleep", "60"]))
        return started[-1]

    def stopped_while_waiting(_self, _deadline):
        raise StoppedBySignal(signal.SIGTERM)

    monkeypatch.setattr(bench_serve.subprocess, "Popen", popen)
    monkeypatch.setattr(bench_serve.ServerProcess, "_wait_ready", stopped_while_waiting)
    with pytest.raises(StoppedBySignal):
        bench_serve.ServerProcess("model", None, RuntimeOptions(), 1, 1, 1)
    assert started[0].returncode == -signal.SIGTERM  # ended and reaped
