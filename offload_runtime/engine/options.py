"""`RuntimeOptions`: every setting of the offloading runtime in one frozen object, checked when made.

    options = RuntimeOptions(policy="mrs", budget="50%", next_token_min_chance=0.5)
    model = load_offloaded("runs/demo/model", "runs/demo/predictor/sida", options)

`engine.resolve.resolve_options` makes the one a run uses, from the settings a user named (the
command line's flags, the Python API's keywords) over the tuned and measured defaults; every result
JSON records `to_json()`. A value of the wrong type or out of range fails here, before any file is
read, with the error class of what it configures (`CapacityError` for the budget, `PolicyError` for
the policy, `DeviceError` for the device, `PredictorError` for the next-token chance,
`OptionsError` for the rest).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from cache import make_serving_policy
from cache.tiered import PRECISION_RULES
from cache.timing import LinkTiming
from prescient.budget import Budget, parse_memory
from prescient.devices import check_device
from prescient.errors import PrescientError

if TYPE_CHECKING:
    import torch

# This module imports no torch: `prescient --help` reads its names and defaults.
STORES = ("disk", "host")
SLOT_FORMATS = ("expanded", "packed")
PREDICTOR_ERRORS = ("raise", "demand")  # what a failing hash-building thread does: stop the run, or serve on
DTYPES = ("float32", "bfloat16")  # torch's names of the dtypes a model computes in
KERNELS = ("eager", "batched_mm", "grouped_mm")  # transformers' experts implementations we choose among
STREAMED = "streamed"  # ours (`expert_kernels.streamed_experts_forward`), registered with transformers' implementations
GEMV = "gemv"  # ours: "streamed" with a decode row's products through `rowdot` (`gemv_experts_forward`)
EXPERT_KERNELS = ("model", "auto", *KERNELS, STREAMED, GEMV)  # `RuntimeOptions.expert_kernel`'s values
MAX_TRANSFER_WORKERS = 64  # reads in flight; storage queues gain nothing past a few dozen
MAX_LOOKAHEAD_LAYERS = 3  # HybriMoE's reach; the residual stream drifts farther out
MAX_TABLE_WAIT = 1.0  # seconds: a predictor slower than that per token costs more than it can win


class OptionsError(PrescientError, ValueError):
    """A runtime option of the wrong type or out of its range."""


def _whole(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionsError(f"{name} must be a whole number, got {value!r}")
    if value < least:
        raise OptionsError(f"{name} must be at least {least}, got {value}")


@dataclass(frozen=True)
class RuntimeOptions:
    """How the runtime serves: `policy` (a serving cache policy: lru, lfu, fifo, mrs, learned,
    learned-belady), `memory` (the whole process's memory, bytes or text such as "8GiB" or "25%" of
    this machine's: the runtime sizes its slots to fit, or loads every expert and runs the plain
    model where they all fit, see `memory_plan`; give it or `budget`, not both), `budget` (expert
    memory alone: a `Budget`, a fraction, or text such as "512MiB"; default half the experts),
    `store` ("disk": read from the checkpoint; "host": kept in host memory), `drop_page_cache`
    (disk store: drop read pages), `device` (of the slots and the resident weights),
    `transfer_workers` (copies that run at once), `read_depth` (disk store: each read split into this
    many reads in flight at once, the queue depth the device needs for its rate, with no buffer
    beyond the slot), `prefetch_per_layer` (experts prefetched per
    layer and predicted token; 0: none, the predictor's forecasts rank the cache's evictions alone;
    None: the model's top-k, but none on the CPU under learned eviction, where a wrong prefetch read
    from disk displaces an expert in use, see `runtime`; cross-token prefetch is apart from it), `link_timing` (hide-only prefetch: only
    copies that can end before their layer runs; None: as many as the slots allow),
    `next_token_min_chance` (cross-token prefetch of the next token's experts forecast at least
    this likely, the model's top-k per layer at most; None: off), `dtype` (what the model computes in, and so what a slot holds:
    "float32", or "bfloat16", half the bytes per slot; experts stored in another precision are
    converted or expanded into it as they arrive), `slot_format` ("expanded": a slot holds an
    expert in `dtype` whatever its stored precision; "packed": an int4-stored expert (in groups)
    stays int4 in its slot, about 3.5x more experts per byte than bf16, an int8-stored one (per
    channel) int8, 2x, and each computes with torch's weight-only CPU kernel, which needs
    `dtype="bfloat16"`); `fine_model` (mixed precision: a directory of the same model whose experts
    are stored finer, e.g. int8 per channel beside this model's int4; needs packed slots; None:
    off), `fine_share` (the share of the budget's bytes in fine slots), `precision_rule` (what
    picks a loaded expert's copy: "router", its router weight; "forecast", the predictor's chance
    that coming tokens use it; "hotness", its use count so far; see `cache.tiered`),
    `expert_pipeline` (Klotski's compute-while-loading order, common offloading practice: a layer's
    resident experts compute while its misses are copied,
    then each miss as it lands; False: the layer waits for all its copies first),
    `lookahead_layers` (in-token lookahead, after HybriMoE's, ordered by layer: when a MoE block starts, the routers of the
    next 1 to 3 layers on its input pick experts to prefetch; 0: off), `lookahead_probe` (a trained
    probe artifact, `prescient train --config configs/predictor/probe.yaml`, guesses instead of the
    routers; None: the routers), `expert_kernel` (EPS-MoE's load-aware kernels, see
    `expert_kernels`: "gemv" (default), ours where the model runs grouped_mm on the CPU: each routed
    expert's GEMM straight from its weights, a decode row of float32 weights of at least 1 MiB through
    `rowdot.product`, a dot product per row at the memory bus's rate (logits within 1e-5 of
    transformers' kernel, the same greedy tokens; in bfloat16/float16, and for smaller matrices,
    torch's `linear`: grouped_mm's numbers bit for bit); "streamed", the same without it, bit for bit; "model", the
    model's own experts implementation (bit-for-bit comparisons with transformers); "auto", per layer and call
    the kernel measured fastest for its tokens per activated expert, and no per-expert pipeline
    where that load is under the measured threshold; or one of transformers' "eager",
    "batched_mm", "grouped_mm"; the outputs are summed as the model's implementation sums them
    whatever kernel computed them), `expert_kernel_table` (with "auto": a crossover table JSON,
    `prescient bench-kernels`; None: measured on the layer's shapes at load), `hybrid_schedule`
    (HybriMoE's scheduler, see `hybrid`: on a GPU host with the host store, each layer's routed
    experts split between the GPU and the CPU beside it by measured costs; on a CPU-only host,
    admission: a miss whose predicted reuse is later than every resident expert's computes from a
    scratch buffer without evicting anything; False: every routed expert computes in a slot),
    `use_predictor` (False: a predictor given is not loaded, and the run is the runtime without one:
    what `prescient tune` keeps where that measured faster on this machine), `prediction_guard`
    (with a predictor: act on its predictions only while they load fewer experts
    than LRU would, see `prediction_guard`; not with mixed precision or `hybrid_schedule`, whose rules
    decide on the forecasts themselves), `table_wait` (SiDA's rule: seconds a forward's first
    MoE layer waits for its hash table; 0: never wait; default 10 ms: the wait hands the GIL to the
    hash-building thread, which otherwise waits up to the interpreter's 5 ms switch interval),
    `hash_thread` (SiDA's hash-building thread beside the inference thread; False: the predictor runs
    inline at each forward's start, its table always on time; None, the default: the thread where the
    slots are on a GPU, inline on the CPU, where the thread's turns at the GIL cost the inference
    thread more than the predictor's own work, see `hash_builder`), `on_predictor_error` (with a
    predictor, when the hash-building thread fails: "raise", the default; "demand": log it, count it
    (`RuntimeStats.predictor_failures`) and go on with demand loads alone, what `serve` always does)."""

    policy: str = "lru"
    memory: int | None = None
    budget: Budget | None = None  # Budget(0.5, "fraction") unless `memory` is given
    store: str = "disk"
    drop_page_cache: bool = False
    device: str = "cpu"
    transfer_workers: int = 1
    read_depth: int = 1
    prefetch_per_layer: int | None = None
    link_timing: LinkTiming | None = None
    next_token_min_chance: float | None = None
    dtype: str = "float32"
    slot_format: str = "expanded"
    fine_model: str | None = None
    fine_share: float = 0.25
    precision_rule: str = "router"  # the best of the three on the bench (README)
    expert_pipeline: bool = True
    lookahead_layers: int = 0
    lookahead_probe: str | None = None
    expert_kernel: str = "gemv"  # decode 1.8x transformers' kernel on runs/tw (results/bench-decode-tw.json)
    expert_kernel_table: str | None = None
    hybrid_schedule: bool = False
    map_experts: bool | None = None
    context_tokens: int | None = None
    use_predictor: bool = True
    prediction_guard: bool = True
    table_wait: float = 0.01  # a SiDA step takes 0.2 ms; without the wait the GIL's 5 ms switch interval made tables late
    hash_thread: bool | None = None
    on_predictor_error: str = "raise"

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str):
            raise OptionsError(f"policy must be a policy name, got {self.policy!r}")
        make_serving_policy(self.policy, top_k=1)  # an unknown or trace-only policy is refused by name
        object.__setattr__(self, "policy", self.policy.lower())
        self._memory_or_budget()
        if self.store not in STORES:
            raise OptionsError(f"store must be one of {', '.join(STORES)}, got {self.store!r}")
        if self.store == "host" and self.memory is not None:
            raise OptionsError("the host store keeps every expert in this process's memory; a memory cap sizes "
                               "the disk store's slots (drop --store host, or give --budget instead of --memory)")
        for flag in ("drop_page_cache", "expert_pipeline", "hybrid_schedule", "use_predictor", "prediction_guard"):
            if not isinstance(getattr(self, flag), bool):
                raise OptionsError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.hash_thread is not None and not isinstance(self.hash_thread, bool):
            raise OptionsError(f"hash_thread must be True, False or None (the device decides), got {self.hash_thread!r}")
        if self.on_predictor_error not in PREDICTOR_ERRORS:
            raise OptionsError(f"on_predictor_error must be one of {', '.join(PREDICTOR_ERRORS)}, "
                               f"got {self.on_predictor_error!r}")
        object.__setattr__(self, "device", str(check_device(self.device)))
        self._memory_settings()
        for name in ("transfer_workers", "read_depth"):
            _whole(name, getattr(self, name), 1)
            if getattr(self, name) > MAX_TRANSFER_WORKERS:
                raise OptionsError(f"{name} must be 1 to {MAX_TRANSFER_WORKERS}, got {getattr(self, name)}")
        if self.prefetch_per_layer is not None:
            _whole("prefetch_per_layer", self.prefetch_per_layer, 0)
        _whole("lookahead_layers", self.lookahead_layers, 0)
        if not (isinstance(self.table_wait, (int, float)) and math.isfinite(self.table_wait)
                and 0 <= self.table_wait <= MAX_TABLE_WAIT):
            raise OptionsError(f"table_wait must be 0 to {MAX_TABLE_WAIT} seconds, got {self.table_wait!r}")
        if self.lookahead_layers > MAX_LOOKAHEAD_LAYERS:
            raise OptionsError(f"lookahead_layers must be 0 (off) to {MAX_LOOKAHEAD_LAYERS}, got {self.lookahead_layers}")
        if self.lookahead_probe is not None:
            self._path("lookahead_probe", "a probe artifact's path")
            if not self.lookahead_layers:
                raise OptionsError("a lookahead probe guesses for in-token lookahead: give lookahead_layers 1 to "
                                   f"{MAX_LOOKAHEAD_LAYERS} (--lookahead N) too")
        if self.link_timing is not None and not isinstance(self.link_timing, LinkTiming):
            raise OptionsError(f"link_timing must be a cache.timing.LinkTiming, got {self.link_timing!r}")
        self._precision_and_kernel()
        self._hybrid()
        chance = self.next_token_min_chance
        if chance is not None:
            if isinstance(chance, bool) or not isinstance(chance, (int, float)) or not 0.0 <= chance <= 1.0:
                from predictor.base import PredictorError  # predictor imports torch

                raise PredictorError(f"cross-token prefetch's least chance of use must be in [0, 1], got {chance}")
            object.__setattr__(self, "next_token_min_chance", float(chance))

    def _precision_and_kernel(self) -> None:
        """What a slot holds (`dtype`, `slot_format`, mixed precision) and the expert kernel that
        computes it: each known, and each combination one the kernels compute."""
        if self.dtype not in DTYPES:
            raise OptionsError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.slot_format not in SLOT_FORMATS:
            raise OptionsError(f"slot_format must be one of {', '.join(SLOT_FORMATS)}, got {self.slot_format!r}")
        if self.slot_format == "packed" and (self.dtype != "bfloat16" or self.device != "cpu"):
            raise OptionsError("packed slots compute with torch's int4/int8 CPU kernels, on bfloat16 activations: use "
                               f"dtype bfloat16 and device cpu (got {self.dtype} on {self.device})")
        if self.fine_model is not None:
            self._path("fine_model", "a model directory")
            if self.slot_format != "packed":
                raise OptionsError("mixed precision (a fine model) keeps both copies packed in their slots: "
                                   "use slot_format packed (--slot-format packed --dtype bfloat16)")
        share = self.fine_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share < 1.0:
            raise OptionsError(f"fine_share must be a share of the budget in (0, 1), got {share!r}")
        if self.precision_rule not in PRECISION_RULES:
            raise OptionsError(f"precision_rule must be one of {', '.join(PRECISION_RULES)}, "
                               f"got {self.precision_rule!r}")
        if self.expert_kernel not in EXPERT_KERNELS:
            raise OptionsError(f"expert_kernel must be one of {', '.join(EXPERT_KERNELS)}, got {self.expert_kernel!r}")
        if self.slot_format == "packed" and self.expert_kernel in ("batched_mm", "grouped_mm"):
            raise OptionsError(f"packed slots compute with the eager loop's int4/int8 kernels, not {self.expert_kernel}; "
                               "use expert_kernel model, auto or eager")
        if self.expert_kernel_table is not None:
            self._path("expert_kernel_table", "a JSON file's path")
            if self.expert_kernel != "auto":
                raise OptionsError("a crossover table chooses the kernel of expert_kernel auto; give --expert-kernel "
                                   f"auto with it (got {self.expert_kernel})")

    def _hybrid(self) -> None:
        """`hybrid_schedule` computes fused experts in the model's dtype where they live: on a GPU
        host that is the CPU beside it, reading the host store's memory."""
        if not self.hybrid_schedule:
            return
        if self.slot_format != "expanded" or self.fine_model is not None:
            raise OptionsError("the hybrid schedule computes experts where they live in the model's dtype: use "
                               "--slot-format expanded and no --fine-model with it")
        if self.device != "cpu" and self.store != "host":
            raise OptionsError(f"on {self.device}, the hybrid schedule computes misses on the CPU from host memory: "
                               "give --store host with it")

    def _memory_or_budget(self) -> None:
        """`memory` in bytes, or `budget` as a `Budget` (half the experts when neither is given)."""
        if self.memory is None:
            object.__setattr__(self, "budget", Budget.of(self.budget if self.budget is not None else 0.5))
            return
        if self.budget is not None:
            raise OptionsError("give the memory (the whole process) or the budget (expert slots alone), not both")
        memory = parse_memory(self.memory) if isinstance(self.memory, str) else self.memory
        _whole("memory", memory, 1)
        object.__setattr__(self, "memory", memory)

    def _memory_settings(self) -> None:
        """`map_experts` and `context_tokens` shape what `memory` buys: both need it."""
        if self.map_experts not in (None, True, False):
            raise OptionsError(f"map_experts must be True, False or None (automatic), got {self.map_experts!r}")
        if self.context_tokens is not None:
            _whole("context_tokens", self.context_tokens, 1)
        named = [name for name in ("map_experts", "context_tokens") if getattr(self, name) is not None]
        if named and self.memory is None:
            raise OptionsError(f"{' and '.join(named)} shape what a memory cap buys: give memory (--memory SIZE) too")
        if self.map_experts and (self.fine_model is not None or self.slot_format != "expanded" or self.device != "cpu"):
            raise OptionsError("mapped experts are the checkpoint's own weights in this process's memory: on the cpu "
                               "device, with no fine model and no packed slots")

    def _path(self, name: str, what: str) -> None:
        """Option `name` must be a path (str or os.PathLike); it is kept as a str."""
        value = getattr(self, name)
        if not isinstance(value, (str, os.PathLike)):
            raise OptionsError(f"{name} must be {what}, got {value!r}")
        object.__setattr__(self, name, str(value))

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @classmethod
    def names(cls) -> frozenset[str]:
        return frozenset(field.name for field in fields(cls))

    def to_json(self) -> dict[str, Any]:
        """Every option, as a results JSON records it (the budget and the link timing as their own JSON)."""
        record = {field.name: getattr(self, field.name) for field in fields(self)}
        return {**record, "budget": self.budget.as_json() if self.budget is not None else None,
                "link_timing": self.link_timing.to_dict() if self.link_timing is not None else None}
