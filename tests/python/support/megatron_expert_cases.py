"""Cases of tests/python/test_megatron.py's expert test, run inside one spawned
4-process gloo job under support.megatron_cpu: a real Megatron-Core MoE GPT
(SequentialMLP experts, registered by Megatron itself: names under
`mlp.experts.local_experts.<i>`, `tensor_model_parallel=True`, `partition_dim`,
`allreduce=False` under expert parallelism) on layouts where the expert TP
group differs from the dense TP group. megatron-core 0.16.1 cannot run an MoE
forward on the CPU (the router needs TransformerEngine), so main grads are
synthetic: every param's whole tensor (each global expert's) is drawn from its
global name, and each rank copies its part into the DDP buffers."""

from __future__ import annotations

import math
import re
import zlib

import torch
import torch.distributed as dist

from muon_ext import MuonAdamW

from support.megatron_cases import DISTRIBUTED_ATOL, optimizer_config
from support.megatron_cpu import megatron_on_cpu

NUM_EXPERTS = 4
CLIP_GRAD = 1.0  # well below the synthetic grads' norm (~50): every step clips
STEPS = 2
# (dense TP, expert TP, expert parallel) on 4 ranks: the expert TP group larger, then smaller, than the dense one.
LAYOUTS = ((1, 2, 2), (2, 1, 2))
# (tp_mode, beta2): each mode with plain Muon, and NorMuon (statistics of each whole matrix) where it is whole.
MODES = (("duplicated", None), ("distributed", None), ("blockwise", None), ("duplicated", 0.95),
         ("distributed", 0.95))


def run_all(rank: int, world: int, cases) -> None:
    with megatron_on_cpu():
        for case, case_args in cases:
            case(*case_args)
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()


def init_layout(tp: int, etp: int, ep: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp,
                                             expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1234)


def moe_gpt(tp: int, etp: int, ep: int, bias: bool = None, dtype=torch.bfloat16):
    """A one-layer MoE GPTModel (local spec: SequentialMLP experts; linear biases by default where Megatron
    allows them in MoE, at expert TP 1) in `dtype` under Megatron DDP (dense and expert-parallel FP32 main_grad
    buffers). Without sequence parallelism, which Megatron wants for TP x EP training and the local spec's
    LayerNorm refuses: nothing runs forward."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp, expert_model_parallel_size=ep,
        num_moe_experts=NUM_EXPERTS, moe_ffn_hidden_size=24, ffn_hidden_size=24,
        add_bias_linear=etp == 1 if bias is None else bias, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=NUM_EXPERTS),
                     vocab_size=64, max_sequence_length=8, share_embeddings_and_output_weights=False)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model.to(dtype))


class Layout:
    """Where each model param's part lies in the whole model, from Megatron's own marks (not muon_ext's rule):
    expert params are the expert-parallel ones (`allreduce=False`), split over the expert TP group; the others
    over the dense TP group; local expert i on expert-parallel rank r is global expert r * local + i."""

    def __init__(self, model):
        from megatron.core import parallel_state

        self.tp = parallel_state.get_tensor_model_parallel_group()
        self.etp = parallel_state.get_expert_tensor_parallel_group()
        self.ep = parallel_state.get_expert_model_parallel_group()
        self.local_experts = NUM_EXPERTS // self.ep.size()
        self.model = model
        self.params = dict(model.named_parameters())
        self.experts = {n for n, p in self.params.items() if getattr(p, "allreduce", True) is False}
        assert self.experts and all(".mlp.experts." in n for n in self.experts), sorted(self.experts)

    def group(self, name: str):
        """The process group `name` is split over (None: not split)."""
        p = self.params[name]
        if not getattr(p, "tensor_model_parallel", False):
            return None
        group = self.etp if name in self.experts else self.tp
        return group if group.size() > 1 else None

    def global_name(self, name: str, expert: int = None) -> str:
        if name not in self.experts:
            return name
        local = int(re.search(r"local_experts\.(\d+)\.", name).group(1))
        index = self.ep.rank() * self.local_experts + local if expert is None else expert
        return re.sub(r"local_experts\.\d+\.", f"local_experts.{index}.", name)

    def full_shape(self, name: str):
        p, group = self.params[name], self.group(name)
        shape = list(p.shape)
        if group is not None:
            shape[p.partition_dim] *= group.size()
        return tuple(shape)

    def whole(self, name: str, salt: str, expert: int = None) -> torch.Tensor:
        """The whole FP32 tensor of `name` (of global expert `expert`), the same on every rank; grads ("grad*"
        salts) have zeros where the draw exceeds 1.5 (about 7%), for the zero counts."""
        key = self.global_name(name, expert)
        g = torch.Generator().manual_seed(zlib.crc32(f"{key}:{salt}".encode()))
        t = torch.randn(self.full_shape(name), generator=g)
        if salt.startswith("grad"):
            t[t > 1.5] = 0.0
        return t

    def part(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of `whole` for the model param `name`."""
        group = self.group(name)
        if group is None:
            return whole
        return whole.chunk(group.size(), dim=self.params[name].partition_dim)[group.rank()]

    def hand_stats(self, salt: str):
        """(L2 norm, zero count) of every distinct whole grad of the model: each dense param once, every global
        expert."""
        total, zeros = 0.0, 0
        for name in self.params:
            experts = range(NUM_EXPERTS) if name in self.experts and name == self._first_local(name) else \
                [None] if name not in self.experts else []
            for expert in experts:
                t = self.whole(name, salt, expert)
                total += t.double().pow(2).sum().item()
                zeros += t.numel() - int(torch.count_nonzero(t))
        return math.sqrt(total), zeros

    def _first_local(self, name: str) -> str:
        return re.sub(r"local_experts\.\d+\.", "local_experts.0.", name)


def set_params(layout: Layout) -> None:
    with torch.no_grad():
        for name, p in layout.params.items():
            p.copy_(layout.part(name, layout.whole(name, "init") * 0.05))


def set_grads(layout: Layout, step: int) -> None:
    for name, p in layout.params.items():
        p.main_grad.copy_(layout.part(name, layout.whole(name, f"grad{step}")))


def experts_use_the_expert_tp_group() -> None:
    """For each layout and tp_mode, on a real MoE GPT with synthetic whole grads:
    the split Muon params are exactly the expert weights where the expert TP
    group is larger than one, and exactly the dense TP weights where the dense
    one is, each viewed over its own group; the reported grad norm equals the
    norm of the whole grads and Megatron's own (ChainedOptimizer: dense over
    the model-parallel group, experts over the expert tensor x expert x
    pipeline group) where megatron-core 0.16.1 counts every expert grad, and
    with its expert TP duplicates judged by the expert TP group where it does
    not (expert biases at dense TP 2, expert TP 1: it reports less), and so
    do the zero counts (log_num_zeros_in_grad); masters after 2 clipped
    steps equal a plain single-process MuonAdamW stepping each whole matrix
    (every global expert's) on the clipped whole grads: bit for bit in
    "duplicated" (and for every unsplit param in every mode), within
    DISTRIBUTED_ATOL in "distributed", with plain Muon and with NorMuon (each
    whole matrix's statistics); "blockwise" equals the plain MuonAdamW
    stepping each local shard alone."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import get_megatron_optimizer

    from muon_ext.megatron import get_megatron_muon_optimizer

    for tp, etp, ep in LAYOUTS:
        for mode, beta2 in MODES:
            where = f"TP={tp} ETP={etp} EP={ep} {mode}" + (" NorMuon" if beta2 else "")
            init_layout(tp, etp, ep)
            model = moe_gpt(tp, etp, ep)
            layout = Layout(model)
            set_params(layout)
            config = dict(clip_grad=CLIP_GRAD, muon_tp_mode=mode, muon_fp32_matmul_prec="highest",
                          log_num_zeros_in_grad=True)
            opt = get_megatron_muon_optimizer(optimizer_config(**config), [model], beta2=beta2)
            megatron_opt = get_megatron_optimizer(optimizer_config(**config), [model])
            _check_views(opt, layout, mode, where)
            reference, reference_of = _plain_reference(opt, layout, mode)
            for step in range(STEPS):
                set_grads(layout, step)
                assert not megatron_opt.prepare_grads()  # copies main_grad to its FP32 main params' grads
                megatron_norm, megatron_fixed, megatron_zeros = _megatron_stats(megatron_opt, layout)
                ok, norm, zeros = opt.step()
                assert ok, where
                hand, hand_zeros = layout.hand_stats(f"grad{step}")
                assert zeros == megatron_zeros == hand_zeros > 0, (where, step, zeros, megatron_zeros, hand_zeros)
                assert abs(norm - hand) <= 1e-6 * hand, (where, step, norm, hand)
                assert abs(norm - megatron_fixed) <= 1e-6 * hand, (where, step, norm, megatron_fixed)
                if _megatron_drops_expert_replicas(layout):
                    assert megatron_norm < hand * (1 - 1e-4), (where, step, megatron_norm, hand)
                else:
                    assert abs(norm - megatron_norm) <= 1e-6 * hand, (where, step, norm, megatron_norm)
                assert norm > 10 * CLIP_GRAD, (where, norm)
                coeff = CLIP_GRAD / (norm + 1.0e-6)  # Megatron's clip_grad_by_total_norm_fp32
                grads = []
                for name, ref in reference_of.items():
                    whole = layout.whole(name, f"grad{step}")
                    ref.main_grad = whole if _is_whole(layout, name, mode) else layout.part(name, whole).clone()
                    grads.append(ref.main_grad)
                torch._foreach_mul_(grads, coeff)
                reference.step()
                _compare(opt, layout, reference, reference_of, mode, f"{where} step {step}")
            parallel_state.destroy_model_parallel()


def _megatron_stats(megatron_opt, layout: Layout):
    """Megatron's ChainedOptimizer grad norm, as it is and with its expert optimizer's TP duplicates judged by
    the expert TP group, and its zero count judged so: megatron-core 0.16.1 gives every optimizer `pg_collection.tp` ("TODO(M4)" in
    optimizer/__init__.py), so an expert param outside TP (an expert's linear_fc2 bias at expert TP 1) counts
    only on dense TP rank 0, though every expert-parallel rank holds other experts'."""
    dense, experts = megatron_opt.chained_optimizers
    as_is = megatron_opt.get_grad_norm()
    tp_group = experts.tp_group
    experts.tp_group = layout.etp
    try:
        return as_is, megatron_opt.get_grad_norm(), megatron_opt.count_zeros()
    finally:
        experts.tp_group = tp_group


def _megatron_drops_expert_replicas(layout: Layout) -> bool:
    """Whether megatron-core's own norm leaves out expert grads here (see _megatron_stats)."""
    return layout.tp.size() > 1 and any(not getattr(layout.params[n], "tensor_model_parallel", False)
                                        for n in layout.experts)


def _check_views(opt, layout: Layout, mode: str, where: str) -> None:
    """Which params muon_ext orthogonalizes over a TP group, and over which ranks."""
    views = {n for n, p in layout.params.items() if id(p) in opt._views}
    want = {n for n in layout.params if _is_whole(layout, n, mode)}
    assert views == want, (where, sorted(views), sorted(want))
    split = {n for n in layout.params if _is_whole(layout, n, "duplicated")}
    assert any(n in layout.experts for n in split) == (layout.etp.size() > 1), (where, sorted(split))
    for n in views:
        ranks = dist.get_process_group_ranks(opt._views[id(layout.params[n])].mesh.get_group())
        assert ranks == dist.get_process_group_ranks(layout.group(n)), (where, n, ranks)


def _is_whole(layout: Layout, name: str, mode: str) -> bool:
    """Whether `name` is a Muon matrix orthogonalized whole (split over its TP group, mode not "blockwise")."""
    p = layout.params[name]
    return mode != "blockwise" and layout.group(name) is not None and p.dim() == 2 and \
        not getattr(p, "is_embedding_or_output_parameter", False)


def _plain_reference(opt, layout: Layout, mode: str):
    """A plain MuonAdamW, one group per model param with the adapter's settings, holding the whole BF16 matrix
    of each Muon param split over its TP group (mode not "blockwise"), else this rank's part; a Muon group's lr
    and weight decay are Megatron's times and over the spectral scale sqrt(max(rows, cols)) of that matrix."""
    by_inner = {id(opt.view_of(p)): n for n, p in layout.params.items()}
    reference_of, groups = {}, []
    for group in opt.optimizer.param_groups:
        outer = opt.param_groups[group["megatron_group"]]
        settings = {k: v for k, v in group.items() if k not in ("params", "param_names", "split_matrices")}
        for inner in group["params"]:
            name = by_inner[id(inner)]
            whole = (layout.whole(name, "init") * 0.05).to(torch.bfloat16)
            value = whole if _is_whole(layout, name, mode) else layout.part(name, whole).clone()
            reference_of[name] = torch.nn.Parameter(value)
            factor = max(value.shape) ** 0.5 if group["kind"] == "muon" else 1.0
            groups.append(dict(settings, params=[reference_of[name]], param_names=[name], update_factor=factor,
                               lr=outer["lr"] * factor, weight_decay=outer["weight_decay"] / factor))
    return MuonAdamW(groups, grad_attr="main_grad", store_param_remainders=True), reference_of


def _compare(opt, layout: Layout, reference, reference_of, mode: str, where: str) -> None:
    """The adapter's masters and BF16 params against the reference's, as whole matrices where the reference
    holds one (gathered over the param's true group), else as this rank's part."""
    worst = 0.0
    for name, p in layout.params.items():  # the same order on every rank: gathers are collective
        whole = _is_whole(layout, name, mode)
        got = _master(opt, p, layout.group(name) if whole else None)
        want = reference.get_full_parameter_master(reference_of[name])
        assert got.shape == want.shape, f"{where}: {name}: master shape {tuple(got.shape)}, want {tuple(want.shape)}"
        if whole and mode == "distributed":
            err = (got - want).abs().max().item()
            worst = max(worst, err)
            assert err <= DISTRIBUTED_ATOL, f"{where}: {name}: max |difference| {err} > {DISTRIBUTED_ATOL}"
        else:
            assert torch.equal(got, want), f"{where}: {name}: max |difference| {(got - want).abs().max().item()}"
            bf16 = torch.cat(_all_parts(p.detach(), layout.group(name)), dim=p.partition_dim) if whole else p.detach()
            assert torch.equal(bf16, reference_of[name].detach()), f"{where}: {name}: BF16 params differ"
    if worst and dist.get_rank() == 0:
        print(f"MEGATRON experts {where}: max |master difference| to whole matrices {worst:.3g}", flush=True)


def _all_parts(t: torch.Tensor, group):
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def fp16_inf_in_one_expert_skips_every_rank() -> None:
    """fp16 with Megatron's dynamic loss scaler at dense TP=1 / expert TP=2 / EP=2 ("duplicated"): an inf in
    rank 0's part of one expert matrix makes every rank skip the step (prepare_grads: the inf found over the
    expert tensor x expert x pipeline group, as Megatron's expert optimizer does; the model-parallel group is
    rank 0 alone), halve the scale and write nothing; the next, finite step succeeds on every rank."""
    from muon_ext.megatron import get_megatron_muon_optimizer

    tp, etp, ep = LAYOUTS[0]
    init_layout(tp, etp, ep)
    layout = Layout(moe_gpt(tp, etp, ep, dtype=torch.float16))
    set_params(layout)
    config = optimizer_config(fp16=True, bf16=False, initial_loss_scale=2.0 ** 10, hysteresis=1,
                              muon_tp_mode="duplicated")
    opt = get_megatron_muon_optimizer(config, [layout.model])
    before = {n: _master(opt, p) for n, p in layout.params.items()}
    set_grads(layout, 0)
    if dist.get_rank() == 0:
        layout.params[sorted(layout.experts)[0]].main_grad[0, 0] = float("inf")
    # prepare_grads is what step() asks first (and returns (False, None, None) on): every rank must answer the
    # same, checked before anything collective follows (ranks that disagree would leave the step's gathers
    # unmatched: a hang until the join deadline instead of a failure).
    skipped = [None] * dist.get_world_size()
    dist.all_gather_object(skipped, opt.prepare_grads())
    assert skipped == [True] * dist.get_world_size(), skipped
    assert opt.get_loss_scale().item() == 2.0 ** 9
    for n, p in layout.params.items():
        assert torch.equal(_master(opt, p), before[n]), f"skipped step wrote {n}"
    set_grads(layout, 1)
    ok, norm, _ = opt.step()
    assert ok and norm > 0, (ok, norm)


def expert_checkpoint_across_layouts(path: str) -> None:
    """dist_checkpointing of model + optimizer ("duplicated", NorMuon: statistics of each whole matrix): saved after one step at dense TP=1 /
    expert TP=2 / EP=2, resumed at dense TP=2 / expert TP=1 / EP=2 (dense and expert matrices resharded), one
    more step: every master and param bit-equal to the run that never stopped (all at the second layout)."""
    from megatron.core import parallel_state

    from muon_ext.megatron import get_megatron_muon_optimizer

    from support.megatron_cases import _load, _save

    config = optimizer_config(clip_grad=0.0, muon_tp_mode="duplicated", muon_fp32_matmul_prec="highest")
    (tp1, etp1, ep1), (tp2, etp2, ep2) = LAYOUTS

    def fresh(tp, etp, ep):
        init_layout(tp, etp, ep)
        model = moe_gpt(tp, etp, ep, bias=False)  # the same architecture at both layouts
        layout = Layout(model)
        set_params(layout)
        return model, layout, get_megatron_muon_optimizer(config, [model], beta2=0.95)

    def step(layout, opt, index):
        set_grads(layout, index)
        assert opt.step()[0]

    model, layout, opt = fresh(tp2, etp2, ep2)
    for index in range(2):
        step(layout, opt, index)
    want = {n: _master(opt, p) for n, p in layout.params.items()}
    want_params = {n: p.detach().clone() for n, p in layout.params.items()}
    parallel_state.destroy_model_parallel()
    model, layout, opt = fresh(tp1, etp1, ep1)
    step(layout, opt, 0)
    where = f"{path}/experts_layout_change"
    _save(model, opt, where)
    parallel_state.destroy_model_parallel()
    model, layout, opt = fresh(tp2, etp2, ep2)
    with torch.no_grad():
        for p in layout.params.values():
            p.zero_()  # the load must bring the params back
    _load(model, opt, where)
    step(layout, opt, 1)
    for n, p in layout.params.items():
        got = _master(opt, p)
        assert torch.equal(got, want[n]), f"resumed: {n}: max |difference| {(got - want[n]).abs().max().item()}"
        assert torch.equal(p.detach(), want_params[n]), f"resumed: {n}: BF16 params differ"


def _master(opt, p, group=None) -> torch.Tensor:
    """The FP32 master the adapter holds for `p`: gathered over `group` into the whole matrix, else this rank's
    part (a TP view's gathered master cut back to its part over the view's own group). Collective."""
    view = opt._views.get(id(p))
    if view is None:
        master = opt.optimizer.get_full_parameter_master(p)
        return master if group is None else torch.cat(_all_parts(master, group), dim=p.partition_dim)
    master = opt.optimizer.gather_full_parameter_master(view.tensor)
    if group is None:
        own = view.mesh.get_group()
        master = master.chunk(own.size(), dim=p.partition_dim)[dist.get_rank(own)]
    return master
