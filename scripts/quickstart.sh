#!/usr/bin/env bash
# Builds sluice and runs it once: a chat turn with a tiny fixture checkpoint
# (random weights, so the reply is gibberish; it shows the whole path working).
# Needs only a Rust toolchain (cargo); everything else comes from crates.io.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p sluice-cli
./target/release/sluice inspect --model fixtures/tiny/gemma4-moe
./target/release/sluice run --model fixtures/tiny/gemma4-moe --chat \
    --prompt "What is the capital of France?" --temperature 0 --max-tokens 24 --stats
