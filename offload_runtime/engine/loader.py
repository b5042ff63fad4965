"""`load_offloaded`: the one-call entry point that returns a servable offloaded model."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cache import make_serving_policy
from offload_runtime.engine.expert_kernels import kernel_workspace_bytes
from offload_runtime.engine.expert_layout import LAYOUT_BYTES_PER_ELEMENT, expert_spec
from offload_runtime.engine.hash_builder import warm_up
from offload_runtime.engine.mapped import load_mmap_model
from offload_runtime.engine.memory_plan import (MAPPED_SHARE, MemoryPlan, largest_matrix_bytes, plan_mapped,
                                                plan_offloaded, plan_resident, reserve_bytes)
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.resolve import options_for
from offload_runtime.engine.resident import ResidentRuntime
from offload_runtime.engine.runtime import OffloadRuntime
from offload_runtime.engine.slots import SlotPool, TieredSlotPool
from offload_runtime.engine.store import ExpertStore
from predictor.artifact import check_tracing_convention, load_predictor
from predictor.base import ExpertPredictor, PredictorError
from prescient.arch import find_moe_layers, is_encoder_decoder
from prescient.budget import Budget
from prescient.checkpoint_schemes import CompressionError
from prescient.errors import ModelFilesError
from prescient.fingerprint import ModelFingerprint, expert_tensor_names, fingerprint_model_dir, loaded_fingerprint
from prescient.loading import load_model, load_without_experts
from prescient.memory_cap import READ_HEADROOM_BYTES, drop_file_pages, process_footprint
from prescient.model_dir import ModelDirectory

log = logging.getLogger(__name__)


def load_offloaded(model_dir: str | Path | ModelDirectory, predictor: str | Path | ExpertPredictor | None = None,
                   options: RuntimeOptions | None = None, **settings: Any):
    """A transformers model whose routed experts live in `options.store` and are loaded into
    `options.budget` worth of slots on `options.device` (see `RuntimeOptions`). `options` given
    whole is used as it is; else `settings`, its fields as keywords, are resolved as the command
    line resolves its flags (`resolve_options`: with `memory`, the settings `prescient tune`
    measured best; the policy that measured best with `predictor`). `predictor`
    (an artifact path, or a predictor) drives SiDA-style prefetching; one built for another
    model is a `FingerprintMismatchError`. `transfer_workers` copies run at once (on our CPU
    machine two made no measurable difference to decode speed from disk; see docs/results). With
    `link_timing` (e.g. `experiments.timing_calibration.load_timing(...).timing`) a predicted
    expert is prefetched only if its copy can end before its layer runs; the others are left to
    demand loads. With `next_token_min_chance` (a predictor with forecast heads) prefetching
    reaches into the next token: the experts its forecast gives at least that chance of use
    (cross-token prefetch).

    `generate(...)` works as usual. `model.offload_runtime` holds the runtime: `stats()`, and
    `close()`, which stops its threads; or run the model inside `with model.offload_runtime:`. A
    model dropped without either stops them once garbage-collected.
    """
    options = options_for(model_dir, predictor, options, settings)  # every option checked before any file is read
    model_dir = ModelDirectory.of(model_dir)
    if options.memory is not None and options.fine_model is None:
        whole = _load_whole(model_dir, options)
        if whole is not None:
            if predictor is not None:
                log.info("every expert is loaded with the model: the predictor is not needed (nothing to prefetch)")
            return whole
    model, layers = load_without_experts(model_dir, dtype=options.torch_dtype)  # experts stay on disk
    eviction = make_serving_policy(options.policy, layers[0].top_k)
    fingerprint = loaded_fingerprint(model_dir, model, layers, options.torch_dtype)
    if isinstance(predictor, ExpertPredictor):
        fingerprint.require_same(predictor.meta.fingerprint, f"predictor {predictor.kind!r}")
    elif predictor is not None:
        predictor = load_predictor(predictor, fingerprint=fingerprint)
    if predictor is not None:
        check_tracing_convention(predictor.meta, is_encoder_decoder(model))
    if eviction.uses_forecasts:
        require_forecasts(predictor, f"cache policy {options.policy!r}")
    if options.next_token_min_chance is not None:
        require_forecasts(predictor, "cross-token prefetch")
    if options.fine_model is not None and options.precision_rule == "forecast":
        require_forecasts(predictor, "the forecast precision rule")
    # under a cap the predictor runs once first, so that the plan measures what it holds at work
    at_work = 0 if predictor is None or options.memory is None else warm_up(
        predictor, eviction.uses_forecasts, options.next_token_min_chance is not None)
    stores = []  # closed here if the runtime is not made
    try:
        # under a cap the store drops each read's pages, cgroup or not: pages its reads left cached would
        # make the kernel evict the libraries' code that every token runs, and read it back per token
        drop = options.drop_page_cache or options.memory is not None
        if options.memory is not None:
            _refuse_before_opening(model_dir, options, layers, at_work)
        stores.append(ExpertStore(model_dir, model, layers, mode=options.store, drop_page_cache=drop,
                                  slot_format=options.slot_format, read_depth=options.read_depth))
        plan = None if options.memory is None else _offloaded_plan(model_dir, options, stores[0], layers, at_work)
        budget = options.budget if plan is None else Budget(plan.slots, "slots")
        if options.fine_model is None:
            pool = SlotPool.for_budget(stores[0].slot_specs, layers[0].num_experts, layers[0].top_k, budget,
                                       options.device)
        else:
            stores.append(_fine_store(options, fingerprint, model, layers, stores[0]))
            pool = TieredSlotPool.for_budget(stores[1].slot_specs, stores[0].slot_specs, layers[0].num_experts,
                                             layers[0].top_k, budget, options.fine_share, options.device)
        model.offload_runtime = OffloadRuntime(model, layers, stores[0], pool, fingerprint, eviction, options,
                                               predictor=predictor, fine_store=stores[1] if len(stores) > 1 else None)
        model.offload_runtime.memory_plan = plan
    except BaseException:
        for store in stores:
            store.close()
        raise
    # What stays resident (attention, routers, norms, shared experts) moves to the device; on the
    # fallback path (a full load) this also copies it out of the memory-mapped checkpoint, so the
    # mapping goes and dropping the page cache really drops it.
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.to(options.device, copy=True)
    log.info("offloaded %d MoE layers: %d of %d experts fit the budget (%.1f MiB of slots)", len(layers),
             pool.num_slots, len(layers) * layers[0].num_experts, pool.nbytes / 2**20)
    if plan is not None:
        log.info("%s", plan.line())
    return model


def _load_whole(model_dir: ModelDirectory, options: RuntimeOptions):
    """The whole model: copied into memory where every expert fits (the plain transformers model,
    its own forward), else its experts mapped from the checkpoint where the page cache can hold
    `MAPPED_SHARE` of them, or wherever `options.map_experts` asks; None: offload them into slots
    (see `memory_plan`)."""
    need = _whole_model_need(model_dir, options)
    expert_bytes = need.experts_bytes // need.total_experts
    if options.map_experts:
        return _load_mapped(model_dir, options, plan_mapped(options.memory, need.footprint, need.reserve, expert_bytes,
                                                            need.total_experts, need.top_k))
    plan = plan_resident(options.memory, need.footprint, need.reserve, need.experts_bytes, need.total_experts)
    if plan is not None:
        return _load_resident(model_dir, options, plan)
    room = options.memory - need.footprint - need.reserve
    if options.map_experts is None and options.device == "cpu" and room >= MAPPED_SHARE * need.experts_bytes:
        try:
            return _load_mapped(model_dir, options, plan_mapped(options.memory, need.footprint, need.reserve,
                                                                expert_bytes, need.total_experts, need.top_k))
        except ModelFilesError as exc:  # another dtype or expert layout than the mapped model computes with
            log.info("the experts are not mapped: %s", exc)
    return None


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


def whole_model_memory(model_dir: str | Path | ModelDirectory, options: RuntimeOptions | None = None) -> int:
    """The memory cap at and above which `--memory` loads every expert (this process now, the whole
    model's weights in the compute dtype, the reserve): the plain model's need, as estimated here."""
    return _whole_model_need(ModelDirectory.of(model_dir), options or RuntimeOptions()).total


def _whole_model_need(model_dir: ModelDirectory, options: RuntimeOptions) -> WholeModelNeed:
    """The whole model's `WholeModelNeed` in `options.dtype`, from the model's shapes (nothing read)."""
    skeleton = model_dir.weightless_model(options.torch_dtype)
    layers = find_moe_layers(skeleton)
    experts = expert_tensor_names(layers)
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in skeleton.state_dict().items()}
    experts_bytes = sum(size for name, size in sizes.items() if name in experts)
    return WholeModelNeed(process_footprint(reads=False) + sum(sizes.values()) - experts_bytes,
                          _reserve(model_dir, options, 0),
                          experts_bytes, len(layers) * layers[0].num_experts, layers[0].top_k)


def _load_mapped(model_dir: ModelDirectory, options: RuntimeOptions, plan: MemoryPlan):
    """The model with every weight a view of its memory-mapped checkpoint (`mapped`), with a
    `ResidentRuntime` as its `offload_runtime`."""
    model, layers = load_mmap_model(model_dir, options.torch_dtype)
    fingerprint = loaded_fingerprint(model_dir, model, layers, options.torch_dtype)
    model.offload_runtime = ResidentRuntime(model, layers, fingerprint, plan, expert_kernel=options.expert_kernel)
    log.info("%s", plan.line())
    return model


def _load_resident(model_dir: ModelDirectory, options: RuntimeOptions, plan: MemoryPlan):
    """The plain transformers model, whole, with a `ResidentRuntime` as its `offload_runtime`."""
    model, layers = load_model(model_dir, dtype=options.torch_dtype)
    model.to(options.device)
    if plan.drop_page_cache:  # what reading the checkpoint left in the page cache
        for file in set(model_dir.weight_index.values()):
            drop_file_pages(file)
    fingerprint = loaded_fingerprint(model_dir, model, layers, options.torch_dtype)
    model.offload_runtime = ResidentRuntime(model, layers, fingerprint, plan, expert_kernel=options.expert_kernel)
    log.info("%s", plan.line())
    return model


def _offloaded_plan(model_dir: ModelDirectory, options: RuntimeOptions, store: ExpertStore, layers,
                    predictor_work: int) -> MemoryPlan:
    """The slots `options.memory` buys beside this process as loaded now (non-expert weights,
    predictor, store) and what its predictor holds at work (`predictor_work` bytes)."""
    expert_bytes = sum(spec.nbytes for spec in store.slot_specs) // len(store.slot_specs)
    copy_buffers = options.transfer_workers * expert_bytes
    return plan_offloaded(options.memory, process_footprint(), _reserve(model_dir, options, copy_buffers),
                          expert_bytes, len(layers) * layers[0].num_experts, layers[0].top_k, predictor_work)


def _refuse_before_opening(model_dir: ModelDirectory, options: RuntimeOptions, layers, predictor_work: int) -> None:
    """A CapacityError now, naming the smallest cap that works, where `options.memory` cannot hold
    this process while the store opens (no expert is read yet: its code pages alone beside its
    anonymous memory): deriving the checkpoint's layout holds temporaries of
    `LAYOUT_BYTES_PER_ELEMENT` per element of one expert, and under a cgroup a cap below that peak is
    killed by the kernel before the plan could refuse it."""
    spec, _ = expert_spec(layers[0])
    elements = sum(math.prod(shape) for shape in spec.shapes.values())
    steady = process_footprint()  # the read headroom it books is not needed before any read
    opening = max(steady, steady - READ_HEADROOM_BYTES + LAYOUT_BYTES_PER_ELEMENT * elements)
    plan_offloaded(options.memory, opening,
                   _reserve(model_dir, options, options.transfer_workers * spec.nbytes), spec.nbytes,
                   len(layers) * layers[0].num_experts, layers[0].top_k, predictor_work)


def _reserve(model_dir: ModelDirectory, options: RuntimeOptions, copy_buffers: int) -> int:
    """`reserve_bytes` with what the expert kernel holds while it decodes (`kernel_workspace_bytes`)."""
    dtype_bytes = options.torch_dtype.itemsize
    return (reserve_bytes(model_dir.config, dtype_bytes, copy_buffers, options.context_tokens)
            + kernel_workspace_bytes(options.expert_kernel, options.torch_dtype, options.device,
                                     largest_matrix_bytes(model_dir.config, dtype_bytes)))


def _fine_store(options: RuntimeOptions, fingerprint: ModelFingerprint, model, layers,
                coarse: ExpertStore) -> ExpertStore:
    """Mixed precision's fine copies: the store of `options.fine_model`, which must be the same
    model (its non-expert weights fingerprinted alike) with every packed expert parameter of
    `coarse` packed too."""
    fine_dir = Path(options.fine_model)
    if not (fine_dir / "config.json").is_file():
        raise FileNotFoundError(f"fine model {fine_dir} is not a model directory (no config.json)")
    fine_dir = ModelDirectory.open(fine_dir)
    fingerprint.require_same(fingerprint_model_dir(fine_dir), f"fine model {fine_dir}")
    fine = ExpertStore(fine_dir, model, layers, mode=options.store, drop_page_cache=options.drop_page_cache,
                       slot_format=options.slot_format, read_depth=options.read_depth)
    if fine.packed.keys() != coarse.packed.keys() or set(coarse.spec.shapes) != set(fine.spec.shapes):
        fine.close()
        raise CompressionError(f"fine model {fine_dir} packs {sorted(fine.packed)}, the model {sorted(coarse.packed)}: "
                               "mixed precision needs every expert matrix packed in both")
    return fine


def require_forecasts(predictor: ExpertPredictor | None, needed_by: str) -> None:
    """What `needed_by` names (a learned policy, cross-token prefetch) needs a predictor with forecast heads."""
    if predictor is None:
        raise PredictorError(f"{needed_by} needs a predictor's forecasts: pass a predictor "
                             "with forecast heads (train one with `prescient train ... --model.horizon 2`)")
    predictor.require_horizon(1)  # no heads: a ForecastHorizonError saying what to train
