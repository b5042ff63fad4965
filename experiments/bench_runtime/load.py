"""A `prescient bench` job, and loading its model: all resident, offloaded to disk by transformers
+ accelerate, or on our offloading runtime with the job's predictor and cache policy."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload_runtime.engine.options import RuntimeOptions
from predictor.base import ExpertPredictor


@dataclass
class Job:
    """One measurement (`experiments.bench_runtime.measure.measure`), picklable for the process
    that runs it."""

    kind: str  # "all_resident" | "accelerate_disk" | "offloaded"
    model_dir: str
    prompts: list[list[int]]  # timed prompts (token ids)
    new_tokens: int
    warmup: list[list[int]] = field(default_factory=list)  # generated untimed first
    warmup_tokens: int = 0
    pad_token_id: int | None = None
    threads: int = 1
    options: RuntimeOptions = RuntimeOptions(budget=1.0, drop_page_cache=True)  # offloaded: the runtime's
    predictor: str | None = None  # "oracle" (path: its trace) or another name (path: an artifact)
    predictor_path: str | None = None
    ignore_tables: bool = False
    work_dir: str | None = None  # accelerate's offload folder is made below it
    trace_out: str | None = None  # all_resident: write the router choices of every prompt here
    sample_seed: int | None = None  # None: greedy; else sampled, see `measure.generate_ids`


class _IgnoredTables(ExpertPredictor):
    """Runs `inner` on the hash-building thread as usual but publishes all-zero scores, which the
    runtime turns into no prefetches: the thread's cost without its benefit."""

    kind = "ignored-tables"

    def __init__(self, inner: ExpertPredictor) -> None:
        self.inner, self.meta = inner, inner.meta

    def predict(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(self.inner.predict(input_ids))

    def start(self, batch_size: int) -> Any:
        return self.inner.start(batch_size)

    def step(self, state: Any, token_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(self.inner.step(state, token_ids))


def _device_map(model: nn.Module, offloaded: set[str]) -> dict[str, str]:
    """Modules named in `offloaded` -> "disk", every other branch -> "cpu"."""
    out: dict[str, str] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = prefix + name
            if path in offloaded:
                out[path] = "disk"
            elif any(o.startswith(path + ".") for o in offloaded):
                visit(child, path + ".")
            else:
                out[path] = "cpu"

    visit(model, "")
    return out


def _load_accelerate(job: Job, stack: ExitStack) -> nn.Module:
    """The model with its routed experts offloaded to disk by transformers + accelerate."""
    from prescient.arch import find_moe_layers
    from prescient.model_dir import ModelDirectory, model_class

    model_dir = ModelDirectory.open(job.model_dir)
    skeleton = model_dir.weightless_model()
    names = {id(module): name for name, module in skeleton.named_modules()}
    device_map = _device_map(skeleton, {names[id(layer.experts)] for layer in find_moe_layers(skeleton)})
    folder = Path(tempfile.mkdtemp(prefix="accelerate-offload-", dir=job.work_dir))
    stack.callback(shutil.rmtree, folder, True)
    model = model_class(model_dir.config).from_pretrained(job.model_dir, dtype=job.options.torch_dtype,
                                                          device_map=device_map, offload_folder=str(folder)).eval()
    if job.options.drop_page_cache:
        fds = [os.open(path, os.O_RDONLY) for path in sorted(folder.rglob("*")) if path.is_file()]
        stack.callback(lambda: [os.close(fd) for fd in fds])

        def drop(*_args) -> None:
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        for fd in fds:
            os.fsync(fd)  # dirty pages of the just-written files cannot be dropped
        drop()
        for layer in find_moe_layers(model):
            layer.experts.register_forward_hook(drop)
    return model


def load_job(job: Job, stack: ExitStack) -> tuple[nn.Module, Any, dict[str, Any]]:
    """The job's model, its offload runtime (None for the baselines; closed by `stack`), and what
    the job reports about it."""
    from offload_runtime.engine.loader import load_offloaded
    from predictor.artifact import load_predictor
    from predictor.baselines import OraclePredictor
    from prescient.arch import find_moe_layers
    from prescient.fingerprint import loaded_fingerprint
    from prescient.loading import load_model
    from prescient.model_dir import ModelDirectory
    from prescient.traces import load_trace

    if job.kind == "all_resident":
        model_dir = ModelDirectory.open(job.model_dir)
        model, layers = load_model(model_dir, dtype=job.options.torch_dtype)
        fingerprint = loaded_fingerprint(model_dir, model, layers, job.options.torch_dtype)
        return model, None, {"fingerprint": fingerprint.to_dict()}
    if job.kind == "accelerate_disk":
        model = _load_accelerate(job, stack)
        return model, None, {"offloaded_modules": len(find_moe_layers(model))}
    predictor = None
    if job.predictor is not None:
        predictor = (OraclePredictor(load_trace(job.predictor_path)) if job.predictor == "oracle"
                     else load_predictor(job.predictor_path))
        predictor = _IgnoredTables(predictor) if job.ignore_tables else predictor
    model = load_offloaded(job.model_dir, predictor, job.options)
    runtime = stack.enter_context(model.runtime)
    layers, store = runtime.layers, runtime.store
    keys = [(layer, expert) for layer in range(len(layers)) for expert in range(layers[0].num_experts)]
    stored = sum(store.stored_nbytes(key) for key in keys)
    return model, runtime, {"model_info": {  # expert_bytes: what one miss moves (compressed bytes if stored so)
        "expert_bytes": round(stored / len(keys)), "slot_bytes": store.expert_nbytes,
        "total_expert_bytes": stored, "total_slot_bytes": store.total_nbytes, "n_moe_layers": len(layers),
        "n_experts": layers[0].num_experts, "top_k": layers[0].top_k}}
