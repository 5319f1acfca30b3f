#!/usr/bin/env bash
# Installs the official OpenAI and Anthropic Python clients (PyPI) into
# <repo>/.cache/clients, for the server tests that talk to `sluice serve` through them
# (crates/sluice-cli/tests/serve.rs, official_clients_talk_to_it). Idempotent.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.cache/clients"
if "$venv/bin/python" -c "import openai, anthropic" >/dev/null 2>&1; then
    exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check "openai==3.57.0" "anthropic==2.16.0"
echo "client_venv: openai and anthropic installed in $venv" >&2
