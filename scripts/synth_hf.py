#!/usr/bin/env python3
"""Synthetic Hugging Face checkpoints with a real model's geometry and random weights.

For measuring speed and memory at real sizes without the real weights (no model hub is
reachable here). The model is built on PyTorch's "meta" device, so only tensor names and
shapes come from transformers; the weights are random bfloat16 written straight to
safetensors shards, one tensor at a time (nothing the size of the model is ever in memory).

Setup: python3 -m venv .venv-ref && .venv-ref/bin/pip install torch transformers safetensors numpy
Usage: .venv-ref/bin/python scripts/synth_hf.py GEOMETRY OUT_DIR [--layers N]
       GEOMETRY: gemma4-26b-a4b | qwen3-30b-a3b
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

GEOMETRIES = {
    # Gemma 4 26B-A4B: 30 layers (5:1 sliding:full), 128 experts top-8 beside a dense MLP.
    "gemma4-26b-a4b": dict(
        cls="Gemma4ForCausalLM", cfg="Gemma4TextConfig",
        config=dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                    num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=1024,
                    enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                    hidden_size_per_layer_input=0, final_logit_softcapping=30.0, max_position_embeddings=262144),
    ),
    "qwen3-30b-a3b": dict(
        cls="Qwen3MoeForCausalLM", cfg="Qwen3MoeConfig",
        config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                    num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                    tie_word_embeddings=False, max_position_embeddings=40960),
    ),
}

SHARD_BYTES = 2 << 30


def write_bf16_safetensors(path: Path, tensors: dict) -> None:
    """Writes uint16 arrays holding bfloat16 bits as BF16 safetensors."""
    header, offset = {}, 0
    for k, v in tensors.items():
        header[k] = {"dtype": "BF16", "shape": list(v.shape), "data_offsets": [offset, offset + v.nbytes]}
        offset += v.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for v in tensors.values():
            f.write(np.ascontiguousarray(v).tobytes())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("geometry", choices=list(GEOMETRIES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import transformers

    g = GEOMETRIES[args.geometry]
    cfg_kwargs = dict(g["config"])
    if args.layers:
        cfg_kwargs["num_hidden_layers"] = args.layers
        if "layer_types" not in cfg_kwargs and args.geometry.startswith("gemma"):
            cfg_kwargs["layer_types"] = [
                "full_attention" if (i + 1) % 6 == 0 or i == args.layers - 1 else "sliding_attention"
                for i in range(args.layers)
            ]
    cfg = getattr(transformers, g["cfg"])(**cfg_kwargs)
    cfg.architectures = [g["cls"]]
    with torch.device("meta"):
        model = getattr(transformers, g["cls"])(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)

    args.out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(args.out)
    rng = np.random.default_rng(args.seed)
    weight_map, shard, shard_bytes, n_shard, total = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, shard_bytes, n_shard
        if shard:
            name = f"model-{n_shard:05d}.safetensors"
            write_bf16_safetensors(args.out / name, shard)
            for k in shard:
                weight_map[k] = name
            n_shard += 1
            shard, shard_bytes = {}, 0

    for name, shape in shapes.items():
        n = int(np.prod(shape))
        if len(shape) == 1 or name.endswith("layer_scalar"):
            v = (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
        else:
            v = (0.02 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
        # float32 -> bfloat16 bits (round to nearest even), kept as uint16 and tagged BF16 below.
        bits = v.view(np.uint32)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        shard[name] = bits.reshape(shape)
        shard_bytes += bits.nbytes
        total += bits.nbytes
        if shard_bytes >= SHARD_BYTES:
            flush()
        print(f"\r{total / 2**30:7.2f} GiB", end="", file=sys.stderr)
    flush()
    print(file=sys.stderr)
    (args.out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    print(f"{args.out}: {len(shapes)} tensors, {total / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
