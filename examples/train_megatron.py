"""Train a Megatron-Core GPT with muon_ext.megatron (MuonAdamW as Megatron's
optimizer), tensor-parallel, on the sorting task of examples/train_gpt.py.

    python examples/train_megatron.py --tp 2            # 2 gloo processes on the CPU (NCCL with 2 GPUs)
    python examples/train_megatron.py --tp 2 --compare  # also Megatron's own Adam on the same batches, same lr
    python examples/train_megatron.py --tp-mode distributed
    python examples/train_megatron.py --tp 1 --pp 2      # pipeline parallel: a stage per process (1F1B)

Needs megatron-core (pip install ".[megatron]"); tqdm and matplotlib are optional
(".[examples]"). On CPUs, megatron-core's hard-coded CUDA calls are mapped to the
CPU by the test helper tests/python/support/megatron_cpu.py. Writes
runs/megatron/metrics.json and runs/megatron/loss.png (loss against step and
time for each run) and prints the mean loss of the last 10 steps.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import compare  # noqa: E402  the examples' summary and plot
from train_gpt import make_generator, sorting_batch  # noqa: E402  the task of train_gpt.py

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


def build(args, world: int):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                             pipeline_model_parallel_size=args.pp)
    model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True,
                               tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                               pipeline_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=-(-(args.num_values + 1) // 8) * 8, max_sequence_length=2 * args.list_len,
                     share_embeddings_and_output_weights=False, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage()).to(torch.bfloat16)
    if torch.cuda.is_available():
        model = model.cuda()
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    return DistributedDataParallel(config=config, ddp_config=ddp, module=model)


def make_optimizer(args, model, kind: str):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from muon_ext.megatron import MATCH_RMS_ADAMW, get_megatron_muon_optimizer

    # One lr (docs/megatron.md, "One learning rate"): Megatron's Adam and MuonAdamW take the same `lr`, Muon's
    # updates scaled to AdamW's update RMS (spectral x 0.2); --muon-lr gives Muon its own.
    lr = args.muon_lr if kind == "muon_ext" and args.muon_lr is not None else args.lr
    config = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr / 10, weight_decay=0.1, bf16=True, clip_grad=1.0,
                             adam_beta2=0.95, muon_tp_mode=args.tp_mode, **MATCH_RMS_ADAMW)
    opt = get_megatron_muon_optimizer(config, [model]) if kind == "muon_ext" else \
        get_megatron_optimizer(config, [model])
    scheduler = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=args.steps // 10,
                                        lr_decay_steps=args.steps, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=args.steps, wd_incr_style="constant")
    return opt, scheduler


def loss_on(model, step: int, args, device) -> torch.Tensor:
    inputs, targets = sorting_batch(args.batch, args.list_len, args.num_values, make_generator(args.seed, step))
    mask = targets >= 0
    labels = torch.where(mask, targets, torch.zeros_like(targets)).to(device)
    positions = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs).to(device)
    losses = model(inputs.to(device), positions, None, labels=labels)
    return (losses.float() * mask.to(device)).sum() / mask.sum()


def pipelined_loss(model, step: int, args, device) -> float:
    """Forward and backward of batch `step` through megatron-core's 1F1B schedule over the pipeline stages (the
    batch in 2 micro-batches); the loss on the last stage, NaN elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    inputs, targets = sorting_batch(args.batch, args.list_len, args.num_values, make_generator(args.seed, step))
    micro = 2
    chunks = zip(inputs.chunk(micro), targets.chunk(micro))

    def forward_step(data, model):
        inputs, targets = next(data)
        mask = (targets >= 0).to(device)
        labels = torch.where(targets >= 0, targets, torch.zeros_like(targets)).to(device)
        positions = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs).to(device)
        output = model(inputs.to(device), positions, None, labels=labels)

        def loss_func(losses):
            loss = (losses.float() * mask).sum() / mask.sum()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(list(chunks)),
                                      model=[model], num_microbatches=micro, seq_length=inputs.shape[1],
                                      micro_batch_size=inputs.shape[0] // micro)
    return sum(float(o["loss"]) for o in out) / micro if out else float("nan")


def run(rank: int, world: int, store: str, args, kind: str):
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=300))
    context = contextlib.nullcontext()
    if backend == "gloo":
        sys.path.insert(0, str(ROOT / "tests" / "python"))
        from support.megatron_cpu import megatron_on_cpu
        context = megatron_on_cpu()
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    records = []
    with context:
        model = build(args, world)
        opt, scheduler = make_optimizer(args, model, kind)
        last = world - 1  # the last pipeline stage (rank order: TP fastest, then PP) reports the loss
        bar = tqdm(total=args.steps, desc=f"{kind} {_layout(args)}", unit="step") if tqdm and rank == last else None
        start = time.perf_counter()
        for step in range(args.steps):
            model.zero_grad_buffer()
            if args.pp > 1:
                loss = pipelined_loss(model, step, args, device)
            else:
                loss = loss_on(model, step, args, device)
                loss.backward()
                loss = loss.item()
            model.finish_grad_sync()
            ok, grad_norm, _ = opt.step()
            scheduler.step(1)
            records.append({"step": step, "loss": loss, "grad_norm": grad_norm,
                            "seconds": time.perf_counter() - start})
            if bar:
                bar.set_postfix(loss=f"{loss:.3f}")
                bar.update()
        if bar:
            bar.close()
    if rank == last:
        Path(args.out, f"{kind}.json").write_text(json.dumps(records))
    torch.distributed.destroy_process_group()


def _layout(args) -> str:
    return f"TP={args.tp}" + (f" PP={args.pp}" if args.pp > 1 else "")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, choices=(1, 2))
    parser.add_argument("--pp", type=int, default=1, choices=(1, 2), help="pipeline stages (divides --layers)")
    parser.add_argument("--tp-mode", default="duplicated", choices=("blockwise", "duplicated", "distributed"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--compare", action="store_true", help="also train with Megatron's own Adam")
    parser.add_argument("--lr", type=float, default=3e-3, help="OptimizerConfig.lr, for Megatron's Adam and "
                        "for both kinds of MuonAdamW (muon_ext.megatron.MATCH_RMS_ADAMW)")
    parser.add_argument("--muon-lr", type=float, default=None,
                        help="MuonAdamW's own lr instead (0.02 before one lr)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--list-len", type=int, default=8)
    parser.add_argument("--num-values", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/megatron")
    parser.add_argument("--plot", default=None, help="default: <out>/loss.png")
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    Path(args.out).mkdir(parents=True, exist_ok=True)
    world = args.tp * args.pp
    runs = {}
    names = {"muon_ext": "MuonAdamW", "megatron_adam": "Megatron Adam"}
    for kind in ["muon_ext"] + (["megatron_adam"] if args.compare else []):
        store = os.path.join(tempfile.mkdtemp(), "store")
        mp.start_processes(run, args=(world, store, args, kind), nprocs=world, start_method="spawn")
        records = json.loads(Path(args.out, f"{kind}.json").read_text())
        runs[f"{names[kind]} {_layout(args)}"] = [{**r, "step": r["step"] + 1} for r in records]
    print(compare.summarize(runs))
    compare.save(runs, {}, Path(args.out, "metrics.json"))
    plot = Path(args.plot or Path(args.out, "loss.png"))
    if compare.plot(runs, plot, f"Megatron-Core GPT, {_layout(args)}, lr {args.lr:g}", "loss (sorted half)"):
        print(f"plot: {plot}")
    return runs


if __name__ == "__main__":
    main()
