"""torchtitan's llama3 debug model (2 layers, seq 64), or its qwen3 MoE debug
recipe made small (`--model qwen3_moe`: 4 routed experts, top 2, a shared
expert, the load-balancing expert bias), with MuonAdamW or torchtitan's AdamW,
on a CPU-only machine (gloo), printing the loss of every step. It applies the CPU patches torchtitan 0.3.0 needs and writes a small
tokenizer and dataset (tests/python/support/titan_cpu.py); on GPUs use
examples/torchtitan_muon/config_registry.py with torchtitan's own launcher.

    pip install '.[titan]'
    python examples/train_titan.py --optimizer muon --steps 20
    python examples/train_titan.py --optimizer adamw --steps 20
    python examples/train_titan.py --optimizer muon --steps 20 --nproc 2 --tp 2   # or --dp-shard 2
    python examples/train_titan.py --model qwen3_moe --steps 20 --nproc 2 --dp-shard 2 --ep 2
"""

import argparse
import datetime
import os
import pathlib
import sys
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))  # support.titan_cpu


def _worker(rank, args, folder, port):
    from support import titan_cpu

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    titan_cpu.patch()
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc, timeout=datetime.timedelta(seconds=300))
    assets = titan_cpu.write_assets(os.path.join(folder, "assets")) if rank == 0 else None
    dist.barrier()
    assets = assets or {"tokenizer": os.path.join(folder, "assets", "tokenizer"),
                        "data": os.path.join(folder, "assets", "data")}
    out = os.path.join(folder, "out")
    if args.model == "qwen3_moe":  # experts: Muon per expert, split over EP (Shard(0)) and FSDP
        config = titan_cpu.qwen3_moe_config(assets, out, optimizer=args.optimizer, steps=args.steps,
                                            dp_shard=args.dp_shard, ep=args.ep)
    else:
        config = titan_cpu.llama3_config(assets, out, optimizer=args.optimizer, steps=args.steps,
                                         dp_shard=args.dp_shard, tp=args.tp)
    trainer, losses = titan_cpu.train(config)
    trainer.close()
    if rank == 0:
        for step in sorted(losses):
            print(f"step {step:3d}  loss {losses[step]:.4f}", flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["llama3", "qwen3_moe"], default="llama3")
    parser.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1, help="llama3 only")
    parser.add_argument("--ep", type=int, default=1, help="qwen3_moe only: expert parallel (divides --dp-shard)")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="train_titan_")
    mp.spawn(_worker, args=(args, folder, 29700 + os.getpid() % 200), nprocs=args.nproc)


if __name__ == "__main__":
    main()
