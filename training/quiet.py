"""What Lightning, wandb and torch print on every `prescient train` that its user does not need:
LightningCLI's warning about `args` beside a command line (our CLI hands it its arguments on
purpose), each INFO line twice (Lightning's own console handler beside the root one), the
litlogger tip, wandb's warning that the `anonymous` setting Lightning passes has no effect, and
a deprecation inside Lightning. What is left: the progress bar, the data and training lines,
and the result."""

from __future__ import annotations

import logging
import os
import warnings

_WARNINGS = (r"LightningCLI's args parameter is intended", r".*isinstance\(treespec, LeafSpec\)")
_TIP_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet_training() -> None:
    """Silence the noise above (call before LightningCLI runs); wandb stays offline unless
    WANDB_MODE says otherwise."""
    for pattern in _WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    lightning = logging.getLogger("lightning")
    if logging.getLogger().handlers:  # the root handler prints Lightning's lines already
        for handler in list(lightning.handlers):
            lightning.removeHandler(handler)
    for name in _TIP_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import wandb
    except ImportError:
        return
    wandb.setup()  # reads WANDB_SILENT now, before the logger's settings warn
