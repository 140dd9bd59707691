"""quantize_fp8 / dequantize_fp8 / Fp8Writer (muon_ext.quantized) on the CPU:
bit for bit against muon_ext.reference, the e4m3fn rounding and scaling rule
at its edges, the out= / found_inf paths, and every refused argument."""


import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from support.helpers import assert_bit_equal, assert_unchanged, snapshot
from muon_ext import quantized, reference

E4M3 = torch.float8_e4m3fn
OP = torch.ops.muon_ext.quantize_fp8.default


def _finite_codes():
    """Every finite e4m3fn code (NaN = 0x7F / 0xFF left out) and its FP32 value."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    return codes, codes.view(E4M3).float()


def _assert_matches_reference(master, block, device="cpu"):
    """Quantized on `device`, the reference's bits; returns (q, scale_inv) on the CPU."""
    q, scale_inv = (t.cpu() for t in quantized.quantize_fp8(master.to(device), block=block))
    ref_q, ref_scale_inv = reference.quantize_fp8(master.contiguous(), block=block)
    assert_bit_equal(scale_inv, ref_scale_inv, "scale_inv")
    assert_bit_equal(q, ref_q, "q")
    return q, scale_inv


SHAPES = [(1, 1), (128, 128), (300, 260), (257, 129), (5, 1000), (1000, 3)]
BLOCKS = [(128, 128), (1, 1), (7, 5), (64, 256), (300, 300), None]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_random_matches_reference(shape, block, device):
    g = torch.Generator().manual_seed(hash((shape, block)) % 1000)
    master = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[1]).reshape(1, -1)
    q, scale_inv = _assert_matches_reference(master, block, device)
    assert scale_inv.shape == quantized.scale_inv_shape(shape, block)
    # Dequantized: within half an e4m3 step (2^-4 relative) or half the subnormal step.
    error = (quantized.dequantize_fp8(q, scale_inv, block=block) - master).abs()
    bound = master.abs() * 2.0**-4 + reference.dequantize_fp8(torch.ones_like(q), scale_inv, block=block) * 2.0**-10
    assert bool((error <= bound).all())


@pytest.mark.parametrize("shape", [(), (7,), (3, 5, 11), (2, 0, 3)], ids=str)
def test_one_scale_per_tensor_for_any_shape(shape, device):
    master = torch.randn(shape) * 5
    q, scale_inv = _assert_matches_reference(master, None, device)
    assert q.shape == master.shape and scale_inv.shape == ()


def test_scale_is_amax_over_448_and_one_for_zero_blocks():
    master = torch.zeros(4, 6)
    master[0, 0] = -3.0   # block (0, 0): amax 3
    master[2, 5] = 1e-3   # block (1, 1): amax 1e-3; blocks (0, 1), (1, 0): all zero
    q, scale_inv = _assert_matches_reference(master, (2, 3))
    expected = torch.tensor([[3.0 / 448, 1.0], [1.0, 1e-3 / 448]], dtype=torch.float32)
    assert_bit_equal(scale_inv, (torch.tensor([[3.0, 0], [0, 1e-3]]) / 448).where(expected != 1, 1.0))
    assert q.view(torch.uint8)[0, 0] == 0xFE and q.view(torch.uint8)[2, 5] == 0x7E  # -448, 448


def test_tiny_values_and_scales_that_underflow():
    # amax/448 underflows to 0 below 448 * 2^-150: such a block is scaled by 1 (all its values round to zero).
    master = torch.tensor([[2.0**-149, -2.0**-149], [1e-42, 1e-40]])
    q, scale_inv = _assert_matches_reference(master, (1, 2))
    assert scale_inv[0, 0].item() == 1.0 and bool((q.view(torch.uint8)[0] & 0x7F == 0).all())
    # A subnormal but nonzero scale (amax 1e-40) still spreads the block over e4m3.
    assert 0 < scale_inv[1, 0].item() < torch.finfo(torch.float32).tiny
    assert q.view(torch.uint8)[1, 1] == 0x7E


def test_huge_values():
    master = torch.tensor([[3.4e38, -3.4e38, 1e38, 1.0], [torch.finfo(torch.float32).max, 1e30, -2e37, 0.0]])
    q, _ = _assert_matches_reference(master, (1, 4))
    assert q.view(torch.uint8)[0, 0] == 0x7E and q.view(torch.uint8)[0, 1] == 0xFE


def test_every_e4m3_value_round_trips_and_448_saturates():
    codes, values = _finite_codes()
    master = values.reshape(2, -1)  # both rows reach +-448: scale_inv 1
    q, scale_inv = _assert_matches_reference(master, (1, 1000))
    assert bool((scale_inv == 1).all())
    assert torch.equal(q.view(torch.uint8).reshape(-1), codes)
    # A block's amax divided by its rounded scale can land just above 448: it saturates to 448 (not NaN).
    amax = torch.linspace(1, 1000, 20001)
    over = amax[amax / (amax / 448) > 448]
    assert len(over) > 0
    master = torch.stack([over, -over / 2], dim=1)  # one block per row, the amax first
    q, scale_inv = _assert_matches_reference(master, (1, 2))
    assert bool((q.view(torch.uint8)[:, 0] == 0x7E).all())


def test_midpoints_round_to_even():
    codes, values = _finite_codes()
    positive = values[(codes < 0x7E)]  # 0 .. 416: each has a larger neighbour below 448
    upper = values[(codes >= 1) & (codes <= 0x7E)]
    midpoints = (positive.double() + upper.double()) / 2  # exact in FP32 (one more mantissa bit)
    master = torch.cat([midpoints.float(), torch.tensor([448.0])]).reshape(1, -1)
    q, scale_inv = _assert_matches_reference(master, None)
    assert scale_inv.item() == 1.0
    got = q.view(torch.uint8).reshape(-1)[:-1].to(torch.int64)
    lower_code = torch.arange(0, 0x7E, dtype=torch.int64)
    assert torch.equal(got, lower_code + (lower_code & 1))  # the even code of the two
    # Just off the midpoint: nearest wins.
    below = torch.nextafter(midpoints.float(), torch.tensor(0.0))
    above = torch.nextafter(midpoints.float(), torch.tensor(1000.0))
    q, _ = _assert_matches_reference(torch.cat([below, above, torch.tensor([448.0])]).reshape(1, -1), None)
    n = len(midpoints)
    assert torch.equal(q.view(torch.uint8)[0, :n].to(torch.int64), lower_code)
    assert torch.equal(q.view(torch.uint8)[0, n:2 * n].to(torch.int64), lower_code + 1)


def test_nan_and_inf_are_left_out_of_the_scale():
    master = torch.tensor([[float("nan"), -float("nan"), float("inf"), -float("inf"), 2.0, -1.0]])
    q, scale_inv = _assert_matches_reference(master, (1, 6))
    assert scale_inv.item() == (torch.tensor(2.0) / 448).item()  # FP32 division
    assert q.view(torch.uint8).tolist() == [[0x7F, 0xFF, 0x7E, 0xFE, 0x7E, 0xF6]]
    q, scale_inv = _assert_matches_reference(torch.tensor([[float("nan"), float("inf")]]), None)
    assert scale_inv.item() == 1.0 and q.view(torch.uint8).tolist() == [[0x7F, 0x7E]]


def test_signed_zeros():
    q, _ = _assert_matches_reference(torch.tensor([[-0.0, 0.0, -1e-30, 1.0]]), None)
    assert q.view(torch.uint8).tolist() == [[0x80, 0x00, 0x80, 0x7E]]


@pytest.mark.parametrize("block", [(128, 128), (3, 7), None], ids=str)
def test_non_contiguous_master_is_quantized_as_its_values(block):
    base = torch.randn(200, 300)
    for view in (base.t(), base[:, ::2], base[10:150, 5:260]):
        _assert_matches_reference(view, block)


def test_outputs_in_a_non_contiguous_masters_storage_are_refused():
    buffer = torch.zeros(2 * 64)
    master = buffer[:64].view(8, 8).t()
    out_scale_inv = buffer[64:65].view(1, 1)  # no overlap, but the same storage: refused to be safe
    before = snapshot([buffer])
    with pytest.raises(ValueError, match="quantize_fp8: out_scale_inv shares its storage with the non-contiguous"):
        quantized.quantize_fp8(master, out_scale_inv=out_scale_inv)
    with pytest.raises(ValueError, match="quantize_fp8: out shares its storage"):
        quantized.quantize_fp8(master, out=buffer.view(torch.uint8)[:64].view(E4M3).view(8, 8))
    assert_unchanged([buffer], before)


def test_the_op_itself_refuses_a_non_contiguous_master():
    master = torch.randn(8, 8).t()
    with pytest.raises(ValueError, match="quantize_fp8: master must be contiguous"):
        OP(master, [4, 4], torch.empty(8, 8, dtype=E4M3), torch.empty(2, 2), None)


def test_empty_masters():
    for shape, block in (((0, 5), (128, 128)), ((5, 0), (2, 2)), ((0,), None)):
        master = torch.empty(shape)
        q, scale_inv = _assert_matches_reference(master, block)
        assert q.shape == shape
    assert scale_inv.item() == 1.0  # per tensor: an empty tensor is an all-zero block


def test_writes_into_out_and_out_scale_inv():
    master = torch.randn(130, 70)
    out = torch.empty(130, 70, dtype=E4M3)
    out_scale_inv = torch.empty(2, 1)
    q, scale_inv = quantized.quantize_fp8(master, block=(128, 128), out=out, out_scale_inv=out_scale_inv)
    assert q is out and scale_inv is out_scale_inv
    ref_q, ref_scale_inv = reference.quantize_fp8(master, (128, 128))
    assert_bit_equal(out, ref_q)
    assert_bit_equal(out_scale_inv, ref_scale_inv)
    # A view into a larger buffer works too (contiguous, offset).
    buffer = torch.zeros(3 * 130 * 70, dtype=torch.uint8)
    window = buffer[130 * 70:2 * 130 * 70].view(E4M3).view(130, 70)
    quantized.quantize_fp8(master, out=window, out_scale_inv=out_scale_inv)
    assert_bit_equal(window, ref_q)
    assert bool((buffer[:130 * 70] == 0).all() and (buffer[2 * 130 * 70:] == 0).all())


@pytest.mark.parametrize("block", [(4, 4), None], ids=str)
def test_nonzero_found_inf_writes_nothing(block):
    master = torch.randn(8, 8)
    out = torch.full((8, 8), 3.0).to(E4M3)
    out_scale_inv = torch.full(quantized.scale_inv_shape((8, 8), block), 7.0)
    before = snapshot([out, out_scale_inv])
    quantized.quantize_fp8(master, block=block, out=out, out_scale_inv=out_scale_inv, found_inf=torch.ones(1))
    assert_unchanged([out, out_scale_inv], before)
    quantized.quantize_fp8(master, block=block, out=out, out_scale_inv=out_scale_inv, found_inf=torch.zeros(1))
    assert_bit_equal(out, reference.quantize_fp8(master, block)[0])


def _op_cases():
    """(description, master, block, out, out_scale_inv, found_inf, error, message) for the op."""
    m = torch.randn(8, 6)
    q, s = torch.empty(8, 6, dtype=E4M3), torch.empty(2, 2)
    buf = torch.zeros(100)
    yield "master dtype", m.double(), [4, 4], q, s, None, TypeError, "master must be float32"
    yield "block length", m, [4], q, s, None, ValueError, "block must be two positive ints"
    yield "block zero", m, [0, 4], q, s, None, ValueError, "block must be two positive ints"
    yield "block 3-D", m.reshape(2, 4, 6), [4, 4], q.reshape(2, 4, 6), s, None, ValueError, "needs a 2-D master"
    yield "out dtype", m, [4, 4], torch.empty(8, 6, dtype=torch.uint8), s, None, TypeError, "out must be"
    yield "out shape", m, [4, 4], torch.empty(6, 8, dtype=E4M3), s, None, ValueError, "out has shape"
    yield "out device", m, [4, 4], q.to("meta"), s, None, ValueError, "out is on meta but master is on cpu"
    yield "out strides", m, [4, 4], torch.empty(6, 8, dtype=E4M3).t(), s, None, ValueError, "out must be contiguous"
    yield "scale dtype", m, [4, 4], q, s.double(), None, TypeError, "out_scale_inv must be"
    yield "scale shape", m, [4, 4], q, torch.empty(2, 3), None, ValueError, r"out_scale_inv has shape \[2, 3\]"
    yield "scale shape per tensor", m, None, q, torch.empty(1), None, ValueError, "out_scale_inv has shape"
    yield "scale strides", m, [4, 4], q, torch.empty(2, 2).t()[:, :1].expand(2, 2), None, ValueError, "contiguous"
    yield "found_inf dtype", m, [4, 4], q, s, torch.zeros(1, dtype=torch.int32), TypeError, "found_inf must be float32"
    yield "found_inf numel", m, [4, 4], q, s, torch.zeros(2), ValueError, "found_inf must hold one element"
    yield ("found_inf device", m, [4, 4], q, s, torch.zeros(1, device="meta"), ValueError,
           "found_inf is on meta but master is on cpu")
    yield ("scale overlaps master", buf[:48].view(8, 6), [4, 4], q, buf[44:48].view(2, 2), None, ValueError,
           "out_scale_inv and master overlap")
    yield ("found_inf overlaps scale", m, [4, 4], q, buf[:4].view(2, 2), buf[3:4], ValueError,
           "found_inf and out_scale_inv overlap")
    released = torch.randn(8, 6)
    released.untyped_storage().resize_(0)
    yield "released master", released, [4, 4], q, s, None, ValueError, "master: its storage holds 0 bytes"


@pytest.mark.parametrize("case", list(_op_cases()), ids=lambda c: c[0])
def test_op_refuses_bad_arguments_before_writing(case):
    _, master, block, out, out_scale_inv, found_inf, error, message = case
    written = [t for t in (out, out_scale_inv) if t.device.type == "cpu" and t.untyped_storage().nbytes()]
    before = snapshot(written)
    with pytest.raises(error, match=message):
        OP(master, block, out, out_scale_inv, found_inf)
    assert_unchanged(written, before)


def test_python_wrapper_refuses_bad_arguments():
    m = torch.randn(8, 6)
    with pytest.raises(TypeError, match="quantize_fp8: master must be a tensor"):
        quantized.quantize_fp8([1.0])
    with pytest.raises(TypeError, match="quantize_fp8: master must be torch.float32, got torch.bfloat16"):
        quantized.quantize_fp8(m.bfloat16())
    for block in ((4,), (4, 0), (True, 4), (4.0, 4), "4x4"):
        with pytest.raises(ValueError, match="quantize_fp8: block must be two positive ints"):
            quantized.quantize_fp8(m, block=block)
    with pytest.raises(ValueError, match=r"quantize_fp8: block=\(128, 128\) needs a 2-D tensor, got shape"):
        quantized.quantize_fp8(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match=r"scale_inv_shape: block=\(1, 1\) needs a 2-D tensor"):
        quantized.scale_inv_shape((5,), (1, 1))
    with pytest.raises(TypeError, match="out must be torch.float8_e4m3fn"):
        quantized.quantize_fp8(m, out=torch.empty(8, 6))
    with pytest.raises(TypeError, match="found_inf must be torch.float32"):
        quantized.quantize_fp8(m, found_inf=torch.zeros(1, dtype=torch.bool))
    released = torch.randn(6, 8)
    view = released.t()  # non-contiguous: copied, but only after its storage is checked
    released.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="quantize_fp8: master: its storage holds 0 bytes"):
        quantized.quantize_fp8(view)


def test_meta_tensors_are_checked_and_opcheck_passes():
    m = torch.randn(8, 6, device="meta")
    q, scale_inv = quantized.quantize_fp8(m, block=(4, 4))
    assert q.device.type == "meta" and scale_inv.shape == (2, 2)
    with pytest.raises(ValueError, match="out_scale_inv has shape"):
        quantized.quantize_fp8(m, out_scale_inv=torch.empty(3, 3, device="meta"))
    written = {a.name for a in OP._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"out", "out_scale_inv"} and not OP._schema.returns
    # opcheck's "test_schema" cannot compare float8 tensors (no float8 mul on the CPU); the rest runs.
    master = torch.randn(9, 5)
    for block, scale_shape in (([4, 4], (3, 2)), (None, ())):
        torch.library.opcheck(OP, (master, block, torch.empty(9, 5, dtype=E4M3), torch.empty(scale_shape), None),
                              test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_dequantize():
    master = torch.randn(130, 260) * 10
    q, scale_inv = quantized.quantize_fp8(master)
    expected = q.float() * scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :260]
    assert_bit_equal(quantized.dequantize_fp8(q, scale_inv), expected)
    q, scale_inv = quantized.quantize_fp8(master, block=None)
    assert_bit_equal(quantized.dequantize_fp8(q, scale_inv, block=None), q.float() * scale_inv)
    with pytest.raises(TypeError, match="dequantize_fp8: q must be torch.float8_e4m3fn"):
        quantized.dequantize_fp8(master, scale_inv)
    with pytest.raises(ValueError, match=r"dequantize_fp8: scale_inv has shape \(\), expected \(2, 3\)"):
        quantized.dequantize_fp8(q, scale_inv)
    with pytest.raises(ValueError, match="dequantize_fp8: block=\\(128, 128\\) needs a 2-D tensor"):
        quantized.dequantize_fp8(q.reshape(-1), scale_inv)


# ---------------------------------------------------------------------------
# Fp8Writer: the param-writer protocol writer(param, master, stream, found_inf)
# ---------------------------------------------------------------------------


def test_writer_quantizes_the_master_into_its_buffers_and_leaves_the_param():
    q_out, scale_inv_out = torch.empty(200, 130, dtype=E4M3), torch.empty(2, 2)
    writer = quantized.Fp8Writer(q_out, scale_inv_out)
    param = torch.randn(200, 130).bfloat16()
    param_before = snapshot([param])
    master = torch.randn(200, 130)
    master_before = snapshot([master])
    assert writer(param, master, None, None) is None
    ref_q, ref_scale_inv = reference.quantize_fp8(master)
    assert_bit_equal(q_out, ref_q)
    assert_bit_equal(scale_inv_out, ref_scale_inv)
    assert_unchanged([param, master], param_before + master_before)


def test_writer_per_tensor_and_found_inf():
    q_out, scale_inv_out = torch.zeros(3, 4, 5, dtype=E4M3), torch.zeros(())
    writer = quantized.Fp8Writer(q_out, scale_inv_out, block=None)
    master = torch.randn(3, 4, 5)
    before = snapshot([q_out, scale_inv_out])
    writer(None, master, None, torch.tensor([1.0]))
    assert_unchanged([q_out, scale_inv_out], before)
    writer(None, master, None, torch.tensor([0.0]))
    assert_bit_equal(q_out, reference.quantize_fp8(master, None)[0])


def test_writer_refuses_bad_buffers():
    q = torch.empty(8, 6, dtype=E4M3)
    with pytest.raises(TypeError, match="Fp8Writer: q_out must be torch.float8_e4m3fn"):
        quantized.Fp8Writer(torch.empty(8, 6), torch.empty(1, 1))
    with pytest.raises(TypeError, match="Fp8Writer: scale_inv_out must be torch.float32"):
        quantized.Fp8Writer(q, torch.empty(1, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"Fp8Writer: scale_inv_out has shape \(2, 2\), expected \(1, 1\)"):
        quantized.Fp8Writer(q, torch.empty(2, 2))
    with pytest.raises(ValueError, match="Fp8Writer: scale_inv_out is on meta but q_out is on cpu"):
        quantized.Fp8Writer(q, torch.empty(1, 1, device="meta"))
    with pytest.raises(ValueError, match="Fp8Writer: q_out must be contiguous"):
        quantized.Fp8Writer(torch.empty(6, 8, dtype=E4M3).t(), torch.empty(1, 1))
    with pytest.raises(ValueError, match="Fp8Writer: block must be two positive ints"):
        quantized.Fp8Writer(q, torch.empty(1, 1), block=(0, 1))
    released = torch.empty(8, 6, dtype=E4M3)
    released.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="Fp8Writer: q_out: its storage holds 0 bytes"):
        quantized.Fp8Writer(released, torch.empty(1, 1))


def test_writer_checks_the_master_before_writing():
    q_out, scale_inv_out = torch.zeros(8, 6, dtype=E4M3), torch.zeros(1, 1)
    writer = quantized.Fp8Writer(q_out, scale_inv_out)
    before = snapshot([q_out, scale_inv_out])
    with pytest.raises(ValueError, match=r"Fp8Writer: master of shape \(6, 8\) on cpu does not fit q_out of shape"):
        writer(None, torch.randn(6, 8), None, None)
    with pytest.raises(TypeError, match="Fp8Writer: master must be torch.float32"):
        writer(None, torch.randn(8, 6).bfloat16(), None, None)
    assert_unchanged([q_out, scale_inv_out], before)


# ---------------------------------------------------------------------------
# Property: any values (NaN and inf included), shapes and blocks
# ---------------------------------------------------------------------------

_any_float32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 12),
    block=st.one_of(st.none(), st.tuples(st.integers(1, 8), st.integers(1, 8))),
    data=st.data(),
)
def test_property_kernel_equals_reference(rows, cols, block, data):
    values = data.draw(st.lists(st.one_of(_any_float32, st.floats(-2.0**-10, 2.0**-10, width=32)),
                                min_size=rows * cols, max_size=rows * cols))
    master = torch.tensor(values, dtype=torch.float32).reshape(rows, cols)
    q, scale_inv = _assert_matches_reference(master, block)
    finite = torch.isfinite(master)
    # q is NaN exactly where the master is.
    assert torch.equal(torch.isnan(q.float()), torch.isnan(master))
    # Finite values come back within half an e4m3 step or half a subnormal step of the block scale.
    deq = quantized.dequantize_fp8(q, scale_inv, block=block)
    unit = reference.dequantize_fp8(torch.ones_like(q), scale_inv, block=block)
    bound = master.abs().double() * 2.0**-4 + unit.double() * 2.0**-10 * (1 + 2.0**-20)
    error = (deq.double() - master.double()).abs()
    # A scale that underflowed to a subnormal (amax < 2^-118) loses the bound's precision: saturation only.
    ok = (error <= bound) | (unit < torch.finfo(torch.float32).tiny) | ~finite
    assert bool(ok.all())


# -- On CUDA (marked gpu, skipped without a device; before: test_quantize_fp8_cuda.py)
# quantize_fp8 and Fp8Writer on CUDA (GPU only): the same bits as the CPU
# kernel (and so the reference), no host sync, one launch with blocks (two per
# tensor), found_inf read on the device, and the writer on a given stream.


def _special_values(n, seed):
    """Random values over many magnitudes, with NaN, inf, zeros, ties and 448."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
    picks = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 448.0, 464.0, 2.0**-10, 1e-42])
    idx = torch.randint(0, n, (min(n, 64),), generator=g)
    x[idx] = picks[torch.arange(len(idx)) % len(picks)]
    return x


def _cpu_and_cuda(master, block):
    cpu = quantized.quantize_fp8(master, block=block)
    gpu = quantized.quantize_fp8(master.cuda(), block=block)
    for c, g, what in zip(cpu, gpu, ("q", "scale_inv")):
        assert_bit_equal(g.cpu(), c, what)
    return cpu


CUDA_SHAPES = [(1, 1), (128, 128), (300, 260), (257, 129), (4096, 1000), (5, 1003), (1001, 7)]
CUDA_BLOCKS = [(128, 128), (1, 1), (7, 5), (64, 256), (4, 128), None]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("block", CUDA_BLOCKS, ids=str)
def test_cuda_equals_cpu_and_reference(shape, block):
    if block == (1, 1) and shape[0] * shape[1] > 1 << 20:
        pytest.skip("a million one-element blocks: slow on the CPU side, nothing new")
    master = _special_values(shape[0] * shape[1], seed=shape[0]).reshape(shape)
    q, scale_inv = _cpu_and_cuda(master, block)
    ref_q, ref_scale_inv = reference.quantize_fp8(master, block)
    assert_bit_equal(q, ref_q)
    assert_bit_equal(scale_inv, ref_scale_inv)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), None], ids=str)
def test_unaligned_and_strided_inputs_take_the_scalar_path(block):
    buffer = _special_values(300 * 256 + 1, seed=3)
    _cpu_and_cuda(buffer[1:].reshape(300, 256), block)  # 4-byte but not 16-byte aligned
    _cpu_and_cuda(buffer[: 300 * 256].reshape(256, 300).t(), block)  # non-contiguous: copied


@pytest.mark.gpu
def test_per_tensor_any_shape_and_large():
    _cpu_and_cuda(_special_values(3 * 5 * 7, seed=4).reshape(3, 5, 7), None)
    _cpu_and_cuda(_special_values((1 << 24) + 3, seed=5), None)  # more elements than one pass of the grid
    _cpu_and_cuda(torch.empty(0), None)


def _kernels_launched(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.parametrize("block, launches", [((128, 128), 1), (None, 2)], ids=["blocks", "per_tensor"])
def test_launches_no_sync_and_found_inf_on_device(block, launches):
    master = torch.randn(1000, 700, device="cuda")
    out = torch.zeros(1000, 700, dtype=E4M3, device="cuda")
    out_scale_inv = torch.zeros(quantized.scale_inv_shape(master.shape, block), device="cuda")
    found_inf = torch.ones(1, device="cuda")
    torch.cuda.synchronize()

    def call():
        quantized.quantize_fp8(master, block=block, out=out, out_scale_inv=out_scale_inv, found_inf=found_inf)

    torch.cuda.set_sync_debug_mode("error")
    try:
        before = snapshot([out, out_scale_inv])
        call()  # found_inf set: nothing written
        torch.cuda.set_sync_debug_mode("default")
        assert_unchanged([out, out_scale_inv], before)
        found_inf.zero_()
        names = _kernels_launched(call)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(names) == launches, names
    assert_bit_equal(out.cpu(), reference.quantize_fp8(master.cpu(), block)[0])


@pytest.mark.gpu
def test_captured_in_a_cuda_graph():
    master = torch.randn(256, 384, device="cuda")
    out, out_scale_inv = torch.empty(256, 384, dtype=E4M3, device="cuda"), torch.empty(2, 3, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        quantized.quantize_fp8(master, out=out, out_scale_inv=out_scale_inv)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantized.quantize_fp8(master, out=out, out_scale_inv=out_scale_inv)
    master.mul_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert_bit_equal(out.cpu(), reference.quantize_fp8(master.cpu())[0])


@pytest.mark.gpu
def test_writer_runs_on_the_given_stream():
    master = torch.randn(512, 256, device="cuda")
    q_out, scale_inv_out = torch.zeros(512, 256, dtype=E4M3, device="cuda"), torch.zeros(4, 2, device="cuda")
    writer = quantized.Fp8Writer(q_out, scale_inv_out)
    stream = torch.cuda.Stream()
    # Every kernel launched below, once before the sleep: with CUDA's lazy module
    # loading, a kernel's first launch may wait for the whole device (the sleep
    # included), which made the check below see the writer's output.
    quantized.quantize_fp8(master, found_inf=torch.zeros(1, device="cuda"))
    bool(q_out.view(torch.uint8).any())
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1 << 30)  # about half a second of work queued on `stream` first
    # The flags stay referenced until `stream` is done with them (a temporary
    # would go back to the allocator, for the default stream, mid-read).
    no_skip, skip = torch.zeros(1, device="cuda"), torch.ones(1, device="cuda")
    writer(None, master, stream, no_skip)
    # Still queued behind the sleep on `stream`: the default stream sees the old buffer.
    assert not bool(q_out.view(torch.uint8).any())
    stream.synchronize()
    assert_bit_equal(q_out.cpu(), reference.quantize_fp8(master.cpu())[0])
    before = snapshot([q_out.cpu(), scale_inv_out.cpu()])
    master.mul_(2)
    writer(None, master, stream, skip)
    torch.cuda.synchronize()
    after = [q_out.cpu(), scale_inv_out.cpu()]
    assert_unchanged(after, before)
