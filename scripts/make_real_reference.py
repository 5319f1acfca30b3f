#!/usr/bin/env python3
"""Reference log-probabilities for the real GGUF models, from Hugging Face transformers.

transformers loads each GGUF file itself (``gguf_file=``), dequantizes every tensor to
float32 and runs its own float32 forward on CPU; this script records, for one real
sentence, the log-probabilities that forward gives at every position. sluice's tests
compare its own logits on the same tokens against them (mean KL, top-1 agreement).

Full logits would be tens of MB per model, so for every position the files keep the most
likely tokens, as many as it takes to cover COVER of the probability (at least MIN_K, at
most MAX_K), with their float32 log-probabilities, and the total probability of the rest;
KL is then computed over those tokens plus one bucket for the tail.

Files: fixtures/real/NAME.json (text, tokens, vocab size, tail mass per position) and
fixtures/real/NAME.top.bin (per position: u32 count, then count x (u32 id, f32 logprob),
little-endian).

With --long, the text is instead the first LONG_TOKENS tokens of the GNU GPL version 3
(/usr/share/common-licenses/GPL-3, whitespace collapsed) and the files NAME-long.*, with
fewer tokens kept per position (LONG_COVER, at most LONG_MAX_K): long enough that a
TurboQuant KV cache reads its codes (it keeps its first and last positions exact), small
enough to commit.

Setup (CI never runs this; its outputs are committed):
    python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch transformers accelerate gguf sentencepiece tokenizers numpy
    scripts/fetch_models.sh all
Usage:
    .venv-ref/bin/python scripts/make_real_reference.py [--models DIR] [--long] [NAME ...]
"""

import argparse
import json
import os
import struct
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
COVER = 0.995
MIN_K = 64
MAX_K = 16384
SENTENCE = (
    "The Eiffel Tower, completed in 1889 for the World's Fair, stands about 330 metres tall "
    "and remains one of the most visited monuments in Paris, the capital of France."
)
LONG_SOURCE = Path("/usr/share/common-licenses/GPL-3")
LONG_TOKENS = 512
LONG_COVER = 0.99
LONG_MAX_K = 256
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=os.environ.get("SLUICE_MODELS", str(ROOT / ".cache" / "models")))
    ap.add_argument("--long", action="store_true", help="the GPL-3 text, LONG_TOKENS tokens")
    ap.add_argument("names", nargs="*", default=list(MODELS))
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    for name in args.names:
        path = Path(args.models) / MODELS[name]
        if not path.exists():
            print(f"{name}: {path} is missing (scripts/fetch_models.sh)", file=sys.stderr)
            return 1
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        model.eval()
        if args.long:
            text = " ".join(LONG_SOURCE.read_text().split())
            ids = tok(text, return_tensors="pt").input_ids[:, :LONG_TOKENS]
            text = tok.decode(ids[0], skip_special_tokens=True)
            cover, max_k, suffix = LONG_COVER, LONG_MAX_K, "-long"
        else:
            text, cover, max_k, suffix = SENTENCE, COVER, MAX_K, ""
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        order = torch.argsort(logp, dim=-1, descending=True)
        blob = bytearray()
        tails = []
        for i in range(ids.shape[1]):
            lp = logp[i][order[i]]
            cum = torch.cumsum(lp.exp(), 0)
            k = int(torch.searchsorted(cum, torch.tensor(cover)).item()) + 1
            k = max(MIN_K, min(max_k, k))
            mass = cum[k - 1].item()
            tails.append(max(0.0, 1.0 - mass))
            blob += struct.pack("<I", k)
            for tid, v in zip(order[i][:k].tolist(), lp[:k].tolist()):
                blob += struct.pack("<If", tid, v)
        out = {
            "model": MODELS[name],
            "text": text,
            "tokens": ids[0].tolist(),
            "vocab_size": logits.shape[-1],
            "cover": cover,
            "tail_mass": tails,
            "top": f"{name}{suffix}.top.bin",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        }
        dest = ROOT / "fixtures" / "real" / f"{name}{suffix}.json"
        dest.write_text(json.dumps(out, indent=1))
        (ROOT / "fixtures" / "real" / f"{name}{suffix}.top.bin").write_bytes(bytes(blob))
        rows = [{"tail_mass": t} for t in tails]
        greedy = tok.decode(logits.argmax(-1).tolist())
        print(f"{name}: {ids.shape[1]} tokens, vocab {logits.shape[-1]}, max tail mass "
              f"{max(r['tail_mass'] for r in rows):.2e}, {len(blob) // 1024} KiB; argmax: {greedy!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
