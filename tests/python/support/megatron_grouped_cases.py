"""Cases of tests/python/test_megatron_grouped_experts.py, run inside spawned gloo jobs under
support.megatron_cpu: a Megatron-Core MoE GPT whose experts are the legacy `GroupedMLP` (all local
experts in one 2-D weight1 [hidden, E * ffn] and weight2 [E * ffn, hidden]; expert e's matrices are
the e-th chunks of their memory, `weight1.view(E, hidden, -1)`, as its forward reads them).

GroupedMLP refuses to be built without the `grouped_gemm` package (a CUDA extension) and megatron-core
0.16.1 cannot run an MoE forward on the CPU, so the availability check is patched out here (nothing
runs forward) and the main grads are synthetic: every global expert's matrices drawn from its index."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from muon_ext import MuonAdamW

from support.dist_helpers import bits
from support.megatron_cases import optimizer_config
from support.megatron_expert_cases import init_layout
from support.megatron_cpu import megatron_on_cpu

NUM_EXPERTS, HIDDEN, FFN = 4, 16, 24
STEPS = 2


def run_all(rank: int, world: int, cases) -> None:
    from megatron.core.transformer.moe import grouped_gemm_util

    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None  # test-side: nothing runs forward
    with megatron_on_cpu():
        for case, case_args in cases:
            case(*case_args)
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()


def grouped_gpt(tp: int, etp: int, ep: int):
    """A one-layer MoE GPTModel with the legacy GroupedMLP experts (no biases: GroupedMLP has none), BF16,
    under Megatron DDP (FP32 main_grad buffers)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
        params_dtype=torch.bfloat16, bf16=True, tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp,
        expert_model_parallel_size=ep, num_moe_experts=NUM_EXPERTS, moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN,
        moe_grouped_gemm=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=True,
                                    moe_use_legacy_grouped_gemm=True)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=8,
                     share_embeddings_and_output_weights=False)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model.bfloat16())


def _whole(which: str, salt: str) -> torch.Tensor:
    """Every global expert's matrix of `which` ("weight1": [E, hidden, ffn], "weight2": [E, ffn, hidden])."""
    shape = (NUM_EXPERTS, HIDDEN, FFN) if which == "weight1" else (NUM_EXPERTS, FFN, HIDDEN)
    g = torch.Generator().manual_seed(zlib.crc32(f"{which}:{salt}".encode()))
    return torch.randn(shape, generator=g)


def _local(which: str, whole: torch.Tensor, ep, etp) -> torch.Tensor:
    """This rank's part of the stack: its experts (EP), and of each its columns (weight1) or rows (weight2)
    under expert TP, in the layout GroupedMLP's view gives its local weight."""
    local_experts = NUM_EXPERTS // ep.size()
    part = whole[ep.rank() * local_experts:(ep.rank() + 1) * local_experts]
    return part.chunk(etp.size(), dim=2 if which == "weight1" else 1)[etp.rank()]


def grouped_experts_per_expert(tp: int, etp: int, ep: int, mode: str, beta2=None) -> None:
    """The GroupedMLP weights step as a stack of experts, each orthogonalized
    on its own: equal bit for bit to a plain MuonAdamW on the whole [E,
    rows, cols] stacks (one process; per local shard in "blockwise" mode),
    with Megatron's update scale of each expert's (out, in) = (ffn, hidden) /
    (hidden, ffn); with NorMuon (`beta2`), statistics per expert. At one process also: megatron-core's own rule (the 2-D
    weight1 as one matrix) gives another update."""
    from megatron.core import parallel_state

    from muon_ext.megatron import get_megatron_muon_optimizer
    from muon_ext.megatron import config as cfg

    config = optimizer_config(muon_tp_mode=mode, clip_grad=0.0)
    model, weights, views = _fresh(tp, etp, ep)
    ep_group = parallel_state.get_expert_model_parallel_group()
    etp_group = parallel_state.get_expert_tensor_parallel_group()
    opt = get_megatron_muon_optimizer(config, [model], beta2=beta2)
    blockwise = mode == "blockwise" and etp > 1
    refs, ref_groups = {}, []
    for which in weights:
        start = 0.05 * _whole(which, "init")
        if blockwise:
            start = _local(which, start, ep_group, etp_group)
        refs[which] = torch.nn.Parameter(start.bfloat16())
        rows, cols = refs[which].shape[1:]
        lr, wd = cfg.lr_and_decay(config.lr, config.weight_decay,
                                  cfg.muon_scale(cols, rows, config.muon_scale_mode, config.muon_extra_scale_factor))
        ref_groups.append(dict(params=[refs[which]], kind="muon", lr=lr, weight_decay=wd, matrix_view="batch",
                               **{k: v for k, v in cfg.muon_settings(config, beta2, None).items()
                                  if k != "matrix_view"}))
    ref = MuonAdamW(ref_groups, grad_attr="main_grad")  # FP32 grads of BF16 params, as Megatron's
    for step in range(STEPS):
        _grads(model, weights, views, step)
        for which in weights:
            g = _whole(which, f"grad{step}")
            refs[which].main_grad = _local(which, g, ep_group, etp_group).contiguous() if blockwise else g
        ok, _, _ = opt.step()
        assert ok
        ref.step()
    for which, p in weights.items():
        want = refs[which].detach() if blockwise else _local(which, refs[which].detach(), ep_group, etp_group)
        assert torch.equal(bits(views[which](p.detach())), bits(want.contiguous())), f"{which} {tp, etp, ep, mode}"
    if dist.get_world_size() == 1:  # megatron-core's rule: weight1 [hidden, E * ffn] is one matrix
        whole = torch.nn.Parameter((0.05 * _whole("weight1", "init")).bfloat16().view(HIDDEN, -1).clone())
        one = MuonAdamW([dict(ref_groups[0], params=[whole], matrix_view="error")], grad_attr="main_grad")
        for step in range(STEPS):
            whole.main_grad = _whole("weight1", f"grad{step}").view(HIDDEN, -1).clone()
            one.step()
        assert not torch.equal(bits(whole.detach().view(NUM_EXPERTS, HIDDEN, FFN)), bits(refs["weight1"].detach()))


def _fresh(tp: int, etp: int, ep: int):
    """(model, {"weight1", "weight2": GroupedMLP params}, {which: its [E, rows, cols] view of a tensor}) at the
    layout, the experts' values set from their global index."""
    from megatron.core import parallel_state

    init_layout(tp, etp, ep)
    ep_group = parallel_state.get_expert_model_parallel_group()
    etp_group = parallel_state.get_expert_tensor_parallel_group()
    model = grouped_gpt(tp, etp, ep)
    experts = model.module.decoder.layers[0].mlp.experts
    assert type(experts).__name__ == "GroupedMLP"
    weights = {"weight1": experts.weight1, "weight2": experts.weight2}
    views = {}
    with torch.no_grad():
        for which, p in weights.items():
            views[which] = lambda t, which=which: t.view(NUM_EXPERTS // ep, *(
                (HIDDEN, -1) if which == "weight1" else (-1, HIDDEN)))
            views[which](p).copy_(_local(which, 0.05 * _whole(which, "init"), ep_group, etp_group))
    return model, weights, views


def _grads(model, weights, views, step: int) -> None:
    """Synthetic main grads: the experts' from their global index, every other param's zero."""
    from megatron.core import parallel_state

    ep_group = parallel_state.get_expert_model_parallel_group()
    etp_group = parallel_state.get_expert_tensor_parallel_group()
    for p in model.module.parameters():
        p.main_grad.zero_()
    for which, p in weights.items():
        views[which](p.main_grad).copy_(_local(which, _whole(which, f"grad{step}"), ep_group, etp_group))


def grouped_checkpoint_across_layouts(path: str) -> None:
    """dist_checkpointing of model + optimizer with GroupedMLP experts: saved
    after one step at expert TP 2 ("duplicated": each expert split by columns
    / rows), resumed at EP 2 (whole experts, 2 per rank), one more step:
    every expert's param bit-equal to the run that never stopped at EP 2."""
    from megatron.core import parallel_state

    from muon_ext.megatron import get_megatron_muon_optimizer

    from support.megatron_cases import _load, _save

    config = optimizer_config(clip_grad=0.0, muon_tp_mode="duplicated", muon_fp32_matmul_prec="highest")
    model, weights, views = _fresh(1, 1, 2)
    opt = get_megatron_muon_optimizer(config, [model])
    for step in range(2):
        _grads(model, weights, views, step)
        assert opt.step()[0]
    want = {which: p.detach().clone() for which, p in weights.items()}
    parallel_state.destroy_model_parallel()
    model, weights, views = _fresh(1, 2, 1)
    opt = get_megatron_muon_optimizer(config, [model])
    _grads(model, weights, views, 0)
    assert opt.step()[0]
    _save(model, opt, path)
    parallel_state.destroy_model_parallel()
    model, weights, views = _fresh(1, 1, 2)
    opt = get_megatron_muon_optimizer(config, [model])
    with torch.no_grad():
        for p in model.module.parameters():
            p.zero_()  # the load must bring the params back
    _load(model, opt, path)
    _grads(model, weights, views, 1)
    assert opt.step()[0]
    for which, p in weights.items():
        assert torch.equal(bits(p.detach()), bits(want[which])), f"resumed {which}"
