"""`--memory SIZE`: how a memory cap for the whole process becomes the runtime's configuration,
decided here alone (`MemoryPlanner`): the loader asks, and builds what the plan says.

The cap counts everything the process holds (see `prescient.memory_cap`): the imported libraries,
the non-expert weights, the expert slots, the predictor, the KV cache and activations, and the page
cache its reads leave. Four outcomes:
- every expert fits beside the rest, the file pages the process runs (measured) included: they are
  copied into memory with the model (the plain transformers model, its own forward and kernels, no
  hooks);
- where asked (`map_experts`, or what `tune` kept, which measures mapping at every size it tunes):
  every weight is a view of the memory-mapped checkpoint (`mapped`: nothing copied, the page cache
  is the expert cache, the kernel reads back what it drops) and the model runs with no hooks;
- otherwise the experts are offloaded: what is left of the cap after the measured footprint of the
  process (compiled kernels, non-expert weights and predictor loaded) and the reserve buys slots. No longer mapped by
  default where the page cache could hold 80% of the experts: the slots' kernels decode faster
  there (runs/tb at 1100 MiB, 61 of 64 slots: 137-221 tokens/s, mapped 82-105, plain 87-90;
  results/bench-memory-tb-parity-*.json, the memory page);
- a cap that cannot buy one layer's top-k is refused, naming the smallest cap that works.
The limit is held by the kernel where the process runs in a cgroup at or under the cap (the page
cache is then kept: the kernel reclaims it first); elsewhere by dropping the pages the store reads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import cached_property

from offload_runtime.engine.expert_kernels import kernel_workspace_bytes
from offload_runtime.engine.options import RuntimeOptions
from prescient.arch import MoELayer, find_moe_layers
from prescient.errors import CapacityError
from prescient.fingerprint import expert_tensor_names
from prescient.memory_cap import CODE_BYTES, HOT_LIBRARY_BYTES, cgroup_limit
from prescient.model_dir import ModelDirectory

MiB = 2**20
SLACK = 16 * MiB  # the allocator's free lists, small buffers
PREFILL_TOKENS = 512  # activations are reserved for a prefill this long; longer prompts need more room
RESERVED_CONTEXT = 4096  # tokens of KV cache kept free (the model's context, or the request's, where shorter)


@dataclass(frozen=True)
class MemoryPlan:
    """What a memory cap buys, decided before the weights load: every expert resident (the plain
    model), every weight mapped from the checkpoint, or `slots` expert slots beside the rest; every
    figure in bytes. `line()` says it in one line, as `generate` and `serve` print it."""

    cap: int
    footprint: int  # the process with its non-expert weights loaded (estimated before loading)
    reserve: int  # KV cache, activations, copy buffers
    expert_bytes: int  # one expert's slot
    total_experts: int
    slots: int  # of `total_experts`; all of them when resident
    resident: bool  # every expert loaded with the model: no offloading, no hooks
    held_by: str  # "cgroup" (the kernel holds the cap), "dropped pages" (the store drops its reads), or nothing (mapped)
    mapped: bool = False  # resident as views of the memory-mapped checkpoint: the page cache holds the experts
    predictor_work: int = 0  # of `reserve`: what the predictor adds while it runs (measured over a warm-up)
    file_pages: int = HOT_LIBRARY_BYTES  # of `footprint`: the file-backed pages (library code, reads) it leaves room for
    why: str = ""  # why not a plan the cap looked as if it bought (every expert copied), where it was stepped down from

    @property
    def drop_page_cache(self) -> bool:
        return self.held_by != "cgroup"

    def line(self) -> str:
        """The chosen configuration in one line, as `generate` and `serve` print it."""
        gib = 2**30
        if self.mapped:
            cached = min(self.total_experts, max(0, (self.cap - self.footprint - self.reserve) // self.expert_bytes))
            where = (f"every weight mapped from the checkpoint, no hooks (the page cache holds ~{cached} of "
                     f"{self.total_experts} experts)")
        elif self.resident:
            where = "all experts resident, the model's own forward"
        else:
            where = f"{self.slots} of {self.total_experts} experts in slots ({self.slots * self.expert_bytes / gib:.2f} GiB)"
        work = f", the predictor at work {self.predictor_work / 2**20:.0f} MiB of it" if self.predictor_work else ""
        why = f"; {self.why}" if self.why else ""
        return (f"memory {self.cap / gib:.2f} GiB: {where}; process {self.footprint / gib:.2f} GiB (with "
                f"{self.file_pages / 2**20:.0f} MiB of file pages it runs), reserve {self.reserve / gib:.2f} GiB"
                f"{work}; held by {self.held_by}{why}")

    def to_json(self) -> dict:
        return asdict(self)


def held_by(cap: int) -> str:
    """How `cap` is held here: by a cgroup whose limit is at or under it, else by dropped pages."""
    limit = cgroup_limit()
    return "cgroup" if limit is not None and limit <= cap else "dropped pages"


def model_context(config) -> int | None:
    """The model's context in tokens: its text config's `max_position_embeddings` (None where it
    has none: relative positions, no bound). The one reading of it: the prompt checks of `generate`
    and `serve` and the KV cache the plan reserves."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None) or None


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """One token's KV cache over every layer (keys and values) in the compute dtype."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", 0) or 0
    heads = getattr(text, "num_attention_heads", 1) or 1
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or getattr(text, "hidden_size", 0) // heads
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def _ffn_shape(config) -> tuple[int, int, int]:
    """The hidden size, the widest FFN's width and the experts a token is routed to."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", 0) or 0
    widest = max(getattr(text, name, 0) or 0 for name in ("intermediate_size", "moe_intermediate_size",
                                                           "expert_intermediate_size", "ffn_dim"))
    top_k = max((getattr(text, name, 0) or 0 for name in ("num_experts_per_tok", "moe_topk", "top_k")), default=1)
    return hidden, widest, max(top_k, 1)


def workspace_bytes(config, dtype_bytes: int, prefill_tokens: int = PREFILL_TOKENS) -> int:
    """Activations of a `prefill_tokens` prefill through the widest FFN (an expert's gate, up and
    product) for each of the top-k rows a token sends to the experts (the experts' kernels take a
    layer's rows at once), and the residual stream, plus `SLACK`."""
    hidden, widest, top_k = _ffn_shape(config)
    return prefill_tokens * (3 * widest * top_k + 4 * hidden) * dtype_bytes + SLACK


def largest_matrix_bytes(config, dtype_bytes: int) -> int:
    """At most one expert matrix's bytes: the widest FFN's gate and up fused, [2I, H]."""
    hidden, widest, _ = _ffn_shape(config)
    return 2 * widest * hidden * dtype_bytes


def reserve_bytes(config, dtype_bytes: int, copy_buffers: int, context_tokens: int | None = None) -> int:
    """What the cap keeps free beside weights and slots: the KV cache of `context_tokens` (the
    longest sequence the process will hold; None: `RESERVED_CONTEXT`, or the model's context where
    shorter), the workspace of a prefill that long (at most `PREFILL_TOKENS`), and `copy_buffers`
    bytes of reads in flight."""
    context = min(model_context(config) or RESERVED_CONTEXT, context_tokens or RESERVED_CONTEXT)
    return (kv_bytes_per_token(config, dtype_bytes) * context
            + workspace_bytes(config, dtype_bytes, min(context, PREFILL_TOKENS)) + copy_buffers)


def plan_resident(cap: int, footprint: int, reserve: int, experts_bytes: int, total_experts: int,
                  file_pages: int = CODE_BYTES) -> MemoryPlan | None:
    """The plan that copies every expert into memory with the model, if `cap` holds the process's
    estimated `footprint` (non-expert weights loaded, `CODE_BYTES` of file pages), the file pages
    it runs beyond those (`file_pages`, measured), the reserve and `experts_bytes` (all experts);
    else None. Copied experts are anonymous memory the cgroup cannot reclaim (no swap): where they
    leave less than the file pages, the kernel evicts the libraries' code, which every token reads
    back (runs/tb at 1100 MiB: 1.0-1.4 major faults a token, 0.84x plain, results/bench-memory-tb-parity.json).
    No predictor is loaded then: with every expert resident there is nothing to prefetch."""
    footprint += max(0, file_pages - CODE_BYTES)
    if footprint + reserve + experts_bytes > cap:
        return None
    return MemoryPlan(cap, footprint, reserve, experts_bytes // total_experts, total_experts, total_experts,
                      True, held_by(cap), file_pages=max(file_pages, CODE_BYTES))


def plan_mapped(cap: int, footprint: int, reserve: int, expert_bytes: int, total_experts: int,
                min_cached: int) -> MemoryPlan:
    """Every expert mapped from the checkpoint: the page cache holds what is left
    beside the process's estimated `footprint` and the reserve; a CapacityError naming the smallest
    cap that works when that is fewer than `min_cached` experts (one layer's top-k)."""
    _require(cap, footprint, reserve, expert_bytes, min_cached, "experts in the page cache")
    held = held_by(cap)  # without a cgroup no page is dropped for the cap: the machine's pressure trims the cache
    return MemoryPlan(cap, footprint, reserve, expert_bytes, total_experts, total_experts, True,
                      held if held == "cgroup" else "nothing (mapped, no cgroup)", True, file_pages=CODE_BYTES)


def plan_offloaded(cap: int, footprint: int, reserve: int, expert_bytes: int, total_experts: int,
                   min_slots: int, predictor_work: int = 0, peak: int = 0,
                   file_pages: int = HOT_LIBRARY_BYTES) -> MemoryPlan:
    """The slots what is left of `cap` buys beside the process's measured `footprint` (non-expert
    weights and predictor loaded, with `file_pages` of file-backed pages), the reserve and what the
    predictor adds at work; a CapacityError naming the smallest cap that works when that is fewer
    than `min_slots` (one layer's top-k) or `cap` is below the process's `peak` before it holds any
    slot or reserve (its store opening)."""
    reserve += predictor_work
    slots = _require(cap, footprint, reserve, expert_bytes, min_slots, "expert slots", peak)
    return MemoryPlan(cap, footprint, reserve, expert_bytes, total_experts, min(slots, total_experts), False,
                      held_by(cap), predictor_work=predictor_work, file_pages=file_pages)


def _require(cap: int, footprint: int, reserve: int, expert_bytes: int, least: int, what: str, peak: int = 0) -> int:
    """How many experts `cap` holds beside `footprint` and `reserve`; a CapacityError naming the
    smallest cap that works when fewer than `least`, or when `cap` is below `peak` (what the process
    holds at once before any of them or the reserve is allocated)."""
    fixed = footprint + reserve
    count = (cap - fixed) // expert_bytes if cap > fixed else 0
    if count < least or cap < peak:
        smallest = max(fixed + least * expert_bytes, peak)
        opening = (f"; {peak / 2**30:.2f} GiB at its peak while the expert store opens"
                   if peak > fixed + least * expert_bytes else "")
        raise CapacityError(
            f"--memory {cap / 2**30:.2f} GiB cannot hold this model: the process needs {fixed / 2**30:.2f} GiB "
            f"beside its experts (libraries, the weights other than the experts and the predictor, "
            f"{reserve / 2**20:.0f} MiB of KV cache and buffers) and {least} {what} of {expert_bytes / 2**20:.1f} MiB"
            f"{opening}; the smallest memory that works is {smallest / 2**30:.2f} GiB ({-(-smallest // 2**20)}MiB)")
    return int(count)


@dataclass(frozen=True)
class Reserves:
    """What a run keeps free under its memory cap beside the weights and the slots, known to whoever
    starts it and given to the plan as it is, not written into the options: `context_tokens`, the
    longest sequence the process holds, whose KV cache and prefill workspace are reserved (the
    options' own `context_tokens` when named; `generate`: its prompt and new tokens; None:
    `RESERVED_CONTEXT`, or the model's context where shorter), and `prefix_cache`, the bytes of
    finished sequences' KV that `serve --prefix-cache` keeps."""

    context_tokens: int | None = None
    prefix_cache: int = 0


@dataclass(frozen=True)
class WholeModelNeed:
    """What the whole model needs, estimated before loading: this process now with the weights other
    than the routed experts (`footprint`), the reserve, and the experts (in the compute dtype)."""

    footprint: int
    reserve: int
    experts_bytes: int
    total_experts: int
    top_k: int

    @property
    def total(self) -> int:
        return self.footprint + self.reserve + self.experts_bytes

    @property
    def expert_bytes(self) -> int:
        return self.experts_bytes // self.total_experts


class MemoryPlanner:
    """What `options.memory` buys one model (`model_dir`) with `reserves` kept free, decided here
    from what the loader measures of this process: before anything loads, whether the whole model
    fits (`whole_model`: every expert copied, or every weight mapped); else, once the process holds
    the weights other than the experts and the predictor, how many slots are left (`slots`). Every
    reserve is counted by `reserve` alone."""

    def __init__(self, model_dir: ModelDirectory, options: RuntimeOptions, reserves: Reserves = Reserves()) -> None:
        self.model_dir, self.options, self.reserves = model_dir, options, reserves
        self.why = ""  # why the whole model was not copied, where it looked as if it fitted: said by the plan taken

    def reserve(self, copy_buffers: int) -> int:
        """`reserve_bytes` for the options' context (else the reserves'), what the expert kernel
        holds while it decodes (`kernel_workspace_bytes`), and the prefix cache."""
        options, config = self.options, self.model_dir.config
        dtype_bytes = options.torch_dtype.itemsize
        return (reserve_bytes(config, dtype_bytes, copy_buffers, options.context_tokens or self.reserves.context_tokens)
                + kernel_workspace_bytes(options.expert_kernel, options.torch_dtype, options.device,
                                         largest_matrix_bytes(config, dtype_bytes))
                + self.reserves.prefix_cache)

    def need(self, process: int) -> WholeModelNeed:
        """The whole model's `WholeModelNeed` in the options' dtype, from its shapes (nothing read),
        beside this process's `process` bytes now."""
        return replace(self._model_need, footprint=process + self._model_need.footprint)

    @cached_property
    def _model_need(self) -> WholeModelNeed:
        """`need` beside a process of no bytes: the model built on the meta device, once."""
        skeleton = self.model_dir.weightless_model(self.options.torch_dtype)
        layers = find_moe_layers(skeleton)
        experts = expert_tensor_names(layers)
        sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in skeleton.state_dict().items()}
        experts_bytes = sum(size for name, size in sizes.items() if name in experts)
        return WholeModelNeed(sum(sizes.values()) - experts_bytes, self.reserve(0), experts_bytes,
                              len(layers) * layers[0].num_experts, layers[0].top_k)

    def may_hold_slots(self, process: int) -> bool:
        """Whether the cap holds, beside this process's `process` bytes now, the weights other than
        the experts, the reserve and one layer's top-k slots: the least any plan of slots needs
        (from the shapes, before a weight is read; what loads after only adds to it)."""
        need = self.need(process)
        return need.footprint + need.reserve + need.top_k * need.expert_bytes <= self.options.memory

    def whole_model(self, process: int, file_pages: int = CODE_BYTES) -> MemoryPlan | None:
        """The whole model's plan beside this process's `process` bytes now (`CODE_BYTES` of file
        pages counted) and the `file_pages` it has resident now (measured: the libraries it runs):
        mapped where `map_experts` asks; copied into memory where every expert fits beside both (the
        plain transformers model); else None (slots). Where every expert fits beside `CODE_BYTES`
        but not beside the measured file pages, the slots' plan says so (`why`)."""
        need, map_experts, cap = self.need(process), self.options.map_experts, self.options.memory
        if map_experts:
            return plan_mapped(cap, need.footprint, need.reserve, need.expert_bytes, need.total_experts, need.top_k)
        resident = plan_resident(cap, need.footprint, need.reserve, need.experts_bytes, need.total_experts, file_pages)
        if resident is not None:
            return resident
        if need.total <= cap:
            self.why = (f"not every expert copied: {need.experts_bytes / 2**30:.2f} GiB of them beside the process "
                        f"and the {file_pages / 2**20:.0f} MiB of file pages it runs (measured) need "
                        f"{(need.total + file_pages - CODE_BYTES) / 2**30:.2f} GiB, and the copies would evict "
                        f"the libraries' code")
        return None

    def slots(self, footprint: int, expert_bytes: int, layers: list[MoELayer], predictor_work: int,
              peak: int = 0, direct_buffers: int | None = None) -> MemoryPlan:
        """The slots of `expert_bytes` each that the cap buys beside this process's measured
        `footprint` (non-expert weights and predictor loaded,
        `process_footprint(reads=direct_buffers is None)`), the reserve (with one expert's read in
        flight in the page cache per transfer worker, or, where reads pass around the page cache,
        the `direct_buffers` bytes of their bounce buffers) and what its predictor holds at work
        (`predictor_work`); a CapacityError naming the smallest cap that works below one layer's
        top-k, or below the process's `peak` before it holds slots or reserve."""
        direct = direct_buffers is not None
        in_flight = direct_buffers if direct else self.options.transfer_workers * expert_bytes
        plan = plan_offloaded(self.options.memory, footprint, self.reserve(in_flight), expert_bytes,
                              len(layers) * layers[0].num_experts, layers[0].top_k, predictor_work, peak,
                              CODE_BYTES if direct else HOT_LIBRARY_BYTES)
        return replace(plan, why=self.why) if self.why else plan
