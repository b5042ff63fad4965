"""The time-true simulator's `LinkTiming`, calibrated from measurements of a machine.

Two sources:

- a hardware profile (`prescient profile-hw --json`, or a preset name) with the model's
  `config.json`. `expert_bytes`: one expert's gate, up and down matrices (`ModelSpec.expert_bytes`).
  `layer_compute_s`: the HRM's decode step for one request with every expert resident — each
  op of a layer (attention projections, attention over `context_tokens`, router, the top-k
  experts, a shared expert) at its roofline time max(FLOPs / peak FLOP/s, bytes / memory
  bandwidth) on the processor that runs it, times the layers, plus the LM head — over the MoE
  layers; `expert_compute_s`: the routed experts' op of that step. The link: from disk (the
  runtime's default store), the profile's random-read curve when it has one (`prescient
  profile-hw --model DIR`): the rates with 1..d reads in flight, d the depth the runtime keeps
  (`reads_in_flight`, default the depth the curve chose, which `--transfer-workers auto` keeps),
  else `disk_to_cpu` (sequential reads, one at a time); `cpu_to_gpu` for experts in pinned host
  memory (`store="host"`).
- a runtime bench JSON (`prescient bench`). `layer_compute_s`: the all-resident baseline's decode
  seconds per token (`baselines.all_resident.decode_seconds / decode_tokens`) over
  `model.n_moe_layers`. `expert_bytes`: `model.expert_bytes`. `link_bytes_per_s`: Σ `bytes_moved`
  / Σ `stall_seconds` over the runs without prefetching (predictor "none", `stats.prefetch_loads`
  0): there every copy is a demand load that the inference thread waits through from start to
  end (the JSON holds no per-load times), with the bench's `transfer_workers` in flight
  (`reads_in_flight`). `expert_compute_s` is not measured there: the whole layer-step's.

A bench JSON that records `model.fingerprint` must match the trace's model (else an error naming
both fingerprints); one that does not is checked on its MoE shape (layers, experts, top-k).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cache.timing import LinkTiming, TimingError
from offload_runtime.engine.options import STORES
from offload_runtime.planning.hardware import HardwareProfile, load_profile
from offload_runtime.planning.hrm import ModelSpec, Policy, Workload, estimate
from prescient.errors import PrescientError
from prescient.fingerprint import ModelFingerprint

log = logging.getLogger(__name__)

class TimingCalibrationError(PrescientError):
    """A calibration source is unreadable, lacks what the timing needs, or is of another model."""


@dataclass(frozen=True)
class Calibration:
    """A LinkTiming and where each of its numbers came from (for the experiment's JSON)."""

    timing: LinkTiming
    source: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {**self.timing.to_dict(), "source": self.source}


def load_timing(path: str | Path, *, model_config: str | Path | None = None,
                fingerprint: ModelFingerprint | None = None, store: str = "disk",
                context_tokens: int = 256, reads_in_flight: int | None = None) -> Calibration:
    """A runtime bench JSON, or a hardware profile (JSON or preset name) with `model_config`
    (a config.json or a model directory). `fingerprint`: the model the timing is for;
    `reads_in_flight`: a profile's depth to use (default: the one its curve chose)."""
    data = _read_json(path) if Path(path).is_file() else None
    if isinstance(data, dict) and "runs" in data and "baselines" in data:
        return timing_from_bench(path, fingerprint=fingerprint)
    if model_config is None:
        raise TimingCalibrationError(f"{path} is a hardware profile, not a runtime bench JSON: give the model's "
                                     "config too (a config.json or the model directory)")
    return timing_from_profile(path, model_config, fingerprint=fingerprint, store=store,
                               context_tokens=context_tokens, reads_in_flight=reads_in_flight)


# --- a hardware profile and the model config ----------------------------------------------------
def timing_from_profile(profile: HardwareProfile | str | Path, model_config: str | Path, *,
                        fingerprint: ModelFingerprint | None = None, store: str = "disk",
                        context_tokens: int = 256, reads_in_flight: int | None = None) -> Calibration:
    """The module doc's first source."""
    hardware = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    spec = ModelSpec.from_config(model_config)
    if fingerprint is not None:
        _require_shape(fingerprint, {"arch": spec.name, "n_experts": spec.num_experts, "top_k": spec.top_k},
                       f"model config {model_config}")
    moe_layers = fingerprint.n_moe_layers if fingerprint is not None else spec.num_layers
    token_s, experts_s = _decode_seconds(spec, hardware, context_tokens)
    rates, link_field = _link_rates(hardware, store, reads_in_flight)
    if hardware.random_reads is not None and store == "disk" and hardware.random_reads.expert_bytes != spec.expert_bytes:
        log.warning("the random-read curve of %s was measured at %d-byte reads, the model's experts are %d bytes",
                    hardware.name, hardware.random_reads.expert_bytes, spec.expert_bytes)
    source = {"kind": "profile-hw", "profile": str(profile) if not isinstance(profile, HardwareProfile) else None,
              "hardware": hardware.name, "model_config": str(model_config), "store": store,
              "context_tokens": context_tokens, "token_compute_s": token_s, "moe_layers": moe_layers,
              "fields": {"layer_compute_s": "HRM decode step, 1 request, experts resident / MoE layers",
                         "expert_compute_s": "the HRM decode step's routed-experts op, per layer",
                         "expert_bytes": "ModelSpec.expert_bytes (3 · hidden · intermediate · dtype bytes)",
                         "link_bytes_per_s": link_field}}
    what = f"hardware {hardware.name!r}"
    return Calibration(_timing(token_s / moe_layers, spec.expert_bytes, rates, what, min(experts_s, token_s / moe_layers)),
                       source)


def _decode_seconds(spec: ModelSpec, hardware: HardwareProfile, context_tokens: int) -> tuple[float, float]:
    """The HRM's decode step for one request, every expert resident (r_w = 1): on the GPU if
    there is one (KV cache there too), else on the CPU; and the routed experts' op of one layer."""
    place = "gpu" if hardware.gpu is not None else "cpu"
    policy = Policy(1, 1, attention_on=place, ffn_on=place, r_w=1.0, r_c=1.0 if place == "gpu" else 0.0)
    decode = estimate(spec, hardware, Workload(context_tokens, 1), policy).decode
    return decode.seconds, sum(seconds for op, seconds in decode.ops if op.name == "experts")


def _link_rates(hardware: HardwareProfile, store: str, reads_in_flight: int | None) -> tuple[tuple[float, ...], str]:
    """The link's rates with 1..d reads in flight, and where they came from."""
    if store not in STORES:
        raise TimingCalibrationError(f"store {store!r}: experts come from 'disk' (disk_to_cpu) or 'host' "
                                     "(pinned host memory, cpu_to_gpu)")
    if store == "host" and hardware.cpu_to_gpu is None:
        raise TimingCalibrationError(f"hardware {hardware.name!r} has no GPU, so no host → GPU link: "
                                     "use store='disk'")
    curve = hardware.random_reads
    if store == "host" or curve is None:
        if reads_in_flight not in (None, 1):
            raise TimingCalibrationError(f"hardware {hardware.name!r} has no random-read curve to give the rate with "
                                         f"{reads_in_flight} reads in flight: measure one with `prescient profile-hw "
                                         "--model DIR`")
        return ((hardware.disk_to_cpu,), "disk_to_cpu") if store == "disk" else ((hardware.cpu_to_gpu,), "cpu_to_gpu")
    depth = curve.depth if reads_in_flight is None else reads_in_flight
    return curve.rates_up_to(depth), f"random_reads: the curve's rates with 1..{depth} reads in flight"


# --- a runtime bench JSON -------------------------------------------------------------------
def timing_from_bench(source: str | Path | dict[str, Any], *,
                      fingerprint: ModelFingerprint | None = None) -> Calibration:
    """The module doc's second source: a bench JSON's path, or the JSON itself (a bench that
    simulates its own runs)."""
    data, path = (source, "this bench") if isinstance(source, dict) else (_read_json(source), source)
    model = _need(data, "model", path)
    checked = _check_model(model, fingerprint, path)
    resident = _need(_need(data, "baselines", path), "all_resident", path)
    decode_s, tokens = _need(resident, "decode_seconds", path), _need(resident, "decode_tokens", path)
    moe_layers, expert_bytes = _need(model, "n_moe_layers", path), _need(model, "expert_bytes", path)
    demand = [r for r in _need(data, "runs", path) if r.get("predictor") == "none"
              and (r.get("stats") or {}).get("prefetch_loads") == 0 and r.get("stall_seconds") and r.get("bytes_moved")]
    if not demand:
        raise TimingCalibrationError(f"{path} has no run without prefetching that loaded experts (predictor 'none', "
                                     "bytes_moved > 0): the link speed is measured there; add one to the bench grid")
    moved = sum(r["bytes_moved"] for r in demand)
    stalled = sum(r["stall_seconds"] for r in demand)
    token_s = decode_s / tokens if tokens else 0.0
    workers = (data.get("settings") or {}).get("transfer_workers", 1)
    source = {"kind": "bench", "path": str(path), "model_dir": model.get("dir"), "fingerprint": checked,
              "transfer_workers": workers,
              "token_compute_s": token_s, "link_runs": [r.get("label") for r in demand],
              "link_bytes": moved, "link_stall_seconds": stalled,
              "fields": {"layer_compute_s": "baselines.all_resident.decode_seconds / decode_tokens "
                                            "/ model.n_moe_layers",
                         "expert_bytes": "model.expert_bytes",
                         "link_bytes_per_s": "sum(bytes_moved) / sum(stall_seconds) over runs[predictor='none']"}}
    return Calibration(_timing(token_s / moe_layers if moe_layers else 0.0, expert_bytes,
                               (moved / stalled,) * workers, f"runtime bench {path}"), source)


def _check_model(model: dict[str, Any], fingerprint: ModelFingerprint | None, path: str | Path) -> str:
    """Check the bench's model against `fingerprint`; say how it was checked."""
    recorded = model.get("fingerprint")
    if fingerprint is None:
        return "not checked (no model given)"
    if recorded is not None:
        fingerprint.require_same(ModelFingerprint.from_dict(recorded), f"runtime bench {path}")
        return f"matches {fingerprint}"
    shape = {k: model.get(k) for k in ("n_moe_layers", "n_experts", "top_k")}
    _require_shape(fingerprint, shape, f"runtime bench {path}")
    log.warning("%s records no model fingerprint; checked its MoE shape only", path)
    return f"shape only (no fingerprint in the JSON): matches {fingerprint}"


def _require_shape(fingerprint: ModelFingerprint, found: dict[str, Any], what: str) -> None:
    differ = {k: v for k, v in found.items() if v != getattr(fingerprint, k)}
    if differ:
        shown = ", ".join(f"{k}={v}" for k, v in found.items())
        raise TimingCalibrationError(f"{what} is of model ({shown}) but the timing is for model {fingerprint}; "
                                     "calibrate from a measurement of this model")


# --- shared ------------------------------------------------------------------------------------
def _read_json(path: str | Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TimingCalibrationError(f"calibration file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TimingCalibrationError(f"calibration file {path} is not JSON ({exc})") from None


def _need(data: Any, key: str, path: str | Path) -> Any:
    if not isinstance(data, dict) or data.get(key) is None:
        raise TimingCalibrationError(f"{path} lacks {key!r}, which the timing calibration reads; is it a complete "
                                     "`prescient bench` JSON?")
    return data[key]


def _timing(layer_compute_s: float, expert_bytes: float, rates: tuple[float, ...], what: str,
            expert_compute_s: float | None = None) -> LinkTiming:
    """A LinkTiming keeping len(rates) reads in flight, rates[n - 1] bytes/s with n in flight."""
    try:
        if len(rates) == 1:
            return LinkTiming(layer_compute_s, expert_bytes, rates[0], expert_compute_s=expert_compute_s)
        return LinkTiming.of_curve(layer_compute_s, expert_bytes, rates, expert_compute_s)
    except TimingError as exc:
        raise TimingCalibrationError(f"{what} gives no usable timing: {exc}") from None
