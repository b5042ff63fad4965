"""The one interface every expert predictor implements, and the registry of predictor kinds.

A predictor guesses, for each token, which experts every MoE layer's router will pick.
Scores are "higher is likelier"; callers take the top-k (or top-2k) per layer.

    predict(input_ids [B, T])        -> [B, T, L, E]   a whole prompt at once
    start(batch_size) -> state                          begin decoding
    step(state, token_ids [B])       -> [B, L, E]      one new token per row, causal,
                                                       incremental: each token is seen once
    forecast(state)                  -> [B, H, L, E]   optional: tokens t+1..t+H after the last
                                                       `step` (`horizon` H; 0 = no forecasts)
    predict_with_forecasts(input_ids) -> ([B, T, L, E], [B, T, H, L, E])   the same, whole prompts
    chance_selected(scores, top_k)   -> [..., E]       what learned eviction ranks by: each
                                                       expert's chance of being picked

Kinds are registered by name (the style of transformers' `ExpertsInterface`) so an artifact's
JSON `kind` picks the class that loads it; see `predictor.artifact`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from predictor.forecast import chance_selected, chances_of_use, chances_of_use_compiled
from prescient.errors import PrescientError
from prescient.fingerprint import ModelFingerprint
from prescient.traces import TraceManifest


class PredictorError(PrescientError):
    """A predictor cannot do what was asked (unknown kind, unsupported operation, unknown input)."""


class ForecastHorizonError(PredictorError):
    """Forecasts were asked of a predictor without forecast heads, or beyond its horizon."""


@dataclass
class PredictorMeta:
    """What an artifact's JSON holds besides the tensors."""

    kind: str
    fingerprint: ModelFingerprint
    hparams: dict[str, Any] = field(default_factory=dict)  # everything needed to rebuild the module
    training: dict[str, Any] = field(default_factory=dict)  # trace dirs, dataset, split, config
    metrics: dict[str, float] = field(default_factory=dict)  # validation metrics at export

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "fingerprint": self.fingerprint.to_dict(),
            "hparams": self.hparams,
            "training": self.training,
            "metrics": self.metrics,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PredictorMeta":
        return cls(
            kind=data["kind"],
            fingerprint=ModelFingerprint.from_dict(data["fingerprint"]),
            hparams=dict(data.get("hparams", {})),
            training=dict(data.get("training", {})),
            metrics=dict(data.get("metrics", {})),
        )


P = TypeVar("P", bound="ExpertPredictor")


class ExpertPredictor(ABC):
    """Base of every predictor kind. Subclasses set `kind` and implement the three calls
    plus `tensors` / `from_artifact` for the artifact format."""

    kind: ClassVar[str]
    meta: PredictorMeta
    certain: ClassVar[bool] = False  # its chances of use are the truth: learned eviction ranks by them alone

    @property
    def n_layers(self) -> int:
        return self.meta.fingerprint.n_moe_layers

    @property
    def n_experts(self) -> int:
        return self.meta.fingerprint.n_experts

    @abstractmethod
    def predict(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scores [B, T, L, E] for every token of a batch of prompts."""

    @abstractmethod
    def start(self, batch_size: int) -> Any:
        """Fresh decoding state for `batch_size` rows."""

    @abstractmethod
    def step(self, state: Any, token_ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([B]); scores [B, L, E] for it. Updates `state` in place."""

    @property
    def horizon(self) -> int:
        """How many tokens ahead `forecast` sees (0: no forecasts)."""
        return 0

    def require_horizon(self, horizon: int) -> None:
        """Raise `ForecastHorizonError`, saying what to train, unless forecasts reach `horizon` tokens."""
        if self.horizon == 0:
            raise ForecastHorizonError(
                f"this {self.kind!r} predictor has no forecasts; train one with --model.horizon {max(horizon, 1)} "
                "(a SiDA hash function with forecast heads)"
            )
        if not 1 <= horizon <= self.horizon:
            raise ForecastHorizonError(
                f"this {self.kind!r} predictor forecasts 1..{self.horizon} tokens ahead, not {horizon}; "
                f"train one with --model.horizon {max(horizon, 1)}"
            )

    def forecast(self, state: Any, horizon: int | None = None) -> torch.Tensor:
        """Scores [B, h, L, E] for tokens t+1..t+h after the last `step` (h = `horizon`, default all)."""
        self.require_horizon(self.horizon if horizon is None else horizon)
        raise NotImplementedError(f"{type(self).__name__} has a horizon but no forecast")

    def predict_with_forecasts(self, input_ids: torch.Tensor,
                               horizon: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`predict` [B, T, L, E] and, for every token t, the forecasts [B, T, h, L, E] of t+1..t+h."""
        self.require_horizon(self.horizon if horizon is None else horizon)
        raise NotImplementedError(f"{type(self).__name__} has a horizon but no predict_with_forecasts")

    def chance_selected(self, scores: torch.Tensor, top_k: int) -> torch.Tensor:
        """[..., E] each expert's chance of being among the router's top-k, from this predictor's
        scores (see `predictor.forecast`)."""
        return chance_selected(scores, top_k)

    def chances_of_use(self, state: Any, last_scores: torch.Tensor,
                       top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After the last `step` (its scores `last_scores` [B, L, E]), per row: the [B, L, E]
        chances of use soon counted from that token, counted from the next one on, and of use by
        the next token (`predictor.forecast.chances_of_use`; the runtime asks once a token)."""
        ahead = self.forecast(state).float()
        if getattr(self.chance_selected, "__func__", None) is ExpertPredictor.chance_selected:
            return chances_of_use_compiled(last_scores, ahead, top_k)  # the same formula, compiled
        soon, later = chances_of_use(last_scores, ahead, top_k, to_chances=self.chance_selected)
        return soon, later, self.chance_selected(ahead[:, 0], top_k)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors an artifact stores for this predictor."""
        raise PredictorError(f"a {self.kind!r} predictor has no artifact form")

    @classmethod
    def from_artifact(cls: type[P], meta: PredictorMeta, tensors: dict[str, torch.Tensor]) -> P:
        """The predictor an artifact's meta and `tensors` (as `tensors()` wrote them) describe;
        kinds that have no artifact refuse."""
        raise PredictorError(f"a {cls.kind!r} predictor cannot be loaded from an artifact")


class TokenwisePredictor(ExpertPredictor):
    """A predictor whose guess for a token depends on that token alone (tables, frequencies):
    decoding needs no state and `step` is `predict` on a length-1 prompt."""

    def start(self, batch_size: int) -> None:
        return None

    def step(self, state: None, token_ids: torch.Tensor) -> torch.Tensor:
        return self.predict(token_ids[:, None])[:, 0]


PREDICTORS: dict[str, type[ExpertPredictor]] = {}


def register_predictor(cls: type[P]) -> type[P]:
    """Class decorator: make `cls` loadable by its `kind`."""
    if cls.kind in PREDICTORS and PREDICTORS[cls.kind] is not cls:
        raise ValueError(f"predictor kind {cls.kind!r} is registered twice")
    PREDICTORS[cls.kind] = cls
    return cls


def predictor_class(kind: str) -> type[ExpertPredictor]:
    try:
        return PREDICTORS[kind]
    except KeyError:
        raise PredictorError(f"unknown predictor kind {kind!r}; known kinds: {', '.join(sorted(PREDICTORS))}") from None


def describe_trace(manifest: TraceManifest, trace_dir: str | None = None) -> dict[str, Any]:
    """What an artifact records about the trace it was built from."""
    return {
        "trace_dir": trace_dir,
        "dataset": manifest.dataset,
        "split": manifest.split,
        "n_tokens": manifest.n_tokens,
        "top_t": manifest.top_t,
        "settings": manifest.settings,
    }
