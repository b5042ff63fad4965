"""The Lightning pipeline end to end on a synthetic trace: train, export, resume, NaN, DDP."""

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from predictor import SiDAPredictor, SiDASizes, load_predictor, recall_at
from prescient.errors import TraceError
from prescient.traces import load_trace
from training.predictor_cli import main
from training.predictor_module import NonFiniteLossError, PredictorModule

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/predictor/sida.yaml")
SMALL = [
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    "--model.sizes.compress_dim", "16", "--model.sizes.hidden_dim", "32",
    "--data.window", "12", "--data.batch_size", "8", "--model.lr", "0.01",
]


def cli_args(trace: Path, run: Path, *extra: str, logger: bool = False) -> list[str]:
    args = ["--config", CONFIG, "--data.trace_dir", str(trace), "--trainer.default_root_dir", str(run), *SMALL]
    args += ["--trainer.logger.init_args.save_dir", str(run)] if logger else ["--trainer.logger", "false"]
    return [*args, *extra]


def trace_recall(pred, trace_dir: Path) -> float:
    trace = load_trace(trace_dir)
    rows = torch.stack(trace.sequences())  # synthetic sequences all have the same length
    return float(recall_at(pred.predict(trace["token_id"][rows]), trace["topk_ids"][rows], 2))


def test_training_improves_recall_and_exports_a_loadable_artifact(tmp_path, synthetic_trace, tiny_fingerprint):
    torch.manual_seed(0)
    untrained = PredictorModule(str(synthetic_trace), sizes=SiDASizes(compress_dim=16, hidden_dim=32)).to_predictor()
    export = tmp_path / "hash"
    main(cli_args(synthetic_trace, tmp_path / "run", "--trainer.max_epochs", "16", "--data.batch_size", "4",
                  "--export", str(export), logger=True))  # the default WandbLogger, offline
    pred = load_predictor(export, fingerprint=tiny_fingerprint)
    assert isinstance(pred, SiDAPredictor)
    before, after = trace_recall(untrained, synthetic_trace), trace_recall(pred, synthetic_trace)
    assert after > before + 0.15, (before, after)
    meta = json.loads(export.with_suffix(".json").read_text())
    assert meta["metrics"]["val/recall_at_k"] > 0.4
    assert meta["training"]["trace_dir"] == str(synthetic_trace)
    assert meta["training"]["config"]["model"]["sizes"]["hidden_dim"] == 32
    assert list((tmp_path / "run").glob("wandb/offline-run-*")), "wandb logs offline"


def test_resume_from_checkpoint(tmp_path, synthetic_trace):
    run = tmp_path / "run"
    main(cli_args(synthetic_trace, run, "--trainer.max_epochs", "1"))
    last = run / "checkpoints" / "last.ckpt"
    first_steps = torch.load(last, weights_only=False)["global_step"]
    main(cli_args(synthetic_trace, run, "--trainer.max_epochs", "2", "--ckpt_path", str(last)))
    assert torch.load(last, weights_only=False)["global_step"] == 2 * first_steps
    assert (run / "predictor.json").exists()
    restored = PredictorModule.load_from_checkpoint(last)
    assert restored.sizes == SiDASizes(compress_dim=16, hidden_dim=32)


class PoisonAt(L.Callback):
    """Turns a weight to NaN before the given step, as a diverging run would."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                module.hash.head.weight.fill_(float("nan"))


def test_nan_loss_stops_with_a_message_and_keeps_the_last_good_checkpoint(tmp_path, synthetic_trace):
    run = tmp_path / "run"
    poison = json.dumps({"class_path": f"{__name__}.PoisonAt", "init_args": {"step": 5}})
    with pytest.raises(NonFiniteLossError, match=r"loss became nan at step 5.*last\.ckpt"):
        main(cli_args(synthetic_trace, run, "--trainer.max_steps", "20", "--trainer.val_check_interval", "2",
                      "--trainer.check_val_every_n_epoch", "null", "--trainer.limit_val_batches", "1",
                      f"--trainer.callbacks+={poison}"))
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 4  # the validation before the NaN step
    assert all(torch.isfinite(t).all() for t in saved["state_dict"].values())
    assert not (run / "predictor.json").exists(), "a failed run exports nothing"


def test_missing_or_corrupt_trace_is_a_clear_error(tmp_path, make_synthetic_trace):
    with pytest.raises(TraceError, match="not a trace directory"):
        main(cli_args(tmp_path / "missing", tmp_path / "run"))
    trace = make_synthetic_trace(tmp_path / "trace", n_seqs=20)
    (trace / "shard-00000.safetensors").write_bytes(b"garbage")
    with pytest.raises(TraceError, match="missing or corrupt"):
        main(cli_args(trace, tmp_path / "run"))


def test_model_dir_comes_from_the_trace_or_the_option(tmp_path, make_synthetic_trace, tiny_model_dir):
    trace = make_synthetic_trace(tmp_path / "trace", n_seqs=4, record_model=False)
    with pytest.raises(Exception, match="model.model_dir"):
        PredictorModule(str(trace))
    assert PredictorModule(str(trace), model_dir=str(tiny_model_dir)).fingerprint.n_experts == 8


@pytest.mark.slow  # two training processes: 23 s of the default suite's 600 s budget
def test_ddp_on_two_cpu_processes(tmp_path, synthetic_trace, tiny_fingerprint):
    export = tmp_path / "hash"
    args = cli_args(synthetic_trace, tmp_path / "run", "--trainer.max_steps", "3", "--export", str(export),
                    "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "cli.main", "train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert load_predictor(export, fingerprint=tiny_fingerprint).meta.metrics["val/recall_at_k"] > 0


@pytest.mark.slow  # 20 s: a training process with the wandb logger
def test_train_prints_progress_and_result_without_noise(tmp_path, synthetic_trace):
    """`prescient train` as a user runs it (wandb logger on): no LightningCLI args warning, no
    line twice, no litlogger tip, no wandb warning, no deprecation warning."""
    export = tmp_path / "hash"
    args = cli_args(synthetic_trace, tmp_path / "run", "--trainer.max_steps", "2", "--export", str(export),
                    logger=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "cli.main", "train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    assert f"exported the predictor to {export}.{{safetensors,json}}" in lines
    for noise in ("LightningCLI's args", "Tip:", "wandb: WARNING", "deprecated", "INFO:"):
        assert not [line for line in lines if noise in line], done.stderr
    assert len(lines) == len(set(lines)), done.stderr
