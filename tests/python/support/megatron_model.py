"""Test-only: a tiny Megatron-Core GPT under Megatron DDP on a gloo world
(model parallel initialized inside `megatron_on_cpu()`)."""

from __future__ import annotations

import torch

__all__ = ["init_parallel", "tiny_gpt", "batch", "forward_backward", "VOCAB", "SEQ"]

VOCAB = 64
SEQ = 8


def init_parallel(tp: int, seed: int = 1234) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)


def tiny_gpt(*, dtype=torch.bfloat16, hidden=32, heads=4, query_groups=None, layers=2, fp16=False,
             ddp=True, seed: int = 1234, **config_kwargs):
    """A GPTModel (local layer spec, CPU init) in `dtype`, wrapped in Megatron DDP
    (FP32 main_grad buffers) unless ddp=False. Same init at every TP size."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core import parallel_state

    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=query_groups,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=fp16,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        hidden_dropout=0.0, attention_dropout=0.0, perform_initialization=True, **config_kwargs)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False)
    model = model.to(dtype)
    if not ddp:
        return model
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def batch(step: int, batch_size: int = 2):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(batch_size, -1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), position_ids


def forward_backward(model, step: int, loss_scale=None) -> float:
    """One forward/backward on batch `step`; grads land in main_grad (DDP) and are all-reduced."""
    tokens, labels, position_ids = batch(step)
    model.zero_grad_buffer()
    losses = model(tokens, position_ids, None, labels=labels)
    loss = losses.float().mean()
    (loss if loss_scale is None else loss * loss_scale).backward()
    model.finish_grad_sync()
    return float(loss)
