"""Bodies of tests/python/test_reliability_distributed.py, run on every rank
of one spawned gloo world (W = 2): each case must end with every rank having
completed the call or every rank having raised with nothing changed; none
may hang (the collective timeout is 60 s; the cases take about a second)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from support.distributed_cases import dtensor
from muon_ext import MuonAdamW
from muon_ext import state as state_module
from muon_ext.distributed import agreement
from muon_ext.writers import ParamWriterError
from support.optimizer_snapshot import snapshot


def _values(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _expect_everywhere(rank, call, mine: str, elsewhere: str, on_ranks=None):
    """`call()` raises on every rank: matching `mine` where the rank is in `on_ranks` (all when None),
    `elsewhere` on the others."""
    pattern = mine if on_ranks is None or rank in on_ranks else elsewhere
    with pytest.raises(Exception, match=pattern):
        call()


def zero_size_dtensor_params_are_skipped(rank, world, mesh):
    shapes = [(0, 5), (5, 0)]
    for placements in ([Shard(0)], [Replicate()]):
        w = torch.nn.Parameter(dtensor(_values((8, 6), 0), mesh, placements))
        zeros = [torch.nn.Parameter(dtensor(torch.zeros(s), mesh, placements)) for s in shapes]
        opt = MuonAdamW([{"params": [w] + zeros, "kind": "muon"},
                         {"params": [torch.nn.Parameter(dtensor(torch.zeros(0), mesh, placements))],
                          "kind": "adamw"}], adapters=False)
        ref_w = torch.nn.Parameter(_values((8, 6), 0))
        ref = MuonAdamW([{"params": [ref_w], "kind": "muon"}], adapters=False)
        for k in range(2):
            w.grad = dtensor(_values((8, 6), 10 + k), mesh, placements)
            for z in zeros:
                z.grad = dtensor(torch.zeros(z.shape), mesh, placements)
            opt.param_groups[1]["params"][0].grad = dtensor(torch.zeros(0), mesh, placements)
            ref_w.grad = _values((8, 6), 10 + k)
            opt.step()
            ref.step()
        assert torch.equal(w.full_tensor(), ref_w.detach()), placements


def writer_failing_on_one_rank_raises_on_every_rank(rank, world, mesh):
    """The step (and a load) completes on every rank, then every rank raises ParamWriterError naming the
    failing rank and param; the failing writer is retried at the next step. Only ranks whose mesh has a
    writer somewhere pay the report's collective."""
    def build():
        w = torch.nn.Parameter(dtensor(_values((8, 6), 1), mesh, [Shard(0)]))
        plain = torch.nn.Parameter(_values((4, 4), 2).bfloat16())
        return w, plain, MuonAdamW([{"params": [plain, w], "kind": "muon"}], adapters=False)

    w, plain, opt = build()
    rw, rplain, ref = build()
    seen, fail = [], {"step": rank == 0}

    def writer(param, master, stream, found_inf):
        if fail["step"]:
            fail["step"] = False
            raise RuntimeError(f"inference engine on rank {rank} is gone")
        seen.append(master.clone())

    shared = []
    original = state_module.share_failures

    def counting(meshes, failures):
        shared.append(len(meshes))
        return original(meshes, failures)

    state_module.share_failures = counting
    try:
        for o, ww, pp in ((opt, w, plain), (ref, rw, rplain)):
            ww.grad = dtensor(_values((8, 6), 19), mesh, [Shard(0)])
            pp.grad = _values((4, 4), 29).bfloat16()
        opt.step()  # no writer on any rank: no report collective
        ref.step()
        assert shared == []
        if rank == 1:  # a writer on one rank is enough for every rank to share the report
            opt.register_param_writer(plain, writer)
        ref.register_param_writer(rplain, lambda *a: None)
        for k in range(2):
            for o, ww, pp in ((opt, w, plain), (ref, rw, rplain)):
                ww.grad = dtensor(_values((8, 6), 20 + k), mesh, [Shard(0)])
                pp.grad = _values((4, 4), 30 + k).bfloat16()
            fail["step"] = k == 0 and rank == 1
            if k == 0:
                with pytest.raises(ParamWriterError, match=r"step: completed on every rank .* failed on rank\(s\) "
                                   r"\[1\].*rank 1: param group 0 \(muon\), param 0: RuntimeError: inference "
                                   r"engine on rank 1 is gone") as info:
                    opt.step()
                assert info.value.ranks == [1]
                assert [name for name, _ in info.value.failures] == ["rank 1: param group 0 (muon), param 0"]
            else:
                opt.step()  # rank 1's writer is retried and succeeds: no error anywhere
            ref.step()
            assert shared == [1] * 2 * (k + 1)  # opt and ref: one mesh each
            # Every rank stepped everything: the same state as a run whose writer works.
            assert torch.equal(w.to_local(), rw.to_local())
            assert torch.equal(opt.state[w]["momentum_buffer"].to_local(),
                               ref.state[rw]["momentum_buffer"].to_local())
            assert torch.equal(opt.get_full_parameter_master(plain), ref.get_full_parameter_master(rplain))
        if rank == 1:
            assert torch.equal(seen[-1], ref.get_full_parameter_master(rplain))  # rank 1's writer caught up
        # A writer failing on rank 1 inside load_state_dict: the load completes, every rank raises.
        sd = copy.deepcopy(opt.state_dict())
        fail["step"] = rank == 1
        with pytest.raises(ParamWriterError, match=r"load_state_dict: completed on every rank .*rank\(s\) \[1\]"):
            opt.load_state_dict(sd)
        assert torch.equal(opt.get_full_parameter_master(plain), ref.get_full_parameter_master(rplain))
    finally:
        state_module.share_failures = original


def differing_settings_are_refused_at_construction(rank, world, mesh):
    w = torch.nn.Parameter(dtensor(_values((8, 6), 3), mesh, [Shard(0)]))
    beta2 = None if rank == 1 else 0.95  # the gloo SIGABRT ("Received data size doesn't match") of the issue
    _expect_everywhere(rank, lambda: MuonAdamW([{"params": [w], "kind": "muon", "beta2": beta2}], adapters=False),
                       r"param group 0 differs across ranks in setting 'beta2': ranks \[0\] vs \[1\]", "")
    shape = (8, 6) if rank == 0 else (8, 7)  # another model on rank 1
    v = torch.nn.Parameter(dtensor(_values(shape, 3), mesh, [Shard(0)]))
    _expect_everywhere(rank, lambda: MuonAdamW([{"params": [v], "kind": "muon"}], adapters=False),
                       r"differs across ranks in its params \(shapes, dtypes, placements\)", "")
    # A rank on another CPU BF16 GEMM path (no AMX there, or MUON_EXT_CPU_TILE_GEMM=0 on it alone) would sum in
    # another order: its replicas would drift apart. The path is the host's, so rank 1 pretends.
    original = agreement.cpu_polar_gemm
    if rank == 1:
        agreement.cpu_polar_gemm = lambda: ("another host's path", "", False)  # differs on every host
    try:
        _expect_everywhere(rank, lambda: MuonAdamW([{"params": [w], "kind": "muon"}], adapters=False),
                           r"param group 0 differs across ranks in its CPU BF16 GEMM path .*"
                           r"MUON_EXT_CPU_BF16_GEMM=rounded", "")
        # Not where the path does not matter: the FP32 polar_dtype.
        MuonAdamW([{"params": [w], "kind": "muon", "polar_dtype": "float32"}], adapters=False)
    finally:
        agreement.cpu_polar_gemm = original
    lr = -1.0 if rank == 1 else 0.02  # refused by rank 1's own checks: rank 0 must not wait
    _expect_everywhere(rank, lambda: MuonAdamW([{"params": [w], "kind": "muon", "lr": lr}], adapters=False),
                       "lr", r"refused on rank\(s\) \[1\]", on_ranks=[1])


def _stepped_optimizer(mesh):
    w = torch.nn.Parameter(dtensor(_values((8, 6), 4), mesh, [Shard(0)]))
    a = torch.nn.Parameter(dtensor(_values((6,), 5), mesh, [Shard(0)]))
    opt = MuonAdamW([{"params": [w], "kind": "muon"}, {"params": [a], "kind": "adamw"}], adapters=False)
    w.grad = dtensor(_values((8, 6), 6), mesh, [Shard(0)])
    a.grad = dtensor(_values((6,), 7), mesh, [Shard(0)])
    opt.step()
    return opt, w, a


def step_refuses_divergent_settings_and_one_sided_grad_scaler(rank, world, mesh):
    opt, w, a = _stepped_optimizer(mesh)
    w.grad = dtensor(_values((8, 6), 8), mesh, [Shard(0)])
    a.grad = dtensor(_values((6,), 9), mesh, [Shard(0)])
    before = snapshot(opt)
    if rank == 1:  # what scaler.step(opt) does on the rank that has a scaler
        opt.grad_scale, opt.found_inf = torch.ones(()), torch.zeros(())
    _expect_everywhere(rank, opt.step, "a GradScaler drives this step on 1 of 2 ranks", "")
    assert snapshot(opt) == before and not hasattr(opt, "found_inf")
    opt.param_groups[0]["beta2"] = None if rank == 1 else 0.95
    _expect_everywhere(rank, opt.step, "group settings of the DTensor params differ across ranks", "")
    assert snapshot(opt)["params"] == before["params"]  # the groups hold the edit
    opt.param_groups[0]["beta2"] = 0.95
    original = agreement.cpu_polar_gemm
    if rank == 0:  # as MUON_EXT_CPU_TILE_GEMM=0 set on one rank between steps does on an AMX host
        agreement.cpu_polar_gemm = lambda: (original()[0], "changed")
    try:
        _expect_everywhere(rank, opt.step, r"differ across ranks \(edited on some ranks only\? or a CPU BF16 GEMM path", "")
    finally:
        agreement.cpu_polar_gemm = original
    assert snapshot(opt)["params"] == before["params"]
    opt.step()  # in step again


def load_and_add_param_group_refuse_on_every_rank(rank, world, mesh):
    opt, w, a = _stepped_optimizer(mesh)
    sd = copy.deepcopy(opt.state_dict())
    before = snapshot(opt)
    other = copy.deepcopy(sd)
    if rank == 1:
        other["param_groups"][0]["ns_steps"] = 3
    _expect_everywhere(rank, lambda: opt.load_state_dict(other),
                       r"load_state_dict: param group 0 differs across ranks in setting 'ns_steps'", "")
    assert snapshot(opt) == before
    broken = copy.deepcopy(sd)
    if rank == 0:
        del broken["state"]
    _expect_everywhere(rank, lambda: opt.load_state_dict(broken), "expected a dict with 'param_groups'",
                       r"load_state_dict: refused on rank\(s\) \[0\]", on_ranks=[0])
    assert snapshot(opt) == before
    opt.load_state_dict(sd)  # the same dict everywhere: loads
    new = torch.nn.Parameter(dtensor(_values((4, 4), 9), mesh, [Shard(0)]))
    steps = 3 if rank == 0 else 5
    _expect_everywhere(rank, lambda: opt.add_param_group({"params": [new], "kind": "muon", "ns_steps": steps}),
                       r"add_param_group \(param group 2\): param group 2 differs across ranks in setting "
                       r"'ns_steps'", "")
    assert len(opt.param_groups) == 2
    opt.add_param_group({"params": [new], "kind": "muon"})
    assert len(opt.param_groups) == 3


def row_block_scales_out_of_range_are_refused_on_every_rank(rank, world, mesh):
    """Rank 0's shard holds only block 0, whose scale is fine; the block-1 scale overflows the lr: both ranks
    refuse before writing (the planner checks every block's lr and weight decay, not the kernel)."""
    ps = [torch.nn.Parameter(dtensor(_values((8, 6), k), mesh, [Shard(0)])) for k in range(2)]
    opt = MuonAdamW([dict(params=ps, kind="muon", row_blocks=(4, 4), row_block_scales=(1.0, 1e300))],
                    adapters=False)
    for k, p in enumerate(ps):
        p.grad = dtensor(_values((8, 6), 10 + k), mesh, [Shard(0)])
    before = snapshot(opt)
    _expect_everywhere(rank, opt.step, r"row_block_scales\[1\]=1e\+300 gives row block 1 a lr of 1e\+297", "")
    assert snapshot(opt) == before
    opt.param_groups[0]["row_block_scales"] = (1.0, 2.0)
    opt.step()


def lr_edited_on_one_rank_is_refused_on_every_rank(rank, world, mesh):
    """A scheduler stepped on one rank only (a float lr, or a CPU tensor lr written in place): the step's
    settings digest holds the lr, so every rank refuses before writing; Replicate() copies stay identical."""
    p = torch.nn.Parameter(dtensor(_values((8, 6), 20), mesh, [Replicate()]))
    for lr in (0.02, torch.tensor(0.02)):
        opt = MuonAdamW([dict(params=[p], kind="muon", lr=lr)], adapters=False)
        p.grad = dtensor(_values((8, 6), 21), mesh, [Replicate()])
        opt.step()
        before = snapshot(opt)
        if rank == 1:
            if isinstance(lr, torch.Tensor):
                lr.fill_(0.05)
            else:
                opt.param_groups[0]["lr"] = 0.05
        _expect_everywhere(rank, opt.step, "group settings of the DTensor params differ across ranks", "")
        if rank == 0:
            assert snapshot(opt) == before
        assert snapshot(opt)["params"] == before["params"]  # the edited rank's group holds its edit
        opt.param_groups[0]["lr"] = lr.fill_(0.05) if isinstance(lr, torch.Tensor) else 0.05
        opt.step()
        parts = [torch.empty(8, 6) for _ in range(world)]
        dist.all_gather(parts, p.to_local().contiguous())
        assert torch.equal(parts[0], parts[1])


def update_local_masters_agrees_over_its_process_group(rank, world, mesh):
    """update_local_masters writes each rank's own shard without a collective over the param's mesh; with a
    process group, a refusal on one rank (NaN values there) raises on every rank before any rank writes."""
    w = torch.nn.Parameter(dtensor(_values((8, 6), 30), mesh, [Shard(0)]))
    plain = torch.nn.Parameter(_values((4,), 31))
    opt = MuonAdamW([{"params": [w], "kind": "muon"}, {"params": [plain], "kind": "adamw"}], adapters=False)
    before = snapshot(opt)
    mine = opt.get_local_master(w) * 0.5
    bad = mine.clone()
    if rank == 1:
        bad[0, 0] = float("nan")
    _expect_everywhere(rank, lambda: opt.update_local_masters([plain, w], [plain.detach() * 2, bad],
                                                              process_group=dist.group.WORLD),
                       "NaN or inf", r"update_local_masters: refused on another rank", on_ranks=[1])
    assert snapshot(opt) == before
    opt.update_local_masters([plain, w], [plain.detach() * 2, mine], process_group=dist.group.WORLD)
    assert torch.equal(opt.get_local_master(w), mine) and torch.equal(w.to_local(), mine)
    assert torch.equal(opt.gather_full_parameter_master(w), _values((8, 6), 30) * 0.5)


CASES = [update_local_masters_agrees_over_its_process_group, row_block_scales_out_of_range_are_refused_on_every_rank, lr_edited_on_one_rank_is_refused_on_every_rank,
         zero_size_dtensor_params_are_skipped, writer_failing_on_one_rank_raises_on_every_rank,
         differing_settings_are_refused_at_construction, step_refuses_divergent_settings_and_one_sided_grad_scaler,
         load_and_add_param_group_refuse_on_every_rank]


def run_all(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    for case in CASES:
        try:
            case(rank, world, mesh)
        except BaseException as exc:
            raise AssertionError(f"rank {rank}: {case.__name__}: {exc}") from exc
        dist.barrier()  # every rank finished the case: none is left waiting in a collective
