"""The MoE architectures of the installed transformers, and a tiny random model of each.

`moe_families()` reads transformers' own auto mappings: every model type with a causal-LM (or
seq2seq-LM) class whose default config names experts (a field matching `expert` or `moe`, in
the config or one of its sub-configs). Nothing here lists families by hand; a new transformers
release brings its new MoE families along.

`tiny_config(family)` shrinks the family's default config field by field to hidden 64, 4 layers,
8 experts and top-2 (top-1 where the config only allows that): sizes by field name, per-layer
lists (`layer_types`, `mlp_layer_types`, ...) cut to 4 entries that keep every kind of layer
the full list has, sub-configs (a composite model's `text_config`) shrunk alike. A few
families' defaults do not build as they are; `_FIXES` holds the field values that make them
build, one line each with the reason.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
)

from prescient.errors import PrescientError

log = logging.getLogger(__name__)

HIDDEN, LAYERS, EXPERTS, TOP_K, VOCAB = 64, 4, 8, 2, 512

# field name → tiny value, for every field of that name the config (or a sub-config) has
_SIZES: dict[str, object] = {
    "hidden_size": HIDDEN, "d_model": HIDDEN, "num_hidden_layers": LAYERS, "num_layers": LAYERS,
    "num_decoder_layers": LAYERS, "encoder_layers": LAYERS, "decoder_layers": LAYERS,
    "num_attention_heads": 4, "num_heads": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "d_kv": 16,
    "intermediate_size": 128, "d_ff": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "ffn_dim": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "expert_ffn_hidden_size": 32, "shared_intermediate_size": 32,
    "ffn_hidden_size": 128, "router_hidden_size": 32,
    "adapter_in_dim": HIDDEN, "adapter_input_size": HIDDEN, "adapter_out_dim": HIDDEN,  # multimodal adapters
    "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB, "unpadded_vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K, "num_experts_per_token": TOP_K, "moe_topk": TOP_K, "moe_k": TOP_K,
    "top_k_experts": TOP_K, "moe_top_k": TOP_K,
    "n_group": 1, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "num_dense_layers": 1,
    "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0,
    "enable_moe_block": True, "is_moe": True, "zero_expert_num": 2,
}
_TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts", "moe_top_k")
# fields whose tiny value follows from the others' (`fields`: the default config, `tiny`: the
# tiny values so far): latent attention (MLA, a `kv_lora_rank`) has as many kv heads as heads,
# and its head_dim is the rope part
_DERIVED = {
    "head_dim": lambda fields, tiny: tiny.get("qk_rope_head_dim", 16),
    "num_key_value_heads": lambda fields, tiny: tiny["num_attention_heads"] if "kv_lora_rank" in fields else 2,
}
# families whose default config does not build a model as it is (nested dicts: sub-configs)
_FIXES: dict[str, dict[str, object]] = {
    "dots1": {"n_shared_experts": 1},  # the default None multiplies a size
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},  # the default None is indexed
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"] * 2},  # all-Mamba cannot generate
    # the default leaves the sparse attention's indexer unset, which its layers need
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 4},
    # the attention reads a field its config class lacks, and clamps by clip_qkv, which defaults to None
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # the speaker head's input size must equal the diarization encoder's width; a token id below the tiny vocab
    "nemo_speechlm": {"audio_config": {"diarization_config": {"head_config": {"audio_hidden_size": HIDDEN}}},
                      "word_timestamp_config": {"blank_token_id": VOCAB - 1}},
}
_FIXES["qwen4_exp"] = {"text_config": _FIXES["qwen4_exp_text"]}
_MOE_FIELD = re.compile(r"expert|moe", re.IGNORECASE)


class TinyModelError(PrescientError):
    """transformers cannot build a tiny model of a family from its default config."""


@dataclass(frozen=True)
class Family:
    """One MoE architecture of the installed transformers."""

    model_type: str  # config.model_type, e.g. "mixtral"
    model_class: str  # the auto class's choice, e.g. "MixtralForCausalLM"
    encoder_decoder: bool


def _names_experts(config: dict) -> bool:
    return any(_MOE_FIELD.search(str(key)) or (isinstance(value, dict) and _names_experts(value))
               for key, value in config.items())


def moe_families() -> list[Family]:
    """Every model type with a causal-LM or seq2seq-LM class whose default config names experts,
    sorted by name. A config that cannot even be built with its defaults is skipped, with a log line."""
    found: dict[str, Family] = {}
    for mapping, encoder_decoder in ((MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, False),
                                     (MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, True)):
        for model_type, class_name in mapping.items():
            if model_type not in CONFIG_MAPPING or model_type in found:
                continue
            try:
                config = CONFIG_MAPPING[model_type]()
            except Exception as exc:  # noqa: BLE001 - a transformers default that fails its own validation
                log.debug("%s: the default config does not build (%s); skipped", model_type, exc)
                continue
            if _names_experts(config.to_dict()):
                found[model_type] = Family(model_type, class_name, encoder_decoder)
    return sorted(found.values(), key=lambda f: f.model_type)


def _per_layer(values: list, n: int) -> list:
    """The first `n` of `values`, with the last ones replaced by the kinds that would be missing."""
    kept = list(values[:n])
    missing = [v for v in dict.fromkeys(values) if v not in kept]
    for i, value in enumerate(missing[:n]):
        kept[n - 1 - i] = value
    return kept


def _shrink(config: PretrainedConfig, top_k: int) -> dict:
    """Constructor kwargs that make `config` tiny."""
    fields = config.to_dict()
    alias = {name: real for name, real in config.attribute_map.items() if real in fields}
    layers = getattr(config, "num_hidden_layers", None)
    out = {alias.get(key, key): value for key, value in _SIZES.items() if alias.get(key, key) in fields}
    out.update({key: rule(fields, out) for key, rule in _DERIVED.items() if key in fields})
    out.update({key: top_k for key in _TOP_K_FIELDS if key in fields})
    for key, value in fields.items():
        if isinstance(value, list) and layers and len(value) == layers and value and not isinstance(value[0], (int, float)):
            out[key] = _per_layer(value, LAYERS)
        elif isinstance(value, dict) and isinstance(getattr(config, key, None), PretrainedConfig):
            out[key] = _shrink(getattr(config, key), top_k)
    return out


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def tiny_config(model_type: str) -> PretrainedConfig:
    """`model_type`'s default config shrunk to hidden 64, 4 layers, 8 experts, top-2 (top-1 if the
    config refuses 2)."""
    cls = CONFIG_MAPPING[model_type]
    errors = []
    for top_k in (TOP_K, 1):
        try:
            return cls(**_merge(_shrink(cls(), top_k), _FIXES.get(model_type, {})))
        except Exception as exc:  # noqa: BLE001 - transformers' own validation, reported below
            errors.append(f"top-{top_k}: {exc}".replace("\n", " "))
    raise TinyModelError(f"{model_type}: no tiny config builds ({'; '.join(errors)})")


def auto_class(config: PretrainedConfig) -> type:
    return AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM


def tiny_model(family: Family | PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised tiny model of `family` (or of a config of one's own), as its auto
    class builds it (a composite config's causal LM is built from its text config), in eval
    mode, float32."""
    config = tiny_config(family.model_type) if isinstance(family, Family) else family
    torch.manual_seed(seed)
    try:
        model = auto_class(config).from_config(config, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - transformers' own code failing on a tiny config
        first_line = str(exc).strip().splitlines()[0]
        raise TinyModelError(f"{config.model_type}: transformers cannot build the tiny model "
                             f"({type(exc).__name__}: {first_line})") from exc
    _randomise_buffers(model)
    return model.eval()


def _randomise_buffers(model: PreTrainedModel) -> None:
    """Routing-correction biases start at zero; a small random one makes them matter for the choice."""
    generator = torch.Generator().manual_seed(1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias") and buffer.is_floating_point():
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)


def save_tiny_model(family: Family | PretrainedConfig, path: str | Path, seed: int = 0, tokenizer=None) -> Path:
    """Save a tiny model of `family` (or of a config, see `tiny_model`) into `path` (config.json
    + safetensors, and `tokenizer` if given) and return `path`."""
    path = Path(path)
    tiny_model(family, seed).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
