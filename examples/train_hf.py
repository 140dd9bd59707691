"""A small LlamaForCausalLM (built from a config: no download) trained by
Hugging Face's Trainer with MuonAdamW (muon_ext.hf.MuonTrainer) or with
Trainer's own AdamW, on the CPU, printing the loss of every step.

    pip install '.[hf]'
    python examples/train_hf.py --optimizer muon --steps 20
    python examples/train_hf.py --optimizer adamw --steps 20
"""

import argparse
import tempfile

import torch
import transformers

from muon_ext.hf import MuonTrainer

VOCAB, SEQ = 64, 16


class Tokens(torch.utils.data.Dataset):
    """Sequences of a repeating pattern with noise: learnable, so the loss falls."""

    def __init__(self, n=512):
        gen = torch.Generator().manual_seed(0)
        base = torch.arange(SEQ) * 3 % VOCAB
        self.rows = [(base + torch.randint(0, 4, (SEQ,), generator=gen) * (i % 2)) % VOCAB for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizer", choices=["muon", "adamw"], default="muon")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's lr (MuonAdamW: its AdamW group's)")
    parser.add_argument("--muon-lr", type=float, default=0.02)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = transformers.LlamaForCausalLM(config)
    training = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="train_hf_"), max_steps=args.steps, per_device_train_batch_size=8,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    if args.optimizer == "muon":
        trainer = MuonTrainer(model=model, args=training, train_dataset=Tokens(),
                              muon_options={"lr": args.muon_lr})
    else:
        trainer = transformers.Trainer(model=model, args=training, train_dataset=Tokens())
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']:3d}  loss {entry['loss']:.4f}")


if __name__ == "__main__":
    main()
