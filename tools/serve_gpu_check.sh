#!/usr/bin/env bash
# One stream through `kuiper serve` against the bare engine, in one run:
#   tools/serve_gpu_check.sh MODEL.bin [DEVICE] [PROMPT_LEN] [GEN_LEN]
# (defaults: cuda, 512, 128). Starts the server on a free port, measures one stream's decode tok/s over GEN_LEN
# tokens and the TTFT of a PROMPT_LEN-token prompt (tools/bench_serve.py --single, medians of 5), stops it, runs
# `kuiper bench -m MODEL -p PROMPT_LEN -n GEN_LEN`, and prints the comparison: server decode / bench tgN
# (target >= 0.95) and TTFT / bare prefill time (target <= 1.2). Exit 0 when both targets hold, 1 when not.
set -euo pipefail
MODEL=${1:?usage: tools/serve_gpu_check.sh MODEL.bin [DEVICE] [PROMPT_LEN] [GEN_LEN]}
DEVICE=${2:-cuda}
P=${3:-512}
N=${4:-128}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
WORK=$(mktemp -d)
SERVER=""
cleanup() {
  if [ -n "$SERVER" ] && kill -0 "$SERVER" 2>/dev/null; then kill -TERM "$SERVER"; wait "$SERVER" || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

"$PY" -m kuiper_py serve -m "$MODEL" --device "$DEVICE" --port 0 --max-context $((P + N + 64)) \
  2> >(tee "$WORK/server.log" >&2) &
SERVER=$!
URL=""
for _ in $(seq 1 600); do
  URL=$(grep -o 'http://127.0.0.1:[0-9]*' "$WORK/server.log" 2>/dev/null | head -1 || true)
  if [ -n "$URL" ] && curl -sf "$URL/health" >/dev/null 2>&1; then break; fi
  kill -0 "$SERVER" 2>/dev/null || { echo "serve_gpu_check: the server exited" >&2; exit 2; }
  sleep 0.5
done
curl -sf "$URL/health" >/dev/null || { echo "serve_gpu_check: the server did not become ready" >&2; exit 2; }

"$PY" "$ROOT/tools/bench_serve.py" --base-url "$URL" --single --input-len "$P" --output-len "$N" --json \
  > "$WORK/serve.json"
kill -TERM "$SERVER"
wait "$SERVER"
SERVER=""
"$PY" -m kuiper_py bench -m "$MODEL" --device "$DEVICE" -p "$P" -n "$N" -o json > "$WORK/bench.json"

"$PY" - "$WORK/serve.json" "$WORK/bench.json" "$P" "$N" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
rows = {r["test"]: r for r in json.load(open(sys.argv[2]))}
p, n = sys.argv[3], sys.argv[4]
tg, pp = rows[f"tg{n}"]["avg_ts"], rows[f"pp{p}"]["avg_ts"]
prefill_ms = int(p) / pp * 1000
dec, ttft = s["decode_tok_s"] / tg, s["ttft_ms"] / prefill_ms
print(f"| figure | server | kuiper bench | ratio | target |")
print(f"| --- | ---: | ---: | ---: | --- |")
print(f"| decode tok/s (one stream, {n} tokens) | {s['decode_tok_s']:.1f} | {tg:.1f} (tg{n}) | {dec:.3f} | >= 0.95 |")
print(f"| TTFT / prefill ms ({p}-token prompt) | {s['ttft_ms']:.1f} | {prefill_ms:.1f} (pp{p}) | {ttft:.3f} | <= 1.2 |")
sys.exit(0 if dec >= 0.95 and ttft <= 1.2 else 1)
EOF
