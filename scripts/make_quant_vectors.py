#!/usr/bin/env python3
"""Make the GGUF block-format test vectors in fixtures/quant/ from gguf-py's reference dequantizer.

For every stored type sluice reads (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K,
MXFP4) it writes `fixtures/quant/<NAME>.bin`: random blocks in GGUF's byte layout and what
`gguf.quants.dequantize` makes of them, as float32. The Rust test
`sluice-core/src/quant.rs::tests::matches_gguf_py` checks sluice's reference dequantizer
against these bit for bit, and `sluice-cpu`'s `row_to_f32` is checked against that dequantizer.

File layout, all little-endian:

    u32 n_blocks, u32 block_bytes, u32 block_elems,
    n_blocks * block_bytes bytes of blocks,
    n_blocks * block_elems float32 values (gguf-py's dequantization, in block order)

"Block" means one element for the plain types. The blocks are random but shaped like real data:
- half-precision scales (d, dmin, Q4_1/Q5_1's m) are finite float16s, mostly of realistic size
  (|d| between 1e-5 and 0.1, m between -0.1 and 0.01), plus edge cases: zero, the smallest
  subnormal, subnormals, 65504 and negative scales;
- nibbles, high bits, 6-bit K-quant scales and Q6_K's int8 scales are uniformly random bytes;
- Q8_0 quants cover the whole int8 range, -128 included;
- MXFP4's e8m0 exponent byte covers 0, 1, 2 (gguf-py's subnormal branch), 127, 254, 255 and
  random values in between;
- plain types are random bit patterns with the exponent kept finite (subnormals included).

32-element types get 400 blocks; 256-element types get 72 blocks (each block carries 1 KiB of
float32 output, and every file stays under 100 KB); plain types get 4096 elements.
The seed is fixed, so the output is deterministic; CI never runs this script, its outputs are
committed.

Setup (PyPI; made with gguf 0.19.0 and numpy 2.4):

    python3 -m venv /work/venv/ref        # or any venv
    /work/venv/ref/bin/pip install gguf numpy

Run from the repository root:

    /work/venv/ref/bin/python scripts/make_quant_vectors.py [--out fixtures/quant]
"""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

SEED = 20240611
N_SMALL = 400  # blocks of the 32-element types
N_K = 72  # blocks of the 256-element types
N_PLAIN = 4096  # elements of the plain types


def f16_scales(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    """`n` finite float16 scales as raw bytes [n, 2]: log-uniform magnitudes in [lo, hi] with a
    random sign for a tenth of them, and edge cases mixed in."""
    mag = np.exp(rng.uniform(np.log(lo), np.log(hi), n))
    sign = np.where(rng.random(n) < 0.1, -1.0, 1.0)
    v = (mag * sign).astype(np.float16)
    edges = np.array([0.0, 6e-8, 3e-6, -4e-7, 65504.0, -1.5, 1.0], dtype=np.float16)
    k = min(len(edges), n // 8)
    idx = rng.choice(n, size=k, replace=False)
    v[idx] = edges[:k]
    assert np.all(np.isfinite(v))
    return v.view(np.uint8).reshape(n, 2)


def rand_bytes(rng: np.random.Generator, n: int, width: int) -> np.ndarray:
    return rng.integers(0, 256, size=(n, width), dtype=np.uint8)


def make_blocks(qt: T, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `qt` as a uint8 array [n_blocks, block_bytes]."""
    if qt == T.F32:
        bits = rng.integers(0, 2**32, size=N_PLAIN, dtype=np.uint64).astype(np.uint32)
        exp = (bits >> 23) & 0xFF
        bits = np.where(exp == 0xFF, bits & ~np.uint32(0x40000000), bits)  # keep finite
        return bits.view(np.uint8).reshape(N_PLAIN, 4)
    if qt == T.F16:
        bits = rng.integers(0, 2**16, size=N_PLAIN, dtype=np.uint32).astype(np.uint16)
        exp = (bits >> 10) & 0x1F
        bits = np.where(exp == 0x1F, bits & ~np.uint16(0x4000), bits)
        return bits.view(np.uint8).reshape(N_PLAIN, 2)
    if qt == T.BF16:
        bits = rng.integers(0, 2**16, size=N_PLAIN, dtype=np.uint32).astype(np.uint16)
        exp = (bits >> 7) & 0xFF
        bits = np.where(exp == 0xFF, bits & ~np.uint16(0x4000), bits)
        return bits.view(np.uint8).reshape(N_PLAIN, 2)

    n = N_K if GGML_QUANT_SIZES[qt][0] == 256 else N_SMALL
    if qt == T.Q8_0:
        parts = [f16_scales(rng, n, 1e-5, 0.1), rand_bytes(rng, n, 32)]
    elif qt == T.Q4_0:
        parts = [f16_scales(rng, n, 1e-5, 0.1), rand_bytes(rng, n, 16)]
    elif qt == T.Q4_1:
        parts = [f16_scales(rng, n, 1e-5, 0.1), f16_scales(rng, n, 1e-4, 0.1), rand_bytes(rng, n, 16)]
    elif qt == T.Q5_0:
        parts = [f16_scales(rng, n, 1e-5, 0.1), rand_bytes(rng, n, 4), rand_bytes(rng, n, 16)]
    elif qt == T.Q5_1:
        parts = [f16_scales(rng, n, 1e-5, 0.1), f16_scales(rng, n, 1e-4, 0.1), rand_bytes(rng, n, 4), rand_bytes(rng, n, 16)]
    elif qt == T.Q4_K:
        parts = [f16_scales(rng, n, 1e-6, 0.01), f16_scales(rng, n, 1e-6, 0.01), rand_bytes(rng, n, 12), rand_bytes(rng, n, 128)]
    elif qt == T.Q5_K:
        parts = [
            f16_scales(rng, n, 1e-6, 0.01),
            f16_scales(rng, n, 1e-6, 0.01),
            rand_bytes(rng, n, 12),
            rand_bytes(rng, n, 32),
            rand_bytes(rng, n, 128),
        ]
    elif qt == T.Q6_K:
        parts = [rand_bytes(rng, n, 128), rand_bytes(rng, n, 64), rand_bytes(rng, n, 16), f16_scales(rng, n, 1e-6, 0.01)]
    elif qt == T.MXFP4:
        e = rng.integers(100, 140, size=(n, 1), dtype=np.uint8)
        e[: 6, 0] = [0, 1, 2, 127, 254, 255]
        e[6:40, 0] = rng.integers(0, 256, size=34, dtype=np.uint8)
        parts = [e, rand_bytes(rng, n, 16)]
    else:
        raise ValueError(qt)
    blocks = np.concatenate(parts, axis=1)
    assert blocks.shape == (n, GGML_QUANT_SIZES[qt][1]), (qt, blocks.shape)
    return blocks


TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="fixtures/quant", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    for qt in TYPES:
        elems, nbytes = GGML_QUANT_SIZES[qt]
        blocks = make_blocks(qt, rng)
        n = blocks.shape[0]
        # gguf-py dequantizes a byte array whose last axis is a whole row of blocks.
        # MXFP4 exponents 254 and 255 overflow to inf on purpose; numpy would warn.
        with np.errstate(over="ignore"):
            values = dequantize(blocks.reshape(1, n * nbytes).copy(), qt).astype(np.float32, copy=False)
        values = values.reshape(-1)
        assert values.shape == (n * elems,)
        path = args.out / f"{qt.name}.bin"
        with open(path, "wb") as f:
            f.write(struct.pack("<III", n, nbytes, elems))
            f.write(blocks.tobytes())
            f.write(values.astype("<f4").tobytes())
        size = path.stat().st_size
        assert size < 100_000, (path, size)
        print(f"{path}: {n} blocks, {size} bytes, {np.isfinite(values).mean():.3f} finite")


if __name__ == "__main__":
    main()
