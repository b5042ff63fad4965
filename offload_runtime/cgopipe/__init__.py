"""CGOPipe (MoE-Lightning): many requests decoded together over the engine, weights streamed
page by page behind compute; `batching` partitions requests into micro-batches."""
