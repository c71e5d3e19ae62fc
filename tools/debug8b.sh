#!/usr/bin/env bash
# Device debugging of the 8B-shaped decode path on a 2-layer model (fast to make).
set -u
OUT=${OUT:-/tmp/kuiper_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD KUIPER_QWEN_TIKTOKEN=$PWD/.cache/qwen.tiktoken
python3 tools/make_synthetic.py /tmp/d8 --preset 8b --layers ${LAYERS:-2} --shards 1 2>&1 | tail -1
python3 -m kuiper_py export /tmp/d8 -o /tmp/d8.bin -q 2>&1 | tail -1
CUDA_LAUNCH_BLOCKING=1 python3 -m kuiper_py --debug generate -m /tmp/d8.bin -p "The capital of France is" -n 8 --temp 0 \
  --device cuda --json 2>&1 | tr '\r' '\n' | grep -v upload | tail -25
if [ "${SAN:-1}" = 1 ]; then
  timeout 300 compute-sanitizer --tool memcheck --print-limit 3 python3 -m kuiper_py generate -m /tmp/d8.bin \
    -p "The capital of France is" -n 3 --temp 0 --device cuda 2>&1 | tr '\r' '\n' | grep -v upload | head -60
fi
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_gpu_e2e.py 2>&1 | tail -15
