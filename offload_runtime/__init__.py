"""Running a model whose experts do not fit in fast memory. The Python API is these names:

    from offload_runtime import load_offloaded

    loaded = load_offloaded("runs/demo/model", "runs/demo/predictor/sida", memory="2GiB")
    with loaded:                             # stops the runtime's threads at the end
        ...                                  # loaded.generate(...) as with any transformers model
        print(loaded.runtime.stats(), loaded.plan)

- `load_offloaded`: a `LoadedModel`, the model with its experts offloaded (or resident);
- `LoadedModel`: the transformers model, its runtime, its memory plan and its options, owned together;
- `generate_offloaded`: load, generate and measure in one call (what `prescient generate` runs);
- `RuntimeOptions`: every setting of the runtime, checked when made;
- `resolve_options`: the options a run uses, from the settings named over the tuned and measured
  defaults (the command line and `load_offloaded` both call it);
- `LoadRequest`: what a run asks to load (model, predictor, options or the settings named,
  reserves), built alike by the command line and the Python API and resolved once;
- `MemoryPlan`: what a memory cap buys (resident, mapped, or so many expert slots);
- `Reserves`: what a run keeps free under its memory cap (its longest sequence, a prefix cache);
- `ModelRuntime`: what `LoadedModel.runtime` is, whichever runtime was made;
- `OffloadRuntime`: the runtime of an offloaded model.

The package's rooms:

- `engine/`: the serving runtime — its options (`RuntimeOptions`, resolved by `resolve.py`), expert
  store (slow tier), slot pool (fast tier), transfer engine, hash-building thread and prefetch, the
  module that replaces a model's experts, `load_offloaded`; its `__init__` walks one miss through them.
- `cgopipe/`: MoE-Lightning's batch decoding (CGOPipe) over the engine, and request batching.
- `server/`: the OpenAI-compatible HTTP server over the engine (routes, per-endpoint handling,
  typed bodies, the batching scheduler, Prometheus metrics).
- `planning/`: the HRM performance model, hardware profiles and the policy search, which import
  nothing of the engine; `tune` measures configurations by decoding through the engine, and
  `link_profile` reads the engine's disk store to measure it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offload_runtime.engine.generate import generate_offloaded
    from offload_runtime.engine.loaded import LoadedModel
    from offload_runtime.engine.loader import load_offloaded
    from offload_runtime.engine.memory_plan import MemoryPlan, Reserves
    from offload_runtime.engine.model_runtime import ModelRuntime
    from offload_runtime.engine.options import RuntimeOptions
    from offload_runtime.engine.resolve import LoadRequest, resolve_options
    from offload_runtime.engine.runtime import OffloadRuntime

# each public name -> the module that defines it, imported on first use: a module of the package
# (the options a `--help` reads) then loads without torch
_HOMES = {"LoadRequest": "resolve", "LoadedModel": "loaded", "MemoryPlan": "memory_plan",
          "ModelRuntime": "model_runtime", "OffloadRuntime": "runtime", "Reserves": "memory_plan",
          "RuntimeOptions": "options", "generate_offloaded": "generate", "load_offloaded": "loader",
          "resolve_options": "resolve"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"offload_runtime.engine.{_HOMES[name]}"), name)
