"""HRM: MoE-Lightning's Hierarchical Roofline Model of batched, offloaded MoE inference
(paper §3.2 and §4.2, Eq. 12-14).

Every op of a transformer layer has a roofline time: max(FLOPs / peak FLOP/s, bytes / memory
bandwidth) of the processor it runs on. An op's cross-level roof (Eq. 8, bytes over the link
from a lower tier) is its own op on a link tier here, because CGOPipe prefetches it (weights a
layer ahead, hidden states a micro-batch ahead) so that it overlaps compute. The tiers work in
parallel, so a layer takes T = max(T_link, T_cpu, T_gpu) (Eq. 12), each tier the sum of its
ops (Eq. 13). The link is full duplex: T_link = max(into the compute device, GPU → CPU).

A policy (N, μ, attention place, FFN place, r_w, r_c) processes N requests in N/μ micro-batches.
The dense weights (projections, router, LM head) sit on the GPU when there is one; the MoE FFN
runs where F_g says: on the GPU (F_g = 1, streamed experts cross the link) or on the CPU beside
it (F_g = 0: the experts stay in CPU memory and compute there; the hidden states cross instead).
The paper says the optimiser "minimises T"; T alone favours tiny batches, so the quantity to
maximise is throughput, N tokens per decode step (`Estimate.decode_tokens_per_s`), or over a
whole workload with the prefill (`Estimate.tokens_per_s`, what `predict` returns).

On a machine without GPU the CPU runs attention and the FFN (their times add in T_cpu) and the
link is disk → CPU memory, the slow tier of experts that are not resident.

`turning_points` gives the paper's turning points (Eq. 9, 10) and balance point (Eq. 11) of a
policy's MoE FFN: where, by its operational intensity over the CPU-resident expert bytes, the FFN
is better computed on the CPU, bound by the link, or bound by the GPU.

`estimate` models CGOPipe; `estimate_schedule` models the other batch schedules of
`prescient bench-batch` at the same policy by what distinguishes each (`SCHEDULES`): which
expert bytes cross the link, how often each expert's weights are read to compute, and which
tiers overlap.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offload_runtime.planning.hardware import HardwareProfile, Processor
from prescient.errors import PrescientError
from prescient.model_dir import ModelDirectory

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}
_PLACES = ("cpu", "gpu")
TIERS = ("cpu", "gpu", "link", "link_back")


class ModelSpecError(PrescientError):
    """A model config cannot be read as a mixture-of-experts decoder."""


class BatchPolicyError(PrescientError):
    """A policy is malformed or asks for a processor the hardware does not have."""


def _compressed_bytes_per_param(quantization: dict | None, hidden: int, intermediate: int,
                                source: str) -> float | None:
    """Bytes a compressed-tensors weight-only scheme stores per expert weight: its codes, and a
    2-byte scale per group (per channel: per row of gate and up [intermediate, hidden] and of down
    [hidden, intermediate]); None for an uncompressed config. The first config group is taken as
    the experts'."""
    if not quantization:
        return None
    try:
        weights = next(iter(quantization["config_groups"].values()))["weights"]
        if weights.get("group_size"):
            return weights["num_bits"] / 8 + 2 / weights["group_size"]
        return weights["num_bits"] / 8 + 2 * (2 * intermediate + hidden) / (3 * hidden * intermediate)
    except (KeyError, TypeError, StopIteration, AttributeError):
        raise ModelSpecError(f"{source}: quantization_config has no config group with weight arguments "
                             "(num_bits, group_size)") from None


@dataclass(frozen=True)
class ModelSpec:
    """The shapes the HRM needs; `intermediate_size` is one routed expert's."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    vocab_size: int
    bytes_per_param: int = 4
    shared_intermediate_size: int = 0  # an always-on shared expert (Qwen2-MoE, DeepSeek)
    tie_word_embeddings: bool = False
    expert_bytes_per_param: float | None = None  # routed experts stored compressed; None: bytes_per_param

    @classmethod
    def from_config(cls, path: str | Path | ModelDirectory) -> ModelSpec:
        """Read a transformers `config.json` (or the model directory holding one, or one already
        opened)."""
        if isinstance(path, ModelDirectory):
            return cls.from_dict(path.config_dict, source=str(path.path / "config.json"))
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelSpecError(f"no model config at {path}; give a config.json or a model directory") from None
        except json.JSONDecodeError as exc:
            raise ModelSpecError(f"{path} is not JSON ({exc})") from None
        return cls.from_dict(config, source=str(path))

    @classmethod
    def from_dict(cls, config: dict[str, Any], source: str = "config") -> ModelSpec:
        """Mixtral-style keys; Qwen/OLMoE/DeepSeek names (`num_experts`, `n_routed_experts`,
        `moe_intermediate_size`) are read too."""
        def need(*keys: str) -> Any:
            for key in keys:
                if config.get(key) is not None:
                    return config[key]
            raise ModelSpecError(f"{source} has no {' / '.join(keys)}; is it a mixture-of-experts decoder config "
                                 "(Mixtral, Qwen-MoE, OLMoE, DeepSeek)?")

        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
        if dtype not in _DTYPE_BYTES:
            raise ModelSpecError(f"{source}: unknown dtype {dtype!r}; known: {', '.join(_DTYPE_BYTES)}")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        expert_size = need("moe_intermediate_size", "intermediate_size")
        shared = config.get("shared_expert_intermediate_size") or (config.get("n_shared_experts") or 0) * expert_size
        return cls(
            name=str(config.get("model_type", "unknown")), hidden_size=hidden, intermediate_size=expert_size,
            num_layers=need("num_hidden_layers"), num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            num_experts=need("num_local_experts", "num_experts", "n_routed_experts"),
            top_k=need("num_experts_per_tok"), vocab_size=need("vocab_size"), bytes_per_param=_DTYPE_BYTES[dtype],
            shared_intermediate_size=shared, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            expert_bytes_per_param=_compressed_bytes_per_param(config.get("quantization_config"), hidden, expert_size,
                                                               source),
        )

    @property
    def expert_bytes(self) -> int:
        """One gated expert: gate, up and down, each hidden × intermediate (as stored: compressed
        experts count their codes and scales)."""
        per_param = self.expert_bytes_per_param or self.bytes_per_param
        return round(3 * self.hidden_size * self.intermediate_size * per_param)

    @property
    def layer_expert_bytes(self) -> int:
        return self.num_experts * self.expert_bytes

    @property
    def expert_total_bytes(self) -> int:
        return self.num_layers * self.layer_expert_bytes

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def non_expert_bytes(self) -> int:
        """Attention projections, router, shared expert and norms of every layer; embeddings."""
        h = self.hidden_size
        per_layer = (h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + h * self.num_experts
                     + 3 * h * self.shared_intermediate_size + 2 * h)
        tables = (1 if self.tie_word_embeddings else 2) * self.vocab_size * h
        return (self.num_layers * per_layer + tables + h) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token in every layer."""
        return self.num_layers * 2 * self.kv_dim * self.bytes_per_param

    def activation_bytes(self, tokens: int) -> int:
        """Working set of one micro-batch of `tokens` in a layer: the residual stream, its normed
        copy and the layer output (3h), q/k/v, and the gate/up products of every routed copy and
        of the shared expert."""
        per_token = (3 * self.hidden_size + self.q_dim + 2 * self.kv_dim
                     + 2 * self.top_k * self.intermediate_size + 2 * self.shared_intermediate_size)
        return tokens * per_token * self.bytes_per_param

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    gen_len: int

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.gen_len < 1:
            raise BatchPolicyError(f"prompt and generation lengths must be at least 1, got {self.prompt_len}, "
                              f"{self.gen_len}")

    @property
    def decode_context(self) -> float:
        """Average context over the decode steps: prompt_len + gen_len / 2."""
        return self.prompt_len + self.gen_len / 2

    @property
    def max_context(self) -> int:
        return self.prompt_len + self.gen_len


@dataclass(frozen=True)
class Policy:
    """MoE-Lightning's policy (N, μ, A_g, F_g, r_w, r_c). `r_w`: share of expert weights that stays
    in the compute device's memory (the rest streams in every step); `r_c`: share of the KV cache
    in GPU memory (only with attention on the GPU)."""

    n_requests: int
    micro_batch: int
    attention_on: str = "cpu"
    ffn_on: str = "gpu"
    r_w: float = 0.0
    r_c: float = 0.0

    def __post_init__(self) -> None:
        if self.micro_batch < 1 or self.n_requests < 1 or self.n_requests % self.micro_batch:
            raise BatchPolicyError(f"N={self.n_requests} must be a positive multiple of μ={self.micro_batch}")
        if self.attention_on not in _PLACES or self.ffn_on not in _PLACES:
            raise BatchPolicyError(f"attention_on and ffn_on are 'cpu' or 'gpu', got {self.attention_on!r}, {self.ffn_on!r}")
        if not (0 <= self.r_w <= 1 and 0 <= self.r_c <= 1):
            raise BatchPolicyError(f"r_w={self.r_w} and r_c={self.r_c} must lie in [0, 1]")
        if self.attention_on == "cpu" and self.r_c:
            raise BatchPolicyError(f"r_c={self.r_c} with attention on the CPU: the KV cache stays where attention runs; "
                              "use r_c=0")

    @property
    def n_micro_batches(self) -> int:
        return self.n_requests // self.micro_batch

    def fit(self, hardware: HardwareProfile) -> None:
        """Raise BatchPolicyError unless `hardware` can run this policy as modelled."""
        if hardware.gpu is None and "gpu" in (self.attention_on, self.ffn_on):
            raise BatchPolicyError(f"{hardware.name} has no GPU: use attention_on='cpu', ffn_on='cpu'")
        if hardware.gpu is not None and self.ffn_on == "cpu" and self.r_w:
            raise BatchPolicyError(f"r_w={self.r_w} with the FFN on the CPU beside a GPU (F_g=0): the experts stay in "
                                   "CPU memory and compute there; use r_w=0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Op:
    """One op of a layer for all N requests: `tier` is 'cpu' or 'gpu' (compute) or a link
    ('link': into the compute device's memory; 'link_back': GPU → CPU), `nbytes` the bytes it
    moves in that tier's memory or over that link."""

    name: str
    tier: str
    flops: float
    nbytes: float


def roofline(flops: float, nbytes: float, processor: Processor) -> float:
    """Seconds of an op on `processor`: compute roof or memory roof, whichever binds."""
    return max(flops / processor.peak_flops, nbytes / processor.memory_bandwidth)


def op_seconds(op: Op, hardware: HardwareProfile) -> float:
    if op.tier in ("link", "link_back"):
        return op.nbytes / hardware.link_bandwidth
    processor = hardware.gpu if op.tier == "gpu" else hardware.cpu
    if processor is None:
        raise BatchPolicyError(f"op {op.name} is placed on the GPU of {hardware.name}, which has none")
    return roofline(op.flops, op.nbytes, processor)


def expected_experts(tokens: float, num_experts: int, top_k: int) -> float:
    """Expected distinct experts that `tokens` tokens touch when each picks top_k of num_experts
    uniformly: E·(1 − (1 − k/E)^m). Equals k at m = 1 and tends to E."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class StageTime:
    """One pass over the model for all N requests (a decode step, or the prefill): per-layer
    ops with their seconds, each tier's busy seconds per layer, T = their max, and the LM head."""

    ops: tuple[tuple[Op, float], ...]
    tiers: dict[str, float]
    layer_seconds: float
    head_seconds: float
    seconds: float

    @property
    def bottleneck(self) -> str:
        return max(self.tiers, key=self.tiers.__getitem__)

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "layer_seconds": self.layer_seconds, "head_seconds": self.head_seconds,
                "bottleneck": self.bottleneck, "tiers": self.tiers,
                "ops": [{**dataclasses.asdict(op), "seconds": s} for op, s in self.ops]}


@dataclass(frozen=True)
class Estimate:
    """`tokens_per_s` = N·gen_len / (prefill + (gen_len − 1)·step): the prefill yields each
    request's first token, every decode step one more. `decode_tokens_per_s` = N / step."""

    policy: Policy
    decode: StageTime
    prefill: StageTime
    tokens_per_s: float
    decode_tokens_per_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.to_dict(), "tokens_per_s": self.tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s, "decode_step": self.decode.to_dict(),
                "prefill": self.prefill.to_dict()}


def dense_on(hardware: HardwareProfile) -> str:
    """Where the dense weights (projections, router, LM head) live and compute: the GPU if any."""
    return "cpu" if hardware.gpu is None else "gpu"


def experts_stream(hardware: HardwareProfile, policy: Policy) -> bool:
    """Whether streamed experts cross the link: not when they compute in CPU memory beside a GPU (F_g=0)."""
    return policy.r_w < 1 and not (hardware.gpu is not None and policy.ffn_on == "cpu")


def _projection_ops(spec: ModelSpec, dense: str, ffn: str, tokens: float, n_mb: int, mb_tokens: float) -> list[Op]:
    """The weight-bound ops of a layer for `tokens` tokens in `n_mb` micro-batches of
    `mb_tokens`, the dense ones on `dense`, the experts on `ffn`: every micro-batch reads the
    weights it uses once. The FFN away from the dense weights gets its hidden states over the
    link and sends its output back."""
    h, b = spec.hidden_size, spec.bytes_per_param
    qkv = spec.q_dim + 2 * spec.kv_dim
    ops = [
        Op("qkv_proj", dense, 2 * tokens * h * qkv, (n_mb * h * qkv + tokens * (h + qkv)) * b),
        Op("o_proj", dense, 2 * tokens * spec.q_dim * h, (n_mb * spec.q_dim * h + tokens * (spec.q_dim + h)) * b),
        Op("router", dense, 2 * tokens * h * spec.num_experts, (n_mb * h * spec.num_experts + tokens * h) * b),
        Op("experts", ffn, 6 * tokens * spec.top_k * h * spec.intermediate_size,
           n_mb * expected_experts(mb_tokens, spec.num_experts, spec.top_k) * spec.expert_bytes
           + 2 * tokens * h * b),
    ]
    if spec.shared_intermediate_size:
        i_s = spec.shared_intermediate_size
        ops.append(Op("shared_expert", ffn, 6 * tokens * h * i_s, (n_mb * 3 * h * i_s + 2 * tokens * h) * b))
    if ffn != dense:
        ops += [Op("ffn_in_to_cpu", "link_back", 0, tokens * h * b), Op("ffn_out_to_gpu", "link", 0, tokens * h * b)]
    return ops


def decode_ops(spec: ModelSpec, hardware: HardwareProfile, workload: Workload, policy: Policy) -> list[Op]:
    """One layer of one decode step for all N requests, at the average context."""
    n, b = policy.n_requests, spec.bytes_per_param
    ctx = workload.decode_context
    dense = dense_on(hardware)
    ops = _projection_ops(spec, dense, policy.ffn_on, n, policy.n_micro_batches, policy.micro_batch)
    ops.append(Op("attention", policy.attention_on, 4 * n * spec.q_dim * ctx,
                  n * (ctx * 2 * spec.kv_dim + 2 * spec.q_dim) * b))
    if policy.attention_on != dense:  # CPU attention beside a GPU: q, k, v go down, the output comes back
        ops.append(Op("qkv_to_cpu", "link_back", 0, n * (spec.q_dim + 2 * spec.kv_dim) * b))
        ops.append(Op("attn_out_to_gpu", "link", 0, n * spec.q_dim * b))
    elif hardware.gpu is not None and policy.r_c < 1:
        ops.append(Op("kv_to_gpu", "link", 0, (1 - policy.r_c) * n * ctx * 2 * spec.kv_dim * b))
    if experts_stream(hardware, policy):
        ops.append(Op("expert_weights", "link", 0, (1 - policy.r_w) * spec.layer_expert_bytes))
    return ops


def prefill_ops(spec: ModelSpec, hardware: HardwareProfile, workload: Workload, policy: Policy) -> list[Op]:
    """One layer of the prefill for all N prompts. Its attention runs beside the dense weights
    (prompt attention is compute-bound); the KV cache not kept on the GPU is written back to the CPU."""
    n, s, b = policy.n_requests, workload.prompt_len, spec.bytes_per_param
    dense = dense_on(hardware)
    ops = _projection_ops(spec, dense, policy.ffn_on, n * s, policy.n_micro_batches, policy.micro_batch * s)
    ops.append(Op("attention", dense, 2 * n * spec.q_dim * s * (s + 1),  # causal: s(s+1)/2 scores, 2 matmuls
                  n * s * (2 * spec.q_dim + 2 * spec.kv_dim) * b))
    if hardware.gpu is not None and policy.r_c < 1:
        ops.append(Op("kv_to_cpu", "link_back", 0, (1 - policy.r_c) * n * s * 2 * spec.kv_dim * b))
    if experts_stream(hardware, policy):
        ops.append(Op("expert_weights", "link", 0, (1 - policy.r_w) * spec.layer_expert_bytes))
    return ops


def head_op(spec: ModelSpec, policy: Policy, where: str) -> Op:
    """Embedding lookup, final norm and LM head for one token of each request, on `where`."""
    n, h, v = policy.n_requests, spec.hidden_size, spec.vocab_size
    nbytes = (policy.n_micro_batches * v * h + n * (2 * h + v)) * spec.bytes_per_param
    return Op("lm_head", where, 2 * n * h * v, nbytes)


def stage_time(spec: ModelSpec, hardware: HardwareProfile, ops: list[Op], head: Op,
               overlap: str = "all") -> StageTime:
    """`overlap`: "all" (CGOPipe, Eq. 12: the tiers run in parallel), "link" (the links run
    beside compute, but CPU and GPU compute one after the other: FlexGen(c)'s schedule S3),
    "none" (every op waits for the one before: on-demand loads)."""
    timed = tuple((op, op_seconds(op, hardware)) for op in ops)
    tiers = dict.fromkeys(TIERS, 0.0)
    for op, seconds in timed:
        tiers[op.tier] += seconds
    if overlap == "all":
        layer = max(tiers.values())  # = max(T_link, T_cpu, T_gpu) with T_link = max(link, link_back)
    elif overlap == "link":
        layer = max(tiers["link"], tiers["link_back"], tiers["cpu"] + tiers["gpu"])
    elif overlap == "none":
        layer = sum(tiers.values())
    else:
        raise BatchPolicyError(f"overlap is 'all', 'link' or 'none', got {overlap!r}")
    head_seconds = op_seconds(head, hardware)
    return StageTime(timed, tiers, layer, head_seconds, spec.num_layers * layer + head_seconds)


def estimate(spec: ModelSpec, hardware: HardwareProfile, workload: Workload, policy: Policy) -> Estimate:
    """The HRM's prediction for `policy`, with the per-layer breakdown of decode and prefill."""
    policy.fit(hardware)
    head = head_op(spec, policy, dense_on(hardware))
    decode = stage_time(spec, hardware, decode_ops(spec, hardware, workload, policy), head)
    prefill = stage_time(spec, hardware, prefill_ops(spec, hardware, workload, policy), head)
    total = prefill.seconds + (workload.gen_len - 1) * decode.seconds
    return Estimate(policy, decode, prefill, tokens_per_s=policy.n_requests * workload.gen_len / total,
                    decode_tokens_per_s=policy.n_requests / decode.seconds)


# What distinguishes each batch schedule from CGOPipe in the HRM: (tier overlap, expert bytes over
# the link per layer pass, expert weight bytes read to compute). Per layer pass over N requests
# in n = N/μ micro-batches of μ tokens (the prefill: μ·s tokens), E experts, share r_w resident,
# X(m) = expected_experts(m) distinct experts that m tokens activate:
#   cgopipe     all        every streamed expert, (1 − r_w)·E      n·X(μ): each micro-batch reads its experts
#   zigzag      link       (1 − r_w)·E (the layer ahead)            n·X(μ); FlexGen(c), schedule S3: attention
#                          and FFN never overlap each other (the same as CGOPipe without a GPU)
#   klotski     all        (1 − r_w)·X(N): activated experts only   X(N): each expert once over the group
#   sequential  none       n·(1 − r_w)·X(μ): on demand, per         n·X(μ)
#                          micro-batch (the double buffer has lost
#                          layer i's experts when the next micro-batch reaches it; the prefill goes
#                          layer by layer, so a layer's loads serve every micro-batch: (1 − r_w)·X(N·s))
#   accelerate  none       (1 − r_w)·E: accelerate's hooks load a disk-offloaded layer's weights
#                          whole before its forward (r_w: the share of layers it keeps; the
#                          policy's μ is N, one `generate` over the batch); attention and
#                          norm weights of those layers are left out (a small share)
# "klotski-paper" is klotski here: requesting the hot experts at the attention rather than at
# the previous gate changes when the link moves them, not how much, nor the bound.
SCHEDULES = ("cgopipe", "zigzag", "klotski", "klotski-paper", "sequential", "accelerate")
_OVERLAP = {"cgopipe": "all", "zigzag": "link", "klotski": "all", "klotski-paper": "all", "sequential": "none",
            "accelerate": "none"}


def _schedule_ops(spec: ModelSpec, ops: list[Op], policy: Policy, schedule: str, tokens: float,
                  mb_tokens: float, prefill: bool) -> list[Op]:
    """`ops` (CGOPipe's, for `tokens` tokens in micro-batches of `mb_tokens`) with the expert
    weight transfer and the experts' weight reads of `schedule` (see the table above)."""
    experts, b = spec.expert_bytes, spec.bytes_per_param
    streamed = 1 - policy.r_w
    out = []
    for op in ops:
        if op.name == "expert_weights":
            if schedule.startswith("klotski") or (schedule == "sequential" and prefill):
                op = dataclasses.replace(op, nbytes=streamed * expected_experts(tokens, spec.num_experts, spec.top_k)
                                         * experts)
            elif schedule == "sequential":
                op = dataclasses.replace(op, nbytes=policy.n_micro_batches * streamed
                                         * expected_experts(mb_tokens, spec.num_experts, spec.top_k) * experts)
        elif op.name == "experts" and schedule.startswith("klotski"):
            op = dataclasses.replace(op, nbytes=expected_experts(tokens, spec.num_experts, spec.top_k) * experts
                                     + 2 * tokens * spec.hidden_size * b)
        out.append(op)
    return out


def estimate_schedule(spec: ModelSpec, hardware: HardwareProfile, workload: Workload, policy: Policy,
                      schedule: str = "cgopipe") -> Estimate:
    """The HRM's prediction for `schedule` (one of `SCHEDULES`) at `policy`; "cgopipe" is `estimate`."""
    if schedule not in SCHEDULES:
        raise BatchPolicyError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if schedule == "cgopipe":
        return estimate(spec, hardware, workload, policy)
    policy.fit(hardware)
    n, s = policy.n_requests, workload.prompt_len
    head = head_op(spec, policy, dense_on(hardware))
    decode = stage_time(spec, hardware, _schedule_ops(spec, decode_ops(spec, hardware, workload, policy), policy,
                                                      schedule, n, policy.micro_batch, prefill=False),
                        head, _OVERLAP[schedule])
    prefill = stage_time(spec, hardware, _schedule_ops(spec, prefill_ops(spec, hardware, workload, policy), policy,
                                                       schedule, n * s, policy.micro_batch * s, prefill=True),
                         head, _OVERLAP[schedule])
    total = prefill.seconds + (workload.gen_len - 1) * decode.seconds
    return Estimate(policy, decode, prefill, tokens_per_s=n * workload.gen_len / total,
                    decode_tokens_per_s=n / decode.seconds)


def predict(spec: ModelSpec, hardware: HardwareProfile, workload: Workload, policy: Policy) -> float:
    """Predicted generation throughput (tokens/s over the workload, prefill included)."""
    return estimate(spec, hardware, workload, policy).tokens_per_s


@dataclass(frozen=True)
class TurningPoints:
    """MoE-Lightning's turning points (Eq. 9, 10) and balance point (Eq. 11) for the MoE FFN of
    one decode layer, level i the GPU, level j the CPU memory holding the streamed experts.
    Intensities are FLOPs per byte; `region` names what bounds the FFN at this policy."""

    intensity_cpu: float  # I^j: FFN FLOPs per byte of streamed expert weights (in CPU memory)
    intensity_gpu: float  # I^i: FFN FLOPs per byte the GPU reads doing it
    p1: float  # Eq. 9: below this I^j, computing on the CPU beats moving the weights to the GPU
    p2: float  # Eq. 10: below this I^j, the link bounds the FFN on the GPU
    balance: float  # B^{j,i}·I^j / (B^i·I^i): 1 at the balance point (Eq. 11)

    @property
    def region(self) -> str:
        if self.intensity_cpu < self.p1:
            return "cpu"  # F_g = 0 pays
        return "link" if self.intensity_cpu < self.p2 else "gpu"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "region": self.region}


def turning_points(spec: ModelSpec, hardware: HardwareProfile, policy: Policy) -> TurningPoints | None:
    """The FFN's turning and balance points at `policy` (F_g = 1, some experts streamed); None
    without a GPU (the disk under a CPU-only machine computes nothing) or with nothing streamed."""
    if hardware.gpu is None or policy.r_w >= 1:
        return None
    n = policy.n_requests
    flops = 6 * n * spec.top_k * spec.hidden_size * spec.intermediate_size
    gpu_bytes = (policy.n_micro_batches * expected_experts(policy.micro_batch, spec.num_experts, spec.top_k)
                 * spec.expert_bytes + 2 * n * spec.hidden_size * spec.bytes_per_param)
    i_cpu = flops / ((1 - policy.r_w) * spec.layer_expert_bytes)
    i_gpu = flops / gpu_bytes
    cpu, gpu, link = hardware.cpu, hardware.gpu, hardware.link_bandwidth
    return TurningPoints(
        intensity_cpu=i_cpu, intensity_gpu=i_gpu,
        p1=min(cpu.peak_flops, cpu.memory_bandwidth * i_cpu) / link,
        p2=min(gpu.peak_flops, gpu.memory_bandwidth * i_gpu) / link,
        balance=link * i_cpu / (gpu.memory_bandwidth * i_gpu))
