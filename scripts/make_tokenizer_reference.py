#!/usr/bin/env python3
"""Reference tokenizations of the real GGUF models, from Hugging Face transformers.

sluice builds a tokenizer from a GGUF file's `tokenizer.ggml.*` metadata
(`Tokenizer::from_gguf`); its reference is the tokenizer transformers builds from the same
file, `AutoTokenizer.from_pretrained(folder, gguf_file=name)`. For each fetched model this
script writes fixtures/tokenizer/<model>.json holding:

- "encode": for every text of CORPUS (code, digits, whitespace runs, accented Latin, emoji with
  ZWJ sequences, CJK, Arabic, special-token strings written in text, the empty string), the
  ids of `tok(text)` (add_special_tokens=True, the default) and
  `tok.decode(ids, skip_special_tokens=True)`;
- "chat": CHAT (system, user, assistant, user) rendered by the file's chat template with
  add_generation_prompt=True (`apply_chat_template(..., tokenize=False)`) and the ids
  `apply_chat_template(..., tokenize=True)` gives (the rendered text encoded with
  add_special_tokens=False); null, with "chat_missing" saying why, when the file has no template.

sluice's crates/sluice-tokenizer/tests/gguf.rs checks its own tokenizer against these. CI
never runs this script; its outputs are committed (a few KB each).

Setup (from PyPI; made with transformers 5.24.0, tokenizers 0.23.3, gguf 0.19.0):

    python3 -m venv .venv-ref
    .venv-ref/bin/pip install "transformers>=5.24" tokenizers gguf sentencepiece jinja2
    scripts/fetch_models.sh all

Usage, from the repository root:

    .venv-ref/bin/python scripts/make_tokenizer_reference.py [--models DIR] [--out DIR] [NAME ...]

--models defaults to $SLUICE_MODELS, else .cache/models; NAME is one of MODELS (default: all
that are present; a named model that is missing is an error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import tokenizers
import transformers
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent

# The names scripts/fetch_models.sh uses, and the files it writes.
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
}

CORPUS = [
    "Hello, world! This is a test.",
    " Hello with a leading space",
    "",
    " ",
    "\n",
    # Code, indented with spaces and with tabs.
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'
    "        return n\n    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n"
    "    return b\n\n\nclass Foo:\n\tdef bar(self):  # tab-indented\n\t\treturn {\"key\": [1, 2, 3]}\n",
    "fn main() {\n    let v: Vec<u64> = (0..10).map(|x| x * x).collect();\n    println!(\"{v:?}\");\n}\n",
    # Digits and long numbers.
    "Pi is 3.14159265358979, e is 2.71828; 1234567890123456789 and 0x1F, 1,000,000 and 2024-02-29.",
    "Call 555-0123 or +44 20 7946 0958 before 23:59:59 on 12/31/1999 (ID #000042, $1,234.56, 99.9%).",
    # Whitespace runs, tabs, newlines, carriage returns.
    "  leading spaces\tand\ttabs\n\n\nmultiple newlines   trailing   \r\n windows line\r\n\t\t\tend  ",
    "a  b   c    d     e      f\n \n  \n\t \t",
    # Accented Latin.
    "Café, naïve résumé, Ærøskøbing, Straße, façade, São Paulo, Dvořák, Łódź, Ångström, crème brûlée.",
    # Emoji, with ZWJ sequences, skin tones, flags and variation selectors.
    "I ❤️ emoji 😀🎉 👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs, 🧑‍💻 coder, 🇫🇷🇯🇵 flags.",
    # CJK, Korean, Arabic, and more scripts.
    "日本語のテキストと中文文本，还有한국어 텍스트。東京は日本の首都です。",
    "مرحبا بالعالم! هذا نص عربي مع أرقام ١٢٣ و 456.",
    "Mixed: English, Français, Deutsch, 中文, русский текст, ελληνικά, עברית, हिन्दी, ไทย.",
    # Contractions and punctuation runs.
    "I'm sure they'll say it's what we'd've done, DON'T YOU? Yes!!! ... --- ??? (((nested)))",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    # Special-token strings written in text, for every model's format, and HTML.
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n<eos><pad><unk><mask>",
    "<s>[INST] hi [/INST]</s><tool_call>{\"name\": \"f\"}</tool_call><|fim_prefix|>x<|fim_suffix|>",
    "<table><tr><td>cell</td></tr></table><h1>Title</h1><code>x = 1</code>",
    # Odd characters: NUL, no-break space, zero-width space, a lone combining mark.
    "null\u0000byte, no\u00a0break, zero\u200bwidth, e\u0301 combining, tab\u000bvtab",
]

CHAT = [
    {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Japan? Answer with 日本語 too 😀."},
]


def reference(folder: Path, file: str) -> dict:
    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=file)
    out: dict = {
        "file": file,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "add_special_tokens": True,
        "encode": [],
    }
    for text in CORPUS:
        ids = tok(text)["input_ids"]
        out["encode"].append(
            {"text": text, "ids": ids, "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)}
        )
    if tok.chat_template:
        text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        out["chat"] = {"messages": CHAT, "add_generation_prompt": True, "text": text, "ids": ids}
    else:
        out["chat"] = None
        out["chat_missing"] = "the file has no tokenizer.chat_template"
    return out


def dump(data: dict) -> str:
    """JSON with one corpus entry per line, so that diffs stay readable."""
    lines = ["{"]
    keys = list(data)
    for i, key in enumerate(keys):
        comma = "," if i + 1 < len(keys) else ""
        value = data[key]
        if key == "encode":
            lines.append('  "encode": [')
            for j, entry in enumerate(value):
                sep = "," if j + 1 < len(value) else ""
                lines.append("    " + json.dumps(entry, ensure_ascii=False) + sep)
            lines.append("  ]" + comma)
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=os.environ.get("SLUICE_MODELS", str(ROOT / ".cache" / "models")))
    ap.add_argument("--out", default=str(ROOT / "fixtures" / "tokenizer"))
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"one of {', '.join(MODELS)}")
    args = ap.parse_args()
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    models = Path(args.models)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    names = args.names or list(MODELS)
    done = 0
    for name in names:
        path = models / MODELS[name]
        if not path.exists():
            msg = f"{name}: {path} is missing (scripts/fetch_models.sh {name})"
            if args.names:
                print(msg, file=sys.stderr)
                return 1
            print(f"skipped {msg}")
            continue
        data = reference(models, MODELS[name])
        target = out_dir / f"{name}.json"
        target.write_text(dump(data), encoding="utf-8")
        chat = "with chat" if data["chat"] else "no chat template"
        print(f"{name}: {len(data['encode'])} texts, {chat} -> {target}")
        done += 1
    if done == 0:
        print("no model found; fetch them with scripts/fetch_models.sh all", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
