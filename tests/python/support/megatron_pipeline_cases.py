"""Cases of tests/python/test_megatron_pipeline.py: a tiny Megatron-Core GPT
(2 layers, FP32, Megatron DDP) trained with muon_ext's Megatron optimizer
through megatron-core's own schedules (`get_forward_backward_func`): one
process (no pipelining), then 2 gloo processes at pipeline parallel size 2
(1F1B, one layer per stage, activations sent between stages by megatron's
p2p). Params are set by their global names (the same values at every PP
size), so the stages' grads, grad norm, zero count and clipped steps can be
compared with the one-process run."""

from __future__ import annotations

import os
import re
import zlib

import torch
import torch.distributed as dist

from support.megatron_cases import optimizer_config
from support.megatron_cpu import megatron_on_cpu
from support.megatron_model import SEQ, VOCAB, batch

LAYERS, HIDDEN, MICRO, MICRO_BATCH, STEPS = 2, 32, 4, 2, 3


def run_all(rank: int, world: int, cases) -> None:
    with megatron_on_cpu():
        for case, case_args in cases:
            case(*case_args)
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()


def _models(pp: int, vpp: int, layers: int):
    """The model chunks of this rank (`vpp` virtual stages each), under Megatron DDP, and {local name: global
    name} of each chunk."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.destroy_model_parallel()
    virtual = vpp if vpp > 1 else None
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=virtual)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        virtual_pipeline_model_parallel_size=virtual, hidden_dropout=0.0, attention_dropout=0.0,
        # On gloo, megatron's batched p2p (batch_isend_irecv) pairs the interleaved schedule's sends and
        # receives wrongly (the activations of another micro-batch arrive: the forward differs from one
        # process before any optimizer step); one isend / irecv at a time is right.
        batch_p2p_comm=virtual is None)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
    chunks, names = [], []
    for stage in range(vpp):
        vp_stage = stage if virtual else None
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                         max_sequence_length=SEQ, share_embeddings_and_output_weights=False, vp_stage=vp_stage,
                         pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                         post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))
        numbers = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}."
                   for i, layer in enumerate(model.decoder.layers)}
        chunk_names = {}
        with torch.no_grad():  # the same value for a param at every PP size: drawn from its global name
            for name, p in model.named_parameters():
                global_name = re.sub(r"decoder\.layers\.\d+\.", lambda m: numbers[m.group(0)], name)
                g = torch.Generator().manual_seed(zlib.crc32(global_name.encode()))
                p.copy_(0.05 * torch.randn(p.shape, generator=g) + (1.0 if "layernorm" in name and "weight" in name
                                                                      else 0.0))
                chunk_names[name] = global_name
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=model))
        names.append(chunk_names)
    return chunks, names


def _forward_step(data_iterator, model):
    tokens, labels, position_ids = next(data_iterator)
    output = model(tokens, position_ids, None, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _train(pp: int, vpp: int = 1, layers: int = LAYERS, beta2=None, steps=range(STEPS), save: str = "",
           load: str = ""):
    """`steps` (MICRO micro-batches each, clipped) at PP size `pp` with `vpp` virtual stages, after a
    dist_checkpointing `load` and before a `save` (paths; "": none); returns ({global name: param}, norms,
    zeros, losses on the last stage, the optimizer)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from muon_ext.megatron import get_megatron_muon_optimizer

    chunks, names = _models(pp, vpp, layers)
    # FP32 params and Polar-Express: the stages sum in another order than one process (the grad norm over two
    # stages), and in BF16 a rounding flip would move a whole Muon update. The grads' norm is ~1.5: every step clips.
    config = optimizer_config(clip_grad=0.05, log_num_zeros_in_grad=True, bf16=False, muon_fp32_matmul_prec="highest")
    opt = get_megatron_muon_optimizer(config, chunks, beta2=beta2)
    if load:
        _load(chunks, opt, load)
    forward_backward = get_forward_backward_func()
    norms, zeros, losses = [], [], []
    for step in steps:
        batches = [batch(step * MICRO + k, MICRO_BATCH) for k in range(MICRO)]
        data = [iter(batches) for _ in chunks] if vpp > 1 else iter(batches)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        out = forward_backward(forward_step_func=_forward_step, data_iterator=data, model=chunks,
                               num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
        for chunk in chunks:
            chunk.finish_grad_sync()
        ok, norm, zero_count = opt.step()
        assert ok
        norms.append(norm)
        zeros.append(zero_count)
        losses += [float(o["loss"]) for o in out]
    if save:
        _save(chunks, opt, save)
    params = {chunk_names[n]: p.detach().float().clone() for chunk, chunk_names in zip(chunks, names)
              for n, p in chunk.module.named_parameters()}
    return params, norms, zeros, losses, opt


def _sharded(chunks, opt, is_loading: bool = False) -> dict:
    (chunk,) = chunks  # one model chunk (no virtual stages): its local keys are the state dict's
    model = chunk.module.sharded_state_dict()
    return {"model": model, "optimizer": opt.sharded_state_dict(model, is_loading=is_loading)}


def _save(chunks, opt, path: str) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(chunks, opt), path)


def _load(chunks, opt, path: str) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded(chunks, opt, is_loading=True), path)
    chunks[0].module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


def one_process(folder: str) -> None:
    for layers in (LAYERS, 2 * LAYERS):  # the references of PP = 2, and of PP = 2 x 2 virtual stages
        params, norms, zeros, losses, _ = _train(1, layers=layers, save=os.path.join(folder, f"ckpt_{layers}")
                                                 if layers == LAYERS else "")
        torch.save({"params": params, "norms": norms, "zeros": zeros, "losses": losses},
                   os.path.join(folder, f"pp1_{layers}.pt"))
    params, *_ = _train(1, load=os.path.join(folder, f"ckpt_{LAYERS}"), steps=[STEPS])  # never stopping's next
    torch.save(params, os.path.join(folder, f"pp1_{LAYERS}_next.pt"))


def resumed_at_two_stages(folder: str) -> None:
    """The one-process checkpoint (after STEPS steps) resumed at PP = 2 (the
    stages' layers, their moments and masters resharded by dist_checkpointing):
    the next step equals the one-process run's next step."""
    want = torch.load(os.path.join(folder, f"pp1_{LAYERS}_next.pt"))
    params, *_ = _train(2, load=os.path.join(folder, f"ckpt_{LAYERS}"), steps=[STEPS])
    for name, value in params.items():
        err = float((value - want[name]).norm() / want[name].norm())
        assert err < 1e-5, f"resumed at PP = 2: {name}: relative difference {err:.3g} from one process"


def two_stages(folder: str, vpp: int = 1) -> None:
    """PP = 2 (with `vpp` virtual stages: model chunks, the interleaved
    schedule): each stage's params after 3 clipped steps, the grad norm (over
    the PP group: each stage holds part of the model), the zero count and the
    losses equal the one-process run's; a stage holds its own layers only;
    state_dict / load_state_dict round-trip on each stage."""
    from megatron.core import parallel_state

    layers = LAYERS * vpp
    want = torch.load(os.path.join(folder, f"pp1_{layers}.pt"))
    params, norms, zeros, losses, opt = _train(2, vpp, layers)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    assert params and set(params) < set(want["params"]), sorted(params)
    mine = {f"layers.{chunk * 2 + stage}." for chunk in range(vpp)}  # layer of each virtual stage (1 layer each)
    assert all(any(m in n for m in mine) for n in params if ".layers." in n), (stage, sorted(params))
    for name, value in params.items():
        ref = want["params"][name]
        err = float((value - ref).norm() / ref.norm())
        assert err < 1e-4, f"stage {stage} {name}: relative difference {err:.3g} from one process"
    for got, ref in zip(norms, want["norms"]):
        assert abs(got - ref) <= 1e-6 * ref, (vpp, norms, want["norms"])
    # Zero counts: structural zeros (embedding rows of tokens not in the batch) are the same; a sum that cancels
    # to exactly zero in one summation order and not the other may differ by one now and then.
    assert all(abs(a - b) <= 2 for a, b in zip(zeros, want["zeros"])), (vpp, zeros, want["zeros"])
    if parallel_state.is_pipeline_last_stage():
        assert max(abs(a - b) for a, b in zip(losses, want["losses"])) < 1e-5, (losses, want["losses"])
    state = opt.state_dict()
    opt.load_state_dict(state)
    dist.barrier()
