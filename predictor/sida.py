"""SiDA's hash function: an LSTM with sparsemax self-attention that predicts every MoE
layer's experts for every token (Du et al., SiDA, §3.4), made causal for decoders.

    token ids ─▶ target model's embeddings (frozen) ─▶ Linear compression (d_c) + LayerNorm
              ─▶ 2-layer LSTM (H) ─▶ self-attention over the LSTM outputs ─▶ + LSTM output of
                 the current token (residual) = the token's feature ─┬▶ Linear to L·E ─▶ [.., L, E] logits
                                                                      └▶ Linear to H·L·E ─▶ [.., H, L, E]
                                                                         forecasts of t+1..t+H (optional)

Choices the paper leaves open, and ours:
- Attention: q = W_q·h, k = W_k·h, v = h (the LSTM outputs; learned query/key projections
  of size H, no value projection). Without projections the score h_t·h_t usually dominates
  and the attention collapses onto the token itself. Weights are `entmax.sparsemax` of the
  raw scaled scores q·k/√H, so most weights are exactly zero.
- Causal variant (default, for decoders): unidirectional LSTM, and token t attends to the
  last `attn_window` tokens s ∈ (t − W, t]. `step` keeps the LSTM state and the LSTM outputs
  of the last W tokens (no keys: the score q·k = (h_t W_qᵀW_k)·h_s uses W_qᵀW_k, computed once
  in `start`), so each decoded token costs O(W), and `step` equals `predict` on the same
  prefix. The window bounds memory and latency on long generations.
- Bidirectional variant (for prompts / encoders): bidirectional LSTM (outputs 2H), full
  attention over the prompt. Its `step` re-encodes the last W tokens per call (O(W) LSTM
  steps); decode with the causal variant.
- Forecast heads (`horizon` H > 0, causal variant only): one more Linear from the same
  feature to H·L·E, the logits of tokens t+1..t+H's experts, known after token t. The
  forecast of t+h is a guess over the tokens that may come, so its training target is the
  share of each expert among the router's top-k (see `predictor.losses.forecast_loss`).
  Without heads (H = 0, every artifact made before them) nothing changes.
- The compression is Linear + LayerNorm (embeddings of real models are tiny). Export folds
  the frozen embedding, the Linear and the LayerNorm into one [V, d_c] table (exact: the
  map depends on the token alone), so an artifact needs neither the model nor its
  embedding matrix and a token costs one row lookup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from entmax import sparsemax
from safetensors import safe_open
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from predictor import sida_decode
from predictor.base import ExpertPredictor, PredictorError, PredictorMeta, register_predictor
from prescient.errors import ModelFilesError

EMBEDDING_SUFFIXES = ("embed_tokens.weight", "shared.weight")


def read_token_embeddings(model_dir: str | Path) -> torch.Tensor:
    """The input-embedding matrix [V, D] (float32) of a HF model directory, read from its
    safetensors files alone (the model is not loaded): the tensor named *embed_tokens.weight or
    *shared.weight, else the one the model's `get_input_embeddings()` loads from (found on a
    weightless copy of the model, `prescient.loading.input_embedding_key`)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelFilesError(f"{model_dir} holds no *.safetensors files; expected a Hugging Face model directory")
    found: list[tuple[str, Path]] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            found += [(name, file) for name in f.keys() if name.endswith(EMBEDDING_SUFFIXES)]
    if not found:  # another name (DBRX's transformer.wte, Nemotron-H's embeddings, ...): the model's own
        from prescient.loading import input_embedding_key

        own = input_embedding_key(model_dir)
        found = [own] if own is not None else []
    if not found:
        raise ModelFilesError(
            f"no tensor named *{' or *'.join(EMBEDDING_SUFFIXES)} in {model_dir}, nor the model's own input "
            "embedding; cannot read token embeddings"
        )
    name, file = min(found, key=lambda item: len(item[0]))  # tied copies: the shortest name is the source
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(name).float()


@dataclass
class SiDASizes:
    compress_dim: int = 64  # d_c, the compressed embedding
    hidden_dim: int = 128  # H, per LSTM direction
    lstm_layers: int = 2
    attn_window: int = 128  # W, tokens a causal query attends to (itself included)
    bidirectional: bool = False
    dropout: float = 0.0  # between LSTM layers and on the LSTM outputs, training only


class CompressedEmbedding(nn.Module):
    """Frozen target-model embeddings, then the trainable compression Linear and a LayerNorm
    (model embeddings are tiny, std ~0.02; unnormalised they starve the LSTM). The embedding
    is a non-persistent buffer: checkpoints stay small and re-read it from the model."""

    def __init__(self, embedding: torch.Tensor, dim: int):
        super().__init__()
        self.register_buffer("embedding", embedding.float(), persistent=False)
        self.compress = nn.Linear(embedding.shape[1], dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.compress(nn.functional.embedding(token_ids, self.embedding)))

    def folded(self) -> nn.Embedding:
        """The whole per-token map as one table: exact, since it depends on the token alone."""
        with torch.no_grad():
            return nn.Embedding.from_pretrained(self(torch.arange(len(self.embedding), device=self.embedding.device)),
                                                freeze=True)


@dataclass
class SiDAState:
    """Decoding state of the hash function (per row of the batch)."""

    h: list[torch.Tensor]  # per LSTM layer [B, H]
    c: list[torch.Tensor]  # per LSTM layer [B, H]
    values: torch.Tensor  # [B, ≤W, H] LSTM outputs of the last W tokens: the attention memory
    query_key: torch.Tensor  # W_qᵀW_k [H, H]: score(t, s) = (h_t W_qᵀW_k) · h_s, so no key is stored
    tokens: torch.Tensor  # [B, ≤W] the last W tokens (bidirectional fallback only)
    feature: torch.Tensor | None = None  # [B, H'] the last stepped token's feature: forecasts read it


class SiDAHash(nn.Module):
    def __init__(self, token_proj: nn.Module, n_layers: int, n_experts: int, sizes: SiDASizes, horizon: int = 0):
        super().__init__()
        if horizon < 0 or (horizon and sizes.bidirectional):
            raise PredictorError(
                f"forecast horizon {horizon}: forecast heads need horizon ≥ 1 and the causal variant "
                "(a bidirectional hash sees the tokens it would forecast); use horizon 0 or bidirectional false"
            )
        self.n_layers, self.n_experts, self.sizes, self.horizon = n_layers, n_experts, sizes, horizon
        self.token_proj = token_proj
        self.lstm = nn.LSTM(
            sizes.compress_dim,
            sizes.hidden_dim,
            num_layers=sizes.lstm_layers,
            batch_first=True,
            bidirectional=sizes.bidirectional,
            dropout=sizes.dropout if sizes.lstm_layers > 1 else 0.0,
        )
        width = sizes.hidden_dim * (2 if sizes.bidirectional else 1)
        self.query = nn.Linear(width, width, bias=False)
        self.key = nn.Linear(width, width, bias=False)
        self.scale = 1.0 / math.sqrt(width)
        self.dropout = nn.Dropout(sizes.dropout)
        self.head = nn.Linear(width, n_layers * n_experts)
        self.forecast_head = nn.Linear(width, horizon * n_layers * n_experts) if horizon else None

    @classmethod
    def from_embedding(cls, embedding: torch.Tensor, n_layers: int, n_experts: int, sizes: SiDASizes,
                       horizon: int = 0) -> "SiDAHash":
        return cls(CompressedEmbedding(embedding, sizes.compress_dim), n_layers, n_experts, sizes, horizon)

    def folded(self) -> "SiDAHash":
        """A copy whose token projection is one [V, d_c] table (see module doc)."""
        if not isinstance(self.token_proj, CompressedEmbedding):
            return self
        table = self.token_proj.folded()
        out = SiDAHash(table, self.n_layers, self.n_experts, self.sizes, self.horizon)
        rest = {k: v for k, v in self.state_dict().items() if not k.startswith("token_proj.")}
        out.load_state_dict({**rest, "token_proj.weight": table.weight})
        return out.train(self.training)

    # --- whole sequences -------------------------------------------------------------
    def lstm_states(self, token_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """LSTM outputs [B, T, H'] (padding after `lengths` ignored by the bidirectional LSTM)."""
        x = self.token_proj(token_ids)
        if self.sizes.bidirectional and lengths is not None:
            packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
            states, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=x.shape[1])
        else:
            states, _ = self.lstm(x)
        return self.dropout(states)

    def attention_mask(self, length: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Allowed (query, key) pairs: [T, T] band for the causal variant, [B, 1, T] key
        padding (or all-True [T, T]) for the bidirectional one."""
        pos = torch.arange(length, device=self.head.weight.device)
        if not self.sizes.bidirectional:
            offset = pos[:, None] - pos[None, :]
            return (offset >= 0) & (offset < self.sizes.attn_window)
        if lengths is None:
            return torch.ones(length, length, dtype=torch.bool, device=pos.device)
        return (pos[None, :] < lengths.to(pos.device)[:, None])[:, None, :]

    def attention(self, states: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparsemax self-attention over `states` [B, T, H']. Returns (context, weights [B, T, T])."""
        scores = (self.query(states) @ self.key(states).transpose(-1, -2)) * self.scale
        weights = sparsemax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # of the raw scores: exact zeros
        return weights @ states, weights

    def features(self, token_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Each token's feature [B, T, H']: attention context + the token's LSTM output."""
        states = self.lstm_states(token_ids, lengths)
        context, _ = self.attention(states, self.attention_mask(token_ids.shape[1], lengths))
        return self.dropout(context) + states

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Features [..., H'] → the token's own expert logits [..., L, E]."""
        out = self.head(features)
        return out.view(*out.shape[:-1], self.n_layers, self.n_experts)

    def forecasts(self, features: torch.Tensor) -> torch.Tensor:
        """Features [..., H'] of token t → expert logits [..., H, L, E] of tokens t+1..t+H."""
        if self.forecast_head is None:
            raise PredictorError("this hash function has no forecast heads; train one with --model.horizon N")
        out = self.forecast_head(features)
        return out.view(*out.shape[:-1], self.horizon, self.n_layers, self.n_experts)

    def forward(self, token_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Expert logits [B, T, L, E]."""
        return self.logits(self.features(token_ids, lengths))

    # --- incremental decoding ----------------------------------------------------------
    def start(self, batch_size: int) -> SiDAState:
        device = self.head.weight.device
        zeros = [torch.zeros(batch_size, self.sizes.hidden_dim, device=device) for _ in range(self.sizes.lstm_layers)]
        return SiDAState(
            h=zeros, c=list(zeros),
            values=torch.zeros(batch_size, 0, self.query.in_features, device=device),
            query_key=self.query.weight.T @ self.key.weight,
            tokens=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
        )

    def step(self, state: SiDAState, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, L, E] for one new token per row; updates `state` (its `feature` is what
        `forecasts` reads for tokens t+1..t+H). The causal variant runs
        one LSTM time step with `torch.lstm_cell` on nn.LSTM's own weights (the same math;
        oneDNN's sequence kernel costs milliseconds for a single step) and attends over the
        memory of the last W outputs."""
        window = self.sizes.attn_window
        if self.sizes.bidirectional:
            state.tokens = torch.cat([state.tokens, token_ids[:, None]], dim=1)[:, -window:]
            return self.forward(state.tokens)[:, -1]
        x = self.token_proj(token_ids)
        for i in range(self.sizes.lstm_layers):
            weights = [getattr(self.lstm, f"{name}_l{i}") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
            state.h[i], state.c[i] = torch.lstm_cell(x, (state.h[i], state.c[i]), *weights)
            x = state.h[i]
        out = x[:, None]
        state.values = torch.cat([state.values, out], dim=1)[:, -window:]
        scores = ((out @ state.query_key) @ state.values.transpose(-1, -2)) * self.scale
        context = sparsemax(scores, dim=-1) @ state.values
        state.feature = (self.dropout(context) + out)[:, 0]
        return self.logits(state.feature)


@register_predictor
class SiDAPredictor(ExpertPredictor):
    """A trained (folded) hash function behind the predictor interface, in eval mode."""

    kind = "sida"

    def __init__(self, hash_fn: SiDAHash, meta: PredictorMeta):
        self.hash = hash_fn.folded().eval()
        self.meta = meta
        # the causal decode step as one compiled call (`sida_decode`: what the runtime runs inline
        # once a token); the bidirectional variant re-encodes its window with the module instead
        self._decode = None if self.hash.sizes.bidirectional else sida_decode.DecodeWeights.of(self.hash)

    @property
    def horizon(self) -> int:
        return self.hash.horizon

    @torch.inference_mode()
    def predict(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hash(input_ids)

    @torch.inference_mode()
    def predict_with_forecasts(self, input_ids: torch.Tensor,
                               horizon: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        horizon = self.horizon if horizon is None else horizon
        self.require_horizon(horizon)
        features = self.hash.features(input_ids)
        return self.hash.logits(features), self.hash.forecasts(features)[..., :horizon, :, :]

    @torch.inference_mode()
    def forecast(self, state: SiDAState | sida_decode.DecodeState, horizon: int | None = None) -> torch.Tensor:
        horizon = self.horizon if horizon is None else horizon
        self.require_horizon(horizon)
        if state.feature is None:
            raise PredictorError("forecast needs a token: call step at least once after start")
        if isinstance(state, sida_decode.DecodeState):
            return torch.from_numpy(state.forecasts).view(-1, self.horizon, self.n_layers, self.n_experts)[:, :horizon]
        return self.hash.forecasts(state.feature)[:, :horizon]

    @torch.inference_mode()
    def start(self, batch_size: int) -> SiDAState | sida_decode.DecodeState:
        if self._decode is not None:
            sizes = self.hash.sizes
            return sida_decode.DecodeState.start(batch_size, sizes.lstm_layers, sizes.hidden_dim, sizes.attn_window)
        return self.hash.start(batch_size)

    @torch.inference_mode()
    def step(self, state: SiDAState | sida_decode.DecodeState, token_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(state, sida_decode.DecodeState):
            logits = sida_decode.step(self._decode, state, token_ids.cpu())
            return torch.from_numpy(logits).view(-1, self.n_layers, self.n_experts)
        return self.hash.step(state, token_ids)

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.hash.state_dict())

    @classmethod
    def from_artifact(cls, meta: PredictorMeta, tensors: dict[str, torch.Tensor]) -> "SiDAPredictor":
        """`meta.hparams` holds the `SiDASizes` fields and `horizon` (absent before forecast heads: 0)."""
        hparams = dict(meta.hparams)
        horizon = int(hparams.pop("horizon", 0))
        table = nn.Embedding(*tensors["token_proj.weight"].shape)
        fp = meta.fingerprint
        hash_fn = SiDAHash(table, fp.n_moe_layers, fp.n_experts, SiDASizes(**hparams), horizon)
        hash_fn.load_state_dict(tensors)
        return cls(hash_fn, meta)
