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
# command may run 10 minutes, so a lease typically runs `build tests adamw`
# in one call and `muon step offload` in a second (the in-place build is kept).
# RESULTS_DIR receives: stages.json (rc and seconds per stage), log.txt (all
# output), gpu_tests.json (per-test outcomes) and one JSON file per benchmark.
set -uo pipefail

OUT=${1:?usage: bench/gpu_check.sh RESULTS_DIR [build|tests|adamw|muon|step|offload|quantize|sanitize ...]}
shift
STAGES_WANTED=${*:-build tests adamw muon step offload quantize}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
PY=${PYTHON:-python3}
LOG="$OUT/log.txt"
STAGES="$OUT/stages.json"
[ -f "$STAGES" ] || echo "[]" > "$STAGES"

# stage NAME SECONDS COMMAND...: run, log, and record rc / duration.
stage() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
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
if wants build; then
  stage build 300 "$PY" -m pip install --no-build-isolation --no-deps -v -e . || exit 1
fi
if wants tests; then
  stage gpu_tests 240 "$PY" -m pytest tests/python -m gpu -q -rA -p no:cacheprovider \
    --junitxml="$OUT/gpu_tests.xml"
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
wants muon && stage bench_muon 200 "$PY" bench/muon.py --device cuda --out "$OUT/muon.json"
wants step && stage bench_step 240 "$PY" bench/step.py --device cuda --out "$OUT/step.json"
wants offload && stage bench_offload 240 "$PY" bench/offload.py --device cuda --out "$OUT/offload.json"
wants quantize && stage bench_quantize 120 "$PY" bench/quantize.py --device cuda --out "$OUT/quantize.json"
if wants sanitize; then
  SANITIZER="$CUDA_HOME/bin/compute-sanitizer"
  SANITIZED_TESTS=(tests/python/test_muon_phases_cuda.py tests/python/test_quantize_fp8_cuda.py
                   tests/python/test_adamw_cuda.py -m gpu -q -x -p no:cacheprovider
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
