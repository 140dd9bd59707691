"""What the trainer examples (train_megatron.py, train_titan.py, train_hf.py) share when they compare
MuonAdamW with the trainer's own AdamW: the final-loss summary and the plot of loss against step and
against training time (docs/guide.md, "Migrating from AdamW").

A run is a list of records {"step", "loss", "seconds"} (seconds: training time since the first step
began); `runs` maps a label to its run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

from train_gpt import loss_figure, plain_log_ticks  # the same figure as train_gpt.py's plot

LAST = 10  # the final loss: the mean of the last LAST steps' training losses


def final_loss(records: List[dict]) -> float:
    tail = records[-LAST:]
    return sum(r["loss"] for r in tail) / len(tail)


def summarize(runs: Dict[str, List[dict]], held_out: Optional[Dict[str, float]] = None) -> str:
    """One line per run: steps, mean loss of the last 10 steps, held-out loss where given, training time."""
    held_out = held_out or {}
    lines = [f"{'run':<28} {'steps':>5} {'last-10 loss':>12} {'held-out':>9} {'train s':>8}"]
    for label, records in runs.items():
        held = f"{held_out[label]:>9.4f}" if label in held_out else f"{'-':>9}"
        lines.append(f"{label:<28} {records[-1]['step']:>5} {final_loss(records):>12.4f} {held} "
                     f"{records[-1]['seconds']:>8.1f}")
    return "\n".join(lines)


def save(runs: Dict[str, List[dict]], held_out: Dict[str, float], path: Path) -> None:
    """The runs and held-out losses as JSON (next to the plot: metrics.json), to redraw or compare later."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs, "held_out": held_out}))


def plot(runs: Dict[str, List[dict]], path: Path, title: str = "", ylabel: str = "training loss") -> bool:
    """Loss against step and against training time, one curve per run (raw, faint, and a 10-step moving
    mean); False without matplotlib."""
    figure = loss_figure()
    if figure is None:
        return False
    plt, fig, (by_step, by_time) = figure
    for label, records in runs.items():
        losses = [r["loss"] for r in records]
        smooth = [sum(losses[max(0, i - LAST + 1):i + 1]) / (i + 1 - max(0, i - LAST + 1)) for i in range(len(losses))]
        for ax, key in ((by_step, "step"), (by_time, "seconds")):
            x = [r[key] for r in records]
            line, = ax.plot(x, losses, lw=0.6, alpha=0.3)
            ax.plot(x, smooth, lw=1.4, color=line.get_color(), label=label)
    by_step.set(xlabel="step", ylabel=f"{ylabel} (line: 10-step mean)", yscale="log")
    by_time.set(xlabel="training time (s)")
    plain_log_ticks(by_step.yaxis)
    by_step.legend()
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3, which="both")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
