#!/usr/bin/env bash
# Device call 1 (PART=1): GPU tests (tools/gpu_suite.py: as many as the limit allows), soak on a tiny model, kernel benchmark.
# Device call 2 (PART=2): Qwen3-8B-shaped file, kuiper bench, end-to-end benchmark with transformers.
# Device call 3 (PART=final): every GPU test (8B and 30B-A3B checkpoints drawn and exported on the CPU
#   meanwhile), bench_e2e on both, a 30B-A3B generate, the soak and bench_kernels (TESTS=none skips the tests).
# A/B call (PART=ab): GEMV variants KVARIANTS="ROWS,MIN_BLOCKS,BLOCKS_PER_SM,PDL,PIPE,FUSE_NORM,FUSE_ROPE ...", GPU tests, 8B
#   bench_e2e for each of E2E_VARIANTS (same form); an untracked earlier tree in _old/ is measured first.
set -u
OUT=${OUT:-/tmp/kuiper_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD KUIPER_QWEN_TIKTOKEN=$PWD/.cache/qwen.tiktoken
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# synthetic files of the given presets in /tmp/PRESET.bin (kept between calls on a warm machine), written directly
# (make_synthetic.py --ak48: no checkpoint on disk, one write instead of a checkpoint's and the export's)
make_models() {
  for p in "$@"; do [ -f /tmp/$p.bin ] || python3 tools/make_synthetic.py /tmp/$p.bin --ak48 --preset $p; done
}
make_soak() {  # the small preset for tools/soak.py
  python3 -c "from kuiper_py import synth, export; d=synth.make_checkpoint('/tmp/soak', 'small', seed=3); export.export(d, '/tmp/soak.bin', progress=False)" 2>&1 | tail -1
}
if [ "${PART:-1}" = final ]; then
  make_models 30b-a3b 8b > "$OUT/make.log" 2>&1 &
  MK=$!
  # every GPU test, one pytest process per GPU (tools/gpu_suite.py; one GPU reaches ~1/5 of the suite in 480 s,
  # the rest are listed in $OUT/left.txt for `gpu_suite.py --only`)
  [ "${TESTS:-all}" = none ] || python3 tools/gpu_suite.py --limit ${TEST_S:-480} --log-dir "$OUT" 2>&1 | tail -8
  wait $MK; grep exported "$OUT/make.log"
  timeout 100 python3 tools/bench_e2e.py /tmp/30b-a3b.bin --ctx 512,8192 --prompts 512,2048 --no-hf --json "$OUT/bench_e2e_30b.json" 2>&1 | grep -v upload | tail -9
  timeout 200 python3 tools/bench_e2e.py /tmp/8b.bin --json "$OUT/bench_e2e_8b.json" 2>&1 | grep -v upload | tail -12
  python3 -m kuiper_py generate -m /tmp/30b-a3b.bin -p "The capital of France is" -n 64 --temp 0 --device cuda 2>&1 >/dev/null | tr '\r' '\n' | grep -v upload | tail -1
  make_soak
  timeout 120 python3 tools/soak.py /tmp/soak.bin --runs 20 --steps 1000 --json "$OUT/soak.json" 2>/dev/null | tail -4
  timeout 150 python3 tools/bench_kernels.py --json "$OUT/bench_kernels.json" 2>&1 | tail -30
elif [ "${PART:-1}" = prof ]; then  # GPU tests (TESTS=none skips), then a kernel-by-kernel decode profile
  make_models ${PROF_MODELS:-8b} > "$OUT/make.log" 2>&1 &
  MK=$!
  [ "${TESTS:-all}" = none ] || { timeout 480 python3 -m pytest -q -rs -m gpu -p no:cacheprovider --tb=short \
    $([ "${TESTS:-all}" = all ] && echo tests/test_gpu_moe.py tests/test_gpu.py tests/test_gpu_e2e.py || echo $TESTS) \
    > "$OUT/gpu_tests.log" 2>&1; echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -12; }
  wait $MK; grep exported "$OUT/make.log"
  for c in ${CTX:-512}; do for mdl in ${PROF_MODELS:-8b}; do
    timeout 120 python3 tools/profile_decode.py /tmp/$mdl.bin --ctx $c --timeline ${TIMELINE:-8} \
      --json "$OUT/prof_${mdl}_$c.json" 2>&1 | grep -v -e upload -e _warn_once -e "warnings.warn"
  done; done
  [ -z "${E2E:-}" ] || [ ! -d _old ] || { echo "== _old"; timeout 150 python3 _old/tools/bench_e2e.py /tmp/8b.bin --no-hf $E2E \
    2>&1 | grep -E "^\| [0-9]"; echo "== new"; }
  [ -z "${E2E:-}" ] || timeout 150 python3 tools/bench_e2e.py /tmp/8b.bin --no-hf $E2E --json "$OUT/e2e.json" 2>&1 | grep -E "^\| [0-9]|^#"
elif [ "${PART:-1}" = ab ]; then
  make_models 8b > "$OUT/make.log" 2>&1 &
  MK=$!
  # an untracked copy of an earlier tree in _old/ (kuiper_py, kernels_cu, tools) is benchmarked first
  [ ! -d _old ] || { echo "== _old"; KUIPER_BENCH_GEMV_ONLY=1 timeout 90 python3 _old/tools/bench_kernels.py \
    --json "$OUT/kern_old.json" 2>&1 | grep -E "^\| [a-z0-9]" | grep -v prefill; }
  variant() {  # ROWS,MIN_BLOCKS,BLOCKS_PER_SM,PDL,PIPE,FUSE_NORM,FUSE_ROPE -> the environment of one variant
    IFS=, read R MB BPS P PP FN FR <<< "$1"
    echo "KUIPER_GEMV_ROWS=$R KUIPER_GEMV_MIN_BLOCKS=$MB KUIPER_GEMV_BLOCKS_PER_SM=$BPS KUIPER_PDL=$P" \
         "KUIPER_GEMV_PIPE=${PP:-0} KUIPER_FUSE_NORM=${FN:-1} KUIPER_FUSE_ROPE=${FR:-1}"
  }
  for v in ${KVARIANTS:-16,4,4,1,0}; do echo "== GEMV $(variant $v)"
    env $(variant $v) KUIPER_BENCH_GEMV_ONLY=1 \
      timeout 90 python3 tools/bench_kernels.py --json "$OUT/kern_${v//,/}.json" 2>&1 | grep -E "^\| [a-z0-9]" | grep -v prefill
  done
  [ "${TESTS:-all}" = none ] || { timeout ${TEST_S:-280} python3 -m pytest -q -rs -m gpu -p no:cacheprovider --tb=short \
    $([ "${TESTS:-all}" = all ] && echo tests/test_gpu.py tests/test_gpu_e2e.py tests/test_gpu_moe.py || echo $TESTS) \
    > "$OUT/gpu_tests.log" 2>&1; echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -15; }
  wait $MK; grep exported "$OUT/make.log"
  [ ! -d _old ] || { echo "== _old"; timeout 90 python3 _old/tools/bench_e2e.py /tmp/8b.bin --ctx 512 --prompts 512 --no-hf \
    2>&1 | grep -v upload | tail -4; }
  for v in ${E2E_VARIANTS:-16,4,4,1,0}; do echo "== e2e $(variant $v)"
    env $(variant $v) timeout 120 python3 tools/bench_e2e.py /tmp/8b.bin --ctx ${CTX:-512,8192} --prompts ${PROMPTS:-512,2048} \
      --no-hf --json "$OUT/e2e_${v//,/}.json" 2>&1 | grep -v upload | grep -E "^\| [0-9]"
  done
  [ -z "${KFULL:-}" ] || timeout 150 python3 tools/bench_kernels.py --json "$OUT/bench_kernels.json" 2>&1 | tail -22
elif [ "${PART:-1}" = 1 ]; then
  python3 tools/gpu_suite.py --limit ${TEST_S:-480} --log-dir "$OUT" 2>&1 | tail -8
  make_soak
  timeout 200 python3 tools/soak.py /tmp/soak.bin --runs 20 --steps 1000 --json "$OUT/soak.json" 2>/dev/null | tail -4
  timeout 200 python3 tools/bench_kernels.py --json "$OUT/bench_kernels.json" 2>&1 | tail -30
else
  B=/tmp/8b.bin
  make_models 8b 2>&1 | tail -2
  python3 -m kuiper_py generate -m $B -p "The capital of France is" -n 64 --temp 0 --device cuda 2>&1 >/dev/null | tr '\r' '\n' | grep -v upload | tail -1
  python3 -m kuiper_py bench -m $B -p 512,2048 -n 128 -r 3 --device cuda 2>/dev/null | tee "$OUT/bench8b.md"
  timeout 330 python3 tools/bench_e2e.py $B ${E2E_ARGS:-} --json "$OUT/bench_e2e.json" 2>&1 | grep -v upload | tail -20
  [ "${KERNELS:-1}" != 1 ] || timeout 200 python3 tools/bench_kernels.py --json "$OUT/bench_kernels.json" 2>&1 | tail -30
fi
