"""Running a model whose experts do not fit in fast memory, in four rooms:

- `engine/`: the serving runtime — its options (`RuntimeOptions`), expert store (slow tier),
  slot pool (fast tier), transfer engine, hash-building thread and prefetch, the module that
  replaces a model's experts, `load_offloaded`; its `__init__` walks one miss through them.
- `cgopipe/`: MoE-Lightning's batch decoding (CGOPipe) over the engine, and request batching.
- `server/`: the OpenAI-compatible HTTP server over the engine (routes, per-endpoint handling,
  typed bodies, the batching scheduler, Prometheus metrics).
- `planning/`: the HRM performance model, hardware profiles and the policy search; it imports
  nothing of the engine.
"""
