"""Builds and runs the C++ GoogleTest suite (tests/cpp, CMakeLists.txt).

The C++ tests hold the bit-level facts (remainder split/merge over all 2^32
patterns, per-ISA AdamW bit-exactness), so a missing toolchain is a failure,
not a silent skip.  Set MUON_EXT_SKIP_CPP_TESTS=1 to skip on purpose.
The build directory build/cpp is reused, so reruns only rebuild what changed.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BUILD_DIR = ROOT / "build" / "cpp"
BINARY = BUILD_DIR / "muon_ext_cpp_tests"
OUTPUT_TAIL = 12000


def _tail(text: str) -> str:
    return text if len(text) <= OUTPUT_TAIL else "...\n" + text[-OUTPUT_TAIL:]


def _run(cmd, step: str, timeout: int, hint: str = "") -> str:
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"C++ suite: {step} timed out after {timeout} s: {' '.join(map(str, cmd))}\n{_tail(out)}")
    if proc.returncode != 0:
        pytest.fail(
            f"C++ suite: {step} failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n"
            f"{hint}{_tail(proc.stdout)}",
            pytrace=False,
        )
    return proc.stdout


def test_cpp_gtest_suite():
    if os.environ.get("MUON_EXT_SKIP_CPP_TESTS", "0") == "1":
        pytest.skip("MUON_EXT_SKIP_CPP_TESTS=1")
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail(
            "C++ suite: cmake not found on PATH; install cmake (and libgtest-dev) "
            "or set MUON_EXT_SKIP_CPP_TESTS=1 to skip the C++ tests explicitly.",
            pytrace=False,
        )

    torch_dir = Path(torch.__file__).resolve().parent
    _run(
        [
            cmake,
            "-S", str(ROOT),
            "-B", str(BUILD_DIR),
            f"-DTORCH_DIR={torch_dir}",
            f"-DTORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DCMAKE_BUILD_TYPE=Release",
        ],
        "configure",
        timeout=300,
        hint="(GoogleTest missing? Debian/Ubuntu: apt-get install -y libgtest-dev; "
        "or set MUON_EXT_SKIP_CPP_TESTS=1 to skip the C++ tests explicitly.)\n",
    )
    _run([cmake, "--build", str(BUILD_DIR), "-j2"], "build", timeout=1800)

    out = _run([str(BINARY), "--gtest_color=no"], "gtest run", timeout=900)
    assert "[  PASSED  ]" in out and "FAILED" not in out, _tail(out)
