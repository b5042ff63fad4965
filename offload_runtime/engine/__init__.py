"""The serving runtime: experts live in a store, compute on a slot pool filled by a transfer
engine, ahead of need when a hash-building thread predicts them. `loader.load_offloaded` builds it."""
