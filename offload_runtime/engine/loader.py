"""`load_offloaded`: the one-call entry point that returns a servable offloaded model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any


from cache import make_serving_policy
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.runtime import OffloadRuntime
from offload_runtime.engine.slots import SlotPool, TieredSlotPool
from offload_runtime.engine.store import ExpertStore
from predictor.artifact import check_tracing_convention, load_predictor
from predictor.base import ExpertPredictor, PredictorError
from prescient.arch import is_encoder_decoder
from prescient.checkpoint_schemes import CompressionError
from prescient.fingerprint import ModelFingerprint, loaded_fingerprint
from prescient.loading import load_without_experts
from prescient.model_dir import ModelDirectory

log = logging.getLogger(__name__)


def load_offloaded(model_dir: str | Path | ModelDirectory, predictor: str | Path | ExpertPredictor | None = None,
                   options: RuntimeOptions | None = None, **settings: Any):
    """A transformers model whose routed experts live in `options.store` and are loaded into
    `options.budget` worth of slots on `options.device` (see `RuntimeOptions`; `settings`, its
    fields as keywords, are a shorthand for `options=RuntimeOptions(**settings)`). `predictor`
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
    options = RuntimeOptions.of(options, **settings)  # every option checked before any file is read
    model_dir = ModelDirectory.of(model_dir)
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
    stores = []  # closed here if the runtime is not made
    try:
        stores.append(ExpertStore(model_dir, model, layers, mode=options.store,
                                  drop_page_cache=options.drop_page_cache, slot_format=options.slot_format))
        if options.fine_model is None:
            pool = SlotPool.for_budget(stores[0].slot_specs, layers[0].num_experts, layers[0].top_k, options.budget,
                                       options.device)
        else:
            stores.append(_fine_store(options, fingerprint, model, layers, stores[0]))
            pool = TieredSlotPool.for_budget(stores[1].slot_specs, stores[0].slot_specs, layers[0].num_experts,
                                             layers[0].top_k, options.budget, options.fine_share, options.device)
        model.offload_runtime = OffloadRuntime(model, layers, stores[0], pool, fingerprint, eviction, options,
                                               predictor=predictor, fine_store=stores[1] if len(stores) > 1 else None)
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
    return model


def _fine_store(options: RuntimeOptions, fingerprint: ModelFingerprint, model, layers,
                coarse: ExpertStore) -> ExpertStore:
    """Mixed precision's fine copies: the store of `options.fine_model`, which must be the same
    model (its non-expert weights fingerprinted alike) with every packed expert parameter of
    `coarse` packed too."""
    fine_dir = Path(options.fine_model)
    if not (fine_dir / "config.json").is_file():
        raise FileNotFoundError(f"fine model {fine_dir} is not a model directory (no config.json)")
    fine_dir = ModelDirectory.open(fine_dir)
    fingerprint.require_same(fine_dir.fingerprint, f"fine model {fine_dir}")
    fine = ExpertStore(fine_dir, model, layers, mode=options.store, drop_page_cache=options.drop_page_cache,
                       slot_format=options.slot_format)
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
