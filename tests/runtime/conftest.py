"""Fixtures of the runtime tests: tiny models with compressed experts the packed kernels run."""

from __future__ import annotations

from pathlib import Path

import pytest

from offload_runtime.compression.writer import quantize_model
from prescient.arch_zoo import save_tiny_model
from tests.conftest import tiny_test_config

# the tests' tiny configs with experts at least 32 wide, the kernel's smallest group
WIDER = {"mixtral": {}, "qwen3_moe": {"moe_intermediate_size": 32}, "olmoe": {"intermediate_size": 32}}


@pytest.fixture(scope="module")
def int4_model(tiny_tokenizer, tmp_path_factory):
    """`int4_model(arch, bits=4)`: a tiny `arch` model (experts 32 wide) quantised to int4 (or
    int2) in groups of 32, or to int8 per channel."""
    built: dict[tuple[str, int], Path] = {}

    def get(arch: str, bits: int = 4) -> Path:
        if (arch, bits) not in built:
            root = tmp_path_factory.mktemp(f"{arch}-w{bits}-packed")
            config = tiny_test_config(arch, tiny_tokenizer)
            for name, value in WIDER[arch].items():
                setattr(config, name, value)
            source = save_tiny_model(config, root / "source", seed=1, tokenizer=tiny_tokenizer)
            quantize_model(source, root / "model", bits, group_size="channel" if bits == 8 else 32)
            built[arch, bits] = root / "model"
        return built[arch, bits]

    return get
