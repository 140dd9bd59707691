"""Plain-PyTorch reference math: the oracle the kernels are tested against.

Everything here is written for clarity, in FP32, with the same operation order
as the kernels' shared element math (csrc/common), so on CPU the kernels are
expected to match these functions bit for bit.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

__all__ = [
    "split_master",
    "merge_master",
    "adamw_step",
    "POLAR_EXPRESS_COEFFICIENTS",
    "polar_express",
    "polar_express_gram",
    "muon_lr_factor",
    "muon_step",
    "quantize_fp8",
    "dequantize_fp8",
]


# ---------------------------------------------------------------------------
# BF16 + int16 remainder master weights (TransformerEngine's convention)
# ---------------------------------------------------------------------------


def split_master(master: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split FP32 masters into (BF16 param, int16 remainder).

    Bit pattern b: remainder = low 16 bits as int16; BF16 bits = (b >> 16) +
    (low >= 0x8000), mod 2^16 (round half up on the pattern, not RNE), except
    that a NaN master's BF16 magnitude is clamped to 0x7F81..0x7FFF so the
    param is NaN too (docs/design.md, "Master weights and remainders").
    """
    if master.dtype != torch.float32:
        raise TypeError(f"split_master: master must be float32, got {master.dtype}")
    bits = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = bits & 0xFFFF
    magnitude = ((bits >> 16) & 0x7FFF) + (lo >> 15)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    magnitude = torch.where(is_nan, magnitude.clamp(0x7F81, 0x7FFF), magnitude)
    hi = ((bits >> 16) & 0x8000) | magnitude
    param = _uint16_to_int16(hi).view(torch.bfloat16)
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
    n, result = int(min(step, 2.0**62)) if step > 0 else 0, 1.0  # the kernels' cap (beta^(2^62) is 0)
    while n:
        if n & 1:
            result = result * base
        base = base * base
        n >>= 1
    return result


def _inverse_bias_correction(beta: torch.Tensor, step: float, enabled: bool) -> torch.Tensor:
    # 1 / (1 - beta^t) in double, rounded once to FP32, like the kernels.
    return _f32(1.0 / (1.0 - _pow_by_squaring(float(beta), step))) if enabled else _f32(1.0)


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
      v = b2 v + (1 - b2) g^2; upd = (m / bc1) / (sqrt(v / bc2) + eps), evaluated as
      (m * (1 / bc1)) / (sqrt(v * (1 / bc2)) + eps) with 1 / bc rounded once to FP32;
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
        inv_bc1 = _inverse_bias_correction(b1, t, bias_correction).to(p.device)
        inv_bc2 = _inverse_bias_correction(b2, t, bias_correction).to(p.device)
        master = _load_master(p, masters[i] if masters else None)
        g = grad.float() * scale.to(p.device)
        if not adam_w_mode:
            g = g + wd.to(p.device) * master
        m.copy_(b1 * m + one_minus_b1 * g)
        v.copy_(b2 * v + one_minus_b2 * (g * g))
        update = (m * inv_bc1) / (_sqrt(v * inv_bc2) + eps_t.to(p.device))
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


# ---------------------------------------------------------------------------
# Muon
# ---------------------------------------------------------------------------

POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch.lerp's two-sided formula, written out (torch's vectorized CPU lerp uses FMA)."""
    if abs(float(weight)) < 0.5:
        return start + weight * (end - start)
    return end - (end - start) * (_f32(1.0) - weight)


def polar_express(x: torch.Tensor, coefficients, bf16: bool = False, fp16: bool = False,
                  method: str = "standard") -> torch.Tensor:
    """Polar-Express iterations on a batch of matrices x [B, rows, cols] (FP32 in and out).

    wide (rows <= cols): A = X X^T; B = b A + c A A; X = a X + B X
    tall (rows >  cols): A = X^T X; B = b A + c A A; X = a X + X B
    With bf16=True every GEMM takes BF16 operands, accumulates in FP32 and rounds
    its output (A, B, X) to BF16 once: the rounding of the CUDA kernels; fp16=True
    the same with IEEE FP16. method="gram": Gram Newton-Schulz (`polar_express_gram`).
    """
    if method == "gram":
        return polar_express_gram(x, coefficients, bf16=bf16, fp16=fp16)
    if method != "standard":
        raise ValueError(f"unknown method {method!r} (the iteration: 'standard' or 'gram')")
    rnd = _polar_rounding(bf16, fp16)
    x = rnd(x.float())
    wide = x.shape[-2] <= x.shape[-1]
    for a, b, c in coefficients:
        a, b, c = _f32(a), _f32(b), _f32(c)
        if wide:
            gram = rnd(x @ x.mT)
            poly = rnd(b * gram + c * (gram @ gram))
            x = rnd(a * x + poly @ x)
        else:
            gram = rnd(x.mT @ x)
            poly = rnd(b * gram + c * (gram @ gram))
            x = rnd(a * x + x @ poly)
    return x


def _polar_rounding(bf16: bool, fp16: bool):
    if bf16:
        return lambda t: t.bfloat16().float()
    return (lambda t: t.half().float()) if fp16 else (lambda t: t)


# Gram Newton-Schulz restarts before iteration 2 and every period-th after it:
# period 2 with BF16 or FP16 rounding, 3 in FP32 (csrc/common/polar_plan.h,
# polar_gram_restart_period).
GRAM_FIRST_RESTART = 2
GRAM_RESTART_PERIOD_HALF = 2
GRAM_RESTART_PERIOD = 3


def gram_restarts_before(step: int, sixteen_bit: bool) -> bool:
    period = GRAM_RESTART_PERIOD_HALF if sixteen_bit else GRAM_RESTART_PERIOD
    return step >= GRAM_FIRST_RESTART and (step - GRAM_FIRST_RESTART) % period == 0


def polar_express_gram(x: torch.Tensor, coefficients, bf16: bool = False, fp16: bool = False) -> torch.Tensor:
    """Gram Newton-Schulz on x [B, rows, cols]: the polynomial of `polar_express`
    (equal in exact arithmetic), evaluated on the Gram matrix. With V = X
    (wide) or X^T (tall), R = V V^T, and per iteration Z = b R + c R R:
      Q = Z + a I (first since a (re)start), else Q = Q Z + a Q
      R = Z T + a T with T = R Z + a R   (the next Gram matrix, when needed)
    and V = Q V at the end and at restarts (`gram_restarts_before`: before
    iterations 2, 4, ... with bf16 or fp16, 2, 5, ... in FP32), where R is recomputed. Every product's output is rounded (bf16 / fp16) as
    in `polar_express`, so are Q = Z + a I and the final X."""
    rnd = _polar_rounding(bf16, fp16)
    x = rnd(x.float())
    if not coefficients:
        return x
    wide = x.shape[-2] <= x.shape[-1]
    v = x if wide else x.mT
    eye = torch.eye(v.shape[-2])
    r = rnd(v @ v.mT)
    q = None
    for k, (a, b, c) in enumerate(coefficients):
        a, b, c = _f32(a), _f32(b), _f32(c)
        if gram_restarts_before(k, bf16 or fp16):
            v = rnd(q @ v)
            r = rnd(v @ v.mT)
            q = None
        z = rnd(c * (r @ r) + b * r)
        q = rnd(z + a * eye) if q is None else rnd(q @ z + a * q)
        if k + 1 < len(coefficients) and not gram_restarts_before(k + 1, bf16 or fp16):
            t = rnd(r @ z + a * r)
            r = rnd(z @ t + a * t)
    v = rnd(q @ v)
    return v if wide else v.mT


def muon_lr_factor(lr_scale: str, rows: int, cols: int) -> float:
    """lr' / lr for a (rows, cols) matrix: "original" sqrt(max(1, rows/cols)),
    "match_rms_adamw" 0.2 sqrt(max(rows, cols)), "none" 1."""
    if lr_scale == "original":
        return math.sqrt(max(1.0, rows / cols))
    if lr_scale == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if lr_scale == "none":
        return 1.0
    raise ValueError(f"unknown lr_scale {lr_scale!r}")


def muon_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    second_momentum_buffers: Sequence[torch.Tensor] = (),
    *,
    masters: Sequence[torch.Tensor] = (),
    lr,
    momentum: float = 0.95,
    nesterov: bool = True,
    beta2: Optional[float] = 0.95,
    weight_decay: float = 0.1,
    ns_steps: int = 5,
    ns_coefficients=None,
    lr_scale: str = "original",
    inv_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    polar_dtype: str = "bfloat16",
    polar_method: str = "standard",
) -> None:
    """Reference for `muon_ext.ops.muon_step` (same arguments, same in-place effect).

    Per matrix (params are [..., rows, cols]; leading dims index matrices), FP32:
      mom = lerp(mom, g, 1 - mu); u = lerp(g, mom, mu) if nesterov else mom
      X = polar_express(u / (||u||_F * 1.02 + 1e-6))
      NorMuon (beta2 not None), red = cols if rows >= cols else rows:
        vm = mean(X^2 over the reduced dim); smb = lerp(smb, vm, 1 - beta2)
        s = 1 / sqrt(max(smb, 1e-10)); X *= s * sqrt(sum(vm) red) / max(sqrt(sum(vm red s^2)), 1e-10)
      p -= lr' X + lr' wd p [X p >= 0]      (p: the FP32 master, lr' = lr * factor)
    `polar_dtype` "bfloat16" rounds every Polar-Express GEMM's operands and
    output to BF16 (FP32 accumulation), "float16" to FP16, "float32" keeps them FP32.
    `polar_method` ("standard", "gram", "auto") picks the iteration per matrix
    shape by the kernels' own rule (`muon_ext.ops.polar_method_for`).
    """
    from .ops import polar_method_for  # the shape rule lives in C++, once
    if polar_dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"unknown polar_dtype {polar_dtype!r}")
    if found_inf is not None and float(found_inf) != 0.0:
        return
    coefficients = list(POLAR_EXPRESS_COEFFICIENTS if ns_coefficients is None else ns_coefficients)
    if ns_steps > len(coefficients):
        raise ValueError(f"ns_steps={ns_steps} but only {len(coefficients)} coefficient tuples")
    mu = _f32(momentum)
    scale = _f32(1.0) if inv_scale is None else inv_scale.detach().float().reshape(()).cpu()
    for i, (p, grad, mom) in enumerate(zip(params, grads, momentum_buffers)):
        rows, cols = p.shape[-2], p.shape[-1]
        lr_prime = _f32(float(lr)) * _f32(muon_lr_factor(lr_scale, rows, cols))
        lr_wd = lr_prime * _f32(weight_decay)
        g = grad.float().reshape(-1, rows, cols) * scale
        m = mom.view(-1, rows, cols)
        m.copy_(_lerp(m, g, _f32(1.0) - mu))
        u = _lerp(g, m, mu) if nesterov else m.clone()
        sum_sq = (u.double() ** 2).sum(dim=(-2, -1), keepdim=True).float()
        x = u * (_f32(1.0) / (_sqrt(sum_sq) * _f32(1.02) + _f32(1e-6)))
        x = polar_express(x, coefficients[:ns_steps], bf16=polar_dtype == "bfloat16",
                          fp16=polar_dtype == "float16", method=polar_method_for(polar_method, rows, cols))
        if beta2 is not None:
            x = x * _normuon_multipliers(x, second_momentum_buffers[i], beta2)
        master = _load_master(p, masters[i] if masters else None).reshape(-1, rows, cols)
        decay = torch.where(x * master >= 0, lr_wd * master, torch.zeros_like(master))
        master = master - (lr_prime * x + decay)
        _store_master(p, masters[i] if masters else None, master.reshape(p.shape))


def _normuon_multipliers(x: torch.Tensor, second_moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """Per-row (rows >= cols) or per-column factors of NorMuon; updates the state."""
    rows, cols = x.shape[-2], x.shape[-1]
    per_row = rows >= cols
    reduced = cols if per_row else rows
    dim = -1 if per_row else -2
    vm = (x.double() ** 2).sum(dim=dim, keepdim=True).float() / _f32(float(reduced))
    smb = second_moment.view(vm.shape)
    smb.copy_(_lerp(smb, vm, _f32(1.0) - _f32(beta2)))
    s = _f32(1.0) / _sqrt(torch.clamp_min(smb, 1e-10))
    sum_vm = vm.sum(dim=(-2, -1), keepdim=True)
    sum_scaled = (((vm * _f32(float(reduced))) * s) * s).sum(dim=(-2, -1), keepdim=True)
    n0 = _sqrt(sum_vm * _f32(float(reduced)))
    ratio = n0 / torch.clamp_min(_sqrt(sum_scaled), 1e-10)
    return s * ratio


# ---------------------------------------------------------------------------
# FP8 (e4m3fn) quantization with block scales (muon_ext.quantized)
# ---------------------------------------------------------------------------


def _expand_blocks(scales: torch.Tensor, shape, block) -> torch.Tensor:
    """Each block's scale repeated over its elements (edge blocks cut to shape)."""
    if block is None:
        return scales
    rows, cols = shape
    return scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]


def quantize_fp8(master: torch.Tensor, block=(128, 128)) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_inv): amax = max |x| over a block's finite elements, scale_inv
    = amax / 448 in FP32 (1 where that is 0), q = e4m3fn(clamp(x / scale_inv,
    -448, 448)) with torch's round-to-nearest-even conversion; NaN gives NaN
    with the master's sign."""
    if master.dtype != torch.float32:
        raise TypeError(f"quantize_fp8: master must be float32, got {master.dtype}")
    magnitude = torch.where(torch.isfinite(master), master.abs(), torch.zeros((), dtype=torch.float32))
    if block is None:
        amax = magnitude.amax() if master.numel() else torch.zeros((), dtype=torch.float32)
    else:
        rows, cols = master.shape
        br, bc = block
        padded = torch.nn.functional.pad(magnitude, (0, -cols % bc, 0, -rows % br))
        amax = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc).amax(dim=(1, 3))
    scale_inv = amax / torch.tensor(448.0)
    scale_inv = torch.where(scale_inv == 0, torch.ones((), dtype=torch.float32), scale_inv)
    scaled = (master / _expand_blocks(scale_inv, master.shape, block)).clamp(-448.0, 448.0)
    # NaN keeps its sign: taken from the master, not from the arithmetic.
    return torch.where(torch.isnan(master), master, scaled).to(torch.float8_e4m3fn), scale_inv


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """q * scale_inv of its block, in FP32 (exact: 4 + 24 significant bits)."""
    return q.to(torch.float32) * _expand_blocks(scale_inv, q.shape, block)
