"""Running a model whose experts do not fit in fast memory, in three rooms:

- `engine/`: the serving runtime — expert store (slow tier), slot pool (fast tier), transfer
  engine, hash-building thread, the module that replaces a model's experts, `load_offloaded`.
- `cgopipe/`: MoE-Lightning's batch decoding (CGOPipe) over the engine, and request batching.
- `planning/`: the HRM performance model, hardware profiles and the policy search; it imports
  nothing of the engine.
"""
