"""Reference-model recipes (configs/reference/*.yaml): read and checked before any training.

A recipe names a tokenizer, a Mixtral-architecture model and a training schedule, or (with
`base:`) widens another recipe's experts. Every field is checked for type and range here, so an
inconsistent recipe is one error naming its field, never a traceback from inside training.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from prescient.errors import PrescientError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "reference"
SIZES = ("tiny", "base", "bench")


class ReferenceModelError(PrescientError):
    """A reference recipe is inconsistent, or a reference model folder holds a damaged report."""


def recipe(size: str) -> dict:
    """The recipe shipped for `size`."""
    if size not in SIZES:
        raise ValueError(f"unknown reference size {size!r}; choose one of {', '.join(SIZES)}")
    return read_recipe(CONFIG_DIR / f"{size}.yaml")


def read_recipe(path: str | Path) -> dict:
    """A recipe file, checked; a widening recipe carries its base's recipe as `base_recipe`."""
    try:
        spec = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ReferenceModelError(f"cannot read the recipe {path}: {exc}") from None
    if not isinstance(spec, dict):
        raise ReferenceModelError(f"the recipe {path} is not a mapping of fields")
    if "base" in spec:
        if spec["base"] not in SIZES or spec["base"] == "bench":
            raise ReferenceModelError(f"{path}: base must name a trained recipe (tiny or base), not {spec['base']!r}")
        spec = {**spec, "base_recipe": recipe(spec["base"])}
    check_recipe(spec, str(path))
    return spec


# field -> (type, smallest allowed value)
_TRAINED_FIELDS = {
    "seed": (int, 0),
    "tokenizer.vocab_size": (int, 260),  # 256 bytes + the special tokens
    "tokenizer.train_chars": (int, 1),
    "model.hidden_size": (int, 1),
    "model.num_hidden_layers": (int, 1),
    "model.num_attention_heads": (int, 1),
    "model.num_key_value_heads": (int, 1),
    "model.intermediate_size": (int, 1),
    "model.num_local_experts": (int, 1),
    "model.num_experts_per_tok": (int, 1),
    "model.router_aux_loss_coef": (float, 0.0),
    "model.max_position_embeddings": (int, 1),
    "model.tie_word_embeddings": (bool, None),
    "training.corpus_chars": (int, 1),
    "training.seq_len": (int, 2),
    "training.batch_size": (int, 1),
    "training.max_steps": (int, 1),
    "training.lr": (float, 0.0),
    "training.warmup_steps": (int, 0),
    "training.weight_decay": (float, 0.0),
    "training.layer_balance_coef": (float, 0.0),
    "training.val_windows": (int, 1),
    "training.val_every": (int, 1),
}


def _field(spec: dict, dotted: str, where: str):
    node = spec
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ReferenceModelError(f"{where}: the recipe has no field {dotted}")
        node = node[part]
    return node


def check_recipe(spec: dict, where: str = "recipe") -> None:
    """Raise `ReferenceModelError` naming the first field of `spec` that is missing, of the
    wrong type, out of range or inconsistent with another."""
    if "base" in spec:
        wide = spec.get("expert_intermediate_size")
        if type(wide) is not int or wide < spec["base_recipe"]["model"]["intermediate_size"]:
            raise ReferenceModelError(f"{where}: expert_intermediate_size must be an integer at least the base's "
                                      f"intermediate_size ({spec['base_recipe']['model']['intermediate_size']}), "
                                      f"not {wide!r}")
        return
    for dotted, (kind, least) in _TRAINED_FIELDS.items():
        value = _field(spec, dotted, where)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else type(value) is kind
        if not ok:
            raise ReferenceModelError(f"{where}: {dotted} must be {kind.__name__}, not {value!r}")
        if least is not None and value < least:
            raise ReferenceModelError(f"{where}: {dotted} must be at least {least}, not {value!r}")
    model, training = spec["model"], spec["training"]
    if model["hidden_size"] % model["num_attention_heads"]:
        raise ReferenceModelError(f"{where}: model.num_attention_heads ({model['num_attention_heads']}) must divide "
                                  f"model.hidden_size ({model['hidden_size']})")
    if model["num_attention_heads"] % model["num_key_value_heads"]:
        raise ReferenceModelError(f"{where}: model.num_key_value_heads ({model['num_key_value_heads']}) must divide "
                                  f"model.num_attention_heads ({model['num_attention_heads']})")
    if model["num_experts_per_tok"] > model["num_local_experts"]:
        raise ReferenceModelError(f"{where}: model.num_experts_per_tok ({model['num_experts_per_tok']}) is above "
                                  f"model.num_local_experts ({model['num_local_experts']})")
    if training["seq_len"] > model["max_position_embeddings"]:
        raise ReferenceModelError(f"{where}: training.seq_len ({training['seq_len']}) is above "
                                  f"model.max_position_embeddings ({model['max_position_embeddings']})")
    if training["warmup_steps"] >= training["max_steps"]:
        raise ReferenceModelError(f"{where}: training.warmup_steps ({training['warmup_steps']}) must be below "
                                  f"training.max_steps ({training['max_steps']})")
    if training["lr"] <= 0:
        raise ReferenceModelError(f"{where}: training.lr must be above 0, not {training['lr']!r}")
