"""Compressed experts: routed experts stored int8 / int4 (or bf16) in compressed-tensors'
`pack-quantized` layout, the format GPTQModel and llm-compressor write and transformers and vLLM
read.

- `scheme.py`: the `quantization_config` we write (the one a checkpoint declares is read and
  checked in `prescient.checkpoint_schemes`, where the model directory is opened).
- `codec.py`: one weight quantised (round-to-nearest, group-wise) and expanded again, through
  compressed-tensors' own compressor, so what we write is what its readers read.
- `gptq.py`: GPTQ's levels on the same grid, chosen on each expert's calibration inputs.
- `writer.py`: `quantize_model`, a model directory in, a compressed one out, shard by shard.
- `kernels.py`: experts kept compressed in slots (int4 in groups, int8 per channel) and computed
  by torch's weight-only CPU kernels: the slot layout, the re-arrangement of stored bytes into it,
  and the weight objects that answer `F.linear`.

The runtime's store (`engine/store.py`) reads the compressed bytes of an expert (what crosses the
link) and, on arrival, expands them into the slot in the model's dtype or (packed slots) arranges
them for the kernels.
"""
