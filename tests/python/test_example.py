"""examples/train_gpt.py: a few steps of a tiny model through each mechanism, and
resuming a checkpoint continues bit-exactly (CPU)."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
train_gpt = sys.modules["train_gpt"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
_spec.loader.exec_module(train_gpt)

TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--list-len", "4", "--num-values", "8",
        "--batch-size", "4", "--eval-batch-size", "8", "--eval-every", "2", "--warmup", "2"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and are then not slowed by a busy host's other cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(tmp_path: Path, *args: str):
    return train_gpt.main([*TINY, "--out-dir", str(tmp_path), "--plot", str(tmp_path / "loss.png"), *args])


@pytest.mark.parametrize("flags", [
    ["--compare"],
    ["--precision", "bf16", "--grad-accum", "2"],  # BF16 params, FP32 main_grad hooks
    ["--precision", "bf16", "--optimizer", "torch_muon"],
    ["--precision", "bf16", "--no-main-grad", "--clip", "0"],
    ["--precision", "fp16", "--optimizer", "adamw"],  # autocast + GradScaler
    ["--precision", "fp16", "--grad-accum", "2"],
], ids=lambda flags: " ".join(flags))
def test_a_few_steps_train_and_record_metrics(tmp_path, flags):
    runs = run(tmp_path, "--steps", "4", "--name", "smoke", *flags)
    expected = {"muon_ext", "adamw", "torch_muon"} if "--compare" in flags else {train_gpt.run_label(
        train_gpt.parse_args(flags))}
    assert set(runs) == expected
    for records in runs.values():
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in records)
        assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
        assert records[-1]["loss"] < records[0]["loss"]  # the tiny task is learnt from the first steps


def test_main_grad_hooks_sum_micro_batch_grads_in_fp32():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    train_gpt.attach_main_grads(layer)
    inputs = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(2)]
    for x in inputs:
        layer(x).float().square().sum().backward()
    expected = sum(torch.autograd.grad(layer(x).float().square().sum(), layer.weight)[0].float() for x in inputs)
    assert layer.weight.grad is None and layer.weight.main_grad.dtype == torch.float32
    assert torch.equal(layer.weight.main_grad, expected)


def test_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install '.[examples]')")
    run(tmp_path, "--steps", "2", "--name", "plot")
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert "plot:" in capsys.readouterr().out


def test_runs_without_tqdm_and_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_gpt, "tqdm", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    runs = run(tmp_path, "--steps", "2", "--name", "bare")
    assert [r["step"] for r in runs["muon_ext"]] == [1, 2]
    assert "no plot: matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "loss.png").exists()


@pytest.mark.parametrize("flags", [
    ["--optimizer", "muon_ext"],
    ["--optimizer", "muon_ext", "--precision", "bf16", "--grad-accum", "2"],
    ["--optimizer", "muon_ext", "--precision", "fp16"],
    ["--optimizer", "torch_muon"],
], ids=lambda flags: " ".join(flags))
def test_resume_continues_bit_exactly(tmp_path, flags):
    """runs/<name>/metrics.jsonl (what main returns) and the final checkpoint:
    6 steps straight == 3 steps, exit, resume for 3: the same losses and the same bits
    in the model and the optimizer state (warmup and cosine cross the break)."""
    steps = ["--steps", "6", "--save-every", "3", *flags]
    straight = run(tmp_path, "--name", "straight", *steps)
    run(tmp_path, "--name", "resumed", *steps, "--exit-after", "3")
    resumed = run(tmp_path, "--name", "resumed", *steps, "--resume")

    def strip_timing(runs):
        return {label: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "train_seconds")} for r in recs]
                for label, recs in runs.items()}

    assert strip_timing(resumed) == strip_timing(straight)
    label = train_gpt.run_label(train_gpt.parse_args(flags))
    final = [torch.load(tmp_path / name / f"{label}.pt", weights_only=True) for name in ("straight", "resumed")]
    assert final[0]["step"] == final[1]["step"] == 6
    for key in ("model", "optimizers", "schedulers", "scaler"):
        assert_bit_equal(final[0][key], final[1][key], key)


def assert_bit_equal(a, b, where: str):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bit_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), where
