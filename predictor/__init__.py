"""Every way to guess a token's experts ahead of its routers, behind one interface.

Kinds (registered by name in `PREDICTORS`): "sida" (learned hash function), "frequency",
"token-table", "klotski-correlation", "gate-lookahead", "probe" (hidden-state probe), "oracle". Artifacts are saved and
loaded with `save_predictor` / `load_predictor`.
"""

from predictor.artifact import PredictorArtifactError, load_predictor, read_predictor_meta, save_predictor
from predictor.base import (
    PREDICTORS,
    ExpertPredictor,
    ForecastHorizonError,
    PredictorError,
    PredictorMeta,
    TokenwisePredictor,
    predictor_class,
    register_predictor,
)
from predictor.baselines import FrequencyPredictor, OraclePredictor, TokenTablePredictor
from predictor.correlation import CorrelationTable
from predictor.lookahead import GateLookahead, HiddenLookahead
from predictor.probe import ProbeLookahead, load_probe
from predictor.metrics import recall_at
from predictor.sida import SiDAHash, SiDAPredictor, SiDASizes, read_token_embeddings

__all__ = [
    "PREDICTORS",
    "CorrelationTable",
    "ExpertPredictor",
    "ForecastHorizonError",
    "FrequencyPredictor",
    "GateLookahead",
    "HiddenLookahead",
    "OraclePredictor",
    "PredictorArtifactError",
    "PredictorError",
    "PredictorMeta",
    "ProbeLookahead",
    "SiDAHash",
    "SiDAPredictor",
    "SiDASizes",
    "TokenTablePredictor",
    "TokenwisePredictor",
    "load_predictor",
    "load_probe",
    "predictor_class",
    "read_predictor_meta",
    "read_token_embeddings",
    "recall_at",
    "register_predictor",
    "save_predictor",
]
