#!/usr/bin/env bash
# Perplexity at each KV cache width, the issue's table: the license texts under
# /usr/share/common-licenses (real files, not their links) concatenated, scored by
# `sluice perplexity` at each context and --kv-bits, one run after another.
#
#   scripts/kv_perplexity.sh [MODEL] [CONTEXTS] [WIDTHS] [TOKENS]
#
# Defaults: Qwen2.5-Coder-1.5B from .cache/models, contexts "4096 8192", widths
# "16 4 3.5 2" (an empty string: llama.cpp alone), and 16384 tokens a context (its number of windows). Prints a markdown
# table: PPL +- its standard error, and the ratio to the first width's PPL.
#
# With LLAMA_PERPLEXITY (llama.cpp's llama-perplexity), the same windows of the same text
# are also scored by llama.cpp with each of its caches in LLAMA_CACHES (default
# "f16 q8_0 q4_0", flash attention on, which its quantized V cache needs), the ratio then
# to its first cache. Both score the second half of each window.
set -euo pipefail
model="${1:-.cache/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}"
contexts="${2:-4096 8192}"
widths="${3-16 4 3.5 2}"
tokens="${4:-16384}"
sluice="${SLUICE:-target/release/sluice}"
text="$(mktemp --suffix .txt)"
log="$(mktemp)"
trap 'rm -f "$text" "$log"' EXIT
find /usr/share/common-licenses -type f | sort | xargs cat >"$text"
# A run that fails stops the table with the run it was and the end of what it said.
fail() {
    echo "kv_perplexity.sh: $1; its last lines:" >&2
    tail -n 5 <<<"$2" >&2
    exit 1
}
echo "| context | --kv-bits | PPL | ratio to --kv-bits ${widths%% *} | seconds |"
echo "| --- | --- | --- | --- | --- |"
for c in $contexts; do
    base=""
    for w in $widths; do
        j=$("$sluice" perplexity --model "$model" --file "$text" --context "$c" --chunks $((tokens / c)) \
            --kv-bits "$w" --json 2>"$log") || fail "sluice perplexity --context $c --kv-bits $w failed (exit $?)" "$(cat "$log")"
        read -r ppl err secs <<<"$(python3 -c 'import json,sys; j=json.loads(sys.argv[1]); print(j["ppl"], j["ppl_stderr"], j["seconds"])' "$j")"
        base="${base:-$ppl}"
        ratio=$(python3 -c "print(f'{$ppl / $base:.4f}')")
        printf '| %s | %s | %.4f +- %.4f | %s | %.0f |\n' "$c" "$w" "$ppl" "$err" "$ratio" "$secs"
    done
done
[ -n "${LLAMA_PERPLEXITY:-}" ] || exit 0
export LD_LIBRARY_PATH="$(dirname "$LLAMA_PERPLEXITY"):${LD_LIBRARY_PATH:-}"
llama_caches="${LLAMA_CACHES:-f16 q8_0 q4_0}"
for c in $contexts; do
    base=""
    for t in $llama_caches; do
        start=$(date +%s)
        out=$("$LLAMA_PERPLEXITY" -m "$model" -f "$text" -c "$c" --chunks $((tokens / c)) \
            -t "${THREADS:-2}" -fa on -ctk "$t" -ctv "$t" 2>&1) || fail "llama-perplexity -c $c, $t cache failed (exit $?)" "$out"
        read -r ppl err < <(sed -n 's/.*Final estimate: PPL = \([0-9.]*\) +\/- \([0-9.]*\).*/\1 \2/p' <<<"$out") ||
            fail "llama-perplexity -c $c, $t cache printed no final estimate" "$out"
        base="${base:-$ppl}"
        ratio=$(python3 -c "print(f'{$ppl / $base:.4f}')")
        printf '| %s | llama.cpp %s | %.4f +- %.4f | %s | %s |\n' "$c" "$t" "$ppl" "$err" "$ratio" $(($(date +%s) - start))
    done
done
