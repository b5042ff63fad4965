"""A decoder-only transformers model driven layer by layer and half-layer by half-layer.

CGOPipe interleaves micro-batches inside a layer: the attention half of one micro-batch runs
between the FFN halves of others. transformers runs a whole decoder layer per call, so this
module calls the layer's own submodules in the order its `forward` does (pre-norm residual:
norm → self-attention → add; norm → MoE block → add) and builds the causal mask and rotary
embeddings with transformers' own functions, as the base model's `forward` does. No model math
is rewritten; `check_split` compares one layer's split against its own `forward`, and the
CGOPipe tests compare whole generations against the plain model.

With `attention_device="cpu"` on a CUDA model, the attention core and the KV cache live in CPU
memory (MoE-Lightning's CPU attention): the cache keeps keys and values on the CPU, and the
model's attention function runs there through a registered transformers attention interface.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from prescient.errors import UnsupportedModelError

_HALVES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


class CPUKVCache(DynamicCache):
    """A DynamicCache whose keys and values always live in CPU memory."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return super().update(key_states.cpu(), value_states.cpu(), layer_idx, *args, **kwargs)


def _cpu_attention(inner_name: str):
    inner = ALL_ATTENTION_FUNCTIONS.get(inner_name)
    if inner is None:  # "eager" lives in each modeling file, not in the registry
        raise UnsupportedModelError(f"CPU attention wraps a registered attention implementation; the model uses "
                                    f"{inner_name!r}: load it with attn_implementation='sdpa'")

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs):
        mask = attention_mask.cpu() if isinstance(attention_mask, torch.Tensor) else attention_mask
        out, weights = inner(module, query.cpu(), key.cpu(), value.cpu(), mask, **kwargs)
        return out.to(query.device), weights
    return attention


@dataclass
class MicroBatchInputs:
    """What every half-layer of one micro-batch's current forward needs."""

    masks: dict[str, Any]  # per attention kind ("full_attention", ...), the model's mask for this forward
    position_ids: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    cache: DynamicCache


class DecoderStack:
    """`model`'s base model as embed → [attention half, FFN half] × L → norm → lm_head."""

    def __init__(self, model: nn.Module, attention_device: str | None = None) -> None:
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if layers is None or not all(hasattr(layer, name) for layer in layers for name in _HALVES):
            raise UnsupportedModelError(
                f"{type(model).__name__} has no pre-norm decoder layers with {', '.join(_HALVES)}; "
                "CGOPipe decoding supports decoder-only MoE models built like Mixtral"
            )
        if getattr(model.config, "is_encoder_decoder", False):
            raise UnsupportedModelError("CGOPipe decoding is for decoder-only models, not encoder-decoders")
        self.model, self.base, self.layers = model, base, list(layers)
        self.config = model.config
        self.device = next(model.parameters()).device
        self.cpu_attention = attention_device == "cpu" and self.device.type != "cpu"
        if self.cpu_attention:
            name = f"prescient_cpu_{self.config._attn_implementation}"
            AttentionInterface.register(name, _cpu_attention(self.config._attn_implementation))
            self.config._attn_implementation = name
        # which mask each layer attends with, as the base models decide it: by `layer_types` where
        # the config has them (Qwen2-MoE, Qwen3-MoE, ...), else by whether a sliding window is set (Mixtral)
        default = "full_attention" if getattr(self.config, "sliding_window", None) is None else "sliding_attention"
        self.layer_types = list(getattr(self.config, "layer_types", None) or [default] * len(self.layers))
        unknown = sorted(set(self.layer_types) - set(_MASKS))
        if unknown:
            raise UnsupportedModelError(f"{type(model).__name__} has layers of kind {', '.join(unknown)}; CGOPipe "
                                        f"builds masks for {', '.join(_MASKS)} attention only")
        rotary_args = inspect.signature(self.base.rotary_emb.forward).parameters
        if any(p.default is inspect.Parameter.empty for name, p in rotary_args.items() if name not in ("x", "position_ids")):
            raise UnsupportedModelError(f"{type(model).__name__}'s rotary embedding needs more than the positions "
                                        f"({', '.join(rotary_args)}); CGOPipe computes one per forward")

    def new_cache(self) -> DynamicCache:
        return CPUKVCache(config=self.config) if self.cpu_attention else DynamicCache(config=self.config)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache
              ) -> tuple[torch.Tensor, MicroBatchInputs]:
        """Embeddings of `input_ids` ([b, t], left-padded), and the forward's mask and positions:
        each row's real tokens are numbered from 0, as when the request runs alone."""
        hidden = self.base.embed_tokens(input_ids.to(self.device))
        mask2d = attention_mask.to(self.device)
        position_ids = (mask2d.long().cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
        masks = {kind: _MASKS[kind](config=self.config, inputs_embeds=hidden, attention_mask=mask2d,
                                    past_key_values=cache, position_ids=position_ids)
                 for kind in set(self.layer_types)}
        rotary = self.base.rotary_emb(hidden, position_ids=position_ids)
        return hidden, MicroBatchInputs(masks, position_ids, rotary, cache)

    def attention_half(self, index: int, hidden: torch.Tensor, inputs: MicroBatchInputs) -> torch.Tensor:
        layer = self.layers[index]
        out, _ = layer.self_attn(
            hidden_states=layer.input_layernorm(hidden), position_embeddings=inputs.position_embeddings,
            attention_mask=inputs.masks[self.layer_types[index]], position_ids=inputs.position_ids,
            past_key_values=inputs.cache,
        )
        return hidden + out

    def ffn_half(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        layer = self.layers[index]
        out = layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden + (out[0] if isinstance(out, tuple) else out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last position's logits."""
        return self.model.lm_head(self.base.norm(hidden[:, -1:]))[:, -1]

    @torch.no_grad()
    def check_split(self, index: int = 0, tokens: int = 3) -> None:
        """Raise UnsupportedModelError unless layer `index` split in halves equals its forward."""
        ids = torch.zeros(1, tokens, dtype=torch.long, device=self.device)
        mask = torch.ones_like(ids)
        hidden, inputs = self.embed(ids, mask, self.new_cache())
        hidden = hidden + torch.randn_like(hidden)  # distinct positions, not one repeated token
        reference = self.layers[index](
            hidden, attention_mask=inputs.masks[self.layer_types[index]], position_ids=inputs.position_ids,
            past_key_values=self.new_cache(), position_embeddings=inputs.position_embeddings,
        )
        reference = reference[0] if isinstance(reference, tuple) else reference
        try:
            split = self.ffn_half(index, self.attention_half(index, hidden, inputs))
        except (TypeError, ValueError, AttributeError, NotImplementedError) as exc:  # halves unlike Mixtral's
            raise UnsupportedModelError(
                f"{type(self.layers[index]).__name__}'s attention and MoE halves do not run as Mixtral's do "
                f"({type(exc).__name__}: {str(exc).strip().splitlines()[0]}); CGOPipe cannot drive it") from exc
        if not torch.equal(reference, split):
            raise UnsupportedModelError(
                f"{type(self.layers[index]).__name__}.forward is not norm → attention → add, norm → MoE → add "
                "(its split differs from its forward); CGOPipe cannot drive it"
            )
