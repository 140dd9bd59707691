"""Train a small GPT with muon_ext.MuonAdamW, Megatron-style, and compare it with torch's optimizers.

The task is generated here, so nothing is downloaded: each sequence is a list
of random numbers, a separator, and the same list sorted. The loss is taken on
the sorted half only; emitting the k-th smallest number needs attention over
the whole list.

    python examples/train_gpt.py                    # MuonAdamW, 300 steps: under a minute on 2 CPU cores
    python examples/train_gpt.py --compare          # MuonAdamW, torch AdamW, torch Muon on identical data
    python examples/train_gpt.py --muon-lr 0.01     # Muon's own lr (the two-lr form) instead of one lr
    python examples/train_gpt.py --precision bf16   # BF16 params + FP32 main_grad (Megatron)
    python examples/train_gpt.py --resume           # continue from runs/<name>/<run>.pt

Each run appends to runs/<name>/metrics.jsonl and redraws runs/<name>/loss.png
with every run recorded under that name (an optimizer, precision and --compile
setting is one run; rerunning it replaces its records).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

import muon_ext

try:
    from tqdm import tqdm
except ImportError:  # progress bars are optional: pip install tqdm (the "examples" extra)
    tqdm = None

OPTIMIZERS = ("muon_ext", "adamw", "torch_muon")
IGNORE = -100  # cross_entropy's ignore_index: positions without a target


# ----------------------------------------------------------------------------
# The task: sort a list of numbers
# ----------------------------------------------------------------------------

def make_generator(*key: int) -> torch.Generator:
    """A CPU generator seeded from integers, so every batch is reproducible on its own
    (resuming needs no data-loader state, and every optimizer sees the same batches)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def sorting_batch(batch_size: int, list_len: int, num_values: int, generator: torch.Generator):
    """Inputs and targets for `x_1 .. x_n SEP sorted(x)`; only the sorted half has targets."""
    values = torch.randint(num_values, (batch_size, list_len), generator=generator)
    separator = torch.full((batch_size, 1), num_values)
    sequence = torch.cat([values, separator, values.sort(dim=1).values], dim=1)
    inputs, targets = sequence[:, :-1], sequence[:, 1:].clone()
    targets[:, :list_len] = IGNORE  # the unsorted list is random: nothing to learn there
    return inputs, targets


# ----------------------------------------------------------------------------
# The model: a pre-norm GPT
# ----------------------------------------------------------------------------

@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128


class Block(nn.Module):
    """Causal self-attention, then an MLP, each added to the residual stream from an RMS-normed input."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.attn_norm = nn.RMSNorm(d)
        # Separate q, k, v matrices: Muon orthogonalizes each update matrix as a whole.
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.attn_out = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d)
        self.mlp_in = nn.Linear(d, 4 * d, bias=False)
        self.mlp_out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(batch, seq_len, self.n_head, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(batch, seq_len, d))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))


class GPT(nn.Module):
    """Token and position embeddings, blocks, a final norm and an untied output head (logits)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.final_norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (in FP32) over the positions that have a target."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


# ----------------------------------------------------------------------------
# Megatron mechanics: FP32 main grads, clipping
# ----------------------------------------------------------------------------

def attach_main_grads(model: nn.Module) -> None:
    """Give each param an FP32 `main_grad` that its gradient is added into as soon as
    autograd has computed it (micro-batches then sum in FP32, and the BF16 `.grad`
    is freed at once). MuonAdamW(grad_attr="main_grad") steps on these."""
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.register_post_accumulate_grad_hook(_add_into_main_grad)


def _add_into_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


def clip_by_global_norm(grads: List[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale `grads` in place so their global L2 norm is at most `max_norm` (no host sync);
    returns the norm before clipping. Works on `.grad` and `main_grad` alike."""
    total = torch.nn.utils.get_total_norm(grads)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale)
    return total


# ----------------------------------------------------------------------------
# Optimizers and the LR schedule
# ----------------------------------------------------------------------------

def build_optimizers(model: nn.Module, args) -> List[torch.optim.Optimizer]:
    """The optimizer(s) of one run, all on the same split of the model's params:
    hidden matrices (Muon's) and embeddings, head and norms (AdamW's)."""
    # One lr (the default, docs/guide.md "One learning rate"): --lr serves both kinds, Muon's updates scaled to
    # AdamW's RMS; --muon-lr gives Muon its own lr on its own scale (the two-lr form).
    groups = muon_ext.param_groups(model, lr=args.muon_lr, adamw_lr=args.adamw_lr, weight_decay=args.weight_decay,
                                   adamw_weight_decay=0.0)
    matrices = next(g for g in groups if g["kind"] == "muon")
    others = next(g for g in groups if g["kind"] == "adamw")
    betas = (0.9, 0.95)
    if args.optimizer == "muon_ext":
        others["betas"] = betas
        matrices["polar_method"] = args.polar_method
        matrices["polar_dtype"] = args.polar_dtype
        grad_attr = "main_grad" if args.main_grad else "grad"
        return [muon_ext.MuonAdamW(groups, grad_attr=grad_attr)]
    if args.optimizer == "adamw":
        return [torch.optim.AdamW([{"params": matrices["params"], "weight_decay": args.weight_decay},
                                   {"params": others["params"], "weight_decay": 0.0}],
                                  lr=args.adamw_lr, betas=betas)]
    # torch.optim.Muon takes only matrices: pair it with AdamW for the rest, as MuonAdamW does internally;
    # the same lr and lr scale as MuonAdamW's Muon group.
    adjust = "original" if matrices.get("lr_scale", "original") == "original" else "match_rms_adamw"
    return [torch.optim.Muon(matrices["params"], lr=matrices["lr"], weight_decay=args.weight_decay,
                             adjust_lr_fn=adjust),
            torch.optim.AdamW(others["params"], lr=args.adamw_lr, betas=betas, weight_decay=0.0)]


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int):
    """Linear warmup to each group's lr over `warmup` steps, then cosine decay to 0 at `total`."""
    sched = torch.optim.lr_scheduler
    cosine = sched.CosineAnnealingLR(optimizer, T_max=max(total - warmup, 1))
    if warmup == 0:
        return cosine
    linear = sched.LinearLR(optimizer, start_factor=1.0 / warmup, total_iters=warmup)
    return sched.SequentialLR(optimizer, [linear, cosine], milestones=[warmup])


# ----------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------

def save_checkpoint(path: Path, step: int, train_seconds: float, model, optimizers, schedulers, scaler) -> None:
    state = {
        "step": step,
        "train_seconds": train_seconds,
        "model": model.state_dict(),
        "optimizers": [o.state_dict() for o in optimizers],
        "schedulers": [s.state_dict() for s in schedulers],
        "scaler": scaler.state_dict(),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash while saving leaves the previous checkpoint intact


def load_checkpoint(path: Path, model, optimizers, schedulers, scaler) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    for obj, saved in zip([*optimizers, *schedulers], [*state["optimizers"], *state["schedulers"]]):
        obj.load_state_dict(saved)
    scaler.load_state_dict(state["scaler"])
    return state


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------

def run_label(args) -> str:
    """A run's name in metrics and plots: the optimizer, plus what differs from the defaults."""
    label = args.optimizer
    if args.precision != "fp32":
        label += f"-{args.precision}"
    return label + ("-compiled" if args.compile else "")


def train(args) -> List[dict]:
    """One training run; returns its metric records (also appended to metrics.jsonl)."""
    device = torch.device(args.device)
    run_dir = Path(args.out_dir) / args.name
    run_dir.mkdir(parents=True, exist_ok=True)
    label = run_label(args)
    checkpoint_path = run_dir / f"{label}.pt"

    torch.manual_seed(args.seed)
    model_cfg = GPTConfig(vocab_size=args.num_values + 1, block_size=2 * args.list_len, n_layer=args.n_layer,
                          n_head=args.n_head, d_model=args.d_model)
    model = GPT(model_cfg)
    if args.precision == "bf16":
        model.to(torch.bfloat16)  # before the optimizer: MuonAdamW keeps the FP32 masters as int16 remainders
    model.to(device)
    if args.main_grad:
        attach_main_grads(model)
    forward = torch.compile(model) if args.compile else model  # compiles forward and backward

    optimizers = build_optimizers(model, args)
    schedulers = [warmup_cosine(o, args.warmup, args.steps) for o in optimizers]
    # FP16 autocast needs loss scaling; with enabled=False the scaler passes everything through.
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    autocast = torch.autocast(device.type, dtype=torch.float16, enabled=args.precision == "fp16")

    start_step, train_seconds = 0, 0.0
    if args.resume and checkpoint_path.exists():
        state = load_checkpoint(checkpoint_path, model, optimizers, schedulers, scaler)
        start_step, train_seconds = state["step"], state["train_seconds"]
    records = MetricsFile(run_dir / "metrics.jsonl").restart(label, keep_through_step=start_step)

    eval_inputs, eval_targets = sorting_batch(args.eval_batch_size, args.list_len, args.num_values,
                                              make_generator(args.seed, -1))
    tokens_per_step = args.batch_size * args.grad_accum * model_cfg.block_size
    params = list(model.parameters())
    stop = min(args.steps, args.exit_after or args.steps)
    bar = tqdm(total=args.steps, initial=start_step, desc=label, unit="step", dynamic_ncols=True) if tqdm else None

    for step in range(start_step, stop):
        started = time.perf_counter()
        for opt in optimizers:
            opt.zero_grad()
        if args.main_grad:
            for p in params:
                p.main_grad.zero_()
        loss_sum = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            inputs, targets = sorting_batch(args.batch_size, args.list_len, args.num_values,
                                            make_generator(args.seed, step, micro))
            with autocast:
                loss = lm_loss(forward(inputs.to(device)), targets.to(device)) / args.grad_accum
            scaler.scale(loss).backward()
            loss_sum += loss.detach()

        for opt in optimizers:
            scaler.unscale_(opt)  # clip the true gradients, not the loss-scaled ones
        grads = [p.main_grad if args.main_grad else p.grad for p in params]
        grad_norm = clip_by_global_norm(grads, args.clip) if args.clip > 0 else torch.nn.utils.get_total_norm(grads)
        if args.main_grad and args.optimizer != "muon_ext":
            for p in params:  # torch's optimizers read .grad, in the param's dtype (no FP32 master)
                p.grad = p.main_grad.to(p.dtype)
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        for sched in schedulers:
            sched.step()

        loss_value = loss_sum.item()  # waits for the device, so the step time below is real
        seconds = time.perf_counter() - started
        train_seconds += seconds
        record = dict(run=label, step=step + 1, loss=loss_value, grad_norm=grad_norm.item(),
                      lr=schedulers[0].get_last_lr()[0], tokens_per_s=tokens_per_step / seconds,
                      train_seconds=train_seconds)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            record.update(evaluate(model, autocast, eval_inputs.to(device), eval_targets.to(device)))
        records.append(record)
        if bar:
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            bar.update()
        if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == stop):
            save_checkpoint(checkpoint_path, step + 1, train_seconds, model, optimizers, schedulers, scaler)
    if bar:
        bar.close()
    return records.of(label)


@torch.no_grad()
def evaluate(model, autocast, inputs, targets) -> Dict[str, float]:
    """Loss, and the fraction of sorted numbers predicted right, on a fixed held-out batch
    (teacher-forced; eager, so a compiled model is not recompiled for its shapes)."""
    with autocast:
        logits = model(inputs)
    has_target = targets != IGNORE
    correct = logits.argmax(-1)[has_target] == targets[has_target]
    return {"eval_loss": lm_loss(logits, targets).item(), "eval_accuracy": correct.float().mean().item()}


class MetricsFile:
    """runs/<name>/metrics.jsonl: one JSON record per step, for every run under that name."""

    def __init__(self, path: Path):
        self.path = path
        self.records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def restart(self, label: str, keep_through_step: int) -> "MetricsFile":
        """Drop `label`'s records after `keep_through_step` (all of them for a fresh run)."""
        self.records = [r for r in self.records if r["run"] != label or r["step"] <= keep_through_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        return self

    def append(self, record: dict) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def of(self, label: str) -> List[dict]:
        return [r for r in self.records if r["run"] == label]

    def by_run(self) -> Dict[str, List[dict]]:
        runs: Dict[str, List[dict]] = {}
        for r in self.records:
            runs.setdefault(r["run"], []).append(r)
        return runs


# ----------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------

def summarize(runs: Dict[str, List[dict]]) -> str:
    """One line per run: final losses, training time and steady-state throughput."""
    lines = [f"{'run':<24} {'steps':>5} {'loss':>7} {'eval loss':>9} {'train s':>8} {'tokens/s':>9}"]
    for label, recs in runs.items():
        last_eval = next((r["eval_loss"] for r in reversed(recs) if "eval_loss" in r), float("nan"))
        steady = [r["tokens_per_s"] for r in recs[len(recs) // 10:]]  # skip warm-up (and compilation)
        lines.append(f"{label:<24} {recs[-1]['step']:>5} {recs[-1]['loss']:>7.4f} {last_eval:>9.4f} "
                     f"{recs[-1]['train_seconds']:>8.1f} {statistics.median(steady):>9.0f}")
    return "\n".join(lines)


def loss_figure():
    """(pyplot, figure, (by-step axes, by-time axes)) for a loss plot, or None without matplotlib
    (examples/compare.py draws the other examples' plots on it too)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    return plt, fig, axes


def plain_log_ticks(*axes) -> None:
    """Log axes labelled only at 1, 2 and 5 per decade, as plain numbers: matplotlib's default labels
    minor ticks too when an axis spans less than a decade, and they collide."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    for axis in axes:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())


def plot(runs: Dict[str, List[dict]], path: Path) -> bool:
    """Loss vs step and vs training wall-clock time for every run; False without matplotlib."""
    figure = loss_figure()
    if figure is None:
        return False
    plt, fig, (by_step, by_time) = figure
    for label, recs in runs.items():
        evals = [r for r in recs if "eval_loss" in r]
        for ax, x in ((by_step, "step"), (by_time, "train_seconds")):
            line, = ax.plot([r[x] for r in recs], [r["loss"] for r in recs], lw=0.8, alpha=0.35)
            ax.plot([r[x] for r in evals], [r["eval_loss"] for r in evals], "o-", ms=3, color=line.get_color(),
                    label=label)
    by_step.set(xlabel="step", ylabel="loss (line: train, dots: held-out)", yscale="log")
    by_time.set(xlabel="training time (s, log scale)", xscale="log")  # runs may differ in speed severalfold
    plain_log_ticks(by_step.yaxis, by_time.xaxis)
    eval_times = [r["train_seconds"] for recs in runs.values() for r in recs if "eval_loss" in r]
    if eval_times:  # the first steps' sub-second times would crowd the axis with empty decades
        by_time.set_xlim(left=0.5 * min(eval_times))
    by_step.legend()
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------

def parse_args(argv: Optional[Iterable[str]] = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run = p.add_argument_group("run")
    run.add_argument("--optimizer", choices=OPTIMIZERS, default="muon_ext",
                     help="torch_muon: torch.optim.Muon for hidden matrices + torch.optim.AdamW (default: %(default)s)")
    run.add_argument("--compare", action="store_true", help="run every optimizer back to back on identical data")
    run.add_argument("--name", default="train_gpt", help="runs/<name>/ holds metrics, plot and checkpoints "
                                                         "(default: %(default)s)")
    run.add_argument("--out-dir", default="runs", help="parent of runs/<name>/ (default: %(default)s)")
    run.add_argument("--plot", default=None, help="where to write the plot (default: runs/<name>/loss.png)")
    run.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    run.add_argument("--seed", type=int, default=0, help="model init and data (default: %(default)s)")
    run.add_argument("--compile", action="store_true", help="torch.compile the model (forward and backward)")
    run.add_argument("--steps", type=int, default=300, help="optimizer steps (default: %(default)s)")
    run.add_argument("--eval-every", type=int, default=25, help="held-out eval interval (default: %(default)s)")
    run.add_argument("--eval-batch-size", type=int, default=256, help="held-out sequences (default: %(default)s)")
    run.add_argument("--save-every", type=int, default=100,
                     help="checkpoint every N steps and at the end; 0: never (default: %(default)s)")
    run.add_argument("--resume", action="store_true", help="continue from runs/<name>/<run>.pt if it exists")
    run.add_argument("--exit-after", type=int, default=0,
                     help="stop after this step (saving a checkpoint), as if preempted; 0: run to --steps")
    task = p.add_argument_group("task and model")
    task.add_argument("--list-len", type=int, default=16, help="numbers per list to sort (default: %(default)s)")
    task.add_argument("--num-values", type=int, default=64,
                      help="numbers are drawn from [0, num_values) (default: %(default)s)")
    task.add_argument("--n-layer", type=int, default=2, help="transformer blocks (default: %(default)s)")
    task.add_argument("--n-head", type=int, default=4, help="attention heads (default: %(default)s)")
    task.add_argument("--d-model", type=int, default=128, help="model width (default: %(default)s)")
    opt = p.add_argument_group("optimization")
    opt.add_argument("--batch-size", type=int, default=32, help="sequences per micro-batch (default: %(default)s)")
    opt.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default: %(default)s)")
    opt.add_argument("--muon-lr", type=float, default=None,
                     help="Muon's own lr for the hidden matrices, on Muon's scale (lr_scale 'original'; the "
                          "two-lr form, 0.01 tuned here); default: none, Muon takes --lr scaled to AdamW's "
                          "update RMS (docs/guide.md, 'One learning rate')")
    opt.add_argument("--polar-method", choices=("standard", "gram", "auto"), default="standard",
                     help="muon_ext's orthogonalization: standard or Gram Newton-Schulz iterations, or auto "
                          "(docs/polar_express.md) (default: %(default)s)")
    opt.add_argument("--polar-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                     help="muon_ext's Polar-Express GEMM precision (docs/polar_express.md) (default: %(default)s)")
    opt.add_argument("--lr", "--adamw-lr", dest="adamw_lr", type=float, default=2e-3,
                     help="the learning rate: every param with --optimizer adamw; both kinds with MuonAdamW "
                          "(embeddings, head and norms only with --muon-lr) (default: %(default)s)")
    opt.add_argument("--weight-decay", type=float, default=0.1,
                     help="on hidden matrices; none elsewhere (default: %(default)s)")
    opt.add_argument("--warmup", type=int, default=20,
                     help="linear warmup steps, then cosine decay to 0 (default: %(default)s)")
    opt.add_argument("--clip", type=float, default=1.0, help="global grad-norm clipping; 0: off (default: %(default)s)")
    opt.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                     help="bf16: BF16 params (MuonAdamW keeps exact FP32 masters as int16 remainders; torch's "
                          "optimizers update BF16 directly); fp16: FP32 params, FP16 autocast and GradScaler "
                          "(default: %(default)s)")
    opt.add_argument("--main-grad", action=argparse.BooleanOptionalAction, default=None,
                     help="accumulate grads into FP32 param.main_grad (default: on with bf16)")
    args = p.parse_args(argv)
    if args.main_grad is None:
        args.main_grad = args.precision == "bf16"
    if args.main_grad and args.precision == "fp16":
        p.error("--main-grad does not go with fp16: GradScaler looks for infs in .grad only")
    return args


def main(argv: Optional[Iterable[str]] = None) -> Dict[str, List[dict]]:
    args = parse_args(argv)
    for name in OPTIMIZERS if args.compare else (args.optimizer,):
        args.optimizer = name
        train(args)
    run_dir = Path(args.out_dir) / args.name
    runs = MetricsFile(run_dir / "metrics.jsonl").by_run()
    print(f"\n{summarize(runs)}\n({torch.get_num_threads()} threads on {args.device}; metrics: {run_dir}/metrics.jsonl)")
    plot_path = Path(args.plot) if args.plot else run_dir / "loss.png"
    if plot(runs, plot_path):
        print(f"plot: {plot_path}")
    else:
        print("no plot: matplotlib is not installed (pip install matplotlib)")
    return runs


if __name__ == "__main__":
    main()
