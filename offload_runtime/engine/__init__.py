"""The serving runtime: experts live in a store, compute on a slot pool filled by a transfer
engine, ahead of need when a hash-building thread predicts them. `loader.load_offloaded` builds it
from a `RuntimeOptions` (`options.py`, made by `resolve.py`); under a memory cap it builds what
`memory_plan.MemoryPlanner` decides (every expert copied or mapped, with a `ResidentRuntime`, or so
many slots), and either runtime is a `model_runtime.ModelRuntime`.

A miss, top to bottom (a decode step whose layer l selects expert e, not resident):

1. `offloaded_experts.py`: the model's router has chosen; the module that replaced the block's
   experts asks `OffloadRuntime.arriving(l, [e, ...])` for them (the one call that fetches experts:
   an iterator that yields each group as it lands, or all together) before the model's own expert
   math runs; `arriving` makes each group resident with `_use`.
2. `runtime.py`, `OffloadRuntime._use`, the whole miss in one function: `ExpertCache.access_many`
   (`cache/`) counts the miss, inserts (l, e) and pins it; if the cache is full its policy picks
   a victim, and `_on_evict` cancels the victim's queued copy and frees its slot
   (`slots.py`). `_load` gives (l, e) a slot and requests a demand copy from the transfer engine.
   Then `_prefetch_after` tops up the prefetches of the layers ahead (`prefetch.py`), and `_use`
   waits for every selected expert (or, with the expert pipeline, `arriving` yields each as it lands).
3. `transfer.py`: a worker takes the demand copy before every prefetch and reads the expert
   into the slot (`store.py`: a pread of its slices from the model's own safetensors files, or a
   host copy); on a GPU through a pinned buffer and a CUDA stream, with an event to wait on.
4. Back in `offloaded_experts.py`: with the slot table that `arriving` yields, the router's expert ids
   become slot ids and the model's experts code runs on the slot weights; the group is unpinned after.

The cache's bookkeeping (`cache/expert_cache.py` over the compiled heap in `cache/kernel.py`)
is the simulator's too; `hash_builder.py` runs the predictor on its own thread and hands each
forward's table to `prefetch.py`.
"""
