"""The modules that replace a MoE block's experts: same forward signature, weights in slots.

Each keeps a *twin* of the model's own experts module whose parameters are views of the slot
pool's [S, ...] buffers, and remaps the router's expert ids to slot ids before calling that
twin's own forward — so transformers' expert math runs unchanged on the slot weights, and the
router stays the model's own. Which module replaces a block goes by its adapter's name:

- "fused" (`OffloadedExperts`): an experts module holding [E, ...] tensors (or [E * rows, ...],
  DBRX), called as `experts(hidden_states, top_k_index, top_k_weights)`. The twin holds the
  [S, ...] buffers and gets slot ids for expert ids; ids of weightless experts (LongCat-Flash's
  zero experts) follow the slots, and the twin's attributes that count experts count slots. The
  batched_mm/grouped_mm kernels sum a token's k expert outputs in router order, so their results
  are bit-identical to the resident model; eager accumulates in expert-id order, which the remap
  changes only for top-k > 2.
- "dense" (`OffloadedDenseExperts`): experts called on a row block per expert (Llama 4); only
  the experts with a nonzero block run, each on a twin over its slot.
- "switch" (`OffloadedSwitchExperts`): Switch Transformers' `nn.ModuleDict` of `expert_{i}`
  modules, called as `experts(hidden_states, one_hot [N, 1, E], weights [N, 1])`. The twin holds
  S `expert_{s}` modules whose weights are slot s's views, and gets the one-hot over slots. A
  token has at most one expert, so the result is exact.

With packed slots (int4 or int8 experts kept compressed, `offload_runtime.compression.kernels`),
the fused twin's packed weight parameters are `PackedWeights` over the slots' codes and scales,
and the twin runs transformers' eager expert loop (its `F.linear` calls reach the kernels);
only fused experts run this way. Mixed precision's slots come in two tiers (`PackedTier`s: int8
slots, then int4 ones), each expert parameter a `PackedWeights` over both.

When a layer selects more experts than slots exist (a long prefill under a small budget), or the
runtime computes experts as their copies land (the expert pipeline, Klotski's order; CGOPipe), the experts
run in groups given by the runtime's `arriving` (the one call every kind makes of it), each (token, choice) row at routing weight one;
the outputs are then weighted and summed as the model's own experts code does (`_combine`), so
that bf16, where a sum of partial sums rounds differently from one sum, stays bit-identical.
"""

from __future__ import annotations

import copy as shallow
from collections import Counter
from collections.abc import Iterator
from itertools import chain
from concurrent.futures import Future
from contextlib import closing
from typing import Protocol

import torch
from torch import nn

from offload_runtime.compression.kernels import SCALES_SUFFIX, PackedMatrixSpec, PackedWeights
from offload_runtime.engine.expert_kernels import (GEMV, KERNELS, STREAMED, CrossoverTable, choose, crossover_for,
                                                   dispatches, expert_rows, load_table, pipelines, stands_in,
                                                   with_kernel)
from offload_runtime.engine.expert_layout import expert_spec
from offload_runtime.engine.hybrid import HybridExperts, measure_times
from offload_runtime.engine.options import OptionsError, RuntimeOptions
from offload_runtime.engine.slots import SlotPool
from prescient.arch import MoELayer
from prescient.checkpoint_schemes import CompressionError


class ExpertSlots(Protocol):
    """What an offloaded experts module needs of the runtime (`OffloadRuntime`): the slot pool it
    computes on, HybriMoE's scheduler (`hybrid`: the weights where they live), its `options` (the
    expert kernel) and the one call that hands it a layer's experts (`arriving`: each group of them
    as it lands, with the slot table, or those that compute where they live first)."""

    pool: SlotPool
    hybrid: "HybridExperts | None"  # HybriMoE's scheduler (`RuntimeOptions.hybrid_schedule`), else None
    options: RuntimeOptions

    def arriving(self, layer: int, experts: list[int], device: torch.device, as_they_land: bool = True,
                 loads: list[int] | None = None) -> Iterator[tuple[list[int], torch.Tensor | None]]: ...


def most_routed_first(chosen: torch.Tensor) -> list[int]:
    """The distinct expert ids in `chosen` (a layer's routing choices, any shape), the expert the
    most tokens routed to first (ties: the lower id). The runtime requests a layer's demand copies
    in this order: HybriMoE's transfer priority, the highest load first, so the expert most rows
    wait for lands first (and, with the expert pipeline, computes first)."""
    if chosen.numel() <= 256:  # a decode step's few ids are quicker counted in Python
        counts = Counter(chosen.flatten().tolist())
        return sorted(counts, key=lambda e: (-counts[e], e))
    counts = torch.bincount(chosen.flatten())
    order = torch.argsort(counts, descending=True, stable=True)
    return order[:int((counts > 0).sum())].tolist()


def twin(module: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of `module` whose parameters named in `tensors` (dotted names, e.g.
    "wi.weight") are those tensors; submodules on their way are copied, all else is shared."""
    copy = object.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    copy._parameters = {name: nn.Parameter(tensors[name], requires_grad=False) if name in tensors else param
                        for name, param in module._parameters.items()}
    below: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if "." in name:
            child, rest = name.split(".", 1)
            below.setdefault(child, {})[rest] = tensor
    copy._modules = {name: twin(child, below[name]) if name in below else child
                     for name, child in module._modules.items()}
    return copy


class _Offloaded(nn.Module):
    """What every kind shares: the layer, the twin (not a submodule: no state_dict copy) and the
    runtime that makes experts resident."""

    def __init__(self, layer: MoELayer, expert_names: set[str], buffers: dict[str, torch.Tensor],
                 slot_twin: nn.Module, runtime: ExpertSlots) -> None:
        super().__init__()
        missing = expert_names - set(buffers)
        if missing:
            raise ValueError(f"slot pool lacks expert tensors {sorted(missing)} of layer {layer.index}")
        self.layer = layer.index
        self.num_experts = layer.num_experts
        object.__setattr__(self, "_twin", slot_twin)
        object.__setattr__(self, "_runtime", runtime)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, offloaded"


OURS = (STREAMED, GEMV)  # our kernels: each stands in for grouped_mm (`expert_kernels.stands_in`)
PackedTier = tuple[dict[str, torch.Tensor], dict[str, PackedMatrixSpec]]  # a tier's slot buffers and matrices


def _fused_twin(layer: MoELayer, buffers: dict[str, torch.Tensor], num_slots: int,
                packed: list[PackedTier]) -> nn.Module:
    """The experts module over slot buffers: each parameter is its [S, ...] buffer (shaped as
    the module holds it), and each attribute that counts experts now counts slots: the expert
    count becomes S and the router's choice count S + the weightless experts (ids remapped alike).
    A parameter packed in the slots is a `PackedWeights` over every tier's instead, and the twin
    runs the eager loop."""
    experts = layer.experts
    spec, _ = expert_spec(layer)
    matrices = packed[0][1] if packed else {}
    copy = twin(experts, {name: spec.as_module_tensor(name, buffers[name]) for name in spec.shapes
                          if name not in matrices})
    if packed:
        for name in matrices:
            del copy._parameters[name]
            copy.__dict__[name] = PackedWeights([(tier[name], tier[name + SCALES_SUFFIX], specs[name])
                                                 for tier, specs in packed])
        if hasattr(experts, "config"):  # transformers' grouped/batched kernels index the [S, ...] tensors themselves
            copy.config = shallow.copy(experts.config)
            copy.config._experts_implementation = "eager"
    weightless = layer.num_choices - layer.num_experts
    for attr, value in vars(experts).items():
        if "expert" in attr and isinstance(value, int) and not isinstance(value, bool):
            if value == layer.num_experts:
                setattr(copy, attr, num_slots)
            elif value == layer.num_choices:
                setattr(copy, attr, num_slots + weightless)
    return copy


def _kernel_setting(layer: MoELayer, slot_twin: nn.Module, runtime: ExpertSlots, packed: list[PackedTier] | None
                    ) -> tuple[str, CrossoverTable | None, dict[str, nn.Module]]:
    """`RuntimeOptions.expert_kernel` for fused experts over slots: the setting ("model" where
    there is nothing to choose: packed slots run the eager loop, experts code of its own has no
    kernels), the crossover table of "auto" (read from `expert_kernel_table`, else measured on
    the twin's shapes once per process) and a twin per kernel it may call."""
    options = getattr(runtime, "options", None)
    kernel = getattr(options, "expert_kernel", "model")
    if kernel == "model" or (kernel in ("auto", "eager", *OURS) and packed):
        return "model", None, {}
    if kernel in OURS:  # stands in for grouped_mm where the model runs it (see `expert_kernels.stands_in`)
        return (kernel, None, {kernel: with_kernel(slot_twin, kernel)}) if dispatches(slot_twin) else \
            ("model", None, {})
    if packed or not dispatches(slot_twin):
        if kernel == "auto":
            return "model", None, {}
        raise OptionsError(f"{layer.name}: expert kernel {kernel!r} needs experts that dispatch to transformers' "
                           f"implementations ({type(layer.experts).__name__} does not); use --expert-kernel model")
    twins = {k: with_kernel(slot_twin, k) for k in (KERNELS if kernel == "auto" else (kernel,))}
    if kernel != "auto":
        return kernel, None, twins
    path = getattr(options, "expert_kernel_table", None)
    experts = min(layer.num_experts, runtime.pool.num_slots)
    return kernel, load_table(path) if path else crossover_for(slot_twin, experts, layer.top_k), twins


class OffloadedExperts(_Offloaded):
    """Drop-in for fused experts: `forward(hidden_states, top_k_index, top_k_weights)`. Ids of
    weightless experts (at or above the expert count: LongCat-Flash's zero experts) pass to the
    twin after the slots, where its own code computes them without weights."""

    def __init__(self, layer: MoELayer, buffers: dict[str, torch.Tensor], runtime: ExpertSlots,
                 packed: list[PackedTier] | None = None) -> None:
        slot_twin = _fused_twin(layer, buffers, runtime.pool.num_slots, packed or [])
        super().__init__(layer, set(expert_spec(layer)[0].shapes), buffers, slot_twin, runtime)
        self._weightless = torch.arange(layer.num_choices - layer.num_experts) + runtime.pool.num_slots
        self._k = layer.top_k
        # choice columns per row when experts run per (token, choice): transformers' dispatching
        # experts take one, so each expert's matmul has the model's rows (float32 GEMMs round by row
        # count); other experts code may index k columns (LongCat's squeezes them), and gets the model's k
        self._columns = 1 if self._implementation is not None else self._k
        self._kernel, self._table, self._kernel_twins = _kernel_setting(layer, self._twin, runtime, packed)
        # twins over a window of the slots, by (first, last) slot: transformers' grouped_mm on the CPU
        # costs per group, empty or not, so a call on the whole pool pays for every slot (see `_windowed`)
        self._windows: dict[tuple[int, int], nn.Module] | None = None if packed or len(self._weightless) else {}
        self._spec = expert_spec(layer)[0]
        # HybriMoE's scheduler: a twin over the weights where they live (the host store's layer, or scratch slots)
        hybrid = getattr(runtime, "hybrid", None)
        object.__setattr__(self, "_lives", None if hybrid is None or packed  # not a submodule: no state_dict copy
                           else _fused_twin(layer, *hybrid.buffers(layer.index), []))
        object.__setattr__(self, "_slot_buffers", buffers)  # not nn.Module's `_buffers`: no state_dict copy
        # the twin's attributes that count its experts (`_fused_twin` made them count slots)
        self._counts = [attr for attr, value in vars(layer.experts).items() if "expert" in attr
                        and isinstance(value, int) and not isinstance(value, bool) and value == layer.num_experts]

    @property
    def _implementation(self) -> str | None:
        """transformers' experts implementation the twin dispatches to (read at each call: a user
        may `set_experts_implementation`); None for experts code of its own."""
        return getattr(getattr(self._twin, "config", None), "_experts_implementation", None)

    def _ids(self, slots: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        """Expert and weightless ids → slot ids and the ids after the slots."""
        if not len(self._weightless):
            return slots[top_k_index]
        return torch.cat([slots, self._weightless.to(slots.device)])[top_k_index]

    def _windowed(self, experts: list[int], ids: torch.Tensor, implementation: str | None
                  ) -> tuple[nn.Module, torch.Tensor]:
        """The twin to call on slot `ids` of `experts`, and the ids it takes: with transformers'
        grouped_mm on the CPU, a twin over just the slots from the first to the last of `experts`
        (ids shifted to it), since that kernel's cost grows with the groups it is given, empty or
        not; its groups are the same matmuls on the same rows, so the result is identical."""
        if self._windows is None or implementation != "grouped_mm" or ids.device.type != "cpu":
            return self._twin, ids
        row = self._runtime.pool.map.rows[self.layer]
        slots = [int(row[e]) for e in experts]
        first, last = min(slots), max(slots)
        if last - first + 1 >= self._runtime.pool.num_slots:
            return self._twin, ids
        window = self._windows.get((first, last))
        if window is None:
            if len(self._windows) >= 256:  # each is a few small objects; bound them all the same
                self._windows.clear()
            window = self._windows[first, last] = twin(self._twin, {
                name: self._spec.as_module_tensor(name, self._slot_buffers[name][first:last + 1])
                for name in self._spec.shapes})
            for attr in self._counts:
                setattr(window, attr, last - first + 1)
        return window, ids - first

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if len(self._weightless):
            weighted = top_k_index < self.num_experts
            experts = most_routed_first(top_k_index[weighted])
        else:  # every choice is an expert with weights
            weighted = None
            experts = most_routed_first(top_k_index)
        device = top_k_index.device
        implementation = self._implementation
        sums_in_router_order = implementation in ("batched_mm", "grouped_mm")
        kernel, as_they_land = self._plan(top_k_index, weighted, len(experts))
        streamed = self._kernel_twins[self._kernel] if self._kernel in OURS and stands_in(implementation, device) \
            else None
        loads = self._loads(hidden_states, top_k_index, experts) if self._lives is not None else None
        with closing(self._runtime.arriving(self.layer, experts, device, as_they_land, loads)) as arriving:
            lives, first = [], next(arriving)
            if first[1] is None:  # HybriMoE's scheduler (`hybrid`): these compute where they live, the rest in slots
                lives, first = first[0], next(arriving)
                experts = [e for e in experts if e not in lives]
            # one call of the twin on slot ids sums as the model does, unless the eager loop adds more
            # than two outputs a token: it adds in expert-id order, and slot order is not expert order;
            # the runtime hands every expert in the first group where they are all in (or it waits for them)
            if kernel is None and not lives and (sums_in_router_order or self._k <= 2) and len(first[0]) == len(experts):
                slots = first[1]
                if streamed is not None:
                    return streamed(hidden_states, self._ids(slots, top_k_index), top_k_weights)
                twin, ids = self._windowed(experts, self._ids(slots, top_k_index), implementation)
                return twin(hidden_states, ids, top_k_weights)
            groups = chain([first], arriving)
            if streamed is not None and not lives and weighted is None and len(top_k_index) == 1:
                return self._decode_as_they_land(hidden_states, top_k_index, top_k_weights, groups, streamed)
            computing = (streamed or self._twin) if kernel is None else self._kernel_twins[kernel]
            return self._in_groups(hidden_states, top_k_index, top_k_weights, weighted, groups, lives, computing,
                                   sums_in_router_order)

    def _in_groups(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   weighted: torch.Tensor | None, groups: Iterator[tuple[list[int], torch.Tensor]], lives: list[int],
                   computing: nn.Module, sums_in_router_order: bool) -> torch.Tensor:
        """Each group of experts (`groups`, as they land) on its own (token, choice) rows at routing
        weight one (on `computing`, the chosen kernel's twin), those of `lives` on the CPU where they
        live, the weightless choices last; the outputs then weighted and summed as the model's own
        code does (`_combine`): a sum of partial sums rounds differently in bf16."""
        device = top_k_index.device
        if weighted is None:
            weighted = top_k_index < self.num_experts
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        unweighted = flat.new_zeros(*top_k_index.shape, flat.shape[-1])
        elsewhere = self._compute_where_they_live(flat, top_k_index, lives, top_k_weights.dtype) if lives else None

        def run(rows: torch.Tensor, slots: torch.Tensor, experts_module: nn.Module, part: list[int] | None = None) -> None:
            token, choice, out = self._rows_out(experts_module, flat, top_k_index, rows, slots, top_k_weights.dtype, part)
            unweighted[token, choice] = out.reshape(len(token), -1).to(unweighted.dtype)

        for part, slots in groups:
            if part:
                run(torch.isin(top_k_index, torch.tensor(part, device=device)), slots, computing, part)
        if elsewhere is not None:  # the CPU side's rows, once its thread is done
            for token, choice, out in elsewhere.result():
                unweighted[token.to(device), choice.to(device)] = out.reshape(len(token), -1).to(device, unweighted.dtype)
        if not weighted.all():
            run(~weighted, self._runtime.pool.map.table[self.layer].to(device), self._twin)
        combined = self._combine(unweighted, top_k_index, top_k_weights, sums_in_router_order)
        return combined.reshape(hidden_states.shape)

    def _decode_as_they_land(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                             arriving: Iterator[tuple[list[int], torch.Tensor]], kernel_twin: nn.Module) -> torch.Tensor:
        """One decode token on our kernel's twin (`OURS`), each expert as its part lands
        (`arriving`, from `ExpertSlots.arriving`), unweighted; then weighted and summed in router order
        as the kernel sums them (`_combine`): the row bookkeeping of `_rows_out` done on the token's
        k ids."""
        choices = top_k_index[0].tolist()
        unweighted: list[torch.Tensor | None] = [None] * len(choices)
        for part, slots in arriving:
            for expert in part:
                out = expert_rows(kernel_twin, int(slots[expert]), hidden_states)
                for j, choice in enumerate(choices):
                    if choice == expert:
                        unweighted[j] = out
        combined = self._combine(torch.stack(unweighted, dim=1), top_k_index, top_k_weights, True)
        return combined.reshape(hidden_states.shape)

    def _rows_out(self, experts_module: nn.Module, flat: torch.Tensor, top_k_index: torch.Tensor, rows: torch.Tensor,
                  table: torch.Tensor, weight_dtype: torch.dtype, part: list[int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (token, choice) rows of `rows` computed by `experts_module` on the weights that
        `table` (expert → index into its buffers) points at, each row as a token of its own: the
        choice at weight one, then (`_columns` > 1) the same id at weight zero, adding exact zeros.
        `part`: the slot experts the rows route to, so the twin over the slots is windowed to theirs."""
        token, choice = torch.nonzero(rows, as_tuple=True)
        ids = self._ids(table, top_k_index[token, choice]).unsqueeze(1).expand(-1, self._columns)
        if part and experts_module is self._twin:  # as one call's: grouped_mm on the CPU pays per slot
            experts_module, ids = self._windowed(part, ids, self._implementation)
        weights = torch.zeros(len(token), self._columns, dtype=weight_dtype, device=flat.device)
        weights[:, 0] = 1
        return token, choice, experts_module(flat[token], ids, weights)

    def _loads(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, experts: list[int]) -> list[int]:
        """The tokens routed to each of `experts`, which HybriMoE's scheduler (`hybrid.HybridExperts`)
        decides on; the first call on a GPU host measures the scheduler's costs (HybriMoE's warm-up)."""
        hybrid = self._runtime.hybrid
        if hybrid.split and hybrid.times is None:
            host = {name: t[0] for name, t in hybrid.buffers(self.layer)[0].items()}
            hybrid.times = measure_times(self._twin, self._lives, host, hidden_states.shape[-1], hidden_states.dtype,
                                         hidden_states.device)
        loads = torch.bincount(top_k_index[top_k_index < self.num_experts].flatten(), minlength=self.num_experts)
        return loads[experts].tolist()

    def _compute_where_they_live(self, flat: torch.Tensor, top_k_index: torch.Tensor, lives: list[int],
                                 weight_dtype: torch.dtype) -> Future:
        """Start computing the rows of experts `lives` on the CPU from where they live (the host
        store's tensors or scratch slots, `HybridExperts.lend`): a future of (token, choice, out)
        groups, on CPU tensors."""
        hybrid = self._runtime.hybrid
        x, index = flat.to("cpu"), top_k_index.to("cpu")

        def compute() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
            with torch.inference_mode():
                return [self._rows_out(self._lives, x, index, torch.isin(index, torch.tensor(part)), table, weight_dtype)
                        for part, table in hybrid.lend(self.layer, lives)]

        return hybrid.submit(compute)

    def _plan(self, top_k_index: torch.Tensor, weighted: torch.Tensor | None, experts: int) -> tuple[str | None, bool]:
        """The kernel this call computes with (None: the twin's own, the model's implementation) and
        whether its experts may compute as their copies land (where the runtime's expert pipeline is
        on): by `RuntimeOptions.expert_kernel`; "auto" picks both by the tokens per activated expert."""
        if self._kernel in ("model", *OURS) or not experts:
            return None, True
        if self._kernel != "auto":
            return (None if self._kernel == self._implementation else self._kernel), True
        # only "auto" reads the load (a device sync on a GPU); weighted None: every choice is weighted
        load = (top_k_index.numel() if weighted is None else int(weighted.sum())) / experts
        kernel = choose(load, self._table)
        return (None if kernel == self._implementation else kernel), pipelines(load, self._table)

    @staticmethod
    def _combine(unweighted: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 sums_in_router_order: bool) -> torch.Tensor:
        """Each token's k expert outputs [N, k, H] weighted and summed as the model's experts code
        sums them: transformers' batched and grouped kernels weight in the promoted dtype (a float32
        router weight makes it float32), sum the k in router order and round once; the eager loop
        rounds each weighted output to the hidden dtype and adds them in expert-id order."""
        weighted = unweighted * top_k_weights.unsqueeze(-1)
        if sums_in_router_order:
            return weighted.sum(dim=1).to(unweighted.dtype)
        weighted = weighted.to(unweighted.dtype)
        order = torch.argsort(top_k_index, dim=1, stable=True)
        total = torch.zeros_like(weighted[:, 0])
        for j in range(order.shape[1]):
            total += weighted.gather(1, order[:, j, None, None].expand(-1, 1, weighted.shape[-1])).squeeze(1)
        return total


class OffloadedDenseExperts(_Offloaded):
    """Drop-in for experts that read every (expert, token) row: `forward(hidden_states [E * N, H])`
    (Llama 4). Rows of an expert the router did not choose are zero, and the expert maps them
    to zero; so only experts with a nonzero row run, each on its own rows, on a twin whose
    parameters are its slot's [1, ...] views; the others' rows stay zero."""

    def __init__(self, layer: MoELayer, buffers: dict[str, torch.Tensor], runtime: ExpertSlots) -> None:
        spec, _ = expert_spec(layer)
        biased = [name for name in spec.shapes if "bias" in name]
        if biased:
            raise ValueError(f"layer {layer.index}: dense-call experts with biases {biased} do not map a zero row "
                             "to zero; running only the chosen experts would change the result")
        slots = [twin(layer.experts, {name: spec.as_module_tensor(name, buffers[name][s:s + 1])
                                      for name in spec.shapes})
                 for s in range(runtime.pool.num_slots)]
        super().__init__(layer, set(spec.shapes), buffers, slots[0], runtime)
        object.__setattr__(self, "_slot_twins", slots)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        rows = hidden_states.view(self.num_experts, -1, hidden_states.shape[-1])
        out = torch.zeros_like(rows)
        loads = rows.any(dim=-1).sum(dim=1)  # per expert, its nonzero (routed) rows
        experts = most_routed_first(torch.repeat_interleave(torch.arange(self.num_experts, device=rows.device), loads))
        for part, slots in self._runtime.arriving(self.layer, experts, hidden_states.device):
            for e in part:
                out[e] = self._slot_twins[int(slots[e])](rows[e]).reshape(rows[e].shape)
        return out.view(hidden_states.shape)


class OffloadedSwitchExperts(_Offloaded):
    """Drop-in for Switch Transformers' experts: `forward(hidden_states, one_hot [N, 1, E], weights [N, 1])`."""

    def __init__(self, layer: MoELayer, buffers: dict[str, torch.Tensor], runtime: ExpertSlots) -> None:
        experts = layer.experts
        template = next(iter(experts.children()))
        names = {name for name, _ in template.named_parameters()}
        num_slots = runtime.pool.num_slots
        slot_twin = object.__new__(type(experts))
        slot_twin.__dict__ = dict(experts.__dict__)
        slot_twin._modules = {f"expert_{s}": twin(template, {n: buffers[n][s] for n in names if n in buffers})
                              for s in range(num_slots)}
        slot_twin.num_experts = num_slots
        super().__init__(layer, names, buffers, slot_twin, runtime)

    def forward(self, hidden_states: torch.Tensor, selected_experts: torch.Tensor, routing_weights: torch.Tensor):
        chosen = selected_experts[:, 0, :]  # [N, E] one-hot; a zero row is a token over capacity
        routed = chosen.sum(-1) > 0
        expert_of = chosen.argmax(-1)
        out = torch.zeros_like(hidden_states)
        device = selected_experts.device
        for part, slots in self._runtime.arriving(self.layer, most_routed_first(expert_of[routed]), device):
            rows = torch.nonzero(routed & torch.isin(expert_of, torch.tensor(part, device=device))).squeeze(1)
            one_hot = selected_experts.new_zeros(chosen.shape[0], 1, self._runtime.pool.num_slots)
            one_hot[rows, 0, slots[expert_of[rows]]] = 1
            out = out + self._twin(hidden_states, one_hot, routing_weights)  # parts own disjoint rows
        return out


OFFLOADED: dict[str, type[_Offloaded]] = {"fused": OffloadedExperts, "dense": OffloadedDenseExperts,
                                          "switch": OffloadedSwitchExperts}


def offload_experts(layer: MoELayer, buffers: dict[str, torch.Tensor], runtime: ExpertSlots,
                    packed: list[PackedTier] | None = None) -> nn.Module:
    """The module that replaces `layer.experts`, chosen by `layer.adapter.name`; `packed` (per
    tier of packed slots, its buffers and the store's packed weight parameters) only for fused
    experts."""
    try:
        cls = OFFLOADED[layer.adapter.name]
    except KeyError:
        raise NotImplementedError(f"no offloaded experts module for {layer.adapter.name!r} blocks "
                                  f"({layer.name}); known kinds: {', '.join(OFFLOADED)}") from None
    if packed:
        if cls is not OffloadedExperts:
            raise CompressionError(f"{layer.name}: packed slots run fused experts only, not {layer.adapter.name!r} "
                                   "blocks; serve with --slot-format expanded")
        return cls(layer, buffers, runtime, packed)
    return cls(layer, buffers, runtime)
