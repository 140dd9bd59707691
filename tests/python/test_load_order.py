"""Loading a checkpoint: the optimizer state and the model weights may be
loaded in either order (docs/design.md, "Checkpoints").

Every (saved configuration) x (resumed configuration) x (load order): the
resumed masters are the checkpoint's FP32 masters bit for bit (as far as the
resumed configuration can hold them), and both orders leave the same bits.
Model weights that are not a rounding of the loaded master become the master.
"""

import copy
import io
import pickle

import pytest
import torch

import muon_ext.loaded_masters
from support.helpers import assert_bit_equal, optimizer_tensors
from muon_ext import MuonAdamW, ops
from muon_ext.loaded_masters import is_rounding_of

# name: (param dtype, optimizer kwargs, whether a checkpoint holds FP32 masters)
CONFIGS = {
    "fp32": (torch.float32, dict(), False),
    "bf16_remainder": (torch.bfloat16, dict(), True),
    "bf16_fp32_master": (torch.bfloat16, dict(store_param_remainders=False), True),
    "fp16_fp32_master": (torch.float16, dict(), True),
    "bf16_direct": (torch.bfloat16, dict(master_weights=False), False),
    "fp16_direct": (torch.float16, dict(master_weights=False), False),
}
ORDERS = ["model_first", "optimizer_first"]
WITH_MASTERS = [name for name, (_, _, has) in CONFIGS.items() if has]


def _bits_to_float(bits):
    return torch.as_tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _hard_masters(n=4096, seed=0):
    """FP32 masters covering every way a rounding can go wrong: BF16 ties and
    near-ties (RNE vs the split's round half up, FP32 -> FP16 -> BF16 double
    rounding), FP16 subnormals and underflow, values exact in BF16, signed
    zeros, values past FP16's largest finite, and ordinary trained values."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n // 4, generator=gen) * 0.02]
    hi = torch.randint(0x3A00, 0x3F00, (n // 8,), generator=gen) | (torch.randint(0, 2, (n // 8,), generator=gen) << 15)
    parts.append(_bits_to_float((hi << 16) | 0x8000))  # ties, even and odd high halves, both signs
    hi = torch.randint(0x3A00, 0x3F00, (n // 8,), generator=gen)
    lo = 0x8000 + torch.randint(-0x400, 0x400, (n // 8,), generator=gen)
    parts.append(_bits_to_float((hi << 16) | lo))  # near ties: FP16's rounding lands on the BF16 midpoint
    parts.append(torch.randn(n // 8, generator=gen) * 1e-6)  # FP16 subnormals: far from the master in BF16 ulps
    parts.append(torch.randn(n // 16, generator=gen) * 1e-9)  # below FP16's smallest subnormal
    parts.append(torch.randn(n // 16, generator=gen).bfloat16().float())  # exact in BF16: one neighbour
    parts.append(torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, -70000.0, 3e38, 1e-40]))
    values = torch.cat(parts)
    return torch.cat([values, torch.randn(n - values.numel(), generator=gen) * 0.02]).reshape(64, -1)


class _Net(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(8, 16)
        self.table = torch.nn.Parameter(torch.randn(64, 64) * 0.02)


def _build(config, seed=0):
    dtype, kwargs, _ = CONFIGS[config]
    model = _Net(seed).to(dtype)
    opt = MuonAdamW([{"params": [model.fc.weight], "kind": "muon", "lr": 0.02},
                     {"params": [model.fc.bias, model.table], "kind": "adamw", "lr": 0.01}], **kwargs)
    return model, opt


def _params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def _saved_run(config):
    """Trains 2 steps, then sets `table` to the hard masters; returns the
    checkpoint and each param's FP32 master in the saving run."""
    model, opt = _build(config)
    for k in range(2):
        gen = torch.Generator().manual_seed(100 + k)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    opt.update_param(model.table, _hard_masters())
    masters = [opt.get_full_parameter_master(p) for p in _params(opt)]
    checkpoint = _roundtrip({"model": model.state_dict(), "optimizer": opt.state_dict()})
    return checkpoint, masters


def _load(model, opt, checkpoint, order, weights=None):
    weights = checkpoint["model"] if weights is None else weights
    if order == "model_first":
        model.load_state_dict(weights)
        opt.load_state_dict(checkpoint["optimizer"])
    else:
        opt.load_state_dict(checkpoint["optimizer"])
        model.load_state_dict(weights)


def _expected(saved, resumed, saved_master, saved_weight):
    """(resumed master, resumed param): the saved FP32 master where the
    checkpoint holds one, else the saved weights as model.load_state_dict
    converts them; the param is written from it by the resumed mode's rule."""
    dtype, kwargs, _ = CONFIGS[resumed]
    master = saved_master if CONFIGS[saved][2] else saved_weight.to(dtype).float()
    if resumed == "bf16_remainder":
        param = ops.split_master(master)[0]
    else:
        param = master.to(dtype)
    if dtype == torch.float32 or kwargs.get("master_weights") is False:
        master = param.float()  # the param is the master
    return master, param


@pytest.fixture(scope="module")
def saved_runs():
    return {config: _saved_run(config) for config in CONFIGS}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("resumed", list(CONFIGS))
@pytest.mark.parametrize("saved", list(CONFIGS))
def test_either_load_order_gives_the_checkpoint_masters(saved_runs, saved, resumed, order):
    """Masters and params as the resumed configuration holds the checkpoint's
    masters; moments carried over exactly."""
    checkpoint, masters = saved_runs[saved]
    model, opt = _build(resumed, seed=1)
    _load(model, opt, checkpoint, order)
    by_name = dict(model.named_parameters())
    for name, saved_master in zip(("fc.weight", "fc.bias", "table"), masters):
        p = by_name[name]
        master, param = _expected(saved, resumed, saved_master, checkpoint["model"][name])
        assert_bit_equal(opt.get_full_parameter_master(p), master, f"{name} master")
        assert_bit_equal(p.detach(), param, f"{name} param")
    for key, entry in checkpoint["optimizer"]["state"].items():
        q = _params(opt)[key]
        for name in set(entry) - {"master_param"}:
            assert_bit_equal(opt.state[q][name], entry[name], name)


@pytest.mark.parametrize("resumed", list(CONFIGS))
@pytest.mark.parametrize("saved", list(CONFIGS))
def test_both_orders_leave_the_same_bits(saved_runs, saved, resumed):
    """After loading, the two orders are indistinguishable: every param and
    state tensor, and the steps after."""
    checkpoint, _ = saved_runs[saved]
    runs = []
    for order in ORDERS:
        model, opt = _build(resumed, seed=1)
        _load(model, opt, checkpoint, order)
        opt.state_dict()  # settles pending masters without stepping
        after_load = {k: v.clone() for k, v in optimizer_tensors(opt).items()}
        for k in range(2):
            gen = torch.Generator().manual_seed(200 + k)
            for p in (model.fc.weight, model.fc.bias):
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            opt.step()
        runs.append((after_load, optimizer_tensors(opt)))
    for a, b in zip(*runs):
        assert a.keys() == b.keys()
        for key in a:
            assert_bit_equal(a[key], b[key], key)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("resumed", list(CONFIGS))
@pytest.mark.parametrize("saved", WITH_MASTERS)
def test_weights_that_are_not_a_rounding_of_the_master_become_the_master(saved_runs, saved, resumed, order):
    """Weights other than the saved run's (here in the first 32 rows of
    `table`) are the master there; elsewhere the saved master stays."""
    checkpoint, masters = saved_runs[saved]
    dtype = CONFIGS[resumed][0]
    weights = dict(checkpoint["model"])
    other = weights["table"].clone()
    other[:32] = (1.0 + torch.rand(32, 64, generator=torch.Generator().manual_seed(3))).to(other.dtype)
    weights["table"] = other
    model, opt = _build(resumed, seed=1)
    _load(model, opt, checkpoint, order, weights)
    master, param = _expected(saved, resumed, masters[2], checkpoint["model"]["table"])
    got = opt.get_full_parameter_master(model.table)
    if order == "model_first":  # the optimizer state, loaded last, wins
        assert_bit_equal(got, master, "master")
        return
    assert_bit_equal(got[:32], other[:32].to(dtype).float(), "master follows the other weights")
    assert_bit_equal(model.table.detach()[:32], other[:32].to(dtype), "param keeps the other weights")
    assert_bit_equal(got[32:], master[32:], "saved master elsewhere")
    assert_bit_equal(model.table.detach()[32:], param[32:], "param elsewhere")


def test_tie_masters_move_the_remainder_param_by_one_ulp():
    """From an FP32-master run (BF16 = round to nearest even), a tie master
    loaded into remainder mode before the model weights: the weights' RNE
    value is rewritten to the split's high half (one BF16 ulp up), the only
    BF16 value that with a remainder holds the master exactly."""
    hi = torch.arange(16, dtype=torch.int32) * 2 + 0x3F80  # even high halves: RNE rounds down
    master = ((hi << 16) | 0x8000).view(torch.float32).reshape(4, 4)
    w = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    source = MuonAdamW([{"params": [w], "kind": "adamw"}], store_param_remainders=False)
    source.update_param(w, master)
    weights, sd = w.detach().clone(), _roundtrip(source.state_dict())
    q = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    opt = MuonAdamW([{"params": [q], "kind": "adamw"}])
    opt.load_state_dict(sd)
    with torch.no_grad():
        q.copy_(weights)
    assert_bit_equal(opt.get_full_parameter_master(q), master, "master")
    assert_bit_equal(q.detach().view(torch.int16), (hi + 1).to(torch.int16).reshape(4, 4), "param one ulp up")
    assert torch.equal(weights.view(torch.int16), hi.to(torch.int16).reshape(4, 4))


@pytest.mark.parametrize("resumed", ["bf16_remainder", "bf16_fp32_master", "fp32"])
def test_nan_masters_keep_their_payload_in_either_order(resumed):
    """A NaN master (loaded weights NaN too) stays the checkpoint's NaN, payload included."""
    checkpoint, _ = _saved_run("bf16_fp32_master")
    nan = torch.tensor([0x7FC01234, 0xFFA0ABCD - (1 << 32)], dtype=torch.int32).view(torch.float32)
    entry = checkpoint["optimizer"]["state"][2]  # table
    entry["master_param"].view(-1)[:2] = nan
    checkpoint["model"]["table"].view(-1)[:2] = nan.bfloat16()
    for order in ORDERS:
        model, opt = _build(resumed, seed=1)
        _load(model, opt, checkpoint, order)
        assert_bit_equal(opt.get_full_parameter_master(model.table).view(-1)[:2], nan, order)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_pending_loaded_masters_survive_copies(saved_runs, how):
    """Optimizer state loaded, then the model and optimizer copied, then the
    weights loaded into the copy: the copy ends with the checkpoint's masters."""
    checkpoint, masters = saved_runs["fp16_fp32_master"]
    for resumed in ("bf16_remainder", "bf16_fp32_master", "fp32"):
        model, opt = _build(resumed, seed=1)
        opt.load_state_dict(checkpoint["optimizer"])
        twin_model, twin = copy.deepcopy((model, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((model, opt)))
        twin_model.load_state_dict(checkpoint["model"])
        for p, saved_master in zip(_params(twin), masters):
            assert_bit_equal(twin.get_full_parameter_master(p), saved_master, resumed)


def test_pending_state_from_older_pickles_is_a_reread():
    """(group, index) pairs, as pickled before loaded masters were kept pending, still load."""
    model, opt = _build("bf16_fp32_master")
    state = opt.__getstate__()
    state["_pending_master_reads"] = [(1, 1)]
    twin = MuonAdamW.__new__(MuonAdamW)
    twin.__setstate__(state)
    with torch.no_grad():
        model.table.fill_(0.5)
    assert twin.get_full_parameter_master(model.table).eq(0.5).all()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("resumed", ["bf16_remainder", "bf16_fp32_master", "bf16_direct"])
def test_transformer_engine_int16_masters_in_either_order(resumed, order):
    """int16 remainders (TE style) combine with the model weights whenever
    these are loaded, before or after the optimizer state."""
    model, opt = _build("bf16_remainder")
    opt.update_param(model.table, _hard_masters())
    sd = opt.state_dict()
    for p, entry in zip(_params(opt), sd["state"].values()):
        entry["master_param"] = opt.state[p]["master_param"].clone()
    checkpoint = _roundtrip({"model": model.state_dict(), "optimizer": sd})
    fresh_model, fresh = _build(resumed, seed=1)
    _load(fresh_model, fresh, checkpoint, order)
    for p, q in zip(_params(opt), _params(fresh)):
        master = opt.get_full_parameter_master(p)
        if resumed == "bf16_direct":
            master = master.bfloat16().float()
        assert_bit_equal(fresh.get_full_parameter_master(q), master, resumed)


def test_nothing_is_checked_at_a_step_once_settled(saved_runs, monkeypatch):
    """Settling runs once per loaded master, at its next use; later steps pay nothing."""
    calls = []
    real = muon_ext.loaded_masters.is_rounding_of
    monkeypatch.setattr(muon_ext.loaded_masters, "is_rounding_of", lambda *a: calls.append(1) or real(*a))
    checkpoint, _ = saved_runs["bf16_fp32_master"]
    model, opt = _build("bf16_remainder", seed=1)
    _load(model, opt, checkpoint, "optimizer_first")
    assert calls == []
    for k in range(3):
        for p in (model.fc.weight, model.fc.bias):
            p.grad = torch.ones_like(p)
        opt.step()
        # `table` (tie masters: RNE weights differ from the split's) is tested
        # once, at the first step; params still as loaded skip the test.
        assert len(calls) == 1


def test_a_released_param_stays_pending_and_others_settle(saved_runs):
    """A param whose storage was released (weights handed elsewhere) is not
    read while it is released; it settles once its storage is back."""
    checkpoint, masters = saved_runs["fp16_fp32_master"]
    model, opt = _build("bf16_remainder", seed=1)
    opt.load_state_dict(checkpoint["optimizer"])
    storage = model.table.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    model.fc.weight.data.copy_(checkpoint["model"]["fc.weight"])
    assert_bit_equal(opt.get_full_parameter_master(model.fc.weight), masters[0], "fc.weight")
    storage.resize_(nbytes)
    model.table.data.copy_(checkpoint["model"]["table"])
    assert_bit_equal(opt.get_full_parameter_master(model.table), masters[2], "table")


# -- the rounding test itself -------------------------------------------------


def _neighbours(master, fmt):
    """The two values of `fmt` around each master (one where it is exact)."""
    near = master.to(fmt)
    up = torch.nextafter(near, torch.full_like(near, torch.inf))
    down = torch.nextafter(near, torch.full_like(near, -torch.inf))
    return near, torch.where(near.float() == master, near, torch.where(near.float() < master, up, down))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_rounding_of_a_master_is_recognised(dtype):
    """Weights saved as any rounding of the master (nearest even into BF16,
    FP16 or FP32, the split's round half up, either neighbour), converted to
    `dtype` as model.load_state_dict does (so FP32 -> FP16 -> BF16 and
    FP32 -> BF16 -> FP16 double roundings too): recognised. Far away: not."""
    master = _hard_masters(1 << 14, seed=5).reshape(-1)
    roundings = [master, ops.split_master(master)[0]]
    for fmt in (torch.bfloat16, torch.float16):
        roundings += list(_neighbours(master, fmt))
    for values in roundings:
        assert is_rounding_of(values.to(dtype), master).all()
    # Three BF16 ulps up from the nearest: two beyond either neighbour in any of the formats.
    up = lambda t: torch.nextafter(t, torch.full_like(t, torch.inf))  # noqa: E731
    away = up(up(up(master.bfloat16())))
    normal = ~torch.isinf(away) & (master.abs() > 1e-4) & (master.abs() < 6e4)  # FP16's ulp below BF16's
    assert not is_rounding_of(away.to(dtype)[normal], master[normal]).any()


def test_nan_is_a_rounding_only_of_nan():
    master = torch.tensor([float("nan"), 1.0, float("nan")])
    values = torch.tensor([float("nan"), float("nan"), 0.0])
    assert is_rounding_of(values, master).tolist() == [True, False, False]


def test_settling_is_refused_during_graph_capture(saved_runs, monkeypatch):
    """Captured, settling would replay at every step against stale values: a
    pending master is refused under capture, and nothing is written."""
    checkpoint, masters = saved_runs["bf16_fp32_master"]
    model, opt = _build("bf16_remainder", seed=1)
    opt.load_state_dict(checkpoint["optimizer"])
    snap = {k: v.clone() for k, v in optimizer_tensors(opt).items()}
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(RuntimeError, match="cannot be captured"):
            opt.get_full_parameter_master(model.table)
    for key, value in optimizer_tensors(opt).items():
        assert_bit_equal(value, snap[key], key)
    assert_bit_equal(opt.get_full_parameter_master(model.table), masters[2])
    with monkeypatch.context() as patch:  # settled: nothing left to refuse
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert_bit_equal(opt.get_full_parameter_master(model.table), masters[2])
