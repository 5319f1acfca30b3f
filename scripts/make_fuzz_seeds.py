#!/usr/bin/env python3
"""Writes the seed inputs of sluice's fuzz targets into fuzz/seeds/<target>/.

    /path/to/venv/bin/python scripts/make_fuzz_seeds.py [GGUF ...]

The seeds in git were made with the fixtures and sluice synth's tiny geometries:

    for g in tiny-moe tiny-gemma4 tiny-gpt-oss tiny-deepseek tiny-qwen3.5; do
        sluice synth --geometry $g --out /tmp/seeds/$g.gguf; done
    for q in q5_k q6_k q8_0 q4_0 q4_1 q5_0 q5_1 mxfp4 f16 bf16; do
        sluice synth --geometry tiny-moe --quant $q --layers 1 --out /tmp/seeds/moe-$q.gguf; done
    python scripts/make_fuzz_seeds.py fixtures/tiny/*/*.gguf /tmp/seeds/*.gguf

pack_manifest's seeds are the manifests `sluice synth --geometry G --layers N --packed DIR`
writes (tiny-moe 2, the folder the target checks them against; tiny-gpt-oss 1,
tiny-deepseek 2, tiny-qwen3.5 2, tiny-gemma4 1), copied from DIR/sluice-pack.json.

Needs the `gguf` package (pip install gguf numpy). The fuzzers start from these and
grow their own corpus (fuzz/corpus, not kept); the seeds are kept, and CI runs every
target over them and over fuzz/regressions (crates/sluice-fuzz/tests/corpus.rs).

gguf: every GGUF given (by default the fixtures in fixtures/tiny and what
`sluice synth` writes for its tiny geometries, if passed) rewritten by gguf-py, another
writer than sluice's: all of its metadata (architecture, hyperparameters, vocabulary,
chat template) and every tensor with its name and type, each shrunk to one block of
its type so that a seed is a few kilobytes beyond its vocabulary.
hf_config, tokenizer_json, chat_template: the files of fixtures/tiny; safetensors: each
fixture's tensor names, types and ranks with every dimension cut to at most 2.
"""

import glob
import json
import os
import sys

import numpy as np
import gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = os.path.join(ROOT, "fuzz", "seeds")


def out(target, name, data):
    d = os.path.join(SEEDS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def shrink_gguf(src, dst):
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        # The writer adds these itself.
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        if vtype == gguf.GGUFValueType.ARRAY and not field.contents():
            continue  # gguf-py writes no empty arrays
        w.add_key_value(name, field.contents(), vtype, sub)
    for t in r.tensors:
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        data = np.frombuffer(bytes(t.data.tobytes()[:size]), dtype=np.uint8)
        # One block: gguf-py takes the shape in bytes for raw data ([size] bytes is
        # [block] elements).
        w.add_tensor(t.name, data, raw_shape=[size], raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def safetensors_file(tensors, metadata=None):
    """A .safetensors file of (name, dtype, shape, element size) tensors, data counting up."""
    header, data = {}, b""
    for name, dtype, shape, size in tensors:
        n = size
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + n]}
        data += bytes(i % 251 for i in range(n))
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def main():
    ggufs = sys.argv[1:] or sorted(glob.glob(os.path.join(ROOT, "fixtures/tiny/*/*.gguf")))
    for src in ggufs:
        name = os.path.splitext(os.path.basename(src))[0]
        d = os.path.join(SEEDS, "gguf")
        os.makedirs(d, exist_ok=True)
        shrink_gguf(src, os.path.join(d, name + ".gguf"))
    for fixture in sorted(glob.glob(os.path.join(ROOT, "fixtures/tiny/*/"))):
        name = os.path.basename(os.path.dirname(fixture))
        for target, file in [("hf_config", "config.json"), ("tokenizer_json", "tokenizer.json")]:
            p = os.path.join(fixture, file)
            if os.path.exists(p):
                out(target, name + ".json", open(p, "rb").read())
        st = os.path.join(fixture, "model.safetensors")
        if os.path.exists(st):
            # The fixture's names, dtypes and ranks, each dimension cut to at most 2.
            with open(st, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            size = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I64": 8}
            tensors = [(k, v["dtype"], [min(d, 2) for d in v["shape"]], size.get(v["dtype"], 1))
                       for k, v in sorted(header.items()) if k != "__metadata__"][:24]
            out("safetensors", name + ".safetensors", safetensors_file(tensors, header.get("__metadata__")))
        cfg = os.path.join(fixture, "tokenizer_config.json")
        if os.path.exists(cfg):
            template = json.load(open(cfg)).get("chat_template")
            if isinstance(template, str):
                out("chat_template", name + ".jinja", template.encode())
        jinja = os.path.join(fixture, "chat_template.jinja")
        if os.path.exists(jinja):
            out("chat_template", name + ".jinja", open(jinja, "rb").read())


if __name__ == "__main__":
    main()
