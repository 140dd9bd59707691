"""Mixed precision and CUDA graphs: torch.amp.GradScaler's inputs to the
kernels, and learning rates held as device tensors (capturable=True)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .schema import check_lr_value

__all__ = ["GradScalerInputs", "capturing", "device_lr", "check_step_lr"]


class GradScalerInputs:
    """inv_scale and found_inf from torch.amp.GradScaler, per device, without host syncs.

    GradScaler hands the optimizer `grad_scale` and `found_inf`; a `found_inf`
    that is not a tensor (GradScaler's 0 when no param had a grad) counts as absent.
    """

    def __init__(self, grad_scale: Optional[torch.Tensor], found_inf):
        self.grad_scale = grad_scale
        self.found_inf = found_inf if isinstance(found_inf, torch.Tensor) else None
        self.cache: Dict[torch.device, Tuple] = {}

    def on(self, device: torch.device) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(inv_scale, found_inf) as one-element float32 tensors on `device` (None where absent)."""
        if device not in self.cache:
            inv = None
            # Into CPU memory a non-blocking copy may still be in flight when the CPU kernel reads it.
            non_blocking = device.type != "cpu"
            if self.grad_scale is not None:
                inv = self.grad_scale.to(device, non_blocking=non_blocking).double().reciprocal().float().reshape(1)
            found = None if self.found_inf is None else \
                self.found_inf.to(device, non_blocking=non_blocking).float().reshape(1)
            self.cache[device] = (inv, found)
        return self.cache[device]


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def device_lr(lr, device: torch.device) -> torch.Tensor:
    """lr as a one-element float32 tensor on `device` (a float32 tensor already there is kept)."""
    if isinstance(lr, torch.Tensor):
        if lr.dtype == torch.float32 and lr.device == device and lr.numel() == 1:
            return lr
        return lr.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(lr), dtype=torch.float32, device=device)


def check_step_lr(index: int, group: dict, capturing_now: bool) -> None:
    """A group's lr where the kernels can read it: a float (not while capturing
    a graph, which would bake it in), or a tensor on the CPU (read on the host,
    so its value is checked here) or on every param's device."""
    lr, params = group["lr"], group["params"]
    if not isinstance(lr, torch.Tensor):
        if capturing_now and params:
            raise RuntimeError(f"param group {index}: capturing a step needs its lr as a tensor on the params' "
                               "device (construct with capturable=True); a float lr would be baked into the graph")
        return
    if lr.device.type == "cpu":
        check_lr_value(f"param group {index}: ", float(lr), group["kind"], group)
        return
    for p in params:
        if p.device != lr.device:
            raise ValueError(f"param group {index}: lr is on {lr.device} but a param is on {p.device}")
