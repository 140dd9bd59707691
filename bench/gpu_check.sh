#!/usr/bin/env bash
# GPU check: build in place against the machine's own torch, run the GPU tests,
# then the benchmarks. Each stage runs under its own time limit and writes its
# results into RESULTS_DIR as it finishes, so a partial run still reports.
#
#   bench/gpu_check.sh RESULTS_DIR [STAGE ...]
#
# STAGEs: build tests adamw muon step offload quantize (default: all, in that order), and
# sanitize (only when named): compute-sanitizer memcheck and racecheck over the
# ragged, scalar, grid-stride and shared-memory paths of a few GPU tests. One device
# command may run 10 minutes.
# RESULTS_DIR receives: stages.json (rc and seconds per stage), log.txt (all
# output), gpu_tests.json (per-test outcomes) and one JSON file per benchmark.
#
# Device time is scarce: the whole run stops starting stages once BUDGET_S
# seconds (default 570, under one 600 s device call) have passed, and a stage's
# limit is cut to what is left. A fresh machine (a call more than ~30 s after
# the last) has lost the in-place build: it is rebuilt first whatever the
# STAGEs. The seed peer reaches the machine only from inside the checkout:
# before the call, `mkdir -p shared/peers && cp ../shared/peers/hydra_muonadamw.py
# shared/peers/` (/shared/ is git-ignored).
# Planning a 15-minute lease (the first H200 session, 2026-12-04): a machine
# took ~30 s to start and went back 30 s after each call, so every call paid a
# fresh build (207-217 s at MAX_JOBS=16, before the per-ISA objects were
# compiled in parallel) and the GPU tests took ~45 s. Two calls of
# `build tests adamw muon` and `build step offload quantize [sanitize]` fit
# only with budgets near 350 s each; one call of the default stages fits 570 s.
set -uo pipefail

OUT=${1:?usage: bench/gpu_check.sh RESULTS_DIR [build|tests|adamw|muon|step|offload|quantize|sanitize ...]}
shift
STAGES_WANTED=${*:-build tests adamw muon step offload quantize}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

if [ -z "${CUDA_HOME:-}" ]; then
  NVCC=$(command -v nvcc || true)
  CUDA_HOME=$([ -n "$NVCC" ] && dirname "$(dirname "$NVCC")" || echo /usr/local/cuda)
fi
export CUDA_HOME
export PYTHONUNBUFFERED=1  # a stage killed at its limit still leaves its output in the log
END=$(( $(date +%s) + ${BUDGET_S:-570} ))
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
PY=${PYTHON:-python3}
LOG="$OUT/log.txt"
STAGES="$OUT/stages.json"
[ -f "$STAGES" ] || echo "[]" > "$STAGES"

# stage NAME SECONDS COMMAND...: run, log, and record rc / duration; skipped
# (rc 125) when the budget is spent, its limit cut to what is left.
stage() {
  local name=$1 limit=$2 start rc left
  shift 2
  start=$(date +%s)
  left=$(( END - start ))
  if (( left < 30 )); then
    echo "===== $name skipped: the ${BUDGET_S:-570} s budget is spent" >> "$LOG"
    return 125
  fi
  (( limit > left )) && limit=$left
  echo "===== $name (limit ${limit}s): $*" >> "$LOG"
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  "$PY" - "$STAGES" "$name" "$rc" "$(( $(date +%s) - start ))" <<'PYEOF'
import json, sys
path, name, rc, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
stages = json.load(open(path))
stages.append({"stage": name, "rc": rc, "seconds": seconds, "timed_out": rc in (124, 137)})
json.dump(stages, open(path, "w"), indent=1)
PYEOF
  return $rc
}

wants() { [[ " $STAGES_WANTED " == *" $1 "* ]]; }

nvidia-smi >> "$LOG" 2>&1
if ! wants build && ! "$PY" -c 'import muon_ext, sys; sys.exit(not muon_ext._C.with_cuda)' >> "$LOG" 2>&1; then
  echo "===== no CUDA build of muon_ext here (a fresh machine?): building first" >> "$LOG"
  STAGES_WANTED="build $STAGES_WANTED"
fi
# A compiler that links libstdc++ statically into shared objects gives _C.so
# a second copy of the library beside the one torch loads: on the first H200
# run (2026-12-04) number formatting in _C.so then crashed. Probed with a
# one-line shared object (about a second); the system g++ is used instead
# where it links libstdc++ as a shared library. MUON_EXT_KEEP_CXX=1 keeps CXX.
dynamic_libstdcxx() {  # COMPILER OUT.so: builds a probe; true if it needs libstdc++.so
  "$1" -shared -fPIC -x c++ - -o "$2" 2>/dev/null <<'CPP' && ldd "$2" | grep -q 'libstdc++'
#include <sstream>
#include <string>
std::string format(unsigned long n) { std::ostringstream out; out << n; return out.str(); }
CPP
}
if wants build && [ -z "${MUON_EXT_KEEP_CXX:-}" ] && command -v ldd > /dev/null; then
  PROBE=$(mktemp -d)
  if ! dynamic_libstdcxx "${CXX:-c++}" "$PROBE/default.so"; then
    echo "===== ${CXX:-c++} does not link libstdc++ as a shared library" >> "$LOG"
    if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ] && dynamic_libstdcxx /usr/bin/g++ "$PROBE/system.so"; then
      export CXX=/usr/bin/g++ CC=/usr/bin/gcc
      echo "===== building with CXX=$CXX CC=$CC instead" >> "$LOG"
    fi
  fi
  rm -rf "$PROBE"
fi
if wants build; then
  stage build 300 "$PY" -m pip install --no-build-isolation --no-deps -v -e . || exit 1
  # setup.py builds CPU-only when it finds no nvcc: every GPU stage would then fail obscurely.
  "$PY" -c 'import muon_ext, sys; sys.exit(not muon_ext._C.with_cuda)' >> "$LOG" 2>&1 \
    || { echo "===== the build has no CUDA kernels (CUDA_HOME=$CUDA_HOME)" >> "$LOG"; exit 1; }
fi
# The toolchain the build used. On the first H200 run (2026-12-04) the image's
# /opt/gcc/bin/g++ put libstdc++'s own code into _C.so (codecvt internals in a
# backtrace): ostream number formatting in _C.so then crashed (a SIGSEGV in
# checks::storage_problem), one copy of the library reading the other's locale.
{
  echo "===== toolchain: CXX=${CXX:-unset} c++=$(command -v c++) g++=$(command -v g++)"
  "${CXX:-c++}" --version 2>&1 | head -1
  SO=$(ls muon_ext/_C*.so 2>/dev/null | head -1)
  if [ -n "$SO" ] && command -v nm > /dev/null; then
    copies=$(nm -C "$SO" 2>/dev/null | grep -c "read_utf8_code_point")
    echo "libstdc++ internals linked into $SO: $copies symbol(s)$([ "$copies" -gt 0 ] && echo ' (statically linked libstdc++: expect crashes in error messages)')"
  fi
} >> "$LOG" 2>&1
if wants tests; then
  # pytest-timeout, where installed, fails a hanging test instead of losing the whole stage.
  TIMEOUT_ARGS=()
  "$PY" -c 'import pytest_timeout' 2>/dev/null && TIMEOUT_ARGS=(--timeout=120)
  # pytest-xdist, where installed: a test that crashes its process takes one
  # worker down, not the run and its report (the first H200 run lost both).
  "$PY" -c 'import xdist' 2>/dev/null && TIMEOUT_ARGS+=(-n 4)
  stage gpu_tests 240 "$PY" -m pytest tests/python -m gpu -q -rA -p no:cacheprovider --durations=15 \
    ${TIMEOUT_ARGS[@]+"${TIMEOUT_ARGS[@]}"} --junitxml="$OUT/gpu_tests.xml"
  "$PY" - "$OUT/gpu_tests.xml" "$OUT/gpu_tests.json" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as exc:  # the stage may have been killed before writing it
    json.dump({"error": str(exc)}, open(sys.argv[2], "w")); sys.exit(0)
cases = []
for case in root.iter("testcase"):
    outcome, detail = "passed", ""
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            outcome, detail = tag, (node.get("message") or "")[:2000]
            break
    cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                  "seconds": float(case.get("time", 0)), "detail": detail})
summary = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
json.dump({"summary": summary, "cases": cases}, open(sys.argv[2], "w"), indent=1)
PYEOF
  rm -f "$OUT/gpu_tests.xml"
fi
wants adamw && stage bench_adamw 90 "$PY" bench/adamw.py --device cuda --out "$OUT/adamw.json"
# The compiled seed's torch.compile costs more device time than the fractions it
# would add (bench/muon.py without the flag runs it).
wants muon && stage bench_muon 200 "$PY" bench/muon.py --device cuda --skip-compiled-seed --rounds 5 \
  --out "$OUT/muon.json"
wants step && stage bench_step 300 "$PY" bench/step.py --device cuda --out "$OUT/step.json"
wants offload && stage bench_offload 240 "$PY" bench/offload.py --device cuda --out "$OUT/offload.json"
wants quantize && stage bench_quantize 120 "$PY" bench/quantize.py --device cuda --out "$OUT/quantize.json"
if wants sanitize; then
  SANITIZER="$CUDA_HOME/bin/compute-sanitizer"
  SANITIZED_TESTS=(tests/python/test_muon_phases.py tests/python/test_quantize_fp8.py
                   tests/python/test_adamw.py -m gpu -q -x -p no:cacheprovider
                   -k "odd or experts or one or None or empty or many")
  if [ -x "$SANITIZER" ]; then
    for tool in memcheck racecheck; do
      stage "sanitize_$tool" 240 "$SANITIZER" --tool "$tool" --error-exitcode 99 \
        "$PY" -m pytest "${SANITIZED_TESTS[@]}"
    done
  else
    stage sanitize_missing 5 sh -c "echo '$SANITIZER not found'; exit 127"
  fi
fi
exit 0
