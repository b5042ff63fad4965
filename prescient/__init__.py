"""moe-prescient: learned expert prediction and caching for offloaded MoE inference.

This package holds what every other package shares: the model fingerprint, the
architecture adapters that find a model's MoE blocks, the trace file format,
atomic file writes, and the `prescient` command line.
"""

__version__ = "0.1.0"
