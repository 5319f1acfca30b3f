#!/usr/bin/env bash
# Perplexity at each KV cache width, the issue's table: the license texts under
# /usr/share/common-licenses (real files, not their links) concatenated, scored by
# `sluice perplexity` at each context and --kv-bits, one run after another.
#
#   scripts/kv_perplexity.sh [MODEL] [CONTEXTS] [WIDTHS] [TOKENS]
#
# Defaults: Qwen2.5-Coder-1.5B from .cache/models, contexts "4096 8192", widths
# "16 4 3.5 2", and 16384 tokens a context (its number of windows). Prints a markdown
# table: PPL +- its standard error, and the ratio to the first width's PPL.
set -euo pipefail
model="${1:-.cache/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}"
contexts="${2:-4096 8192}"
widths="${3:-16 4 3.5 2}"
tokens="${4:-16384}"
sluice="${SLUICE:-target/release/sluice}"
text="$(mktemp --suffix .txt)"
trap 'rm -f "$text"' EXIT
find /usr/share/common-licenses -type f | sort | xargs cat >"$text"
echo "| context | --kv-bits | PPL | ratio to --kv-bits ${widths%% *} | seconds |"
echo "| --- | --- | --- | --- | --- |"
for c in $contexts; do
    base=""
    for w in $widths; do
        j=$("$sluice" perplexity --model "$model" --file "$text" --context "$c" --chunks $((tokens / c)) \
            --kv-bits "$w" --json 2>/dev/null)
        read -r ppl err secs <<<"$(python3 -c 'import json,sys; j=json.loads(sys.argv[1]); print(j["ppl"], j["ppl_stderr"], j["seconds"])' "$j")"
        base="${base:-$ppl}"
        ratio=$(python3 -c "print(f'{$ppl / $base:.4f}')")
        printf '| %s | %s | %.4f +- %.4f | %s | %.0f |\n' "$c" "$w" "$ppl" "$err" "$ratio" "$secs"
    done
done
