import pytest
import torch
from safetensors.torch import save_file
from transformers import MixtralForCausalLM

from predictor.sida import SiDAHash, SiDASizes, read_token_embeddings
from prescient.errors import ModelFilesError

SMALL = dict(compress_dim=12, hidden_dim=16, lstm_layers=2)


def make_hash(window: int = 5, bidirectional: bool = False, seed: int = 0) -> SiDAHash:
    torch.manual_seed(seed)
    sizes = SiDASizes(**SMALL, attn_window=window, bidirectional=bidirectional)
    return SiDAHash.from_embedding(torch.randn(30, 20), n_layers=3, n_experts=6, sizes=sizes).eval()


@pytest.mark.parametrize("window", [4, 100])
def test_causal_step_equals_predict_on_the_same_prefix(window):
    hash_fn = make_hash(window)
    ids = torch.randint(0, 30, (3, 14))
    with torch.no_grad():
        full = hash_fn(ids)
        state = hash_fn.start(3)
        steps = torch.stack([hash_fn.step(state, ids[:, t]) for t in range(14)], dim=1)
        prefix = hash_fn(ids[:, :7])
    assert full.shape == (3, 14, 3, 6)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prefix, full[:, :7], atol=1e-5, rtol=1e-5)  # causal: the future does not leak


def test_sparsemax_attention_has_exact_zeros_and_respects_the_causal_window():
    hash_fn = make_hash(window=6)
    ids = torch.randint(0, 30, (2, 20))
    with torch.no_grad():
        states = hash_fn.lstm_states(ids)
        # trained scores spread out (at init they are all near 0): identity projections and
        # unit-scale states give scores of order 1
        states = states / states.std()
        hash_fn.query.weight.copy_(torch.eye(16) * 2)
        hash_fn.key.weight.copy_(torch.eye(16) * 2)
        mask = hash_fn.attention_mask(20)
        _, weights = hash_fn.attention(states, mask)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 20))
    assert (weights[:, ~mask] == 0).all()  # future and out-of-window tokens get nothing
    allowed_zeros = ((weights == 0) & mask).sum()
    assert allowed_zeros > 0, "sparsemax should zero some allowed positions, softmax never does"


def test_bidirectional_sees_the_future_but_not_the_padding():
    hash_fn = make_hash(bidirectional=True)
    ids = torch.randint(0, 30, (2, 10))
    with torch.no_grad():
        full = hash_fn(ids)
        assert not torch.allclose(hash_fn(ids[:, :5]), full[:, :5])  # later tokens change earlier guesses
        padded = torch.cat([ids[:, :6], torch.zeros(2, 4, dtype=torch.long)], dim=1)
        with_padding = hash_fn(padded, lengths=torch.tensor([6, 6]))
        torch.testing.assert_close(with_padding[:, :6], hash_fn(ids[:, :6]), atol=1e-5, rtol=1e-5)
        state = hash_fn.start(2)
        last = [hash_fn.step(state, ids[:, t]) for t in range(3)][-1]
        torch.testing.assert_close(last, hash_fn(ids[:, :3])[:, -1], atol=1e-5, rtol=1e-5)


def test_folding_the_embedding_into_one_table_is_exact():
    hash_fn = make_hash()
    ids = torch.randint(0, 30, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hash_fn.folded()(ids), hash_fn(ids))
    assert isinstance(hash_fn.folded().token_proj, torch.nn.Embedding)


def test_reads_the_model_embeddings_without_loading_the_model(tiny_model_dir):
    expected = MixtralForCausalLM.from_pretrained(tiny_model_dir).get_input_embeddings().weight
    torch.testing.assert_close(read_token_embeddings(tiny_model_dir), expected.float())


def test_model_dir_without_embeddings_is_a_clear_error(tmp_path):
    with pytest.raises(ModelFilesError, match="no \\*.safetensors"):
        read_token_embeddings(tmp_path)
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelFilesError, match="embed_tokens.weight"):
        read_token_embeddings(tmp_path)
