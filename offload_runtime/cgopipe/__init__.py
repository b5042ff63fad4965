"""Batch decoding over the engine: many requests decoded together, streamed experts shared by a
batch's micro-batches. `zigzag` (FlexGen's block schedule, and the request loop every schedule
shares), `pipe` (MoE-Lightning's CGOPipe: weights paged in behind compute), `klotski` (Klotski's
multi-batch pipeline: hot experts ahead, cold ones after the gate, each expert once per group);
`batching` partitions requests into micro-batches; `decoder_stack` runs a model half-layer by half-layer."""
