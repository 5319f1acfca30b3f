#!/usr/bin/env bash
# Fuzzes sluice's parsers with cargo fuzz (libFuzzer; needs a nightly toolchain and
# `cargo install cargo-fuzz`).
#
#   scripts/fuzz.sh TARGET [SECONDS]            one target (gguf, safetensors, hf_config,
#                                               tokenizer_json, chat_template, pack_manifest,
#                                               server_request)
#   scripts/fuzz.sh all [SECONDS]               each in turn
#
# Starts from fuzz/seeds/TARGET (scripts/make_fuzz_seeds.py) and keeps what it learns in
# fuzz/corpus/TARGET (not in git). A crash, hang (-timeout 10 s per input) or allocation
# over 2 GiB (-rss_limit_mb / -malloc_limit_mb) stops it and leaves the input in
# fuzz/artifacts/TARGET; once fixed, it goes into fuzz/regressions/TARGET, which
# crates/sluice-fuzz/tests/corpus.rs runs on every test run. The last line of each run's
# log (fuzz/logs/TARGET.log) gives executions, coverage and corpus size.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
target="${1:?usage: scripts/fuzz.sh TARGET|all [SECONDS]}"
seconds="${2:-600}"
host="$(rustc -vV | sed -n 's/^host: //p')"
cargo +nightly fuzz build -O >/dev/null
targets=("$target")
[ "$target" = all ] && targets=(gguf safetensors hf_config tokenizer_json chat_template pack_manifest server_request)
mkdir -p logs
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t" "artifacts/$t"
    echo "fuzzing $t for ${seconds}s"
    "target/$host/release/$t" "corpus/$t" "seeds/$t" \
        -max_len=65536 -rss_limit_mb=2048 -malloc_limit_mb=2048 -timeout=10 \
        -max_total_time="$seconds" \
        -artifact_prefix="artifacts/$t/" -print_final_stats=1 >"logs/$t.log" 2>&1 || {
        echo "$t stopped on a finding: see fuzz/logs/$t.log and fuzz/artifacts/$t" >&2
        exit 1
    }
    grep -E "^#[0-9]+.*DONE" "logs/$t.log" | tail -1
done
