"""The accelerate baseline of `prescient bench-batch`: the model as transformers and accelerate
offload it on their own, at the same memory budget as the other schedules.

    AutoModelForCausalLM.from_pretrained(model, device_map="auto", max_memory={"cpu": budget},
                                         offload_folder=<a fresh temporary folder>)

accelerate's `infer_auto_device_map` keeps whole modules (a decoder layer is never split: the
model's `_no_split_modules`) in CPU memory in model order while they fit under `budget` after
reserving room for the largest offloaded layer (its load buffer, what the other schedules' double
buffer is), and marks the rest "disk"; transformers writes those layers' fused expert tensors to
the offload folder (the other disk weights are read from the checkpoint itself). Before each
forward of a disk-placed module, accelerate's `AlignDevicesHook` reads all its weights (every
expert of the layer, routed or not) and drops them after: no prefetch, no overlap.

The budget (`weight_budget_bytes`): the bytes of weights the other schedules keep in memory at
r_w, i.e. every non-expert weight (the offload runtime streams routed experts only, and
`ModelSpec.non_expert_bytes` counts the rest) plus their slot pool, `slots_needed` experts
(r_w·E resident in every layer and a double buffer of two layers' streamed experts) of
`ModelSpec.expert_bytes` each. KV cache and activations are outside it, as they are for the others.

The requests decode as one batch, one `generate` call over all N with left padding, not in
micro-batches: accelerate loads each offloaded layer once per forward, so the whole batch in one
forward is the fewest bytes per token it can move (micro-batches would read every offloaded layer
N/μ times per step). Timed as the all-resident run is (`measure_resident`).

Bytes: `bytes_per_token` counts what the hooks load, the offloaded parameters' bytes once per
forward (the prefill and each decode step), over the tokens generated; `read_bytes_per_token` is
the disk's own count, the process's `read_bytes` of /proc/self/io over the same `generate` call.
With `drop_page_cache` (as the other schedules' store) the offload folder's and the checkpoint's
cached pages are dropped after every offloaded module's forward, so each load reads the disk.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from experiments.bench_batch_resident import measure_resident


def weight_budget_bytes(spec, resident_fraction: float) -> int:
    """Bytes of weights the offload runtime's schedules hold at r_w: non-expert weights + slot pool."""
    from offload_runtime.cgopipe.zigzag import slots_needed

    resident = round(resident_fraction * spec.num_experts)
    return spec.non_expert_bytes + slots_needed(resident, spec.num_layers, spec.num_experts) * spec.expert_bytes


def read_bytes() -> int:
    """This process's bytes read from storage so far (/proc/self/io), 0 where there is no such file."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _page_dropper(paths: list[Path]):
    """A forward hook dropping `paths`' cached pages (their dirty pages written first)."""
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    for fd in fds:
        os.fsync(fd)

    def drop(*_: Any) -> None:
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    drop()
    return drop, fds


def measure_accelerate(model_dir: str, prompts: list[list[int]], gen_len: int, resident_fraction: float,
                       reference: list[list[int]], spec, drop_page_cache: bool = True) -> dict[str, Any]:
    """One run of the accelerate baseline over `prompts` at the budget r_w = `resident_fraction` gives
    the other schedules; a fresh load into a fresh offload folder each run."""
    import torch
    from transformers import AutoModelForCausalLM

    budget = weight_budget_bytes(spec, resident_fraction)
    with tempfile.TemporaryDirectory(prefix="accelerate-offload-") as folder:
        model = AutoModelForCausalLM.from_pretrained(model_dir, device_map="auto", max_memory={"cpu": budget},
                                                     offload_folder=folder, dtype=torch.float32)
        model.eval()
        params = dict(model.named_parameters())
        offloaded = {name: p.numel() * p.element_size() for name, p in params.items() if p.device.type == "meta"}
        resident = sum(p.numel() * p.element_size() for name, p in params.items() if name not in offloaded)
        expert_total = sum(p.numel() * p.element_size() for name, p in params.items() if ".experts." in name)
        expert_offloaded = sum(b for name, b in offloaded.items() if ".experts." in name)
        fds: list[int] = []
        if drop_page_cache and offloaded:
            files = sorted(Path(folder).rglob("*.*")) + sorted(Path(model_dir).glob("*.safetensors"))
            drop, fds = _page_dropper([f for f in files if f.is_file()])
            for module in model.modules():
                if getattr(getattr(module, "_hf_hook", None), "offload", False):
                    module.register_forward_hook(drop)
        try:
            run = measure_resident(model, prompts, gen_len, reference=reference, read_bytes=read_bytes)
        finally:
            for fd in fds:
                os.close(fd)
        device_map = dict(model.hf_device_map)
        del model
    tokens = len(prompts) * gen_len
    per_pass = sum(offloaded.values())
    return {
        **run, "mode": "accelerate", "budget_bytes": budget, "resident_weight_bytes": resident,
        "offloaded_bytes_per_pass": per_pass,
        "resident_expert_share": 1 - expert_offloaded / expert_total if expert_total else 1.0,
        "disk_modules": sorted(name for name, place in device_map.items() if place == "disk"),
        "bytes_per_token": per_pass * gen_len / tokens,  # the prefill and gen_len − 1 decode steps
        "decode_bytes_per_token": per_pass / len(prompts),  # each decode step: one pass, one token a request
        "generated_tokens": tokens, "drop_page_cache": drop_page_cache,
    }
