"""Which MoE architectures of the installed transformers the offloading runtime serves exactly.

For each family of `prescient.arch_zoo.moe_families()`: build the tiny model, save it, generate
greedily with the plain model and through `load_offloaded` at each of `SETTINGS` (budget,
policy), and compare the tokens. A family is

- `exact`: every setting gives the plain model's tokens;
- `refused`: our code or transformers declines it on purpose (a `PrescientError`, whose one-line
  message names the family and the reason);
- `different` or `error`: a bug of ours (tokens differ, or an unexpected exception).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from offload_runtime.engine.loader import load_offloaded
from prescient.arch import find_moe_layers
from prescient.arch_zoo import VOCAB, Family, moe_families, save_tiny_model
from prescient.errors import PrescientError
from prescient.loading import load_model

log = logging.getLogger(__name__)

SETTINGS: tuple[tuple[float, str], ...] = ((0.5, "lru"), (0.25, "mrs"))
NEW_TOKENS = 4


@dataclass(frozen=True)
class Support:
    """One row of the support table."""

    family: str  # config.model_type
    status: str  # "exact", "refused", "different" or "error"
    detail: str = ""  # the refusal's reason, the failure; for exact ones the MoE layout that was served
    # filled by `experiments.arch_pipeline` (`prescient archs --pipeline`), for exact families only:
    pipeline: str = ""  # trace, train a SiDA hash function, evaluate it, serve with it: "ok (...)" or what failed
    cgopipe: str = ""  # CGOPipe batch decoding: "exact", "refused: <reason>" or "failed: ..."

    def to_dict(self) -> dict:
        return asdict(self)


def prompt_inputs(encoder_decoder: bool) -> dict[str, torch.Tensor]:
    """Two prompts of different lengths, padded (left for a decoder, as generation needs)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    if encoder_decoder:
        mask[1, 6:] = 0
    else:
        mask[1, :3] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def greedy(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0)


def layout(model) -> str:
    """A short description of the MoE layers: how many of the layers, experts, top-k, how experts are called."""
    layers = find_moe_layers(model)
    experts = sorted({layer.num_experts for layer in layers})
    top_k = sorted({layer.top_k for layer in layers})
    kinds = sorted({layer.adapter.name for layer in layers})
    total = _decoder_layers(model)
    moe = f"{len(layers)} of {total} layers MoE" if total > len(layers) else _count(len(layers), "MoE layer")
    return f"{moe}, {'/'.join(map(str, experts))} experts, top-{'/'.join(map(str, top_k))}, {'+'.join(kinds)}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _decoder_layers(model) -> int:
    """The number of decoder (and encoder) layers the config declares; 0 if it names none."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "is_encoder_decoder", False):
        return getattr(config, "num_layers", 0) + getattr(config, "num_decoder_layers", 0)
    return getattr(config, "num_hidden_layers", 0) or 0


def check_family(family: Family, workdir: Path) -> Support:
    """Build, save and serve the tiny model of `family` at every setting; its support row."""
    try:
        path = save_tiny_model(family, workdir / family.model_type)
        plain, _ = load_model(path, dtype=torch.float32)
        inputs = prompt_inputs(family.encoder_decoder)
        want = greedy(plain, inputs)
        served = layout(plain)
        for budget, policy in SETTINGS:
            model = load_offloaded(path, policy=policy, budget=budget)
            with model.runtime:
                got = greedy(model, inputs)
            if not torch.equal(got, want):
                return Support(family.model_type, "different", f"tokens differ at budget {budget}, {policy}")
    except PrescientError as exc:
        return Support(family.model_type, "refused", str(exc))
    except Exception as exc:  # noqa: BLE001 - reported as a row: a bug of ours to fix
        log.exception("%s failed", family.model_type)
        return Support(family.model_type, "error", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}")
    return Support(family.model_type, "exact", served)


def support_table(families: list[str] | None = None, workdir: str | Path | None = None) -> list[Support]:
    """The support row of every MoE family of the installed transformers (or of `families`)."""
    chosen = [f for f in moe_families() if families is None or f.model_type in families]
    unknown = sorted(set(families or ()) - {f.model_type for f in chosen})
    if unknown:
        raise PrescientError(f"no MoE family named {', '.join(unknown)} in this transformers; "
                             "`prescient archs` lists them")
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        return [check_family(family, Path(tmp)) for family in chosen]


def _tally(values: list[str]) -> str:
    counts = sorted(((values.count(value), value) for value in dict.fromkeys(values)), key=lambda c: -c[0])
    return ", ".join(f"{n} {value}" for n, value in counts)


def summary(rows: list[Support]) -> str:
    """One line: the families per runtime status (and, checked with the pipeline, per pipeline and
    CGOPipe outcome)."""
    line = f"{_count(len(rows), 'MoE architecture')}: {_tally([r.status for r in rows])}."
    checked = [r for r in rows if r.pipeline]
    if checked:
        line += (f" Trace + SiDA training + evaluation + serving with it, of the {len(checked)} exact: "
                 f"{_tally([r.pipeline.split(' (')[0].split(':')[0] for r in checked])}."
                 f" CGOPipe: {_tally([r.cgopipe.split(':')[0] for r in checked])}.")
    return line


def markdown_table(rows: list[Support]) -> str:
    """The support table in markdown, after the summary line; pipeline and CGOPipe columns when
    the rows carry them."""
    def cell(text: str) -> str:
        return text.replace("|", "/") or "—"

    pipeline = any(r.pipeline for r in rows)
    head = ["family", "offloaded generation", "detail"] + (["trace, train, evaluate, serve SiDA", "CGOPipe"] if pipeline else [])
    lines = [summary(rows), "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"`{r.family}`", r.status, cell(r.detail)] + ([cell(r.pipeline), cell(r.cgopipe)] if pipeline else [])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
