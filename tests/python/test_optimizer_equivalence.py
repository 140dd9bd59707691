"""MuonAdamW (CPU) against muon_ext.reference and the seed optimizer, and a
small GPT-like model that trains."""

import os
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import muon_ext
from support.helpers import assert_bit_equal
from muon_ext import MuonAdamW, reference
from support.optimizer_helpers import adamw_hyper, as_params, bf16_values, grad_seq, muon_hyper, set_grads
from support.muon_helpers import stat_shape

SEED_PATH = Path(__file__).resolve().parents[3] / "shared" / "peers" / "hydra_muonadamw.py"


# ---------------------------------------------------------------------------
# equivalence with the reference math and the seed
# ---------------------------------------------------------------------------

SEED_MUON_SHAPES = [(64, 32), (64, 32), (32, 96), (48, 48)]
SEED_HYPER = dict(lr=0.02, momentum=0.95, weight_decay=0.1, beta2=0.95, ns_steps=5, nesterov=True)


def test_fp32_run_matches_reference_math():
    """FP32 params, 5 steps, NorMuon with beta2=0.9, Muon and AdamW groups,
    against muon_ext.reference (FP32 Polar-Express, per param): AdamW is bit
    for bit; Muon differs only by GEMM summation order. Measured max |diff|
    6.7e-8 (1.1e-6 to 1.4e-6 of the 5-step update norm; second moments 1e-6
    relative); allowed 1e-5 of the update norm (second moments 1e-5)."""
    adamw_shapes = [(100,), (7, 5)]
    shapes = SEED_MUON_SHAPES + adamw_shapes
    values = bf16_values(shapes)
    params = as_params(values)
    hyper = dict(SEED_HYPER, beta2=0.9, polar_dtype="float32")
    opt = MuonAdamW([dict(params=params[:4], kind="muon", **hyper),
                     dict(params=params[4:], kind="adamw", lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)])
    ref = [v.clone() for v in values]
    moms = [torch.zeros(s) for s in SEED_MUON_SHAPES]
    smbs = [torch.zeros(stat_shape(s)) for s in SEED_MUON_SHAPES]
    adam = [[torch.zeros(s) for s in adamw_shapes] for _ in range(2)] + [[torch.zeros(()) for _ in adamw_shapes]]
    for grads in grad_seq(shapes, 5):
        set_grads(params, grads)
        opt.step()
        for i in range(4):
            reference.muon_step([ref[i]], [grads[i]], [moms[i]], [smbs[i]], **muon_hyper(opt.param_groups[0]))
        reference.adamw_step(ref[4:], grads[4:], *adam, **adamw_hyper(opt.param_groups[1]))
    for i in range(4):
        update = (ref[i] - values[i]).norm()
        assert ((params[i].detach() - ref[i]).norm() / update).item() < 1e-5, f"muon param {i}"
        assert_bit_equal(opt.state[params[i]]["momentum_buffer"], moms[i], f"momentum {i}")
        torch.testing.assert_close(opt.state[params[i]]["second_momentum_buffer"], smbs[i], rtol=1e-5, atol=0)
    for i in range(2):
        assert_bit_equal(params[4 + i].detach(), ref[4 + i], f"adamw param {i}")


def _load_seed(patch=None):
    """The seed module (eager: HYDRA_MUON_COMPILE=0), optionally with one source line replaced."""
    if not SEED_PATH.exists():
        pytest.skip("../shared (the seed optimizer) is absent")
    source = SEED_PATH.read_text()
    if patch is not None:
        old, new = patch
        assert source.count(old) == 1, f"seed source changed: {old!r} not found exactly once"
        source = source.replace(old, new)
    previous = os.environ.get("HYDRA_MUON_COMPILE")
    os.environ["HYDRA_MUON_COMPILE"] = "0"
    try:
        module = types.ModuleType("hydra_muonadamw_test")
        exec(compile(source, str(SEED_PATH), "exec"), module.__dict__)
    finally:
        if previous is None:
            del os.environ["HYDRA_MUON_COMPILE"]
        else:
            os.environ["HYDRA_MUON_COMPILE"] = previous
    return module


def _run_muon_groups(optimizer_cls, per_shape_groups, steps=5, **extra):
    """FP32 params of SEED_MUON_SHAPES, one group per shape when asked (the seed needs it);
    `extra` group settings (ours only: polar_dtype)."""
    values = bf16_values(SEED_MUON_SHAPES)
    params = as_params(values)
    if per_shape_groups:
        by_shape = {}
        for p in params:
            by_shape.setdefault(tuple(p.shape), []).append(p)
        groups = [dict(params=ps, kind="muon", **SEED_HYPER, **extra) for ps in by_shape.values()]
    else:
        groups = [dict(params=params, kind="muon", **SEED_HYPER, **extra)]
    opt = optimizer_cls(groups)
    for grads in grad_seq(SEED_MUON_SHAPES, steps):
        set_grads(params, grads)
        opt.step()
    return values, [p.detach() for p in params]


def _update_deviation(values, ours, theirs):
    return [((a - b).norm() / (a - v).norm()).item() for v, a, b in zip(values, ours, theirs)]


def test_muon_matches_the_seed_algorithm_with_fp32_orthogonalization():
    """The seed's Muon with its one BF16 cast of the orthogonalization input
    replaced by FP32 (everything else as written) agrees with ours to GEMM
    summation order. Measured 1.2e-6 to 1.6e-6 of the 5-step update norm;
    allowed 1e-5."""
    seed = _load_seed(patch=("    X = g.bfloat16()\n", "    X = g.float()\n"))
    values, ours = _run_muon_groups(MuonAdamW, per_shape_groups=False, polar_dtype="float32")
    _, theirs = _run_muon_groups(seed.MuonAdamW, per_shape_groups=True)
    deviation = _update_deviation(values, ours, theirs)
    assert max(deviation) < 1e-5, deviation


def test_muon_matches_the_seed_within_its_bf16_noise():
    """Against the unmodified seed (BF16 Polar-Express, one group per shape).

    Measured deviation of the 5-step update norm, ours with FP32 Polar-Express:
    2.4% to 3.4%; with BF16 (the default): 2.6% to 3.7%. It comes from the
    seed's BF16 orthogonalization (every op rounded to BF16): patching the
    seed's BF16 casts of lr' and the NorMuon scale to FP32 changes it by less
    than 0.001, orthogonalizing in FP32 brings it to 1.6e-6 (test above), and
    our own BF16 rounding sits at 1.0% to 1.2% from FP32. Ours in BF16 rounds
    at other points than the seed (each GEMM output once, b A + c A A fused),
    so the two BF16 noises add: sqrt(3.4^2 + 1.2^2) = 3.6%, as measured.
    Allowed 5% for both, and BF16 at most 1.15x FP32 (1.06x expected): a 5%
    lr error or momentum 0.9 instead of 0.95 measures 5.7% to 10%, Nesterov off
    or 4 Polar-Express steps 25% or more."""
    seed = _load_seed()
    _, theirs = _run_muon_groups(seed.MuonAdamW, per_shape_groups=True)
    deviation = {}
    for polar_dtype in ("float32", "bfloat16"):
        values, ours = _run_muon_groups(MuonAdamW, per_shape_groups=False, polar_dtype=polar_dtype)
        deviation[polar_dtype] = _update_deviation(values, ours, theirs)
        assert max(deviation[polar_dtype]) < 0.05, deviation
    assert min(deviation["float32"]) > 1e-3, "the seed's BF16 noise vanished: is the seed still orthogonalizing in BF16?"
    assert max(deviation["bfloat16"]) <= 1.15 * max(deviation["float32"]), deviation


def test_adamw_matches_the_seed():
    """AdamW-only groups against the seed (torch ops, p *= 1 - lr wd first,
    lerp moments): measured 3.5e-6 to 4.2e-6 of the 5-step update norm (1.9e-7
    of max |p|); allowed 2e-5 of the update norm."""
    seed = _load_seed()
    shapes = [(100,), (7, 5), (64,)]
    values = bf16_values(shapes, scale=1.0)
    results = []
    for cls in (MuonAdamW, seed.MuonAdamW):
        params = as_params(values)
        opt = cls([dict(params=params, kind="adamw", lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)])
        for grads in grad_seq(shapes, 5):
            set_grads(params, grads)
            opt.step()
        results.append([p.detach() for p in params])
    deviation = _update_deviation(values, *results)
    assert max(deviation) < 2e-5, deviation


# ---------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------


class _TinyGPT(torch.nn.Module):
    """Embedding, two attention-free MLP blocks with LayerNorm, head (tied or not)."""

    def __init__(self, vocab=64, d=32, tied=False):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(dict(ln=torch.nn.LayerNorm(d), fc=torch.nn.Linear(d, 4 * d),
                                     proj=torch.nn.Linear(4 * d, d))) for _ in range(2))
        self.ln_f = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.blocks:
            x = x + block["proj"](F.gelu(block["fc"](block["ln"](x))))
        return self.lm_head(self.ln_f(x))


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gpt_trains_with_bf16_params_and_remainders(tied):
    """muon_ext.param_groups + MuonAdamW train a BF16 model (next token =
    7 x + 3 mod 64) on CPU: hidden Linear weights go to Muon, embedding, head,
    norms and biases to AdamW. Measured over 30 steps: 4.35 -> 0.05 untied,
    31.4 -> 0.24 tied (the tied head starts from N(0, 1) embeddings); required:
    below a quarter of the first loss and below 1 (ln 64 = 4.16 is chance)."""
    torch.manual_seed(0)
    model = _TinyGPT(tied=tied).to(torch.bfloat16)
    groups = muon_ext.param_groups(model, lr=0.02, adamw_lr=1e-2)
    names = {g["kind"]: set(g["param_names"]) for g in groups}
    assert names["muon"] == {f"blocks.{i}.{n}.weight" for i in range(2) for n in ("fc", "proj")}
    assert {"wte.weight", "ln_f.weight", "blocks.0.fc.bias"} <= names["adamw"]
    assert ("lm_head.weight" in names["adamw"]) != tied
    opt = MuonAdamW(groups)
    assert all(s["master_param"].dtype == torch.int16 for s in opt.state.values())
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(30):
        idx = torch.randint(0, 64, (256,), generator=gen)
        loss = F.cross_entropy(model(idx).float(), (7 * idx + 3) % 64)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < min(0.25 * losses[0], 1.0), losses
