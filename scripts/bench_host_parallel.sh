#!/usr/bin/env bash
# Aggregate decode of 8 sequences against 1 on a bigger host's CPU (the GPU machine's
# host, which has no models and no network): writes a Qwen3-30B-A3B-geometry synthetic
# with Zipf-skewed routers and alternates `bench --parallel 1` and `--parallel 8` on it,
# at both precisions. Usage: scripts/bench_host_parallel.sh SLUICE_BIN [LAYERS]
set -euo pipefail
bin=$1
layers=${2:-16}
here=$(dirname "$0")
lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket)" || true
grep -o -E "avx512_vnni|avx512f|avxvnni|amx_int8" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
model=${TMPDIR:-/tmp}/qwen3-30b-synth-${layers}l.gguf
[ -f "$model" ] || { time "$bin" synth --geometry qwen3-30b-a3b --skew 0.9 --layers "$layers" --out "$model"; }
for precision in auto fast; do
  echo "== --precision $precision"
  python3 "$here/bench_engine.py" --bin "$bin" parallel "$model" --rounds 3 -- \
    --prompt-tokens 32 --gen-tokens 32 --residency mapped --precision "$precision"
done
