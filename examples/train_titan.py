"""torchtitan's llama3 debug model (2 layers, seq 64), or its qwen3 MoE debug
recipe made small (`--model qwen3_moe`: 4 routed experts, top 2, a shared
expert, the load-balancing expert bias; `--ep` expert parallel), with MuonAdamW or
torchtitan's AdamW, on a CPU-only machine (gloo), printing the loss of every
25th step and the final losses (mean of the last 10 steps; held-out). It applies the CPU
patches torchtitan 0.3.0 needs and writes a small tokenizer and dataset
(tests/python/support/titan_cpu.py); on GPUs use
examples/torchtitan_muon/config_registry.py with torchtitan's own launcher.

    pip install '.[titan]'
    python examples/train_titan.py --compare                  # both, same batches and seed; plot
    python examples/train_titan.py --optimizer muon --steps 20
    python examples/train_titan.py --optimizer muon --steps 20 --nproc 2 --tp 2   # or --dp-shard 2
    python examples/train_titan.py --model qwen3_moe --steps 20 --nproc 2 --dp-shard 2 --ep 2

MuonAdamW takes torchtitan's AdamW lr and weight decay for both kinds
(muon_ext.torchtitan.muon_adamw(lr=...); docs/guide.md, "One learning rate");
--muon-lr gives Muon its own.
"""

import argparse
import datetime
import json
import os
import pathlib
import sys
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))  # support.titan_cpu
sys.path.insert(0, str(ROOT / "examples"))
import compare  # noqa: E402  the examples' summary and plot


def _worker(rank, args, optimizer, folder, port):
    from support import titan_cpu

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    titan_cpu.patch()  # before torchtitan is imported
    from muon_ext.torchtitan import muon_adamw

    dist.init_process_group("gloo", rank=rank, world_size=args.nproc, timeout=datetime.timedelta(seconds=300))
    assets = titan_cpu.write_assets(os.path.join(folder, "assets")) if rank == 0 else None
    if rank == 0:
        titan_cpu.write_data(os.path.join(folder, "assets", "held_out"), count=100, seed=1)
    dist.barrier()
    assets = assets or {"tokenizer": os.path.join(folder, "assets", "tokenizer"),
                        "data": os.path.join(folder, "assets", "data")}
    out = os.path.join(folder, optimizer)
    if args.model == "qwen3_moe":  # experts: Muon per expert, split over EP (Shard(0)) and FSDP
        config = titan_cpu.qwen3_moe_config(assets, out, optimizer=optimizer, steps=args.steps,
                                            dp_shard=args.dp_shard, ep=args.ep, batch=args.batch)
    else:
        config = titan_cpu.llama3_config(assets, out, optimizer=optimizer, steps=args.steps, dp_shard=args.dp_shard,
                                         tp=args.tp, batch=args.batch)
    config.lr_scheduler.warmup_steps = max(1, args.steps // 20)
    # Held-out loss at the last step: text of the same kind from other random draws (the training set is 400
    # lines, seen several times over, so the training loss also measures memorization).
    config.validator.enable = True
    config.validator.freq = args.steps
    config.validator.steps = args.eval_steps
    config.validator.dataloader.dataset = "c4_test"
    config.validator.dataloader.dataset_path = os.path.join(folder, "assets", "held_out")
    if optimizer == "adamw":
        config.optimizer.param_groups[0].optimizer_kwargs["lr"] = args.lr
    else:  # one lr: torchtitan's AdamW lr and weight decay (0.1) for both kinds; --muon-lr: Muon's own
        config.optimizer = muon_adamw(lr=args.muon_lr if args.muon_lr is not None else args.lr,
                                      adamw_lr=args.lr if args.muon_lr is not None else None)
    trainer = config.build()
    records, log = [], trainer.metrics_processor.log
    start = time.perf_counter()

    def record(step, global_avg_loss, *rest, **kwargs):
        records.append({"step": step, "loss": float(global_avg_loss), "seconds": time.perf_counter() - start})
        return log(step, global_avg_loss, *rest, **kwargs)

    held_out, log_validation = {}, trainer.metrics_processor.log_validation

    def record_validation(loss, step, *rest, **kwargs):
        held_out[step] = float(loss)
        return log_validation(loss, step, *rest, **kwargs)

    trainer.metrics_processor.log = record
    trainer.metrics_processor.log_validation = record_validation
    trainer.train()
    trainer.close()
    if rank == 0:
        pathlib.Path(folder, f"{optimizer}.json").write_text(json.dumps({"records": records, "held_out": held_out}))
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["llama3", "qwen3_moe"], default="llama3")
    parser.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    parser.add_argument("--compare", action="store_true", help="train with both, on the same batches and seed")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8, help="sequences of 64 tokens per step and rank")
    parser.add_argument("--lr", type=float, default=8e-4, help="torchtitan's AdamW lr; MuonAdamW's for both kinds")
    parser.add_argument("--muon-lr", type=float, default=None,
                        help="Muon's own lr (lr_scale 'original'; the two-lr form, 0.02 before one lr)")
    parser.add_argument("--eval-steps", type=int, default=8, help="held-out batches at the last step")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1, help="llama3 only")
    parser.add_argument("--ep", type=int, default=1, help="qwen3_moe only: expert parallel (divides --dp-shard)")
    parser.add_argument("--plot", default="runs/titan/loss.png")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="train_titan_")
    runs, held_out = {}, {}
    names = {"muon": "MuonAdamW", "adamw": "torchtitan AdamW"}
    for optimizer in ("muon", "adamw") if args.compare else (args.optimizer,):
        mp.spawn(_worker, args=(args, optimizer, folder, 29700 + os.getpid() % 200), nprocs=args.nproc)
        saved = json.loads(pathlib.Path(folder, f"{optimizer}.json").read_text())
        records = runs[names[optimizer]] = saved["records"]
        held_out[names[optimizer]] = saved["held_out"][str(args.steps)]
        for r in records:
            if r["step"] % 25 == 0 or r["step"] == 1:
                print(f"{names[optimizer]} step {r['step']:4d}  loss {r['loss']:.4f}", flush=True)
    print(compare.summarize(runs, held_out))
    compare.save(runs, held_out, pathlib.Path(args.plot).with_name("metrics.json"))
    title = "qwen3 MoE debug model (small)" if args.model == "qwen3_moe" else "llama3 debug model (2 layers)"
    if compare.plot(runs, pathlib.Path(args.plot), f"torchtitan {title}, lr {args.lr:g}"):
        print(f"plot: {args.plot}")
    return runs, held_out


if __name__ == "__main__":
    main()
