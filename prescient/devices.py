"""Where tensors go: a device name checked against this machine before any work."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prescient.errors import PrescientError

if TYPE_CHECKING:
    import torch


class DeviceError(PrescientError):
    """A device name is malformed, or names hardware this machine lacks."""


def check_device(name: str | torch.device) -> torch.device:
    """The device `name` names (`cpu`, `cuda`, `cuda:1`); a clear error when it is not one or
    this machine has no such device."""
    import torch  # here, not above: `--help` checks no device and imports no torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeviceError(f"device {str(name)!r} is not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {str(name)!r}: CUDA is not available on this machine; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"device {str(name)!r}: this machine has {torch.cuda.device_count()} CUDA devices "
                              f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    elif device.type != "cpu":
        raise DeviceError(f"device {str(name)!r}: only cpu and cuda devices are supported")
    return device
