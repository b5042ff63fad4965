"""Shared fixtures: tiny randomly initialised MoE model directories, one per architecture.

Each directory is an ordinary Hugging Face model directory (`config.json`, safetensors,
tokenizer files) saved with `save_pretrained`, with a small byte-level BPE tokenizer, so
`prescient.loading.load_model` and `prescient trace` run on it as on a real model.

    tiny_moe            parametrized over every architecture: a `TinyMoE(arch, path)`
    tiny_moe_dir(arch)  the directory of one architecture (built once per session)
    tiny_tokenizer      the shared tokenizer
    text_corpus         a local JSON corpus of prose and code rows of varied lengths

Every test runs with one torch thread (`single_thread`, session-wide).
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
import transformers as tf

from predictor import PredictorMeta, SiDAHash, SiDAPredictor, SiDASizes, read_token_embeddings, save_predictor
from prescient.arch_zoo import save_tiny_model
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model
from training.tokenizer import train_byte_level_bpe

TOKENIZER_VOCAB = 320  # the 256-byte alphabet, 2 special tokens and a few merges
HIDDEN = 32


def _config(arch: str, ids: dict) -> tf.PretrainedConfig:
    """The tiny config of `arch`; `ids` holds vocab_size and the special token ids."""
    if arch == "switch_transformers":
        return tf.SwitchTransformersConfig(
            d_model=HIDDEN, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, num_experts=4,
            encoder_sparse_step=1, decoder_sparse_step=1, expert_capacity=64, **ids,
        )
    moe = dict(hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
               num_hidden_layers=2, num_experts_per_tok=2, **ids)
    if arch == "mixtral":
        return tf.MixtralConfig(num_local_experts=8, intermediate_size=32, **moe)
    if arch == "qwen2_moe":  # with the shared expert and its gate
        return tf.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=16, intermediate_size=32,
                                 shared_expert_intermediate_size=32, **moe)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(num_experts=8, moe_intermediate_size=16, intermediate_size=32, head_dim=16, **moe)
    if arch == "olmoe":
        return tf.OlmoeConfig(num_experts=4, intermediate_size=16, **moe)
    if arch == "deepseek_v3":  # layer 0 dense, layers 1-2 MoE; 2 groups of 4 experts, a token picks 1 group;
        # multi-head latent attention wants as many kv heads as heads
        return tf.DeepseekV3Config(
            n_routed_experts=8, n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
            moe_intermediate_size=16, intermediate_size=32, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, **{**moe, "num_hidden_layers": 3, "num_key_value_heads": 2})
    if arch == "phimoe":
        return tf.PhimoeConfig(num_local_experts=4, intermediate_size=32, **moe)
    if arch == "granitemoe":
        return tf.GraniteMoeConfig(num_local_experts=4, intermediate_size=16, **moe)
    raise ValueError(f"no tiny config for {arch!r}")


ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "phimoe", "granitemoe", "switch_transformers")


@dataclass(frozen=True)
class TinyMoE:
    arch: str  # config.model_type
    path: Path

    @property
    def is_encoder_decoder(self) -> bool:
        return self.arch == "switch_transformers"

    def load(self) -> tf.PreTrainedModel:
        """The plain model, without any of our code between it and transformers."""
        cls = tf.AutoModelForSeq2SeqLM if self.is_encoder_decoder else tf.AutoModelForCausalLM
        return cls.from_pretrained(self.path, dtype=torch.float32).eval()


def _tokenizer_texts() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "string.py", "bisect.py")]


@pytest.fixture(scope="session")
def tiny_tokenizer() -> tf.PreTrainedTokenizerFast:
    return train_byte_level_bpe(_tokenizer_texts(), TOKENIZER_VOCAB)


def tiny_test_config(arch: str, tokenizer, num_hidden_layers: int | None = None) -> tf.PretrainedConfig:
    """The tests' tiny `arch` config for `tokenizer` (2 layers unless `num_hidden_layers`); save a
    model of it with `prescient.arch_zoo.save_tiny_model(config, path, seed, tokenizer)`."""
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
               eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    config = _config(arch, ids)
    if num_hidden_layers is not None:
        config.num_hidden_layers = num_hidden_layers
    return config


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory, tiny_tokenizer) -> Callable[[str], Path]:
    """`tiny_moe_dir(arch)`: the model directory of a tiny `arch` MoE, built once per session."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            config = tiny_test_config(arch, tiny_tokenizer)
            built[arch] = save_tiny_model(config, tmp_path_factory.mktemp(f"tiny-{arch}"), tokenizer=tiny_tokenizer)
        return built[arch]

    return get


@pytest.fixture(scope="session", params=ARCHS)
def tiny_moe(request, tiny_moe_dir) -> TinyMoE:
    return TinyMoE(request.param, tiny_moe_dir(request.param))


def corpus_rows() -> list[dict]:
    """Rows of prose and code whose token counts vary from a few to a few hundred."""
    texts = _tokenizer_texts()
    rows = [{"text": "The cache keeps the experts that the router will choose next.", "source": "prose"}]
    for text in texts:
        lines = text.splitlines()
        spans = zip(range(0, 120, 20), range(1, 25, 4))  # (first line, line count)
        rows += [{"text": "\n".join(lines[i : i + n]), "source": "code"} for i, n in spans]
    return [r for r in rows if r["text"].strip()]


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory) -> Path:
    """A JSON-lines corpus (no splits: `load_corpus` splits it by row)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in corpus_rows()))
    return path


@pytest.fixture(scope="session", autouse=True)
def single_thread():
    """One torch thread for the whole session: tiny models run fastest on one, and on a shared
    2-core machine multi-threaded kernels crawl (a trace ran 100x slower). It also keeps float
    results identical between the runs a test compares."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def one_thread_after_each_test():
    """A command run in-process (generate, serve) sets torch's threads to the decode threads; the
    next test runs on one again (a bit-for-bit comparison against a reference computed on one
    thread failed after such a test)."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def random_sida(model_dir: Path, out: Path, horizon: int = 0) -> Path:
    """An untrained causal SiDA hash function for the model (with `horizon` forecast heads), saved as an artifact."""
    model, layers = load_model(model_dir, dtype=torch.float32)
    fingerprint = fingerprint_model(model, layers)
    sizes = SiDASizes(compress_dim=8, hidden_dim=16, attn_window=8)
    torch.manual_seed(0)
    hash_fn = SiDAHash.from_embedding(read_token_embeddings(model_dir), len(layers), fingerprint.n_experts, sizes,
                                      horizon)
    meta = PredictorMeta("sida", fingerprint, {**asdict(sizes), "horizon": horizon})
    return save_predictor(SiDAPredictor(hash_fn, meta), out / "sida")
