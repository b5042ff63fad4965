"""llama.cpp as an optional system of `prescient bench --memory`: not run unless its binary and a
GGUF are given; a missing binary or GGUF is one error line before any run; its timings line is
parsed for decode tokens/s; a run (here a stand-in `llama-completion` script printing as llama.cpp
prints) gives its text, compared with the plain model's, and bytes read per decoded token."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path

import pytest

from cli.main import main
from experiments.bench_memory import orchestrate
from experiments.bench_memory.child import run as run_child
from experiments.bench_memory.llama_cpp import LlamaCppError, parse_timings, run_llama_cpp
from tests.test_bench_memory import PROMPT, _fake_runner

# the end of a llama-completion run's stderr (llama.cpp's CPU build, 96 greedy tokens)
TIMINGS = """
llama_perf_sampler_print:    sampling time =       4.10 ms /   112 runs   (    0.04 ms per token, 27317.07 tokens per second)
llama_perf_context_print:        load time =     130.22 ms
llama_perf_context_print: prompt eval time =      20.50 ms /    16 tokens (    1.28 ms per token,   780.49 tokens per second)
llama_perf_context_print:        eval time =    1900.00 ms /    95 runs   (   20.00 ms per token,    50.00 tokens per second)
llama_perf_context_print:       total time =    1950.10 ms /   111 tokens
"""


def test_the_eval_line_gives_decode_tokens_per_s():
    timings = parse_timings(TIMINGS)
    assert timings["decode_runs"] == 95 and timings["tokens_per_s"] == pytest.approx(50.0)
    assert timings["prompt_ms"] == pytest.approx(20.5)
    with pytest.raises(LlamaCppError, match="no 'eval time"):
        parse_timings("llama_perf_context_print: prompt eval time =  20.50 ms /  16 tokens\n")


def test_llama_cpp_is_not_run_unless_given(tmp_path):
    out = tmp_path / "curve.json"
    orchestrate.bench_memory("model", [2**30], [PROMPT], json_path=out, new_tokens=4, repeats=1,
                             runner=_fake_runner({}))
    result = json.loads(out.read_text())
    assert "llama.cpp" in orchestrate.SYSTEMS and "llama.cpp" not in result["settings"]["systems"]
    assert result["settings"]["llama_cpp"] is None and "prescient/llama.cpp" not in result["ratios"][0]


def fake_llama(folder: Path, tokens: list[str]) -> Path:
    """A stand-in llama-completion: each token printed to stdout (flushed, as llama.cpp prints them),
    then the timings to stderr."""
    folder.mkdir()
    script = folder / "llama-completion"
    script.write_text("#!/bin/sh\n" + "".join(f"printf '%s' '{t}'; sleep 0.05\n" for t in tokens)
                      + f"cat >&2 <<'EOF'\n{TIMINGS}EOF\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder


def test_a_run_gives_its_text_speed_and_reads(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    spec = {"system": "llama.cpp", "llama_cpp": str(fake_llama(tmp_path / "bin", ["  return", " x", "\n"])),
            "gguf": str(gguf), "prompt": PROMPT, "new_tokens": 3, "threads": 1, "memory": None}
    record = run_child(spec)
    assert record["text"] == "  return x\n" and record["tokens_per_s"] == pytest.approx(50.0)
    assert record["output_pieces"] == 3 and record["decode_read_bytes_per_token"] is not None
    reference = {"token_ids": [1, 2, 3], "text": "  return x\n"}
    assert orchestrate.same_greedy(record, reference)
    assert not orchestrate.same_greedy({**record, "text": "  return y\n"}, reference)
    assert orchestrate.same_greedy(record, {"token_ids": [1], "text": "  return"})  # the plain model hit EOS
    assert orchestrate.same_greedy({**record, "text": "  return x"}, reference)  # another last token boundary


@pytest.mark.parametrize("missing", ["binary", "gguf", "not a gguf", "no flags"])
def test_a_missing_binary_or_gguf_is_one_error_line(tiny_moe_dir, tmp_path, caplog, missing):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60) if missing != "not a gguf" else b"PK\x03\x04")
    folder = fake_llama(tmp_path / "bin", ["x"])
    given = {"binary": ["--llama-cpp", str(tmp_path), "--gguf", str(gguf)],
             "gguf": ["--llama-cpp", str(folder), "--gguf", str(tmp_path / "absent.gguf")],
             "not a gguf": ["--llama-cpp", str(folder), "--gguf", str(gguf)],
             "no flags": ["--systems", "plain,llama.cpp"]}[missing]
    model = tiny_moe_dir("mixtral")
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", str(model), "--json", str(tmp_path / "out.json"), "--memory", "1GiB",
              "--prompt-tokens", "4", *given])
    (err,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert exit_info.value.code == 2 and err.startswith("error:") and len(err.splitlines()) == 1, err
    assert ("llama-completion" if missing == "binary" else "GGUF" if missing != "no flags" else "--llama-cpp") in err
    assert not (tmp_path / "out.json").exists()


def test_a_run_whose_log_lost_its_timings_is_run_again(tmp_path):
    """llama.cpp's log thread can lose the timings' last lines at exit (the log stops at "load
    time"): the run is repeated, up to three runs, and the record says how many ran."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    folder = fake_llama(tmp_path / "bin", ["x"])
    script = folder / "llama-completion"
    marker = tmp_path / "ran-once"
    cut = TIMINGS.split("llama_perf_context_print: prompt eval")[0]
    script.write_text(f"#!/bin/sh\nprintf 'x'\nif [ -e {marker} ]; then cat >&2 <<'EOF'\n{TIMINGS}EOF\n"
                      f"else touch {marker}; cat >&2 <<'EOF'\n{cut}EOF\nfi\n")
    spec = {"llama_cpp": str(folder), "gguf": str(gguf), "prompt": PROMPT, "new_tokens": 1, "threads": 1}
    record = run_llama_cpp(spec)
    assert record["attempts"] == 2 and record["tokens_per_s"] == pytest.approx(50.0) and record["text"] == "x"
    marker.unlink()
    with pytest.raises(LlamaCppError, match="no 'eval time"):
        run_llama_cpp(spec, attempts=1)


def test_the_child_that_runs_llama_cpp_loads_nothing_of_torch():
    """llama.cpp runs beside the bench's child in its memory cgroup: a child that imported torch (it
    did through `generate.storage_reads`) held ~290 MB of the cap's anonymous memory, and llama.cpp
    at 1.1 GB read ~460 MiB a token instead of ~35-75."""
    import subprocess
    import sys

    probe = ("import sys\nfrom experiments.bench_memory import child\nfrom experiments.bench_memory.llama_cpp "
             "import run_llama_cpp\nimport prescient.errors\nprint(sorted(m for m in ('torch', 'numba', 'transformers') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]"
