import pytest
import torch
import torch.nn.functional as F

from predictor.losses import LossConfig, predictor_loss, truncated_kd

B, T, L, E = 2, 5, 3, 6


def teacher(top_t: int):
    logits = torch.randn(B, T, L, E) * 2
    top = logits.topk(top_t, dim=-1)
    return logits, top.indices, top.values


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_tkd_with_all_experts_is_plain_kd(temperature):
    torch.manual_seed(0)
    student = torch.randn(B, T, L, E)
    full, ids, values = teacher(E)
    got = truncated_kd(student, ids, values, top_t=30, temperature=temperature, distance="kl")
    expected = F.kl_div(
        (student / temperature).log_softmax(-1), (full / temperature).softmax(-1), reduction="none"
    ).sum(-1) * temperature**2
    torch.testing.assert_close(got, expected)


def test_tkd_l1_matches_a_direct_computation_over_the_teachers_top_t():
    torch.manual_seed(1)
    student = torch.randn(B, T, L, E)
    _, ids, values = teacher(4)
    got = truncated_kd(student, ids, values, top_t=3, distance="l1")
    for b, t, layer in [(0, 0, 0), (1, 4, 2)]:
        experts = ids[b, t, layer, :3]
        p_s = student[b, t, layer, experts].softmax(-1)
        p_t = values[b, t, layer, :3].softmax(-1)
        assert got[b, t, layer] == pytest.approx(float((p_s - p_t).abs().sum()), abs=1e-6)


def test_tkd_ignores_experts_outside_the_teachers_top_t():
    torch.manual_seed(2)
    student = torch.randn(B, T, L, E)
    _, ids, values = teacher(3)
    outside = torch.ones(B, T, L, E, dtype=torch.bool).scatter_(-1, ids, False)
    changed = student + outside * 100.0
    torch.testing.assert_close(truncated_kd(changed, ids, values, 3), truncated_kd(student, ids, values, 3))


def test_combined_loss_terms_and_mask():
    torch.manual_seed(3)
    student = torch.randn(B, T, L, E, requires_grad=True)
    full, ids, values = teacher(E)
    topk = full.topk(2, dim=-1).indices
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    config = LossConfig(ce_weight=0.5, tkd_weight=1.0, distance="kl", topk_bce_weight=0.25, topk_ce_weight=2.0)
    terms = predictor_loss(student, topk, ids, values, mask, config)

    keep = mask[..., None].expand(B, T, L)
    ce = F.cross_entropy(student[keep], topk[keep][:, 0])
    assert terms["ce"].item() == pytest.approx(ce.item(), rel=1e-5)
    multi_hot = torch.zeros(B, T, L, E).scatter_(-1, topk, 1.0)
    bce = F.binary_cross_entropy_with_logits(student[keep], multi_hot[keep], reduction="sum") / keep.sum()
    assert terms["topk_bce"].item() == pytest.approx(bce.item(), rel=1e-5)
    expected = 0.5 * terms["ce"] + terms["tkd"] + 0.25 * terms["topk_bce"] + 2.0 * terms["topk_ce"]
    assert terms["loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    terms["loss"].backward()
    assert (student.grad[1, 3:] == 0).all()  # padding contributes nothing


def test_all_zero_weights_is_an_error():
    full, ids, values = teacher(E)
    with pytest.raises(ValueError, match="every loss weight is zero"):
        predictor_loss(full, ids[..., :2], ids, values, torch.ones(B, T, dtype=torch.bool),
                       LossConfig(ce_weight=0, tkd_weight=0))
