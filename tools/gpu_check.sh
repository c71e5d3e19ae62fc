#!/usr/bin/env bash
# One device-machine call: GPU tests (and, with E2E=1, the Qwen3-8B-shaped generate/bench run).
# Needs .cache/qwen.tiktoken carried along (no network there). Logs under $OUT.
set -u
OUT=${OUT:-/tmp/kuiper_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD KUIPER_QWEN_TIKTOKEN=$PWD/.cache/qwen.tiktoken
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import cupy; print('cupy', cupy.__version__)"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short --maxfail=40 tests/test_gpu.py tests/test_gpu_e2e.py \
    > "$OUT/gpu_tests.log" 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|Error|error" "$OUT/gpu_tests.log" | tail -40
fi
if [ "${E2E:-0}" = 1 ]; then
  M=/tmp/q8b; B=/tmp/q8b.bin
  /usr/bin/time -f "make %e s" python3 tools/make_synthetic.py $M --preset 8b --shards 4 2>&1 | tail -2
  /usr/bin/time -f "export %e s" python3 -m kuiper_py export $M -o $B -q 2>&1 | tail -2
  python3 -m kuiper_py info $B | tee "$OUT/info8b.txt" | head -5
  python3 -m kuiper_py generate -m $B -p "The capital of France is" -n 64 --temp 0 --device cuda \
    > "$OUT/gen8b.txt" 2> "$OUT/gen8b.err"; echo "generate rc=$?"; tail -3 "$OUT/gen8b.err"
  python3 -m kuiper_py bench -m $B -p ${PP:-128,512,2048} -n ${TG:-128} -r 3 --device cuda -o json \
    > "$OUT/bench8b.json" 2> "$OUT/bench8b.err"; echo "bench rc=$?"; tail -8 "$OUT/bench8b.err"
  python3 -m kuiper_py bench -m $B -p ${PP:-128,512,2048} -n ${TG:-128} -r 1 --device cuda 2>/dev/null | tee "$OUT/bench8b.md"
fi
