"""Predictor artifacts: `NAME.safetensors` (tensors) + `NAME.json` (kind, hyper-parameters,
fingerprint, training data, metrics).

The tensors are written first and the JSON last, each atomically; the JSON records the
SHA-256 of the tensor file, so a pair torn by a crash between the two renames is detected
on load instead of serving weights that do not match their description.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from predictor.base import ExpertPredictor, PredictorMeta, predictor_class
from prescient.atomic import write_atomic, write_json_atomic
from prescient.errors import PrescientError
from prescient.fingerprint import ModelFingerprint

log = logging.getLogger(__name__)

FORMAT = "prescient-predictor/1"


class PredictorArtifactError(PrescientError):
    """A predictor artifact is missing, corrupt, or its two files do not belong together."""


def artifact_paths(path: str | Path) -> tuple[Path, Path]:
    """`NAME`, `NAME.json` or `NAME.safetensors` → (NAME.safetensors, NAME.json)."""
    path = Path(path)
    if path.suffix in (".json", ".safetensors"):
        path = path.with_suffix("")
    return path.with_name(path.name + ".safetensors"), path.with_name(path.name + ".json")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_predictor(pred: ExpertPredictor, path: str | Path) -> Path:
    """Write `pred` as an artifact at `path` (see module doc); returns the JSON path."""
    weights_path, meta_path = artifact_paths(path)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in pred.tensors().items()}
    write_atomic(weights_path, lambda p: save_file(tensors, str(p)))
    meta = {"format": FORMAT, **pred.meta.to_dict(), "weights_sha256": _sha256(weights_path)}
    write_json_atomic(meta_path, meta)
    log.info("saved %s predictor to %s", pred.kind, meta_path)
    return meta_path


def read_predictor_meta(path: str | Path) -> PredictorMeta:
    """The JSON half of an artifact, without loading tensors."""
    _, meta_path = artifact_paths(path)
    return _parse_meta(_read_meta_json(meta_path), meta_path)


def _parse_meta(data: dict, meta_path: Path) -> PredictorMeta:
    try:
        meta = PredictorMeta.from_dict(data)
        if not isinstance(meta.kind, str):
            raise TypeError(f"kind {meta.kind!r} is not a name")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PredictorArtifactError(f"{meta_path} lacks a field or holds a wrong one ({type(exc).__name__}: {exc}); "
                                     "export the predictor again") from exc
    return meta


def _read_meta_json(meta_path: Path) -> dict:
    if not meta_path.exists():
        raise PredictorArtifactError(f"predictor artifact {meta_path} does not exist; train one with `prescient train`")
    try:
        data = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PredictorArtifactError(f"{meta_path} is not valid JSON ({exc}); export the predictor again") from exc
    if not isinstance(data, dict):
        raise PredictorArtifactError(f"{meta_path} holds a JSON {type(data).__name__}, not an artifact's object; "
                                     "export the predictor again")
    if data.get("format") != FORMAT:
        raise PredictorArtifactError(f"{meta_path} has format {data.get('format')!r}; expected {FORMAT!r}")
    return data


def load_predictor(path: str | Path, fingerprint: ModelFingerprint | None = None) -> ExpertPredictor:
    """Load an artifact. With `fingerprint` (the serving model's), a predictor built for
    another model raises `FingerprintMismatchError` naming both."""
    weights_path, meta_path = artifact_paths(path)
    data = _read_meta_json(meta_path)
    meta = _parse_meta(data, meta_path)
    cls = predictor_class(meta.kind)
    if fingerprint is not None:
        fingerprint.require_same(meta.fingerprint, f"predictor {meta_path}")
    if not weights_path.exists():
        raise PredictorArtifactError(f"{weights_path} is missing; it belongs to {meta_path}")
    if _sha256(weights_path) != data.get("weights_sha256"):
        raise PredictorArtifactError(
            f"{weights_path} does not match {meta_path} (interrupted export?); export the predictor again"
        )
    try:
        tensors: dict[str, torch.Tensor] = load_file(str(weights_path))
    except (SafetensorError, OSError) as exc:
        raise PredictorArtifactError(f"{weights_path} is corrupt ({exc}); export the predictor again") from exc
    try:
        return cls.from_artifact(meta, tensors)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        reason = " ".join(str(exc).split())[:240] or type(exc).__name__  # one line
        raise PredictorArtifactError(f"the hyper-parameters in {meta_path} do not fit the tensors in {weights_path} "
                                     f"({reason}); export the predictor again") from exc


def check_tracing_convention(meta: PredictorMeta, encoder_decoder: bool) -> None:
    """Warn when an encoder-decoder's predictor was trained on a trace made before decoder rows
    were the steps that read the row's token: its decoder-layer guesses are one token off."""
    if encoder_decoder and not meta.training.get("settings", {}).get("decoder_reads_row_token"):
        log.warning("predictor %r was not trained on a trace whose decoder rows are the steps reading the "
                    "row's token (a trace made before that convention): its decoder-layer guesses are one "
                    "token off; trace again and retrain", meta.kind)
