"""Test helpers: building AdamW tensor sets in every master mode, snapshots."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import List, Optional

import torch

# (param dtype, master dtype or None): the master modes of the AdamW kernel.
MASTER_MODES = {
    "fp32": (torch.float32, None),
    "bf16_direct": (torch.bfloat16, None),
    "fp16_direct": (torch.float16, None),
    "bf16_fp32_master": (torch.bfloat16, torch.float32),
    "fp16_fp32_master": (torch.float16, torch.float32),
    "bf16_remainder": (torch.bfloat16, torch.int16),
}


@dataclass
class AdamWSet:
    params: List[torch.Tensor]
    exp_avgs: List[torch.Tensor]
    exp_avg_sqs: List[torch.Tensor]
    steps: List[torch.Tensor]
    masters: List[torch.Tensor] = field(default_factory=list)

    def tensors(self) -> List[torch.Tensor]:
        return self.params + self.exp_avgs + self.exp_avg_sqs + self.steps + self.masters

    def kwargs(self):
        return dict(masters=self.masters)

    def args(self, grads):
        return (self.params, grads, self.exp_avgs, self.exp_avg_sqs, self.steps)

    def clone(self) -> "AdamWSet":
        return AdamWSet(*[[t.clone() for t in ts] for ts in
                          (self.params, self.exp_avgs, self.exp_avg_sqs, self.steps, self.masters)])


def make_set(sizes, mode: str, seed: int = 0, device="cpu", init: Optional[List[torch.Tensor]] = None) -> AdamWSet:
    """Params drawn from N(0, 1) (or `init`), zero moments and steps, fresh masters."""
    param_dtype, master_dtype = MASTER_MODES[mode]
    gen = torch.Generator().manual_seed(seed)
    values = init if init is not None else [torch.randn(_shape(s), generator=gen) for s in sizes]
    params = [v.to(param_dtype).to(device) for v in values]
    if master_dtype is torch.float32:
        masters = [p.float() for p in params]
    elif master_dtype is torch.int16:
        masters = [torch.zeros(p.shape, dtype=torch.int16, device=device) for p in params]
    else:
        masters = []
    zeros = lambda: [torch.zeros(p.shape, dtype=torch.float32, device=device) for p in params]  # noqa: E731
    steps = [torch.zeros((), dtype=torch.float32, device=device) for _ in params]
    return AdamWSet(params, zeros(), zeros(), steps, masters)


def make_grads(sizes, dtype=torch.float32, seed: int = 1, device="cpu", scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(_shape(s), generator=gen) * scale).to(dtype).to(device) for s in sizes]


def _shape(s):
    return s if isinstance(s, tuple) else (s,)


def fp32_master(s: AdamWSet, i: int) -> torch.Tensor:
    """The FP32 master of param i, whatever the mode."""
    from muon_ext.reference import merge_master

    if s.masters and s.masters[i].dtype == torch.int16:
        return merge_master(s.params[i], s.masters[i])
    if s.masters:
        return s.masters[i].clone()
    return s.params[i].float()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bit-exact comparisons (NaN == NaN, -0 != +0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, what: str = ""):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if not torch.equal(bits(a.cpu()), bits(b.cpu())):
        diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "n/a"
        raise AssertionError(f"{what}: not bit-identical (max abs diff {diff})")


def snapshot(tensors):
    return [bits(t).clone() for t in tensors]


def assert_unchanged(tensors, before):
    for i, (t, b) in enumerate(zip(tensors, before)):
        assert torch.equal(bits(t), b), f"tensor {i} was modified by a rejected call"


def run_python(code: str, env=None, check: bool = False):
    """Runs `code` in a fresh interpreter outside the source tree, so that
    `import muon_ext` finds the installed package, not ./muon_ext."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=tempfile.gettempdir(), check=check)


def optimizer_tensors(opt):
    """Every tensor an optimizer owns or writes, by name: params and all state."""
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            out[f"group {gi} param {pi}"] = p
            for key, value in opt.state[p].items():
                if isinstance(value, torch.Tensor):
                    out[f"group {gi} param {pi} {key}"] = value
    return out


def assert_same_optimizer_tensors(opt_a, opt_b):
    """Every param and state tensor of two optimizers over the same model
    bit-identical (compared on the CPU, so the two may live on different devices)."""
    a, b = optimizer_tensors(opt_a), optimizer_tensors(opt_b)
    assert a.keys() == b.keys()
    for key in a:
        assert_bit_equal(a[key].cpu(), b[key].cpu(), key)


@contextlib.contextmanager
def onednn_off():
    """torch's oneDNN switched off (torch.backends.mkldnn.enabled) for the block, then as it was; not
    torch.backends.mkldnn.flags, which also sets (and warns about) TF32."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before
