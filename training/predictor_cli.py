"""`prescient train`: LightningCLI over a predictor's LightningModule + LightningDataModule.

    prescient train --config configs/predictor/sida.yaml --data.trace_dir DIR [--export PATH]
    prescient train --config configs/predictor/probe.yaml --data.trace_dir DIR [--export PATH]

Which pair trains is the config's top-level `predictor` key (or `--predictor`; default sida):
`sida` (`PredictorModule` + `PredictorDataModule`: the hash function on router traces) or
`probe` (`ProbeModule` + `ProbeDataModule`: the hidden-state probe on a trace made with
`prescient trace --hidden-states`).

Everything the YAML holds can be overridden on the command line (`--model.lr 1e-3`,
`--trainer.max_epochs 5`, `--trainer.strategy ddp --trainer.devices 2`; forecast heads:
`--model.horizon 2 --model.loss.horizon_weights [0.5,0.25]`). Two options of
our own: `--ckpt_path` resumes a run from a checkpoint, and `--export` names the artifact
(NAME.safetensors + NAME.json) written after training from the best checkpoint; by default
it lands beside the run's checkpoint folder as `predictor.*`.

Weights & Biases runs offline unless WANDB_MODE says otherwise: no network is ever needed.
"""

from __future__ import annotations

import json
import logging
import pickle
import sys
import zipfile
from pathlib import Path

import torch
import yaml
from jsonargparse import ArgumentError
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI

from predictor.artifact import save_predictor
from prescient.errors import PrescientError
from training.predictor_data import PredictorDataModule
from training.predictor_module import PredictorModule
from training.probe_data import ProbeDataModule
from training.probe_module import ProbeModule
from training.quiet import quiet_training

log = logging.getLogger(__name__)


KINDS = {"sida": (PredictorModule, PredictorDataModule), "probe": (ProbeModule, ProbeDataModule)}


class PredictorCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.trace_dir", "model.trace_dir")
        if self.model_class is PredictorModule:
            parser.link_arguments("model.horizon", "data.horizon")  # forecast targets for the forecast heads
        parser.add_argument("--predictor", type=str, default="sida",
                            help=f"what to train: {', '.join(KINDS)} (set in the config's top level)")
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="checkpoint to resume from, e.g. <run dir>/checkpoints/last.ckpt")
        parser.add_argument(
            "--export", type=str | None, default=None,
            help="predictor artifact path NAME (writes NAME.safetensors + NAME.json); default: <run dir>/predictor",
        )


def default_export_path(trainer: Trainer) -> Path:
    checkpoint = trainer.checkpoint_callback
    if checkpoint is not None and checkpoint.dirpath:
        return Path(checkpoint.dirpath).parent / "predictor"
    return Path(trainer.default_root_dir) / "predictor"


def export_best(cli: PredictorCLI, path: str | Path | None) -> Path:
    """Validate the best checkpoint (the last weights if none) and save it as an artifact."""
    trainer, model, data = cli.trainer, cli.model, cli.datamodule
    monitored = [cb for cb in trainer.checkpoint_callbacks if cb.monitor]  # the "latest" one has no monitor
    best = monitored[0].best_model_path if monitored and monitored[0].best_model_path else None
    results = trainer.validate(model, datamodule=data, ckpt_path=best, verbose=False)
    target = Path(path) if path else default_export_path(trainer)
    if trainer.is_global_zero:
        config = json.loads(cli.parser.dump(cli.config, format="json", skip_link_targets=False))
        training = {**data.describe(), "checkpoint": best, "config": config}
        save_predictor(model.to_predictor(training, {k: float(v) for k, v in results[0].items()}), target)
        log.info("exported the predictor to %s.{safetensors,json}", target)
    trainer.strategy.barrier("predictor-export")
    return target


class TrainArgumentError(PrescientError):
    """A `prescient train` argument or config value LightningCLI cannot parse."""


class CheckpointError(PrescientError):
    """A checkpoint to resume from is missing, damaged, or holds what the safe loader refuses."""


def check_checkpoint(path: str | Path) -> None:
    """Read `path` with torch's weights-only loader (the one that never runs pickled code) before
    training starts: a clear error for a missing, truncated or unsafe checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; give --ckpt_path a .ckpt that `prescient train` "
                              "wrote (<run dir>/checkpoints/last.ckpt)")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"checkpoint {path} is truncated or not a checkpoint (not a whole torch archive); "
                              "resume from another one, e.g. <run dir>/checkpoints/last.ckpt")
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = str(exc).rpartition("WeightsUnpickler error:")[2].strip().split(". ")[0][:200]
        raise CheckpointError(f"checkpoint {path} holds what the safe weights-only loader refuses ({reason}); "
                              "resume only from checkpoints `prescient train` wrote") from None
    except Exception as exc:  # noqa: BLE001 - a damaged archive fails the unpickler in many ways
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise CheckpointError(f"checkpoint {path} is damaged ({reason}); resume from another one, e.g. "
                              "<run dir>/checkpoints/last.ckpt") from None


def predictor_kind(args: list[str]) -> str:
    """What `args` train: the last `--predictor`, else the last `--config` file's `predictor` key,
    else sida. A config that cannot be read is left for LightningCLI to report."""
    kind = "sida"
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if name == "--config":
            try:
                config = yaml.safe_load(Path(value).read_text())
            except (OSError, yaml.YAMLError):
                continue
            kind = config.get("predictor", kind) if isinstance(config, dict) else kind
        elif name == "--predictor":
            kind = value
    if kind not in KINDS:
        raise TrainArgumentError(f"predictor {kind!r} is not one `prescient train` trains; known: {', '.join(KINDS)}")
    return kind


def main(args: list[str] | None = None) -> Path:
    """Run LightningCLI on `args` (the command line's, by default): fit, then export the best
    checkpoint; returns the artifact path."""
    quiet_training()
    args = sys.argv[1:] if args is None else args
    module, datamodule = KINDS[predictor_kind(args)]
    try:
        cli = PredictorCLI(
            module,
            datamodule,
            args=args,
            run=False,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"exit_on_error": False},  # a bad argument: one line (cli.main), not the usage
        )
    except ArgumentError as exc:
        raise TrainArgumentError(f"{exc} (see `prescient train --help`)") from None
    if cli.config.ckpt_path:
        check_checkpoint(cli.config.ckpt_path)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.ckpt_path)
    return export_best(cli, cli.config.export)


def train_predictor(config: str | Path, trace_dir: str | Path, export: str | Path, **overrides: object) -> Path:
    """Train from the YAML `config` on `trace_dir` and export to `export`; `overrides` are
    dotted config keys, as on the command line (`**{"trainer.max_time": "00:00:08:00"}`)."""
    args = ["--config", str(config), "--data.trace_dir", str(trace_dir), "--export", str(export)]
    for key, value in overrides.items():
        args += [f"--{key}", str(value)]
    return main(args)

