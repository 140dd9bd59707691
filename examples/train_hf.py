"""A small LlamaForCausalLM (built from a config: no download) trained by
Hugging Face's Trainer with MuonAdamW (muon_ext.hf.MuonTrainer) or with
Trainer's own AdamW, on the CPU, on the sorting task of examples/train_gpt.py
(loss on the sorted half), printing the loss of every 50th step and the final
losses (mean of the last 10 steps; held-out).

    pip install '.[hf]'
    python examples/train_hf.py --compare                  # both, same batches and seed; plot
    python examples/train_hf.py --optimizer muon --steps 20
    python examples/train_hf.py --optimizer adamw --steps 20

MuonAdamW takes TrainingArguments' learning_rate and weight_decay for both
kinds (docs/guide.md, "One learning rate"); --muon-lr gives Muon its own.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from muon_ext.hf import MuonTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402  the examples' summary and plot
from train_gpt import IGNORE, make_generator, sorting_batch  # noqa: E402  the task of train_gpt.py

VOCAB, SEQ = 64, 16


class Tokens(torch.utils.data.Dataset):
    """Sequences of a repeating pattern with noise: learnable in a few steps (tests/python/test_hf.py)."""

    def __init__(self, n=512):
        gen = torch.Generator().manual_seed(0)
        base = torch.arange(SEQ) * 3 % VOCAB
        self.rows = [(base + torch.randint(0, 4, (SEQ,), generator=gen) * (i % 2)) % VOCAB for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class Sorting(torch.utils.data.Dataset):
    """`x_1 .. x_n SEP sorted(x)` (train_gpt.py's task), sequence i drawn from its own generator (seed, i);
    labels on the sorted half only (the model shifts them: position j predicts labels[j + 1])."""

    def __init__(self, n: int, seed: int, list_len: int = 16, num_values: int = 64):
        self.n, self.seed, self.list_len, self.num_values = n, seed, list_len, num_values

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        inputs, targets = sorting_batch(1, self.list_len, self.num_values, make_generator(self.seed, i))
        sequence = torch.cat([inputs[0], targets[0, -1:]])
        labels = sequence.clone()
        labels[:self.list_len + 1] = IGNORE  # the list and the separator: nothing to learn there
        return {"input_ids": sequence, "labels": labels}


class StepTimes(transformers.TrainerCallback):
    """Training seconds at the end of each step."""

    def __init__(self):
        self.start, self.seconds = None, {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds[state.global_step] = time.perf_counter() - self.start


def train(args, optimizer: str):
    """One run; returns ({step, loss, seconds} records, held-out loss)."""
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(vocab_size=65, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    training = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="train_hf_"), max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=args.lr, weight_decay=args.weight_decay, lr_scheduler_type="cosine",
        warmup_steps=max(2, args.steps // 15), logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        seed=args.seed, disable_tqdm=True, per_device_eval_batch_size=256)
    times = StepTimes()
    data = dict(train_dataset=Sorting(args.steps * args.batch, args.seed), eval_dataset=Sorting(256, args.seed + 1000),
                callbacks=[times])
    if optimizer == "muon":
        options = {} if args.muon_lr is None else {"lr": args.muon_lr}
        trainer = MuonTrainer(model=model, args=training, muon_options=options, **data)
    else:
        trainer = transformers.Trainer(model=model, args=training, **data)
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # our own, shorter, log below
    trainer.train()
    records = [{"step": e["step"], "loss": e["loss"], "seconds": times.seconds[e["step"]]}
               for e in trainer.state.log_history if "loss" in e]
    return records, trainer.evaluate()["eval_loss"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    parser.add_argument("--compare", action="store_true", help="train with both, on the same batches and seed")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="TrainingArguments.learning_rate: AdamW's; MuonAdamW's for both kinds")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="TrainingArguments.weight_decay")
    parser.add_argument("--muon-lr", type=float, default=None,
                        help="Muon's own lr (lr_scale 'original'; the two-lr form, 0.02 before one lr)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (intermediate: 4x)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="runs/hf/loss.png")
    args = parser.parse_args(argv)
    runs, held_out = {}, {}
    names = {"muon": "MuonAdamW", "adamw": "Trainer AdamW"}
    for optimizer in ("muon", "adamw") if args.compare else (args.optimizer,):
        records, held_out[names[optimizer]] = train(args, optimizer)
        runs[names[optimizer]] = records
        for r in records:
            if r["step"] % 50 == 0 or r["step"] in (1, args.steps):
                print(f"{names[optimizer]} step {r['step']:4d}  loss {r['loss']:.4f}")
    print(compare.summarize(runs, held_out))
    compare.save(runs, held_out, Path(args.plot).with_name("metrics.json"))
    if compare.plot(runs, Path(args.plot), f"HF Trainer, LlamaForCausalLM (hidden {args.hidden}), lr {args.lr:g}"):
        print(f"plot: {args.plot}")
    return runs, held_out


if __name__ == "__main__":
    main()
