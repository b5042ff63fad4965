"""`load_offloaded`: the one-call entry point that returns a servable offloaded model (a `LoadedModel`)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from cache import make_serving_policy
from offload_runtime.engine.compiled import Kernels, load_compiled, restarts
from offload_runtime.engine.direct_read import ALIGN, bounce_size, opens_direct
from offload_runtime.engine.expert_layout import LAYOUT_BYTES_PER_ELEMENT, expert_spec
from offload_runtime.engine.hash_builder import warm_up
from offload_runtime.engine.loaded import LoadedModel
from offload_runtime.engine.mapped import load_mmap_model
from offload_runtime.engine.memory_plan import MemoryPlan, MemoryPlanner, Reserves
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.resolve import LoadRequest
from offload_runtime.engine.resident import ResidentRuntime
from offload_runtime.engine.runtime import OffloadRuntime
from offload_runtime.engine.slots import SlotPool, TieredSlotPool
from offload_runtime.engine.store import ExpertStore
from predictor.artifact import check_tracing_convention, load_predictor, read_predictor_meta
from predictor.base import ExpertPredictor, PredictorError
from prescient.arch import is_encoder_decoder
from prescient.budget import Budget
from prescient.checkpoint_schemes import CompressionError
from prescient.errors import CapacityError
from prescient.fingerprint import ModelFingerprint, fingerprint_model_dir, loaded_fingerprint
from prescient.loading import load_model, load_without_experts
from prescient.memory_cap import READ_HEADROOM_BYTES, drop_file_pages, file_backed_bytes, process_footprint
from prescient.model_dir import ModelDirectory

log = logging.getLogger(__name__)


def load_offloaded(model_dir: str | Path | ModelDirectory, predictor: str | Path | ExpertPredictor | None = None,
                   options: RuntimeOptions | None = None, *, reserves: Reserves = Reserves(),
                   **settings: Any) -> LoadedModel:
    """A `LoadedModel`: the transformers model, its routed experts living in `options.store` and
    loaded into `options.budget` worth of slots on `options.device` (see `RuntimeOptions`), with the
    runtime that serves them, its memory plan and its options. `options` given whole is used as it
    is; else `settings`, its fields as keywords, are resolved as the command line resolves its flags
    (`resolve_options`: with `memory`, the settings `prescient tune` measured best; the policy that
    measured best with `predictor`). With `memory`, `reserves` is what the run keeps free beside
    the weights and the slots (its longest sequence, a prefix cache; see `memory_plan.Reserves`).
    `predictor` (an artifact path, or a predictor) drives SiDA-style prefetching; one built for
    another model is a `FingerprintMismatchError`. `transfer_workers` copies run at once (on our CPU
    machine two made no measurable difference to decode speed from disk; see docs/results). With
    `link_timing` (e.g. `experiments.timing_calibration.load_timing(...).timing`) a predicted
    expert is prefetched only if its copy can end before its layer runs; the others are left to
    demand loads. With `next_token_min_chance` (a predictor with forecast heads) prefetching
    reaches into the next token: the experts its forecast gives at least that chance of use
    (cross-token prefetch).

    `generate(...)` works as on the transformers model, whose attributes it reads through to.
    `runtime` holds `stats()`, and `close()`, which stops its threads; or run the model inside
    `with loaded:`. A model dropped without either stops them once garbage-collected.
    """
    request = LoadRequest(model_dir, predictor, options, settings, reserves)
    return load(request)


def load(request: LoadRequest) -> LoadedModel:
    """`load_offloaded` of a `LoadRequest`: its options resolved once, then the model loaded whole
    or into slots as the memory plan says (or into the budget's slots)."""
    request = request.resolved()  # every option checked before any file is read
    model_dir, options = ModelDirectory.of(request.model_dir), request.options
    planner = None if options.memory is None else MemoryPlanner(model_dir, options, request.reserves)
    if planner is not None and options.fine_model is None:
        plan = planner.whole_model(process_footprint(reads=False), file_backed_bytes())
        whole = _load_whole(model_dir, options, plan)
        if whole is not None:
            if request.predictor is not None:
                log.info("every expert is loaded with the model: the predictor is not needed (nothing to prefetch)")
            return whole
    return _load_into_slots(model_dir, request.predictor, options, planner)


def _load_into_slots(model_dir: ModelDirectory, predictor: str | Path | ExpertPredictor | None,
                     options: RuntimeOptions, planner: MemoryPlanner | None) -> LoadedModel:
    """The model without its experts, with an `OffloadRuntime` that loads them into slots: as many
    as `planner` finds room for beside this process as loaded (a memory cap), else the budget's."""
    kernels = Kernels(options.policy, predictor_step=_kind(predictor) == "sida")
    # under a cap the compiled kernels load from numba's cache before the weights (so that the plan measures
    # them, and a child process compiling what the cache lacks has room beside this one), unless the cap
    # cannot hold any plan of slots (they would only slow the refusal below; in a cgroup, to a thrash), or
    # a command may start again to compile them (`compiled.prepare_command`): the refusal comes first then
    early = planner is not None and not restarts() and planner.may_hold_slots(process_footprint())
    if early:
        load_compiled(kernels)
    model, layers = load_without_experts(model_dir, dtype=options.torch_dtype)  # experts stay on disk
    eviction = make_serving_policy(options.policy, layers[0].top_k)
    fingerprint = loaded_fingerprint(model_dir, model, layers, options.torch_dtype)
    predictor = _checked_predictor(predictor, fingerprint, model, options, eviction.uses_forecasts)
    if planner is not None:
        # a cap too small is refused before the predictor's warm-up; one the warm-up leaves too small after it
        opening_buffers = _direct_buffers_before_opening(options, model_dir, expert_spec(layers[0])[0].nbytes)
        _refuse_before_opening(planner, layers, 0, 0 if early else kernels.loaded_bytes, opening_buffers,
                               count_unloaded=restarts())
        if not early:
            load_compiled(kernels)
    # under a cap the predictor runs once first, so that the plan measures what it holds at work
    at_work = 0 if predictor is None or planner is None else warm_up(
        predictor, eviction.uses_forecasts, options.next_token_min_chance is not None)
    stores = []  # closed here if the runtime is not made
    try:
        # under a cap the store drops each read's pages, cgroup or not: pages its reads left cached would
        # make the kernel evict the libraries' code that every token runs, and read it back per token
        drop = options.drop_page_cache or planner is not None
        if planner is not None:
            _refuse_before_opening(planner, layers, at_work, direct_buffers=opening_buffers)
        stores.append(ExpertStore(model_dir, model, layers, mode=options.store, drop_page_cache=drop,
                                  slot_format=options.slot_format, read_depth=options.read_depth))
        buffers = _direct_buffers(options, stores[0].reads_direct, 0 if stores[0].reads_in_place else stores[0].bounce_bytes)
        plan = None if planner is None else planner.slots(
            process_footprint(reads=buffers is None), _expert_bytes(stores[0]), layers, at_work, direct_buffers=buffers)
        pool = _slot_pool(options, plan, fingerprint, model, layers, stores)
        runtime = OffloadRuntime(model, layers, stores[0], pool, fingerprint, eviction, options, predictor=predictor,
                                 fine_store=stores[1] if len(stores) > 1 else None, memory_plan=plan)
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
    return LoadedModel(model, runtime)


def whole_model_memory(model_dir: str | Path | ModelDirectory, options: RuntimeOptions | None = None) -> int:
    """The memory cap at and above which `--memory` loads every expert (this process now, the whole
    model's weights in the compute dtype, the reserve): the plain model's need, as estimated here."""
    planner = MemoryPlanner(ModelDirectory.of(model_dir), options or RuntimeOptions())
    return planner.need(process_footprint(reads=False)).total


def _refuse_before_opening(planner: MemoryPlanner, layers, predictor_work: int, unloaded: int = 0,
                           direct_buffers: int | None = None, count_unloaded: bool = False) -> None:
    """A CapacityError now, naming the smallest cap that works, where the cap cannot hold this
    process's plan of one layer's top-k slots, or the process itself while the store opens:
    deriving the checkpoint's layout holds temporaries of `LAYOUT_BYTES_PER_ELEMENT` per element of
    one expert, and under a cgroup a cap below that peak is killed by the kernel before the plan
    could refuse it. At that peak no slot, KV cache or read exists yet: it is the process's
    anonymous memory and code pages alone (the reserve and two slots counted on top of it, with the
    kernels compiled in the process, refused runs/tb's 520 MiB naming 571 where 560 decoded,
    results/refusal-tb-ec14e04.json; now 480 decodes, results/refusal-tb.json). A cap refused
    before the process holds `unloaded` bytes more (the compiled kernels, not loaded yet) is refused
    naming a cap that holds them too; with `count_unloaded` they decide the refusal too (a command
    that may start again to compile them refuses before it compiles what a later run, which loads
    them first, refuses); `direct_buffers`: the store will read around the page cache
    (`MemoryPlanner.slots`)."""
    spec, _ = expert_spec(layers[0])
    elements = sum(math.prod(shape) for shape in spec.shapes.values())
    steady = process_footprint(reads=direct_buffers is None)
    peak = process_footprint() - READ_HEADROOM_BYTES + LAYOUT_BYTES_PER_ELEMENT * elements  # no read yet: no headroom
    counted = unloaded if count_unloaded else 0
    try:
        planner.slots(steady + counted, spec.nbytes, layers, predictor_work, peak=peak + counted,
                      direct_buffers=direct_buffers)
    except CapacityError:
        planner.slots(steady + unloaded, spec.nbytes, layers, predictor_work, peak=peak + unloaded,
                      direct_buffers=direct_buffers)
        raise


def _direct_buffers_before_opening(options: RuntimeOptions, model_dir: ModelDirectory, expert_bytes: int) -> int | None:
    """`_direct_buffers` before the store opens, from whether the weight files take `O_DIRECT` (every
    read through a bounce buffer, at worst)."""
    return _direct_buffers(options, options.store == "disk" and options.slot_format == "expanded"
                           and expert_bytes >= 2 * ALIGN and opens_direct(model_dir.weight_files), bounce_size(expert_bytes))


def _direct_buffers(options: RuntimeOptions, reads_direct: bool, bounce_bytes: int) -> int | None:
    """Where every miss reads around the page cache (`direct_read`) into CPU slots of one tier, the
    bytes of the bounce buffers its reading threads hold, `bounce_bytes` each (0 where every read
    goes straight into its slot); None where reads pass through the page cache."""
    if not reads_direct or torch.device(options.device).type != "cpu" or options.fine_model is not None:
        return None
    return bounce_bytes * (options.transfer_workers + options.read_depth)


def _kind(predictor: str | Path | ExpertPredictor | None) -> str | None:
    """The kind of predictor `predictor` is (an artifact's from its metadata, read alone), or None."""
    if predictor is None or isinstance(predictor, ExpertPredictor):
        return None if predictor is None else predictor.kind
    return read_predictor_meta(predictor).kind


def _expert_bytes(store: ExpertStore) -> int:
    """One slot's bytes in `store`'s layout (the mean over its layers)."""
    return sum(spec.nbytes for spec in store.slot_specs) // len(store.slot_specs)


def _checked_predictor(predictor: str | Path | ExpertPredictor | None, fingerprint: ModelFingerprint, model,
                       options: RuntimeOptions, uses_forecasts: bool) -> ExpertPredictor | None:
    """`predictor` loaded (an artifact path) and checked: built for this model, traced as it runs,
    with forecast heads where the policy, cross-token prefetch or the precision rule needs them."""
    if isinstance(predictor, ExpertPredictor):
        fingerprint.require_same(predictor.meta.fingerprint, f"predictor {predictor.kind!r}")
    elif predictor is not None:
        predictor = load_predictor(predictor, fingerprint=fingerprint)
    if predictor is not None:
        check_tracing_convention(predictor.meta, is_encoder_decoder(model))
    if uses_forecasts:
        require_forecasts(predictor, f"cache policy {options.policy!r}")
    if options.next_token_min_chance is not None:
        require_forecasts(predictor, "cross-token prefetch")
    if options.fine_model is not None and options.precision_rule == "forecast":
        require_forecasts(predictor, "the forecast precision rule")
    return predictor


def _slot_pool(options: RuntimeOptions, plan: MemoryPlan | None, fingerprint: ModelFingerprint, model, layers,
               stores: list[ExpertStore]) -> SlotPool | TieredSlotPool:
    """The slots: `plan.slots` of them under a memory cap, else `options.budget`'s; with a fine model
    (mixed precision, whose store joins `stores`) that many bytes split between fine and coarse."""
    specs, experts, top_k = stores[0].slot_specs, layers[0].num_experts, layers[0].top_k
    if options.fine_model is None:
        phases = stores[0].read_phases
        if plan is not None:
            return SlotPool.for_slots(specs, experts, plan.slots, options.device, phases)
        return SlotPool.for_budget(specs, experts, top_k, options.budget, options.device, phases)
    stores.append(_fine_store(options, fingerprint, model, layers, stores[0]))
    budget = options.budget if plan is None else Budget(plan.slots, "slots")  # in coarse experts, split by bytes
    return TieredSlotPool.for_budget(stores[1].slot_specs, specs, experts, top_k, budget, options.fine_share,
                                     options.device)


def _load_whole(model_dir: ModelDirectory, options: RuntimeOptions, plan: MemoryPlan | None) -> LoadedModel | None:
    """The whole model as `plan` says (`MemoryPlanner.whole_model`): copied into memory (the plain
    transformers model, its own forward), or every weight mapped from the checkpoint (asked for:
    a checkpoint that cannot be mapped is a ModelFilesError); None where the plan is slots."""
    if plan is None:
        return None
    return _load_resident(model_dir, options, plan) if not plan.mapped else _load_mapped(model_dir, options, plan)


def _load_mapped(model_dir: ModelDirectory, options: RuntimeOptions, plan: MemoryPlan) -> LoadedModel:
    """The model with every weight a view of its memory-mapped checkpoint (`mapped`), with a
    `ResidentRuntime`."""
    model, layers = load_mmap_model(model_dir, options.torch_dtype)
    fingerprint = loaded_fingerprint(model_dir, model, layers, options.torch_dtype)
    runtime = ResidentRuntime(model, layers, fingerprint, plan, options)
    log.info("%s", plan.line())
    return LoadedModel(model, runtime)


def _load_resident(model_dir: ModelDirectory, options: RuntimeOptions, plan: MemoryPlan) -> LoadedModel:
    """The plain transformers model, whole, with a `ResidentRuntime`."""
    model, layers = load_model(model_dir, dtype=options.torch_dtype)
    model.to(options.device)
    if plan.drop_page_cache:  # what reading the checkpoint left in the page cache
        for file in set(model_dir.weight_index.values()):
            drop_file_pages(file)
    fingerprint = loaded_fingerprint(model_dir, model, layers, options.torch_dtype)
    runtime = ResidentRuntime(model, layers, fingerprint, plan, options)
    log.info("%s", plan.line())
    return LoadedModel(model, runtime)


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
