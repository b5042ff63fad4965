"""Load-aware expert kernels (EPS-MoE §4): which of transformers' experts implementations
computes a layer's experts fastest for its load, and when the per-expert pipeline pays.

EPS-MoE switches a layer's expert GEMMs between a grouped GEMM and a dense one by the tokens each
expert gets, from a crossover measured on the hardware, and skips the expert pipeline where the
tokens are too few for it to pay (below a measured m0 the split costs more than it hides). Here
the kernels are transformers' own (`transformers.integrations.moe`): the eager loop over experts
(a dense GEMM per expert), `batched_mm` (a batched matrix-vector product per (token, choice) row,
each gathering its expert's weights) and `grouped_mm` (one grouped GEMM over every expert).

    table = measure_crossover(layer.experts)     # on the layer's shapes, random weights
    choose(8.0, table)                           # the kernel measured fastest at 8 tokens per expert
    pipelines(8.0, table)                        # whether per-expert parts pay at that load

`measure_crossover` times each kernel at each load m (tokens per activated expert, every expert
activated) and keeps the fastest, but the model's own kernel unless another beats it by `MARGIN`
(timings on a shared CPU move by more than the kernels differ at some loads, and the model's own
kernel is the one that rounds as the model does); another kernel three times slower than the
fastest at a load is not timed at larger ones (batched_mm gathers an expert's weights per row, so
it only falls further behind). The pipeline threshold: at load m, one call over all A experts
takes t1, and A calls, each on one expert's rows (the pipeline's parts), take tA; splitting adds
tA − t1 and can hide at most t1 (all the compute, on a link slower than it), so parts pay from the
least load where tA < 2·t1 holds at it and every larger load.
The table is small JSON (`CrossoverTable.to_json`, `load_table`); `crossover_for` measures once
per process per layer shape, at fewer loads (seconds for a layer of wide experts: give a table
from `prescient bench-kernels` instead where load time matters).

Two kernels of our own, registered with transformers' experts implementations, stand in for
grouped_mm on the CPU (`stands_in`; `RuntimeOptions.expert_kernel`): "streamed" runs each routed
expert's GEMM straight from its weights, grouped_mm's numbers bit for bit without its per-call
work; "gemv" also runs a decode token's float32 rows against wide matrices through
`rowdot.product`, a dot product per row at the memory bus's rate, which rounds differently in
the last bits.
"""

from __future__ import annotations

import copy as shallow
import json
import logging
import time
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload_runtime.engine import rowdot
from offload_runtime.engine.options import GEMV, KERNELS, STREAMED  # the kernels' names, read by --help without torch
from prescient.errors import PrescientError

log = logging.getLogger(__name__)

LOADS = (1, 2, 4, 8, 16, 32, 64)  # tokens per activated expert
LOAD_TIME_LOADS = (1, 4, 16, 64)  # measured at load (no table given): fewer, a layer of wide experts takes seconds
MARGIN = 0.10  # another kernel replaces the model's own only where it is this much faster
GIVE_UP = 3.0  # a kernel this many times slower than the fastest at a load is not timed at larger loads


class KernelTableError(PrescientError):
    """A crossover table file that cannot be read or does not fit the layer."""


@dataclass(frozen=True)
class CrossoverTable:
    """The fastest kernel per load (`loads` ascending, `kernels` alike), the least load from which
    the per-expert pipeline pays (`pipeline_from`; None: at no measured load), and what was timed
    (`seconds`: per kernel the best time at each load, None where not timed; `parts_seconds`: A
    calls of the kept kernel, each on one expert's rows, as the pipeline's parts; `shape`: the layer's; `model_kernel`: the module's own
    implementation, kept unless another was faster by `margin`)."""

    loads: tuple[int, ...]
    kernels: tuple[str, ...]
    pipeline_from: float | None
    seconds: dict[str, list[float | None]]
    parts_seconds: list[float]
    shape: dict[str, Any]
    model_kernel: str | None = None
    margin: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"loads": list(self.loads), "kernels": list(self.kernels), "pipeline_from": self.pipeline_from,
                "seconds": self.seconds, "parts_seconds": self.parts_seconds, "shape": self.shape,
                "model_kernel": self.model_kernel, "margin": self.margin}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CrossoverTable:
        if "crossover" in data:  # a `prescient bench-kernels` results file holds the table under this key
            data = data["crossover"]
        try:
            table = cls(tuple(int(m) for m in data["loads"]), tuple(data["kernels"]), data["pipeline_from"],
                        dict(data.get("seconds", {})), list(data.get("parts_seconds", [])), dict(data.get("shape", {})),
                        data.get("model_kernel"), float(data.get("margin", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise KernelTableError(f"not a crossover table ({type(exc).__name__}: {exc}); write one with "
                                   "`prescient bench-kernels`") from None
        unknown = sorted(set(table.kernels) - set(KERNELS))
        if not table.loads or len(table.loads) != len(table.kernels) or unknown:
            raise KernelTableError(f"a crossover table needs one kernel of {', '.join(KERNELS)} per load; got loads "
                                   f"{list(table.loads)} and kernels {list(table.kernels)}")
        return table


def load_table(path: str | Path) -> CrossoverTable:
    """A table saved as JSON (by itself, or in a `prescient bench-kernels` results file)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise KernelTableError(f"cannot read the crossover table {path}: {exc}") from None
    return CrossoverTable.from_json(data)


def choose(tokens_per_expert: float, table: CrossoverTable) -> str:
    """The kernel measured fastest at the largest load not above `tokens_per_expert` (below the
    least load: the least load's)."""
    pick = table.kernels[0]
    for load, kernel in zip(table.loads, table.kernels):
        if load > tokens_per_expert:
            break
        pick = kernel
    return pick


def pipelines(tokens_per_expert: float, table: CrossoverTable) -> bool:
    """Whether the per-expert pipeline pays at this load (see the module doc)."""
    return table.pipeline_from is not None and tokens_per_expert >= table.pipeline_from


def with_kernel(module: nn.Module, kernel: str) -> nn.Module:
    """A shallow copy of a dispatching experts module (its parameters shared) that runs `kernel`:
    its config is a copy with `_experts_implementation` set, so the shared config never changes."""
    if kernel in (STREAMED, GEMV):
        register_streamed()
    copy = shallow.copy(module)
    copy.config = shallow.copy(module.config)
    copy.config._experts_implementation = kernel
    return copy


def dispatches(module: nn.Module) -> bool:
    """Whether `module` picks its forward from transformers' experts implementations by its config."""
    return isinstance(getattr(getattr(module, "config", None), "_experts_implementation", None), str)


def _random_experts(module: nn.Module, experts: int) -> nn.Module:
    """`module` with random weights for `experts` experts (parameters [experts, ...] in its dtype
    and device), a copy: the module itself is untouched."""
    copy = shallow.copy(module)
    copy._parameters = {name: None if p is None else nn.Parameter(
        torch.randn(experts, *p.shape[1:], dtype=p.dtype, device=p.device) * 0.02, requires_grad=False)
        for name, p in module._parameters.items()}
    if isinstance(getattr(copy, "num_experts", None), int):
        copy.num_experts = experts
    return copy


def _best_seconds(call, repeats: int) -> float:
    call()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def shape_of(module: nn.Module, experts: int, top_k: int) -> dict[str, Any]:
    """What a crossover depends on: the weights' shapes and dtype, the experts, the threads."""
    params = {name: list(p.shape[1:]) for name, p in module.named_parameters(recurse=False)}
    first = next(module.parameters())
    return {"module": type(module).__name__, "weights": params, "experts": experts, "top_k": top_k,
            "dtype": str(first.dtype).removeprefix("torch."), "device": str(first.device),
            "threads": torch.get_num_threads()}


@torch.inference_mode()
def measure_crossover(module: nn.Module, experts: int, top_k: int, loads: tuple[int, ...] = LOADS,
                      repeats: int = 3, kernels: tuple[str, ...] = KERNELS, seed: int = 0,
                      margin: float = MARGIN) -> CrossoverTable:
    """Time each of `kernels` on `module`'s shapes (random weights for `experts` experts) at each
    load of `loads` (every expert gets that many (token, choice) rows, one choice column each, as
    the runtime calls experts per part); best of `repeats` after a warm-up. At each load the
    fastest is kept, or the module's own implementation if within `margin` of it."""
    if not dispatches(module):
        raise KernelTableError(f"{type(module).__name__} does not dispatch to transformers' experts implementations; "
                               "there is no kernel to choose")
    own = module.config._experts_implementation
    generator = torch.Generator().manual_seed(seed)
    first = next(module.parameters())
    hidden = _hidden_size(module)
    randoms = _random_experts(module, experts)
    twins = {kernel: with_kernel(randoms, kernel) for kernel in kernels}
    seconds: dict[str, list[float | None]] = {kernel: [] for kernel in kernels}
    fastest, parts_seconds, live = [], [], list(kernels)
    for load in loads:
        rows = experts * load
        x = torch.randn(rows, hidden, generator=generator).to(first.dtype).to(first.device)
        ids = torch.arange(experts).repeat_interleave(load)[torch.randperm(rows, generator=generator)]
        ids, weights = ids.unsqueeze(1).to(first.device), torch.ones(rows, 1, dtype=first.dtype, device=first.device)
        timed = {k: _best_seconds(lambda k=k: twins[k](x, ids, weights), repeats) for k in live}
        for kernel in kernels:
            seconds[kernel].append(timed.get(kernel))
        best = min(timed, key=timed.get)
        if own in timed and timed[own] <= (1 + margin) * timed[best]:
            best = own
        fastest.append(best)
        parts = [(x[ids[:, 0] == e], ids[ids[:, 0] == e], weights[:load]) for e in range(experts)]
        parts_seconds.append(_best_seconds(lambda: [twins[best](*part) for part in parts], repeats))
        live = [k for k in live if k == own or timed[k] < GIVE_UP * min(timed.values())]
        log.debug("load %d: %s; %d one-expert calls %.4f s", load, timed, experts, parts_seconds[-1])
    pays = [parts < 2 * seconds[best][i] for i, (parts, best) in enumerate(zip(parts_seconds, fastest))]
    first_paying = next((i for i in range(len(loads)) if all(pays[i:])), None)
    return CrossoverTable(tuple(loads), tuple(fastest), None if first_paying is None else float(loads[first_paying]),
                          seconds, parts_seconds, shape_of(module, experts, top_k), own, margin)


def _hidden_size(module: nn.Module) -> int:
    config = module.config
    size = getattr(module, "hidden_dim", None) or getattr(config, "hidden_size", None)
    if not isinstance(size, int):
        raise KernelTableError(f"{type(module).__name__}: cannot tell the hidden size to time its kernels at")
    return size


_MEASURED: dict[str, CrossoverTable] = {}


def crossover_for(module: nn.Module, experts: int, top_k: int) -> CrossoverTable:
    """`measure_crossover` once per process per layer shape (every layer of a model shares it)."""
    key = json.dumps(shape_of(module, experts, top_k), sort_keys=True)
    if key not in _MEASURED:
        start = time.perf_counter()
        _MEASURED[key] = measure_crossover(module, experts, top_k, loads=LOAD_TIME_LOADS, repeats=2)
        table = _MEASURED[key]
        log.info("expert kernels measured in %.1f s: %s; pipeline from %s tokens per expert",
                 time.perf_counter() - start, ", ".join(f"{m}: {k}" for m, k in zip(table.loads, table.kernels)),
                 table.pipeline_from)
    return _MEASURED[key]


def kernel_workspace_bytes(kernel: str, dtype: torch.dtype, device: str | torch.device, largest_matrix: int) -> int:
    """What `kernel` holds beyond the model's own activations while it decodes: for "gemv" on float32
    CPU weights where an expert matrix may reach `rowdot.LEAST_BYTES` (`largest_matrix`: at most
    one's bytes), `rowdot.WORKSPACE`; else nothing."""
    uses = (kernel == GEMV and dtype == torch.float32 and torch.device(device).type == "cpu"
            and largest_matrix >= rowdot.LEAST_BYTES)
    return rowdot.WORKSPACE if uses else 0


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
            matvec: bool = False) -> torch.Tensor:
    """One expert's matrix on its rows `x`: the GEMM grouped_mm runs on that expert's group (bias
    added after, as `_grouped_linear` adds it); `matvec`: a single row through `rowdot.product` on
    the same [out, in] weight (see `gemv_experts_forward`)."""
    if matvec:
        out = rowdot.product(x, weight)
    else:
        out = torch.mm(x, weight) if transposed else nn.functional.linear(x, weight)
    return out if bias is None else out.add_(bias)


def _grouped(self: nn.Module, name: str, groups: list[tuple[int, torch.Tensor]], matvec: bool) -> torch.Tensor:
    """Projection `name` ("gate_up_proj", "up_proj", "down_proj") of each (expert, rows) group, in
    group order: a GEMM per expert, straight from its slice of the [E, ...] weight; `matvec`: each
    group is one decode row, run through `rowdot.product` where its matrix `rowdot.streams`."""
    weight, bias = getattr(self, name), getattr(self, f"{name}_bias") if self.has_bias else None
    matvec = matvec and not self.is_transposed
    return torch.cat([_linear(rows, weight[e], None if bias is None else bias[e], self.is_transposed,
                              matvec and rowdot.streams(weight[e])) for e, rows in groups])


def _streamed(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              matvec: bool) -> torch.Tensor:
    tokens, k = top_k_index.shape
    flat_ids = top_k_index.reshape(-1)
    order = None
    if tokens == 1:  # decode: one row per expert, the ids read once
        groups = [(e, hidden_states) for e in flat_ids.tolist()]
    else:
        _, order = torch.sort(flat_ids)  # grouped_mm's sort: a GEMM's rounding of a row may depend on its place
        rows = hidden_states[order // k]
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        starts = list(accumulate(counts, initial=0))
        groups = [(e, rows[starts[e]:starts[e + 1]]) for e in range(len(counts)) if counts[e]]
    matvec = matvec and tokens == 1  # a prefill's rows run grouped_mm's GEMMs
    up = _grouped(self, "gate_up_proj" if self.has_gate else "up_proj", groups, matvec)
    hidden = self._apply_gate(up) if self.has_gate else self.act_fn(up)
    hidden = hidden.split([len(rows) for _, rows in groups])
    out = _grouped(self, "down_proj", [(e, part) for (e, _), part in zip(groups, hidden)], matvec)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    if order is not None:
        out = torch.empty_like(out).index_copy_(0, order, out)
    weighted = out * top_k_weights.reshape(-1, 1)
    return weighted.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def expert_rows(self: nn.Module, expert: int, rows: torch.Tensor) -> torch.Tensor:
    """Expert `expert` of experts module `self` (run by "streamed" or "gemv") on `rows`, unweighted:
    the computation `_streamed` runs for that expert's group alone."""
    matvec = self.config._experts_implementation == GEMV and len(rows) == 1
    up = _grouped(self, "gate_up_proj" if self.has_gate else "up_proj", [(expert, rows)], matvec)
    out = _grouped(self, "down_proj", [(expert, self._apply_gate(up) if self.has_gate else self.act_fn(up))], matvec)
    return self.post_expert_norm(out) if self.has_post_expert_norm else out


def streamed_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts signature (`ExpertsInterface`), registered as "streamed": each routed
    expert's GEMM on its own rows, straight from its [2I, H] / [H, I] weights (a decode token's is a
    matrix-vector product streaming the expert's bytes once), without grouped_mm's histogram,
    inverse permutation and per-group work over every expert. Its steps are grouped_mm's on the
    CPU: the same rows per expert in the same order, gating and norm over all rows at once, the k
    outputs weighted and summed in router order; so its result is grouped_mm's bit for bit."""
    return _streamed(self, hidden_states, top_k_index, top_k_weights, matvec=False)


def gemv_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """"streamed", but a decode token's float32 rows against a wide matrix (`rowdot.streams`) run
    `rowdot.product` on the same weights instead of torch's `linear` (MKL's sgemv), at the memory
    bus's rate (`experiments.bench_decode`). Its sums run in another order, so its results differ
    from grouped_mm's in the last bits; a prefill's rows are grouped_mm's, bit for bit."""
    return _streamed(self, hidden_states, top_k_index, top_k_weights, matvec=True)


def stands_in(implementation: str | None, device: torch.device) -> bool:
    """Whether "streamed" (or "gemv") computes in place of `implementation` on `device`: where it is
    transformers' grouped_mm on the CPU, whose per-group GEMMs it runs (see `streamed_experts_forward`)."""
    return implementation == "grouped_mm" and device.type == "cpu"


def stream_experts(model: nn.Module, kernel: str = STREAMED) -> bool:
    """Switch a whole transformers model from grouped_mm to `kernel` ("streamed" or "gemv") where
    `stands_in` holds for its experts; whether it did."""
    config = getattr(model, "config", None)
    weights = next(model.parameters(), None)
    if weights is None or not stands_in(getattr(config, "_experts_implementation", None), weights.device):
        return False
    register_streamed()
    model.set_experts_implementation(kernel)
    return True


def register_streamed() -> None:
    """Make "streamed" and "gemv" transformers' experts implementations (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if STREAMED not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(STREAMED, streamed_experts_forward)
        ALL_EXPERTS_FUNCTIONS.register(GEMV, gemv_experts_forward)
