"""Table: Polar-Express error against an FP64 SVD polar factor, per polar_dtype and polar_method.

Relative Frobenius error ||X - U V^T||_F / ||U V^T||_F of muon_orthogonalize
(input scale + five Polar-Express iterations) on random, condition-1e6,
rank-8, zero, tiny- and huge-norm matrices; the same cases as
tests/python/test_polar_accuracy.py. Polar-Express maps singular values into a
band around 1 and leaves those below ~1e-3 of the largest short of it, so the
errors measure the iteration plus its rounding; compare across columns.
Each polar_dtype has a "standard" and a "gram" column (Gram Newton-Schulz,
polar_method="gram"), and "gram/std" is their ratio (the issue's bound: 1.1).

Usage: python bench/polar_accuracy.py [--shapes 96x200,300x200,40x160,200x800,800x200,1024x4096]
       [--out bench/results/polar_accuracy.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from muon_ext.testing import accuracy_cases, kernel_output, relative_error

DTYPES = ("float32", "bfloat16", "float16")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="96x200,300x200,40x160,200x800,800x200,1024x4096")
    parser.add_argument("--out", default="bench/results/polar_accuracy.json")
    args = parser.parse_args()
    table = []
    print(f"{'shape':>10} {'case':>20} " + " ".join(f"{d + ' std/gram/ratio':>31}" for d in DTYPES))
    for spec in args.shapes.split(","):
        rows, cols = (int(v) for v in spec.split("x"))
        for name, g in accuracy_cases(rows, cols).items():
            row = {"shape": [rows, cols], "case": name}
            for d in DTYPES:  # "float32" etc.: the standard iteration, as before; "<dtype>_gram": Gram
                row[d] = relative_error(g, lambda m, d=d: kernel_output(m, d))
                row[f"{d}_gram"] = relative_error(g, lambda m, d=d: kernel_output(m, d, "gram"))
                row[f"{d}_gram_over_standard"] = row[f"{d}_gram"] / row[d] if row[d] else 1.0
            table.append(row)
            print(f"{spec:>10} {name:>20} " + " ".join(
                f"{row[d]:10.5f} {row[d + '_gram']:10.5f} {row[d + '_gram_over_standard']:9.3f}" for d in DTYPES),
                flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
