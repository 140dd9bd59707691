"""Plain-PyTorch reference math: the oracle the kernels are tested against.

Everything here is written for clarity, in FP32, with the same operation order
as the kernels' shared element math (csrc/common), so on CPU the kernels are
expected to match these functions bit for bit.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

__all__ = [
    "split_master",
    "merge_master",
    "adamw_step",
]


# ---------------------------------------------------------------------------
# BF16 + int16 remainder master weights (TransformerEngine's convention)
# ---------------------------------------------------------------------------


def split_master(master: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split FP32 masters into (BF16 param, int16 remainder).

    Bit pattern b: remainder = low 16 bits as int16; BF16 bits = (b >> 16) +
    (low >= 0x8000), mod 2^16 (round half up on the pattern, not RNE).
    """
    if master.dtype != torch.float32:
        raise TypeError(f"split_master: master must be float32, got {master.dtype}")
    bits = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = bits & 0xFFFF
    hi = (bits >> 16) + (lo >= 0x8000).to(torch.int64)
    param = _uint16_to_int16(hi & 0xFFFF).view(torch.bfloat16)
    remainder = _uint16_to_int16(lo)
    return param, remainder


def merge_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """Reconstruct FP32 masters: b = (bf16_bits << 16) + sign_extend(remainder) mod 2^32."""
    if param.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError("merge_master: expects a bfloat16 param and an int16 remainder")
    hi = param.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((hi << 16) + remainder.to(torch.int64)) & 0xFFFFFFFF
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


def _uint16_to_int16(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0x8000, x - 0x10000, x).to(torch.int16)


# ---------------------------------------------------------------------------
# AdamW
# ---------------------------------------------------------------------------


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 sqrt (torch's vectorized CPU sqrt is not; sqrt in
    double then one rounding to FP32 is exact for every FP32 input)."""
    return torch.sqrt(x.double()).float()


def _pow_by_squaring(base: float, step: float) -> float:
    """beta^n for a whole-number step, by binary exponentiation in double: the
    exact sequence of IEEE multiplications the kernels perform."""
    n, result = int(step) if step > 0 else 0, 1.0
    while n:
        if n & 1:
            result = result * base
        base = base * base
        n >>= 1
    return result


def _bias_correction(beta: torch.Tensor, step: float, enabled: bool) -> torch.Tensor:
    # 1 - beta^t in double, rounded once to FP32, like the kernels.
    return _f32(1.0 - _pow_by_squaring(float(beta), step)) if enabled else _f32(1.0)


def adamw_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    masters: Sequence[torch.Tensor] = (),
    lr,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
    inv_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """Reference for `muon_ext.ops.adamw_step` (same arguments, same in-place effect).

    Per element, in FP32, p being the master:
      g = grad * inv_scale (+ wd * p in L2 mode); m = b1 m + (1 - b1) g;
      v = b2 v + (1 - b2) g^2; upd = (m / bc1) / (sqrt(v / bc2) + eps);
      p -= lr * (upd + wd * p) in AdamW mode, lr * upd in L2 mode.
    """
    if found_inf is not None and float(found_inf) != 0.0:
        return
    lr_t = _f32(float(lr))
    b1, b2, eps_t, wd = _f32(beta1), _f32(beta2), _f32(eps), _f32(weight_decay)
    one_minus_b1, one_minus_b2 = _f32(1.0) - b1, _f32(1.0) - b2
    scale = _f32(1.0) if inv_scale is None else inv_scale.detach().float().reshape(()).cpu()

    for i, (p, grad, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        step += 1
        t = float(step)
        bc1 = _bias_correction(b1, t, bias_correction).to(p.device)
        bc2 = _bias_correction(b2, t, bias_correction).to(p.device)
        master = _load_master(p, masters[i] if masters else None)
        g = grad.float() * scale.to(p.device)
        if not adam_w_mode:
            g = g + wd.to(p.device) * master
        m.copy_(b1 * m + one_minus_b1 * g)
        v.copy_(b2 * v + one_minus_b2 * (g * g))
        update = (m / bc1) / (_sqrt(v / bc2) + eps_t.to(p.device))
        if adam_w_mode:
            update = update + wd.to(p.device) * master
        master = master - lr_t.to(p.device) * update
        _store_master(p, masters[i] if masters else None, master)


def _load_master(param: torch.Tensor, master: Optional[torch.Tensor]) -> torch.Tensor:
    if master is None:
        return param.detach().float()
    if master.dtype == torch.int16:
        return merge_master(param.detach(), master)
    return master.detach().clone()


def _store_master(param: torch.Tensor, master: Optional[torch.Tensor], value: torch.Tensor) -> None:
    """Write the new FP32 master: remainder split, or RNE into a low-precision param."""
    with torch.no_grad():
        if master is not None and master.dtype == torch.int16:
            new_param, new_remainder = split_master(value)
            param.copy_(new_param)
            master.copy_(new_remainder)
            return
        if master is not None:
            master.copy_(value)
        param.copy_(value.to(param.dtype))
