"""Muon in three phases (momentum -> orthogonalize -> apply) against the fused
`ops.muon_step` on the CPU: bit for bit, state included.

The phases exist so that sharded params can run phase 1 and 3 on shards and
phase 2 on whole matrices (docs/design.md, "Muon in three phases"); their
composition must not change a single bit of the single-device result.
"""

import pytest
import torch

from support.helpers import assert_bit_equal, assert_unchanged, snapshot
from muon_ext import ops, reference
from support.muon_helpers import make_muon_grads, make_muon_set
from support.helpers import MASTER_MODES

SHAPES = {
    "wide": [(24, 40)] * 2,
    "tall": [(40, 24)] * 3,
    "odd": [(3, 5), (3, 5)],
    "one": [(1, 1)],
    "stacked": [(3, 8, 12), (2, 8, 12)],
    # Sides >= 256 take the block-triangular Polar-Express products, and more
    # than 16384 elements several work items in the input-norm sums.
    "blocked": [(300, 520)],
}
MODES = ["fp32", "bf16_remainder", "bf16_fp32_master", "fp16_fp32_master", "bf16_direct"]


def _phases(s, grads, *, lr, momentum=0.95, nesterov=True, beta2=0.95, weight_decay=0.1, ns_steps=5,
            ns_coefficients=None, lr_scale="original", inv_scale=None, found_inf=None,
            max_workspace_bytes=1 << 30, polar_row_blocks=None, lr_tensor=None, updates=None):
    """The fused step's arguments, as the three phase calls."""
    if updates is None:
        updates = [torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in s.params]
    ops.muon_momentum(grads, s.momentum_buffers, updates, momentum=momentum, nesterov=nesterov,
                      inv_scale=inv_scale, found_inf=found_inf)
    ops.muon_orthogonalize(updates, s.second_momentum_buffers, beta2=beta2, ns_steps=ns_steps,
                           ns_coefficients=ns_coefficients, max_workspace_bytes=max_workspace_bytes,
                           polar_row_blocks=polar_row_blocks, found_inf=found_inf)
    ops.muon_apply(s.params, updates, masters=s.masters, lr=lr if lr_tensor is None else lr_tensor,
                   weight_decay=weight_decay, lr_scale=lr_scale, found_inf=found_inf)
    return updates


def _fused(s, grads, *, lr, lr_tensor=None, **hyper):
    ops.muon_step(*s.args(grads), **s.kwargs(), lr=lr if lr_tensor is None else lr_tensor, **hyper)


def _assert_same_state(a, b, what="state"):
    for name in ("params", "momentum_buffers", "second_momentum_buffers", "masters"):
        for i, (x, y) in enumerate(zip(getattr(a, name), getattr(b, name))):
            assert_bit_equal(x, y, f"{what}: {name}[{i}]")


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("mode", MODES)
def test_phases_equal_fused_step_bit_for_bit(kind, mode, device):
    shapes = SHAPES[kind]
    fused = make_muon_set(shapes, mode).to(device)
    phased = fused.clone()
    for k in range(3):
        grads = [g.to(device) for g in make_muon_grads(shapes, seed=k)]
        _fused(fused, grads, lr=0.02)
        _phases(phased, grads, lr=0.02)
    _assert_same_state(fused, phased)


@pytest.mark.parametrize("setting", [
    dict(beta2=None), dict(nesterov=False), dict(lr_scale="match_rms_adamw"), dict(lr_scale="none"),
    dict(momentum=0.0, weight_decay=0.0), dict(ns_steps=0), dict(ns_steps=2), dict(polar_row_blocks=3),
    dict(inv_scale=torch.tensor([0.25])), dict(lr_tensor=torch.tensor(0.03)),
    dict(grad_dtype=torch.bfloat16), dict(grad_dtype=torch.float16),
])
def test_phases_equal_fused_step_for_every_setting(setting):
    setting = dict(setting)
    grad_dtype = setting.pop("grad_dtype", torch.float32)
    shapes = [(20, 36), (20, 36)]
    normuon = setting.get("beta2", 0.95) is not None
    fused = make_muon_set(shapes, "bf16_remainder", normuon=normuon)
    phased = fused.clone()
    for k in range(2):
        grads = make_muon_grads(shapes, grad_dtype, seed=k)
        _fused(fused, grads, lr=0.02, **setting)
        _phases(phased, grads, lr=0.02, **setting)
    _assert_same_state(fused, phased)


def test_found_inf_leaves_every_phase_a_no_op():
    shapes = [(12, 20)]
    s = make_muon_set(shapes, "bf16_remainder")
    grads = make_muon_grads(shapes)
    updates = [torch.randn(shapes[0])]
    watched = s.tensors() + updates
    before = snapshot(watched)
    _phases(s, grads, lr=0.02, found_inf=torch.ones(1))
    ops.muon_orthogonalize(updates, s.second_momentum_buffers, found_inf=torch.ones(1))
    assert_unchanged(watched, before)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("momentum", [0.0, 0.3, 0.5, 0.8, 0.95])
def test_momentum_phase_is_the_reference_lerp_bit_for_bit(momentum, nesterov, grad_dtype):
    """Both of torch.lerp's forms, for the EMA (weight 1 - mu) and the Nesterov
    blend (weight mu), in every combination mu in [0, 1) allows (0.5: the
    large-weight form on both sides). The kernel picks each form once per loop
    (docs/design.md, "Rounding contract": Muon element math), so a swapped
    form shows here."""
    gen = torch.Generator().manual_seed(int(momentum * 100) + nesterov)
    grad = torch.randn(5, 37, generator=gen).to(grad_dtype)
    mom = torch.randn(5, 37, generator=gen)
    update = torch.empty(5, 37)
    expected_mom = reference._lerp(mom, grad.float(), reference._f32(1.0) - reference._f32(momentum))
    expected_update = reference._lerp(grad.float(), expected_mom, reference._f32(momentum)) if nesterov else expected_mom
    ops.muon_momentum([grad], [mom], [update], momentum=momentum, nesterov=nesterov)
    assert torch.equal(mom.view(torch.int32), expected_mom.view(torch.int32)), "momentum buffer"
    assert torch.equal(update.view(torch.int32), expected_update.view(torch.int32)), "update"


def test_elementwise_phases_work_on_shards():
    """Phases 1 and 3 are elementwise: applied to row blocks of a matrix (as
    FSDP2 shards it, the last one empty) they give the whole matrix's bits."""
    shape = (10, 16)
    whole = make_muon_set([shape], "bf16_remainder", normuon=False)
    sharded = whole.clone()
    grads = make_muon_grads([shape])
    updates = [torch.empty(shape)]
    ops.muon_momentum(grads, whole.momentum_buffers, updates)
    ops.muon_orthogonalize(updates, beta2=None)
    ops.muon_apply(whole.params, updates, masters=whole.masters, lr=0.02)

    bounds = [(0, 4), (4, 8), (8, 10), (10, 10)]
    shard = lambda t, b: t[b[0]:b[1]]  # noqa: E731  (row blocks of a contiguous matrix are contiguous)
    shard_updates = [torch.empty(shard(updates[0], b).shape) for b in bounds]
    ops.muon_momentum([shard(grads[0], b) for b in bounds], [shard(sharded.momentum_buffers[0], b) for b in bounds],
                      shard_updates)
    full = torch.cat(shard_updates)
    ops.muon_orthogonalize([full], beta2=None)
    ops.muon_apply([shard(sharded.params[0], b) for b in bounds], list(full.split([b[1] - b[0] for b in bounds])),
                   masters=[shard(sharded.masters[0], b) for b in bounds], lr=0.02, matrix_shape=shape)
    _assert_same_state(whole, sharded)


@pytest.mark.parametrize("call, fragment", [
    (lambda: ops.muon_momentum([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3, dtype=torch.float64)]),
     "updates[0] has dtype Double"),
    (lambda: ops.muon_momentum([torch.zeros(3)], [torch.zeros(4)], [torch.zeros(3)]),
     "momentum_buffers[0] has shape [4], expected [3]"),
    (lambda: ops.muon_momentum([torch.zeros(3)], [], [torch.zeros(3)]),
     "momentum_buffers has 0 entries but updates has 1"),
    (lambda: ops.muon_momentum([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], momentum=1.0),
     "momentum must be in [0, 1)"),
    (lambda: ops.muon_orthogonalize([torch.zeros(4, 6), torch.zeros(4, 7)], beta2=None),
     "updates[1] has shape [4, 7] but the bucket's matrices are 4x6"),
    (lambda: ops.muon_orthogonalize([torch.zeros(4, 6)], [torch.zeros(4, 1)]),
     "second_momentum_buffers[0] has shape [4, 1], expected [1, 6]"),
    (lambda: ops.muon_orthogonalize([torch.zeros(4, 6)], [torch.zeros(1, 6)], beta2=None),
     "be empty when beta2 is None"),
    (lambda: ops.muon_apply([torch.zeros(3)], [torch.zeros(3)], lr=0.1),
     "params[0] is not a matrix; pass matrix_shape"),
    (lambda: ops.muon_apply([torch.zeros(2, 3)], [torch.zeros(2, 3)], lr=0.1, lr_scale="spectral"),
     "lr_scale must be"),
    (lambda: ops.muon_apply([torch.zeros(2, 3, dtype=torch.bfloat16)], [torch.zeros(2, 3)],
                            masters=[torch.zeros(2, 3, dtype=torch.int16)], lr=-1.0),
     "lr must be >= 0"),
    (lambda: ops.muon_apply([torch.zeros(2, 3)], [torch.zeros(2, 3, dtype=torch.bfloat16)], lr=0.1),
     "updates[0] has dtype"),
])
def test_phase_checks_name_the_argument(call, fragment):
    with pytest.raises((TypeError, ValueError), match=__import__("re").escape(fragment)):
        call()


def test_momentum_and_updates_must_be_distinct_buffers():
    m = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"momentum_buffers\[0\] and updates\[0\] are the same tensor"):
        ops.muon_momentum([torch.ones(3, 4)], [m], [m])
    assert torch.equal(m, torch.zeros(3, 4))


# -- On CUDA (marked gpu, skipped without a device; before: test_muon_phases_cuda.py)
# The three Muon phases against the fused CUDA step, bit for bit (GPU only).
#
# momentum -> orthogonalize -> apply, with FP32 updates buffers of the params'
# shapes, must leave params, masters, momentum and second moments exactly as
# ops.muon_step does (docs/design.md, "Muon in three phases"): same u, same
# chunks (so cuBLAS sees the same batch counts), same reductions, and the
# NorMuon multiplier folded into the update by the one multiplication the fused
# apply does.


CUDA_SHAPES = {
    "tall": [(160, 64)] * 3,
    "wide": [(64, 160)] * 3,
    "square": [(128, 128)] * 2,
    "experts": [(4, 96, 48), (2, 96, 48)],
    # Several element blocks per matrix: the partial sums of ||u||^2 are reduced across blocks.
    "large": [(300, 200)] * 2,
    # 15 elements per matrix: misaligned operands, the scalar paths and ragged packs.
    "odd": [(3, 5)] * 5 + [(3, 3, 5)],
}

def _compare(shapes, mode="fp32", *, normuon=True, grad_dtype=torch.float32, steps=3, **hyper):
    """`steps` steps of the fused op and of the phases from the same state and grads; equal after each."""
    hyper.setdefault("lr", 0.02)
    hyper["beta2"] = hyper.get("beta2", 0.95) if normuon else None
    fused = make_muon_set(shapes, mode, normuon=normuon).to("cuda")
    phased = fused.clone()
    for k in range(steps):
        grads = [g.cuda() for g in make_muon_grads(shapes, dtype=grad_dtype, seed=k + 1)]
        ops.muon_step(*fused.args(grads), **fused.kwargs(), **hyper)
        _phases(phased, grads, **hyper)
        _assert_same_state(fused, phased, f"step {k}")
    return fused, phased


@pytest.mark.gpu
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("normuon", [True, False])
@pytest.mark.parametrize("kind", list(CUDA_SHAPES))
@pytest.mark.parametrize("mode", list(MASTER_MODES))
def test_phases_match_fused_step(mode, kind, normuon, nesterov):
    fused, _ = _compare(CUDA_SHAPES[kind], mode, normuon=normuon, nesterov=nesterov)
    start = make_muon_set(CUDA_SHAPES[kind], mode).params
    assert not torch.equal(fused.params[0].cpu(), start[0]), "the step did not move the params"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["tall", "wide", "odd"])
@pytest.mark.parametrize("mode", ["fp32", "bf16_remainder", "fp16_fp32_master"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_dtypes(grad_dtype, mode, kind):
    _compare(CUDA_SHAPES[kind], mode, grad_dtype=grad_dtype)


@pytest.mark.parametrize("row_blocks", [None, 1, 3])
@pytest.mark.parametrize("matrices", [1, 2.5])
@pytest.mark.parametrize("shapes", [[(96, 200)] * 9, [(200, 96)] * 4 + [(3, 200, 96)], [(7, 128, 128)],
                                    [(300, 200)] * 3], ids=["wide", "tall", "square", "large"])
@pytest.mark.gpu
def test_chunking_and_row_blocks(shapes, matrices, row_blocks):
    """A small max_workspace_bytes cuts the bucket into chunks: the phases must
    cut the same chunks as the fused step (cuBLAS may round differently for
    another batch count)."""
    rows, cols = shapes[0][-2:]
    # About `matrices` matrices' worth of scratch (X, the Polar-Express buffers):
    # chunks of one or two matrices.
    budget = int(matrices * (4 * rows * cols + 4 * min(rows, cols) ** 2 + 4096))
    _compare(shapes, "bf16_remainder", max_workspace_bytes=budget, polar_row_blocks=row_blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("count", [260, 500])
def test_more_matrices_than_one_launch_carries(count):
    """Beyond one kernel's pointer list (240 matrices with two operands, 480
    with one) the matrices are launched in groups; the groups differ between
    the fused step and phase 2, the bits must not."""
    _compare([(8, 8)] * (count // 2) + [(count - count // 2, 8, 8)], "bf16_fp32_master", steps=2)


@pytest.mark.gpu
@pytest.mark.parametrize("lr_scale", ["original", "match_rms_adamw", "none"])
@pytest.mark.parametrize("kind", ["tall", "wide"])
def test_lr_scale_weight_decay_and_coefficients(kind, lr_scale):
    _compare(CUDA_SHAPES[kind], "bf16_fp32_master", lr_scale=lr_scale, weight_decay=0.0, momentum=0.9, beta2=0.5,
             steps=2)
    coefficients = [(3.4445, -4.7750, 2.0315)] * 3
    _compare(CUDA_SHAPES[kind], "fp32", lr_scale=lr_scale, ns_steps=3, ns_coefficients=coefficients, steps=2)
    _compare(CUDA_SHAPES[kind], "bf16_remainder", lr_scale=lr_scale, ns_steps=0, steps=2)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16_remainder", "bf16_fp32_master"])
def test_device_scalars_found_inf_and_no_host_sync(mode):
    """inv_scale and lr as device tensors give the fused bits; a set found_inf
    leaves every tensor (updates included) unchanged; nothing syncs the host."""
    shapes = CUDA_SHAPES["square"] + [(128, 128)]
    fused = make_muon_set(shapes, mode).to("cuda")
    phased = fused.clone()
    updates = [torch.full(p.shape, 7.0, device="cuda") for p in phased.params]
    lr = torch.tensor([0.02], device="cuda")
    inv_scale = torch.tensor([0.5], device="cuda")
    found_inf = torch.tensor([0.0], device="cuda")
    hyper = dict(lr=lr, inv_scale=inv_scale, found_inf=found_inf)
    grads = [[g.cuda() for g in make_muon_grads(shapes, seed=k)] for k in range(3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for g in grads[:2]:
            ops.muon_step(*fused.args(g), **fused.kwargs(), **hyper)
            _phases(phased, g, updates=updates, **hyper)
        found_inf.fill_(1.0)
        before = [t.clone() for t in phased.tensors() + updates]
        ops.muon_step(*fused.args(grads[2]), **fused.kwargs(), **hyper)
        _phases(phased, grads[2], updates=updates, **hyper)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_same_state(fused, phased, "found_inf")
    for i, (x, y) in enumerate(zip(phased.tensors() + updates, before)):
        assert_bit_equal(x, y, f"found_inf step: tensor {i}")
    start = make_muon_set(shapes, mode).params
    assert not torch.equal(phased.params[0].cpu(), start[0])


def _shards(tensors, sizes):
    """Each tensor's flat view cut into contiguous pieces: `sizes` first (an
    empty one, misaligned starts), then the rest."""
    out = []
    for t in tensors:
        flat = t.view(-1)
        head = [n for n in sizes if n <= flat.numel()]
        out += list(torch.split(flat, head + [flat.numel() - sum(head)]))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16_remainder", "fp16_fp32_master"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_elementwise_phases_on_shards(mode, grad_dtype):
    """Phases 1 and 3 are elementwise on any shape: run on uneven flat shards
    (empty ones included) they give the bits of the whole-matrix run."""
    shapes = [(300, 200), (2, 300, 200)]
    sizes = [0, 7, 1000, 0, 3]
    rows, cols = shapes[0]
    fused = make_muon_set(shapes, mode).to("cuda")
    phased = fused.clone()
    for k in range(2):
        grads = [g.cuda() for g in make_muon_grads(shapes, dtype=grad_dtype, seed=k + 1)]
        ops.muon_step(*fused.args(grads), **fused.kwargs(), lr=0.02)
        updates = [torch.empty(p.shape, device="cuda") for p in phased.params]
        ops.muon_momentum(_shards(grads, sizes), _shards(phased.momentum_buffers, sizes), _shards(updates, sizes))
        ops.muon_orthogonalize(updates, phased.second_momentum_buffers)
        ops.muon_apply(_shards(phased.params, sizes), _shards(updates, sizes), masters=_shards(phased.masters, sizes),
                       lr=0.02, matrix_shape=(rows, cols))
        _assert_same_state(fused, phased, f"step {k}")
