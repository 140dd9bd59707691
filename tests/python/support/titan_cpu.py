"""Running torchtitan 0.3.0's llama3 debug model on CPU with gloo, for the
tests (test-side patches only; nothing here is part of muon_ext).

What torchtitan needs on a CPU-only host (issue 23):
* `torch._utils._get_available_device_type` must say "cpu" before torchtitan
  is imported (`tools/utils.py` falls back to "cuda");
* `torch.cpu` lacks the device-name and memory functions the metrics'
  DeviceMemoryMonitor calls: stubs;
* the wheel ships no tokenizer or `c4_test` data: `write_assets` writes a
  small BPE tokenizer and a JSON dataset;
* FlexAttention has no compiled backward on CPU and `sdpa` is refused for
  LMs: the model runs the uncompiled flex_attention (compile off);
* `barrier(device_ids=[...])` with a non-integer device id: dropped;
* gloo has no PREMUL_SUM (FSDP's gradient_divide_factor): FSDP reduces with
  sum and divides after.
Call `patch()` in every process before importing torchtitan.
"""

from __future__ import annotations

import json
import os
import types

import torch

_PATCHED = False


def patch() -> None:
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    torch._utils._get_available_device_type = lambda: "cpu"  # before torchtitan is imported (below too)
    cpu = torch.cpu
    cpu.get_device_name = lambda *a, **k: "cpu"
    cpu.get_device_properties = lambda *a, **k: types.SimpleNamespace(total_memory=64 << 30, name="cpu")
    for name in ("reset_peak_memory_stats", "empty_cache", "reset_accumulated_memory_stats"):
        if not hasattr(cpu, name):
            setattr(cpu, name, lambda *a, **k: None)
    cpu.memory_stats = lambda *a, **k: {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
                                        "num_alloc_retries": 0, "num_ooms": 0}
    cpu.max_memory_allocated = cpu.max_memory_reserved = lambda *a, **k: 0
    if not hasattr(cpu, "set_device"):
        cpu.set_device = lambda *a, **k: None

    import torch.distributed as dist

    barrier = dist.barrier

    def cpu_barrier(*args, device_ids=None, **kwargs):
        if device_ids is not None:
            device_ids = [d for d in device_ids if isinstance(d, int)] or None
        return barrier(*args, device_ids=device_ids, **kwargs)

    dist.barrier = cpu_barrier
    _fsdp_sum_reduction()
    _eager_flex_attention()


def _eager_flex_attention() -> None:
    """The uncompiled flex_attention (its math path has a backward on CPU; only its device check refuses)."""
    import torch.nn.attention.flex_attention as flex
    from torchtitan.models.common.attention import FlexAttention

    flex._validate_device = lambda *args: None
    flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True  # the higher-order op itself, not torch.compile of it
    FlexAttention._compiled_flex_attn = staticmethod(flex.flex_attention)


def _fsdp_sum_reduction() -> None:
    """gloo has no PREMUL_SUM: FSDP2 always reduces with SUM (and its pre/post division factors)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    original = collectives._get_gradient_divide_factors

    def sum_only(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="", factor=None,
                 force_sum_reduction_for_comms=False):
        return original(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor, True)

    collectives._get_gradient_divide_factors = sum_only


def write_assets(folder: str, vocab_size: int = 512) -> dict:
    """A BPE tokenizer (tokenizer.json + tokenizer_config.json) and a JSON
    text dataset under `folder`; returns their paths."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    os.makedirs(folder, exist_ok=True)
    lines = _lines(400, seed=0)
    tokenizer_dir = os.path.join(folder, "tokenizer")
    data_dir = write_data(os.path.join(folder, "data"), lines)
    os.makedirs(tokenizer_dir, exist_ok=True)
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special))
    tokenizer.save(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": special[0], "eos_token": special[1], "add_bos_token": True,
                   "add_eos_token": True}, f)
    return {"tokenizer": tokenizer_dir, "data": data_dir}


def _lines(count: int, seed: int) -> list:
    """`count` lines of text from 20 words, drawn from generator `seed`."""
    words = ["muon", "adam", "matrix", "orthogonal", "gradient", "tensor", "shard", "rank", "step", "loss",
             "the", "a", "of", "and", "to", "is", "every", "row", "column", "owner"]
    gen = torch.Generator().manual_seed(seed)
    lines = []
    for i in range(count):
        n = 30 + int(torch.randint(0, 30, (1,), generator=gen))
        idx = torch.randint(0, len(words), (n,), generator=gen)
        # A repeating structure (word k follows word k-1 mostly) so the loss can fall.
        lines.append(" ".join(words[(int(idx[0]) + j * (1 + i % 3)) % len(words)] if j % 4 else words[int(idx[j])]
                              for j in range(n)))
    return lines


def write_data(data_dir: str, lines=None, *, count: int = 400, seed: int = 0) -> str:
    """A JSON text dataset (torchtitan's "c4_test" format) in `data_dir`: `lines`, or `count` lines drawn
    from generator `seed` (another seed than write_assets' 0: held-out text of the same kind); returns
    `data_dir`."""
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, "train.json"), "w") as f:
        for line in lines if lines is not None else _lines(count, seed):
            f.write(json.dumps({"text": line}) + "\n")
    return data_dir


def llama3_config(assets: dict, out: str, *, optimizer: str, steps: int, dp_shard: int = 1, tp: int = 1,
                  pp: int = 1, layers: int = 2, seq_len: int = 64, batch: int = 2, checkpoint_interval: int = 0,
                  initial_load_path: str = ""):
    """torchtitan's llama3 debug model config (`llama3_debugmodel`), made small
    for a CPU: `layers` transformer layers, `seq_len` tokens, `batch` sequences
    per data-parallel rank, `steps` steps, FSDP `dp_shard` x TP `tp` x PP `pp`
    (1F1B, `layers / pp` layers a stage, micro-batches of 1 sequence), with
    MuonAdamW (optimizer "muon") or torchtitan's AdamW ("adamw"), FP32
    params and reductions (exact comparisons), checkpoints every
    `checkpoint_interval` steps under `out` (0: none)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    model = config.model_spec.model
    model.layers = model.layers[:layers]
    if pp > 1:
        config.parallelism.pipeline_parallel_degree = pp
        config.parallelism.pipeline_parallel_schedule = "1F1B"
        config.parallelism.pipeline_parallel_layers_per_stage = layers // pp
        config.parallelism.pipeline_parallel_first_stage_less_layers = 0  # embeddings / output count as no layer
        config.parallelism.pipeline_parallel_last_stage_less_layers = 0
        config.training.disable_cuda_graphs = True  # torchtitan refuses CUDA graphs with PP (a CPU has none)
    return _small(config, assets, out, optimizer=optimizer, steps=steps, dp_shard=dp_shard, tp=tp, seq_len=seq_len,
                  batch=batch, checkpoint_interval=checkpoint_interval, initial_load_path=initial_load_path)


def qwen3_moe_config(assets: dict, out: str, *, optimizer: str, steps: int, dp_shard: int = 1, ep: int = 1,
                     experts: int = 4, seq_len: int = 64, batch: int = 2, checkpoint_interval: int = 0,
                     initial_load_path: str = ""):
    """torchtitan's qwen3 MoE debug recipe (`qwen3_moe_debug`: routed experts
    `[E, out, in]` through `torch._grouped_mm`, a top-k router, the
    load-balancing expert bias), its model made small for a CPU: 2 layers of
    dim 64, `experts` routed experts (top 2) of hidden size 32, plus a shared
    expert FFN (as deepseek_v3 has); FSDP `dp_shard` x EP `ep`. Otherwise as
    `llama3_config`."""
    import dataclasses

    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.config_utils import make_ffn_config
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    dim, head_dim, vocab = 64, 16, 512
    layers = qwen3._build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=32,
        num_experts=experts, top_k=2, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4 * seq_len, theta=1000000.0))
    for layer in layers:
        layer.moe.shared_experts = make_ffn_config(dim=dim, hidden_dim=32, w1_param_init=qwen3._LINEAR_INIT,
                                                   w2w3_param_init=qwen3._LINEAR_INIT)
    model = qwen3.Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=qwen3._qwen3_norm(dim), layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT))
    config = qwen3_moe_debug()
    config.model_spec = dataclasses.replace(config.model_spec, model=model)
    config.loss.loss_fn.global_vocab_size = vocab
    config.activation_checkpoint = None  # none: nothing to save on a CPU
    config.parallelism.expert_parallel_degree = ep
    config.training.disable_cuda_graphs = True  # a CPU has none; EP's all-to-all dispatcher syncs with the host
    if ep > 1:  # 0.3.0's default "spmd_types" backend refuses its own EP x FSDP meshes in fully_shard (torch 2.14:
        config.parallelism.spmd_backend = "partial_dtensor"  # "Expected param's DTensor mesh to be the same mesh")
    config.checkpoint.export_dtype = "float32"
    return _small(config, assets, out, optimizer=optimizer, steps=steps, dp_shard=dp_shard, tp=1, seq_len=seq_len,
                  batch=batch, checkpoint_interval=checkpoint_interval, initial_load_path=initial_load_path)


def _small(config, assets: dict, out: str, *, optimizer: str, steps: int, dp_shard: int, tp: int, seq_len: int,
           batch: int, checkpoint_interval: int, initial_load_path: str):
    from muon_ext.torchtitan import muon_adamw

    config.hf_assets_path = assets["tokenizer"]
    config.dataloader.dataset_path = assets["data"]
    config.dump_folder = out
    config.training.steps = steps
    config.training.seq_len = seq_len
    config.training.local_batch_size = batch
    config.training.mixed_precision_param = "float32"
    config.parallelism.data_parallel_shard_degree = dp_shard
    config.parallelism.tensor_parallel_degree = tp
    config.compile.enable = False
    config.validator.enable = False
    config.debug.seed = 0
    config.debug.deterministic = False  # True recompiles flex_attention (distributed/utils.py); the CPU is deterministic
    config.comm.init_timeout_seconds = 120
    config.comm.train_timeout_seconds = 120
    config.metrics.log_freq = 1
    config.checkpoint.enable = checkpoint_interval > 0 or bool(initial_load_path)  # loading needs it enabled
    config.checkpoint.interval = checkpoint_interval or 10 ** 6
    config.checkpoint.folder = "checkpoint"
    config.lr_scheduler.warmup_steps = 1
    if initial_load_path:  # the model's initial values from this checkpoint (TP initializes otherwise)
        config.checkpoint.initial_load_path = initial_load_path
        config.checkpoint.initial_load_model_only = True
    if optimizer == "muon":
        # FP32 Polar Express: TP's other summation order then moves params by float rounding only (in BF16 a
        # rounding flip moves a whole update by BF16's 0.4%).
        config.optimizer = muon_adamw(lr=0.02, adamw_lr=8e-4, muon_options={"polar_dtype": "float32"})
    return config


def train(config, seed_checkpoint: bool = False):
    """Builds torchtitan's Trainer from `config`, trains, and returns
    (trainer, {step: global average loss}) (the losses as its metrics log them).
    With `seed_checkpoint`, first saves the initial state as checkpoint step-0
    (checkpointing must be enabled), for other runs' `initial_load_path`."""
    trainer = config.build()
    if seed_checkpoint:
        trainer.checkpointer.save(curr_step=0, last_step=True)
    losses = {}
    log = trainer.metrics_processor.log

    def record(step, global_avg_loss, *args, **kwargs):
        losses[step] = float(global_avg_loss)
        return log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = record
    trainer.train()
    return trainer, losses


def full_params(trainer) -> dict:
    """Every param of the (one) model part as a full plain tensor (a collective for DTensor params)."""
    out = {}
    for name, p in trainer.model_parts[0].named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out
