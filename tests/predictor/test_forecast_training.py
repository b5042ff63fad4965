"""Training forecast heads: targets t+1..t+H from the same sequence, a weight per horizon, the
current token's loss unchanged, per-horizon recall in validation, H in the artifact."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from predictor import FrequencyPredictor, SiDASizes, load_predictor, recall_at
from predictor.losses import LossConfig, LossConfigError, forecast_loss, predictor_loss
from prescient.traces import load_trace
from training.predictor_cli import main
from training.predictor_data import PredictorDataModule
from training.predictor_module import PredictorModule

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/predictor/sida.yaml")
SMALL = SiDASizes(compress_dim=16, hidden_dim=32)


def test_future_targets_come_from_the_same_sequence_past_the_window_and_stop_at_its_end(synthetic_trace):
    data = PredictorDataModule(str(synthetic_trace), window=10, val_fraction=0.25, horizon=3)
    data.setup("fit")
    trace = load_trace(synthetic_trace)
    windows = data.train_set
    for i in range(len(windows)):
        item, (start, n), end = windows[i], windows.spans[i], windows.sequence_ends[i]
        assert item["future_topk_ids"].shape == (10, 3, 3, 2) and item["future_mask"].shape == (10, 3)
        for t in range(10):
            for h in range(1, 4):
                inside = t < n and start + t + h < end
                assert bool(item["future_mask"][t, h - 1]) == inside
                if inside:
                    assert torch.equal(item["future_topk_ids"][t, h - 1], trace["topk_ids"][start + t + h].long())
    # 24-token sequences in windows of 10: the first window's last token has all 3 targets (rows 10..12)
    first = next(i for i, (start, n) in enumerate(windows.spans) if n == 10)
    assert windows[first]["future_mask"][9].all()
    plain = PredictorDataModule(str(synthetic_trace), window=10)
    plain.setup("fit")
    assert set(plain.train_set[0]) == {"token_ids", "mask", "topk_ids", "topt_ids", "topt_logits"}


def test_forecast_loss_is_cross_entropy_over_each_top_k_expert_of_token_t_plus_h():
    torch.manual_seed(0)
    forecasts = torch.randn(2, 5, 2, 3, 6, requires_grad=True)
    targets = torch.randint(0, 6, (2, 5, 2, 3, 2))
    mask = torch.ones(2, 5, 2, dtype=torch.bool)
    mask[:, -1] = False
    mask[:, -2, 1] = False  # t + 2 past the end
    terms = forecast_loss(forecasts, targets, mask, [0.5, 0.25])
    for h in (1, 2):
        keep = mask[:, :, h - 1, None].expand(2, 5, 3)
        logits, ids = forecasts[:, :, h - 1][keep], targets[:, :, h - 1][keep]
        expected = (F.cross_entropy(logits, ids[:, 0]) + F.cross_entropy(logits, ids[:, 1])) / 2
        assert terms[f"forecast_h{h}"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert terms["loss"].item() == pytest.approx(0.5 * terms["forecast_h1"].item() + 0.25 * terms["forecast_h2"].item())
    terms["loss"].backward()
    assert (forecasts.grad[:, -1] == 0).all() and (forecasts.grad[:, -2, 1] == 0).all()


def test_one_weight_per_horizon():
    assert LossConfig().forecast_weights(3) == [0.5, 0.25, 0.125]
    assert LossConfig(horizon_weights=[1.0, 0.1]).forecast_weights(2) == [1.0, 0.1]
    with pytest.raises(LossConfigError, match=r"has 1 value\(s\) but the horizon is 2"):
        LossConfig(horizon_weights=[1.0]).forecast_weights(2)


def test_the_current_tokens_loss_is_unchanged_by_forecast_heads(synthetic_trace):
    data = PredictorDataModule(str(synthetic_trace), window=12, horizon=2)
    data.setup("fit")
    batch = {name: torch.stack([data.train_set[i][name] for i in range(4)]) for name in data.train_set[0]}
    torch.manual_seed(0)
    plain = PredictorModule(str(synthetic_trace), sizes=SMALL)
    torch.manual_seed(0)
    ahead = PredictorModule(str(synthetic_trace), sizes=SMALL, horizon=2)  # heads are built last: same trunk
    logits, none, base = plain._terms(batch)
    same_logits, forecasts, terms = ahead._terms(batch)
    assert none is None and forecasts.shape == (4, 12, 2, 3, 8)
    torch.testing.assert_close(same_logits, logits)
    expected = predictor_loss(logits, batch["topk_ids"], batch["topt_ids"], batch["topt_logits"], batch["mask"],
                              LossConfig())
    for name in ("ce", "tkd"):
        assert terms[name].item() == base[name].item() == expected[name].item()
    weighted = 0.5 * terms["forecast_h1"] + 0.25 * terms["forecast_h2"]
    assert terms["loss"].item() == pytest.approx((base["loss"] + weighted).item())


def test_cli_trains_forecast_heads_and_records_the_horizon(tmp_path, synthetic_trace, tiny_fingerprint):
    export = tmp_path / "hash"
    args = ["--config", CONFIG, "--data.trace_dir", str(synthetic_trace), "--trainer.default_root_dir",
            str(tmp_path / "run"), "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--model.sizes.compress_dim", "16",
            "--model.sizes.hidden_dim", "32", "--data.window", "12", "--data.batch_size", "4", "--model.lr", "0.01",
            "--trainer.max_epochs", "12", "--model.horizon", "2", "--model.loss.horizon_weights", "[1.0, 0.5]",
            "--export", str(export)]
    main(args)
    pred = load_predictor(export, fingerprint=tiny_fingerprint)
    assert pred.horizon == 2 and pred.meta.hparams["horizon"] == 2
    assert pred.meta.training["config"]["data"]["horizon"] == 2  # linked from --model.horizon
    metrics = pred.meta.metrics
    assert {"val/recall_at_k_h1", "val/recall_at_2k_h1", "val/recall_at_k_h2", "val/recall_at_2k_h2"} <= set(metrics)
    # the synthetic router depends on the previous token: token t tells a lot about t+1's experts
    trace = load_trace(synthetic_trace)
    rows = torch.stack(trace.sequences())
    _, forecasts = pred.predict_with_forecasts(trace["token_id"][rows])
    true_next = trace["topk_ids"][rows][:, 1:]
    learned = recall_at(forecasts[:, :-1, 0], true_next, 4)
    frequency = FrequencyPredictor.from_trace(trace).predict(trace["token_id"][rows])
    assert learned > recall_at(frequency[:, :-1], true_next, 4) + 0.1
    with pytest.raises(LossConfigError, match="one weight per forecast horizon"):
        main([*args[:-2], "--model.loss.horizon_weights", "[1.0]"])
