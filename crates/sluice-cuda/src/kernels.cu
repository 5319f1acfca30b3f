// sluice's CUDA kernels, compiled by NVRTC when the backend starts (kernels.rs).
//
// Weights stay in their stored format in device memory; every product dequantizes
// four consecutive elements at a time per thread (deq4; Q6_K two such runs that share
// their codes' bytes, deq_pair_q6k; Q4_K and Q5_K sixteen weights a lane, K16) into
// registers and multiplies in f32.
// The layouts are ggml's, as sluice_core::quant::dequantize_block reads them.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;

// Programmatic dependent launch (Hopper and later; device.rs's `Launches`): a kernel
// may be started while the one before it in the stream is still running, so that its
// blocks are resident when that one ends instead of a launch's latency later. Each
// kernel therefore waits here, before it touches memory, for the one before to finish
// and its writes to be visible (which, that one having waited likewise, covers every
// kernel before it), and only then lets the next one be started. Without the launch
// attribute both are no-ops.
__device__ __forceinline__ void grid_entry() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
}
// Activation codes: 0 SiLU, 1 GELU (tanh), 2 sigmoid.
__device__ __forceinline__ float act(int a, float x) {
    return a == 0 ? silu(x) : a == 1 ? gelu_tanh(x) : 1.0f / (1.0f + expf(-x));
}
// A gated unit of gate g and up u: kind 0/1 gated with that activation, 2 gpt-oss's
// clamped SwiGLU. One function for every kernel that applies it (glu, and the
// grouped gate and up products that end in it), so that they give the same bits.
__device__ __forceinline__ float glu_of(int kind, float alpha, float limit, float g, float u) {
    if (kind == 2) {
        float x = fminf(g, limit);
        float v = fminf(fmaxf(u, -limit), limit);
        return x / (1.0f + expf(-alpha * x)) * (v + 1.0f);
    }
    return act(kind, g) * u;
}

// Format codes, as kernels.rs numbers them.
#define F_F32 0
#define F_F16 1
#define F_BF16 2
#define F_Q8_0 3
#define F_Q4_0 4
#define F_Q4_1 5
#define F_Q5_0 6
#define F_Q5_1 7
#define F_MXFP4 8
#define F_Q4K 9
#define F_Q5K 10
#define F_Q6K 11

// IEEE half to float, exactly (NVRTC has no cuda_fp16.h without the toolkit's headers).
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float e8m0_half(u8 e) {
    // 2^(e - 128): the e2m1 values are stored doubled.
    return e == 0 ? __int_as_float(0x00200000) : (e == 1 ? __int_as_float(0x00400000) : __int_as_float((int)(e - 1) << 23));
}

// Sub-block j's 6-bit scale and min of a Q4_K / Q5_K super-block (scales at `s`).
__device__ __forceinline__ void k_scale_min(const u8* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

__constant__ signed char MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Aligned loads: the offsets below are multiples of the width for every row, since
// rows start 16-byte aligned and each format's block size keeps the alignment said.
__device__ __forceinline__ u32 ld16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld32(const u8* p) { return *(const u32*)p; }
// Four bytes at a 2-byte aligned address.
__device__ __forceinline__ u32 ld32_2(const u8* p) { return ld16(p) | (ld16(p + 2) << 16); }
__device__ __forceinline__ float h2f_lo(u32 w) { return h2f((u16)(w & 0xffff)); }
__device__ __forceinline__ float h2f_hi(u32 w) { return h2f((u16)(w >> 16)); }
// Byte k of a word's four, and its low or high nibble.
__device__ __forceinline__ int byte_k(u32 w, int k) { return (w >> (8 * k)) & 255; }

// (float)(c - off) for integers 0 <= c, off < 2^22, exactly, without the conversion
// unit: c in the mantissa of 2^23 is the float 2^23 + c, and taking 2^23 + off away
// is exact (`off` a constant, so that its float is folded). An SM converts 16
// integers a cycle against 128 multiply-adds, and the float products converted six
// integers for every eight weights (codes and scales); this takes two full-rate
// instructions, with the same bits.
__device__ __forceinline__ float int_float(u32 c, int off) { return __int_as_float(0x4B000000u | c) - (float)(8388608 + off); }

// Elements e..e+3 of a row (e a multiple of 4): four consecutive elements share one
// block, one scale and one 4-byte run of codes in every format, so a warp's 32 lanes
// read 128 consecutive elements with coalesced loads. `cols` bounds the plain
// formats' last group (the block formats' rows are whole blocks).
template <int F>
__device__ __forceinline__ void deq4(const u8* row, int e, int cols, float* v) {
    if (F == F_F32 || F == F_F16 || F == F_BF16) {
        if ((cols & 3) == 0) {
            if (F == F_F32) {
                float4 t = *(const float4*)(row + 4 * (long long)e);
                v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
            } else {
                uint2 t = *(const uint2*)(row + 2 * (long long)e);
                u32 w[2] = {t.x, t.y};
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    u16 h = (u16)(w[k >> 1] >> (16 * (k & 1)));
                    v[k] = F == F_F16 ? h2f(h) : __uint_as_float((u32)h << 16);
                }
            }
        } else {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int c = e + k;
                float x = 0.0f;
                if (c < cols) {
                    if (F == F_F32) x = ((const float*)row)[c];
                    else if (F == F_F16) x = h2f(((const u16*)row)[c]);
                    else x = __uint_as_float((u32)((const u16*)row)[c] << 16);
                }
                v[k] = x;
            }
        }
        return;
    }
    int i = e & 31;  // within a 32-element block
    if (F == F_Q8_0) {
        const u8* b = row + 34 * (e >> 5);
        float d = h2f((u16)ld16(b));
        u32 q = ld32_2(b + 2 + i);
#pragma unroll
        for (int k = 0; k < 4; k++) v[k] = (float)(i8)byte_k(q, k) * d;
    } else if (F == F_Q4_0 || F == F_Q4_1 || F == F_Q5_0 || F == F_Q5_1 || F == F_MXFP4) {
        // Codes: element i's nibble is the low one of byte i for i < 16, the high one
        // of byte i - 16 after.
        int sh = i < 16 ? 0 : 4;
        u32 q;
        float d, m = 0.0f;
        u32 qh = 0;
        if (F == F_Q4_0) {
            const u8* b = row + 18 * (e >> 5);
            d = h2f((u16)ld16(b));
            q = ld32_2(b + 2 + (i & 15));
        } else if (F == F_Q4_1) {
            const u8* b = row + 20 * (e >> 5);
            u32 dm = ld32(b);
            d = h2f_lo(dm), m = h2f_hi(dm);
            q = ld32(b + 4 + (i & 15));
        } else if (F == F_Q5_0) {
            const u8* b = row + 22 * (e >> 5);
            d = h2f((u16)ld16(b));
            qh = ld32_2(b + 2);
            q = ld32_2(b + 6 + (i & 15));
        } else if (F == F_Q5_1) {
            const u8* b = row + 24 * (e >> 5);
            u32 dm = ld32(b);
            d = h2f_lo(dm), m = h2f_hi(dm);
            qh = ld32(b + 4);
            q = ld32(b + 8 + (i & 15));
        } else {
            const u8* b = row + 17 * (e >> 5);
            d = e8m0_half(b[0]);
            const u8* qs = b + 1 + (i & 15);
            q = (u32)qs[0] | ((u32)qs[1] << 8) | ((u32)qs[2] << 16) | ((u32)qs[3] << 24);
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int c = (byte_k(q, k) >> sh) & 15;
            if (F == F_Q4_0) v[k] = d * (float)(c - 8);
            else if (F == F_Q4_1) v[k] = d * (float)c + m;
            // (int: the fifth bit comes from an unsigned word, and Q5_0 subtracts.)
            else if (F == F_Q5_0) v[k] = d * (float)((c | (int)(((qh >> (i + k)) & 1) << 4)) - 16);
            else if (F == F_Q5_1) v[k] = d * (float)(c | (int)(((qh >> (i + k)) & 1) << 4)) + m;
            else v[k] = d * (float)MXFP4_VALUES[c];
        }
    } else if (F == F_Q4K || F == F_Q5K) {
        const u8* b = row + (F == F_Q4K ? 144 : 176) * (e >> 8);
        int j = (e & 255) >> 5;  // sub-block
        u32 dm = ld32(b);
        int sc, mi;
        k_scale_min(b + 4, j, &sc, &mi);
        float scale = h2f_lo(dm) * (float)sc, mn = h2f_hi(dm) * (float)mi;
        u32 q = ld32(b + (F == F_Q4K ? 16 : 48) + 32 * (j >> 1) + i);
        u32 qh = F == F_Q5K ? ld32(b + 16 + i) : 0;
        int sh = (j & 1) * 4;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int c = (byte_k(q, k) >> sh) & 15;
            if (F == F_Q5K) c |= ((byte_k(qh, k) >> j) & 1) << 4;
            v[k] = scale * (float)c - mn;
        }
    } else if (F == F_Q6K) {
        const u8* b = row + 210 * (e >> 8);
        int ee = e & 255, h = ee >> 7, s = (ee & 127) >> 5;
        u32 ql = ld32_2(b + 64 * h + 32 * (s & 1) + i);
        u32 qh = ld32_2(b + 128 + 32 * h + i);
        float scale = h2f((u16)ld16(b + 208)) * (float)((const i8*)b)[192 + (ee >> 4)];
        int sh = s < 2 ? 0 : 4;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int lo = (byte_k(ql, k) >> sh) & 15;
            int hi = (byte_k(qh, k) >> (2 * s)) & 3;
            v[k] = scale * (float)((lo | (hi << 4)) - 32);
        }
    }
}

// Sub-blocks j and j + 1's 6-bit scales and mins (j even) from a Q4_K / Q5_K
// super-block's first 16 bytes held in registers (`head`: d and dmin, then the twelve
// bytes of scales), as k_scale_min reads them from memory.
__device__ __forceinline__ void k_scales_held(uint4 head, int j, int* sc, int* m) {
    int sh = 8 * (j & 3);  // bytes j & 3 and the next of each word
    u32 w1 = head.y >> sh, w2 = head.z >> sh, w3 = head.w >> sh;
#pragma unroll
    for (int t = 0; t < 2; t++) {
        u32 a = (w1 >> (8 * t)) & 255, b = (w2 >> (8 * t)) & 255, c = (w3 >> (8 * t)) & 255;
        // j < 4: scales[j], scales[j + 4]; after: scales[j + 4] (word 3) with the top
        // bits of scales[j - 4] (word 1) and scales[j] (word 2).
        sc[t] = j < 4 ? (int)(a & 63) : (int)((c & 15) | ((a >> 6) << 4));
        m[t] = j < 4 ? (int)(b & 63) : (int)((c >> 4) | ((b >> 6) << 4));
    }
}

// Two runs of four Q6_K elements that share their codes' bytes: a `ql` byte holds
// element i of strips s and s + 2 (elements e and e + 64), with its `qh` byte. One load
// of codes serves eight weights. v[0..4) are e.., v[4..8) e + 64.
#define PAIR_GAP 64
__device__ __forceinline__ void deq_pair_q6k(const u8* row, int e, float* v) {
    const u8* b = row + 210 * (e >> 8);
    int ee = e & 255, h = ee >> 7, s = (ee & 127) >> 5, i = e & 31;  // s 0 or 1
    u32 ql = ld32_2(b + 64 * h + 32 * s + i);
    u32 qh = ld32_2(b + 128 + 32 * h + i);
    float d = h2f((u16)ld16(b + 208));
    // The signed 8-bit scales, as unsigned ones 128 above.
    float s0 = d * int_float(b[192 + (ee >> 4)] ^ 0x80, 128);
    float s1 = d * int_float(b[192 + ((ee + 64) >> 4)] ^ 0x80, 128);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        u32 lo = byte_k(ql, k), hi = byte_k(qh, k);
        v[k] = s0 * int_float((lo & 15) | (((hi >> (2 * s)) & 3) << 4), 32);
        v[4 + k] = s1 * int_float((lo >> 4) | (((hi >> (2 * s + 4)) & 3) << 4), 32);
    }
}

// Byte k of `w` (at most 255) as a float, exactly: the byte placed in the mantissa of
// 2^23 by one byte permute, then 2^23 taken away (int_float without its shift and mask).
__device__ __forceinline__ float byte_float(u32 w, int k) {
    return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7440 | k)) - 8388608.0f;
}

// Sixteen weights of a Q4_K / Q5_K super-block `sb` for lane (p, h) of its sixteen:
// code bytes 4h..4h + 4 and 16 + 4h..16 + 4h + 4 of the super-block's 32-byte run p,
// whose low nibbles are elements 64p + 4h.. and 64p + 16 + 4h.. of sub-block 2p and
// whose high nibbles the same elements 32 on, of sub-block 2p + 1. Held as codes with
// their sub-blocks' scales (k16_load), made floats eight at a time (k16_weights): the
// scales are decoded once per sixteen weights, the nibbles masked four at a time and
// each made a float by one byte permute (byte_float). Four lanes' inputs for a run of
// four elements are 64 contiguous bytes, whole sectors.
struct K16 {
    float s0, n0, s1, n1;
    u32 lo[2], hi[2];
};
template <int F>
__device__ __forceinline__ K16 k16_load(const u8* row, int sb, int p, int h) {
    const u8* b = row + (F == F_Q4K ? 144 : 176) * sb;
    uint4 head = *(const uint4*)b;
    int sc[2], mn[2];
    k_scales_held(head, 2 * p, sc, mn);
    float d = h2f_lo(head.x), dmin = h2f_hi(head.x);
    K16 k;
    k.s0 = d * int_float(sc[0], 0), k.n0 = dmin * int_float(mn[0], 0);
    k.s1 = d * int_float(sc[1], 0), k.n1 = dmin * int_float(mn[1], 0);
    const u8* q = b + (F == F_Q4K ? 16 : 48) + 32 * p + 4 * h;
    u32 qa = ld32(q), qb = ld32(q + 16);
    k.lo[0] = qa & 0x0F0F0F0Fu, k.lo[1] = qb & 0x0F0F0F0Fu;
    k.hi[0] = (qa >> 4) & 0x0F0F0F0Fu, k.hi[1] = (qb >> 4) & 0x0F0F0F0Fu;
    if (F == F_Q5K) {
        // The fifth bits: bit 2p (and 2p + 1) of qh's byte i for element i.
        u32 ha = ld32(b + 16 + 4 * h), hb = ld32(b + 32 + 4 * h);
        k.lo[0] |= ((ha >> (2 * p)) & 0x01010101u) << 4;
        k.lo[1] |= ((hb >> (2 * p)) & 0x01010101u) << 4;
        k.hi[0] |= ((ha >> (2 * p + 1)) & 0x01010101u) << 4;
        k.hi[1] |= ((hb >> (2 * p + 1)) & 0x01010101u) << 4;
    }
    return k;
}
// Sub-block 2p's eight weights (half 0: elements 64p + 4h.. then 64p + 16 + 4h..) or
// 2p + 1's (half 1, 32 on).
__device__ __forceinline__ void k16_weights(const K16& k, int half, float* v) {
    float s = half ? k.s1 : k.s0, n = half ? k.n1 : k.n0;
#pragma unroll
    for (int w = 0; w < 2; w++) {
#pragma unroll
        for (int i = 0; i < 4; i++) v[4 * w + i] = s * byte_float(half ? k.hi[w] : k.lo[w], i) - n;
    }
}

// Eight weights against their inputs t (four elements) and u (four more: 16 on for
// K16, PAIR_GAP on for deq_pair_q6k).
__device__ __forceinline__ float dot8(const float* v, float4 t, float4 u) {
    return v[0] * t.x + v[1] * t.y + v[2] * t.z + v[3] * t.w + v[4] * u.x + v[5] * u.y + v[6] * u.z + v[7] * u.w;
}

// Warps per block, all on the block's output rows (each a quarter of the columns: a
// decode product has too few rows to keep the GPU's memory busy with a warp per
// row), and input rows per pass of the weights.
#define MM_WARPS 4
#define MM_ROWS 8

// mm_block's loop over RO weight rows for exactly NR input rows (rows nr.. repeat
// row nr - 1), into acc[j * NR + r] (weight row j, input row r). Each (j, r) sum is
// one expression whatever RO is: a block over several weight rows loads each input
// once for all of them, and gives every output the bits it has alone.
template <int F, int NR, int RO, class X>
__device__ __forceinline__ void rows_loop(const u8* const* row, int cols, int nr, X xrow, float* acc) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* xs[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) xs[r] = xrow(min(r, nr - 1));
    float a[RO * NR];
#pragma unroll
    for (int i = 0; i < RO * NR; i++) a[i] = 0.0f;
    if (F == F_Q4K || F == F_Q5K) {
        // A warp takes two super-blocks at a time, sixteen lanes each, a lane sixteen
        // weights of one (K16): the scales decoded once per sixteen weights, a
        // super-block's 128 bytes of codes read whole by its sixteen lanes. Warp w
        // takes super-blocks 2w, 2w + 1, then eight on, so a block of fewer warps
        // (backend.rs's `product_threads`, for rows of at most 2 * warps super-blocks)
        // gives each lane what a full block would.
        int p = (lane >> 2) & 3, h = lane & 3, nsb = cols >> 8;
        for (int sb = 2 * warp + (lane >> 4); sb < nsb; sb += 2 * MM_WARPS) {
            // Inputs x[0..4): elements e, e + 16 (sub-block 2p), e + 32, e + 48 (2p + 1).
            int e = 256 * sb + 64 * p + 4 * h;
            // Each (weight row, input row) adds its two sub-blocks' sums, each a dot8:
            // acc += (lo + hi), whichever loop below computes it.
            if (RO > 1) {
                // Decode: the inputs first, then each weight row's sixteen weights
                // taken at once.
                float4 x[NR][4];
#pragma unroll
                for (int r = 0; r < NR; r++) {
#pragma unroll
                    for (int c = 0; c < 4; c++) x[r][c] = *(const float4*)(xs[r] + e + 16 * c);
                }
#pragma unroll
                for (int j = 0; j < RO; j++) {
                    K16 k = k16_load<F>(row[j], sb, p, h);
                    float lo[8], hi[8];
                    k16_weights(k, 0, lo);
                    k16_weights(k, 1, hi);
#pragma unroll
                    for (int r = 0; r < NR; r++)
                        a[j * NR + r] += dot8(lo, x[r][0], x[r][1]) + dot8(hi, x[r][2], x[r][3]);
                }
            } else {
                // Batches: one sub-block's eight weights at a time against every
                // input row, the first sub-block's sums held.
                K16 k = k16_load<F>(row[0], sb, p, h);
                float w[8], lo[NR];
                k16_weights(k, 0, w);
#pragma unroll
                for (int r = 0; r < NR; r++)
                    lo[r] = dot8(w, *(const float4*)(xs[r] + e), *(const float4*)(xs[r] + e + 16));
                k16_weights(k, 1, w);
#pragma unroll
                for (int r = 0; r < NR; r++)
                    a[r] += lo[r] + dot8(w, *(const float4*)(xs[r] + e + 32), *(const float4*)(xs[r] + e + 48));
            }
        }
    } else if (F == F_Q6K) {
        // A warp takes 256 elements at a time, each lane two runs of four that share
        // their codes (deq_pair_q6k); the lanes' first runs are four whole 128-byte lines
        // of a row's inputs, their second runs the other four. (Measured on an H100:
        // decode +7%, eight sequences +6-9%, a 512-token prompt -4%, against one run
        // of four a lane; eight consecutive elements a lane lost a fifth of prefill.)
        int e0 = 128 * (lane >> 4) + 32 * ((lane >> 3) & 1) + 4 * (lane & 7);
        for (int e = e0 + 256 * warp; e < cols; e += 256 * MM_WARPS) {
            if (RO > 1) {
                // Several weight rows against one or two input rows (decode): the
                // inputs first, then each weight row dequantized and taken at once, so
                // that one row's eight weights are live at a time rather than RO's
                // (the products are bounded to 48 registers). The same sums.
                float4 t[NR], u[NR];
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    t[r] = *(const float4*)(xs[r] + e);
                    u[r] = *(const float4*)(xs[r] + e + PAIR_GAP);
                }
#pragma unroll
                for (int j = 0; j < RO; j++) {
                    float w[8];
                    deq_pair_q6k(row[j], e, w);
#pragma unroll
                    for (int r = 0; r < NR; r++) a[j * NR + r] += dot8(w, t[r], u[r]);
                }
            } else {
                float w[8];
                deq_pair_q6k(row[0], e, w);
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    float4 t = *(const float4*)(xs[r] + e);
                    float4 u = *(const float4*)(xs[r] + e + PAIR_GAP);
                    a[r] += dot8(w, t, u);
                }
            }
        }
    } else {
        for (int e = 4 * lane + 128 * warp; e < cols; e += 128 * MM_WARPS) {
            float w[RO][4];
#pragma unroll
            for (int j = 0; j < RO; j++) deq4<F>(row[j], e, cols, w[j]);
#pragma unroll
            for (int r = 0; r < NR; r++) {
                float4 t = *(const float4*)(xs[r] + e);
#pragma unroll
                for (int j = 0; j < RO; j++) a[j * NR + r] += w[j][0] * t.x + w[j][1] * t.y + w[j][2] * t.z + w[j][3] * t.w;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RO * NR; i++) acc[i] = a[i];
}

// The block's sums of each lane's acc[j * nr + r] for weight rows j < RO and input
// rows r < nr, lanes by shuffles and the warps in warp order, stored by
// `store(j, r, sum)`. Every thread of the block calls it.
template <int RO, class Y>
__device__ __forceinline__ void block_sums(const float* acc, int nr, Y store) {
    __shared__ float part[MM_WARPS][RO * MM_ROWS];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Only the rows there are: a decode row's four loads per lane would otherwise
    // be outweighed by eight reductions.
#pragma unroll
    for (int i = 0; i < RO * MM_ROWS; i++) {
        if (i < RO * nr) {
            float s = acc[i];
            for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffff, s, off);
            if (lane == 0) part[warp][i] = s;
        }
    }
    __syncthreads();
    if (threadIdx.x < RO * nr) {
        float s = 0.0f;
        // A block of fewer warps (a decode product of fewer runs than MM_WARPS, see
        // backend.rs's `product_threads`) adds the zeros of those it lacks, so that its
        // sums are the bits of a full block's.
        int warps = blockDim.x >> 5;
        for (int w = 0; w < MM_WARPS; w++) s += w < warps ? part[w][threadIdx.x] : 0.0f;
        store(threadIdx.x / nr, threadIdx.x % nr, s);
    }
}

// The shared body of the products: the block computes output `o` (weight row
// `row`) of up to MM_ROWS input rows; warp w takes every fourth run of 128
// elements, each lane four consecutive elements of a run (coalesced reads of
// weights and inputs alike; the K-quants every fourth run of 256, see rows_loop).
// `X` gives input row r's address, `Y` stores output j of row r. Every thread of
// the block calls it.
template <int F, class X, class Y>
__device__ __forceinline__ void mm_block(const u8* row, int cols, int nr, X xrow, Y store) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[MM_ROWS];
#pragma unroll
    for (int r = 0; r < MM_ROWS; r++) acc[r] = 0.0f;
    bool vec = (cols & 3) == 0;
    // Whole runs of four (every format but a plain one of odd length): the loop for
    // a fixed number of rows, without a test per row. nr between the sizes computes
    // its last row again in the spare ones; each row's sum is the same expression in
    // every case, so a row's bits do not depend on the rows beside it.
    if (vec) {
        if (nr == 1) rows_loop<F, 1, 1>(&row, cols, nr, xrow, acc);
        else if (nr == 2) rows_loop<F, 2, 1>(&row, cols, nr, xrow, acc);
        else if (nr <= 4) rows_loop<F, 4, 1>(&row, cols, nr, xrow, acc);
        else rows_loop<F, 8, 1>(&row, cols, nr, xrow, acc);
    } else {
        for (int e = 4 * lane + 128 * warp; e < cols; e += 128 * MM_WARPS) {
            float w[4];
            deq4<F>(row, e, cols, w);
#pragma unroll
            for (int r = 0; r < MM_ROWS; r++) {
                if (r < nr) {
                    const float* xr = xrow(r) + e;
                    float s = 0.0f;
                    for (int k = 0; k < 4 && e + k < cols; k++) s += w[k] * xr[k];
                    acc[r] += s;
                }
            }
        }
    }
    block_sums<1>(acc, nr, store);
}

// mm_block over several outputs at once, for decode rows: `ro` (2 or 4) weight
// rows `row[j]` against each input once, four outputs of one input row at a time or
// two of up to two rows, so the inputs are loaded once for all of them. Each output
// is the same expression as in mm_block, so its bits are those mm_block gives. A
// kernel of its own: mm_block's kernels keep their registers (and prompts their
// speed).
template <int F, class X, class Y>
__device__ __forceinline__ void mm_block_outputs(const u8* const* row, int ro, int cols, int nr, X xrow, Y store) {
    float acc[8];
    int step = ro >= 4 ? 1 : 2;
    for (int r0 = 0; r0 < nr; r0 += step) {
        if (r0 > 0) __syncthreads();  // block_sums' shared sums, read before written again
        int n = min(step, nr - r0);
        auto x = [&](int r) { return xrow(r0 + r); };
        auto y = [&](int j, int r, float s) { store(j, r0 + r, s); };
        if (ro == 4) {
            rows_loop<F, 1, 4>(row, cols, n, x, acc);
            block_sums<4>(acc, n, y);
        } else {
            if (n == 1) rows_loop<F, 1, 2>(row, cols, n, x, acc);
            else rows_loop<F, 2, 2>(row, cols, n, x, acc);
            block_sums<2>(acc, n, y);
        }
    }
}

// The weight rows of a block's outputs o0..o0 + ro, each at `base + o * row_bytes`;
// those past `out` repeat the last (computed, not stored).
#define MAX_OUTPUTS 4
__device__ __forceinline__ void out_rows(const u8* base, long long row_bytes, int o0, int ro, int out,
                                         const u8** row) {
    for (int j = 0; j < MAX_OUTPUTS; j++) row[j] = base + (long long)min(o0 + min(j, ro - 1), out - 1) * row_bytes;
}

struct DenseX {
    const float* x;
    int cols;
    int r0;
    __device__ const float* operator()(int r) const { return x + (long long)(r0 + r) * cols; }
};
struct DenseY {
    float* y;
    int out;
    int o;
    int r0;
    __device__ void operator()(int j, int r, float s) const {
        if (o + j < out) y[(long long)(r0 + r) * out + o + j] = s;
    }
};

// y[r, o] = x[r, :] · W[o, :] for r < n, o < out. Grid (out, ceil(n / MM_ROWS)),
// block 32 * MM_WARPS. Each block reads its weight row once per MM_ROWS input rows.
template <int F>
__device__ void mm(const u8* w, long long row_bytes, int out, int cols, const float* x, int n, float* y) {
    int o = blockIdx.x;
    int r0 = blockIdx.y * MM_ROWS;
    mm_block<F>(w + (long long)o * row_bytes, cols, min(MM_ROWS, n - r0), DenseX{x, cols, r0}, DenseY{y, out, o, r0});
}

// Up to MANY_MATS matrices of one format that read the same input (q, k and v; an
// expert's gate and up), in one launch of mm_outputs or mm_grouped_outputs: the
// matrix m of a block is the first whose `end` (its last block + 1, counted over the
// matrices in order) is past blockIdx.x. `w` is a matrix's weights (a grouped
// product's table of expert addresses), `y` its output. As backend.rs's `Many`.
#define MANY_MATS 3
struct Many {
    unsigned long long w[MANY_MATS];
    unsigned long long y[MANY_MATS];
    long long row_bytes[MANY_MATS];
    int out[MANY_MATS];
    int end[MANY_MATS];
};

// The matrix of this block, and its first output row; written with constant
// indices, so the struct stays in the parameter space.
struct ManyPick {
    unsigned long long w, y;
    long long row_bytes;
    int out, o;
};
__device__ __forceinline__ ManyPick many_pick(const Many& m, int ro) {
    int b = blockIdx.x, start = 0;
    ManyPick p = {m.w[0], m.y[0], m.row_bytes[0], m.out[0], 0};
#pragma unroll
    for (int i = 1; i < MANY_MATS; i++) {
        if (b >= m.end[i - 1]) {
            start = m.end[i - 1];
            p = ManyPick{m.w[i], m.y[i], m.row_bytes[i], m.out[i], 0};
        }
    }
    p.o = (b - start) * ro;
    return p;
}

// mm with `ro` outputs a block (mm_block_outputs), for each matrix of `m`. Grid
// (m.end[last], ceil(n / MM_ROWS)), a matrix's blocks ceil(out / ro).
template <int F>
__device__ void mm_outputs(const Many& m, int cols, const float* x, int n, int ro) {
    ManyPick p = many_pick(m, ro);
    int r0 = blockIdx.y * MM_ROWS;
    const u8* row[MAX_OUTPUTS];
    out_rows((const u8*)p.w, p.row_bytes, p.o, ro, p.out, row);
    mm_block_outputs<F>(row, ro, cols, min(MM_ROWS, n - r0), DenseX{x, cols, r0},
                        DenseY{(float*)p.y, p.out, p.o, r0});
}

// A grouped product's unit of work: compact rows start..start + n (n <= MM_ROWS) of
// expert `expert` (an index into the layer's table of weight addresses).
struct Work {
    int expert;
    int start;
    int n;
    int pad;
};

struct GatherX {
    const float* x;
    const u32* rows;
    int cols;
    int start;
    __device__ const float* operator()(int r) const {
        long long i = rows ? rows[start + r] : start + r;
        return x + i * cols;
    }
};
struct ScatterY {
    float* y;
    const u32* rows;
    int out;
    int o;
    int start;
    __device__ void operator()(int j, int r, float s) const {
        long long i = rows ? rows[start + r] : start + r;
        if (o + j < out) y[i * out + o + j] = s;
    }
};

// Every routed expert of a layer in one launch: for each work item, y[yrow[j]] =
// W_e · x[xrow[j]] over its compact rows j (an index array may be null: j itself).
// An expert whose address is 0 is passed over, its outputs left as they are: the
// VRAM tier's held experts are computed while its misses are still being copied in,
// and those after (backend.rs's `moe`); every grouped product does the same.
// Grid (out, items).
template <int F>
__device__ void mm_grouped(const unsigned long long* ws, long long row_bytes, int out, int cols, const float* x,
                           const u32* xrow, const Work* work, float* y, const u32* yrow) {
    int o = blockIdx.x;
    Work it = work[blockIdx.y];
    if (it.n == 0 || ws[it.expert] == 0) return;
    const u8* row = (const u8*)ws[it.expert] + (long long)o * row_bytes;
    mm_block<F>(row, cols, it.n, GatherX{x, xrow, cols, it.start}, ScatterY{y, yrow, out, o, it.start});
}

// mm_grouped with `ro` outputs a block (mm_block_outputs), for each matrix of `m`
// (tables of expert addresses, sharing the work list and the rows). Grid
// (m.end[last], items).
template <int F>
__device__ void mm_grouped_outputs(const Many& m, int cols, const float* x, const u32* xrow, const Work* work,
                                   int ro, const u32* yrow) {
    ManyPick p = many_pick(m, ro);
    Work it = work[blockIdx.y];
    if (it.n == 0 || ((const unsigned long long*)p.w)[it.expert] == 0) return;
    const u8* row[MAX_OUTPUTS];
    out_rows((const u8*)((const unsigned long long*)p.w)[it.expert], p.row_bytes, p.o, ro, p.out, row);
    mm_block_outputs<F>(row, ro, cols, it.n, GatherX{x, xrow, cols, it.start},
                        ScatterY{(float*)p.y, yrow, p.out, p.o, it.start});
}

// An expert layer's gate and up products and their GLU in one launch, for work items
// of decode rows: a block takes outputs o and o + 1 of gate and of up (the four
// weight rows of mm_block_outputs' ro = 4, each sum the same expression, so the bits
// of mm_grouped_outputs) and writes glu(gate, up) of both to y (compact rows,
// `out` wide). Grid (ceil(out / 2), items).
template <int F>
__device__ void mm_grouped_glu(const unsigned long long* wg, const unsigned long long* wu, long long row_bytes,
                               int out, int cols, const float* x, const u32* xrow, const Work* work, float* y,
                               int kind, float alpha, float limit) {
    __shared__ float sums[4];
    Work it = work[blockIdx.y];
    if (it.n == 0 || wg[it.expert] == 0) return;
    int o = 2 * blockIdx.x;
    const u8 *row[MAX_OUTPUTS], *up[MAX_OUTPUTS];
    out_rows((const u8*)wg[it.expert], row_bytes, o, 2, out, row);
    out_rows((const u8*)wu[it.expert], row_bytes, o, 2, out, up);
    row[2] = up[0], row[3] = up[1];
    for (int r = 0; r < it.n; r++) {
        if (r > 0) __syncthreads();  // the sums of the row before, read before written again
        float acc[8];
        GatherX gx{x, xrow, cols, it.start + r};
        rows_loop<F, 1, 4>(row, cols, 1, gx, acc);
        block_sums<4>(acc, 1, [&](int j, int, float s) { sums[j] = s; });
        __syncthreads();
        int t = threadIdx.x;
        if (t < 2 && o + t < out)
            y[(long long)(it.start + r) * out + o + t] = glu_of(kind, alpha, limit, sums[t], sums[2 + t]);
    }
}

// ---- Integer products: K-quant weights against quantized activations ----
//
// The inputs quantized per 32 elements to 8 or 16 bits as sluice_cpu::quant::act does
// it (quantize_act, below), so a product takes four weights against four inputs in
// one `dp4a` and applies the block scales once per run of eight: the float products
// above spend most of their instructions unpacking each weight to a float.

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Input rows as quantize_act writes them, row i of n: its codes (the 8-bit codes, or
// a 16-bit code's high bytes) at q + i * cols, a 16-bit row's low bytes at
// q + (n + i) * cols; per 32 elements the scale d and sx = d * sum(code); per 16
// elements sum(code); wide[i] 1 for a 16-bit row.
struct QIn {
    const i8* q;
    const float* d;
    const float* sx;
    const int* s16;
    const u32* wide;
    int n;
    int cols;
};

// Two runs of eight weights of a K-quant row that share their codes' bytes (a Q4_K
// byte's two nibbles, as in K16; a Q6_K `ql` byte's, as in deq_pair_q6k): the codes
// as bytes c[0..2) (run 0) and c[2..4) (run 1), each run's scale, and for Q4_K/Q5_K
// its min's.
struct KRuns {
    int c[4];
    float f0, f1, n0, n1;
};

// Lane `sub` (0..16) of super-block `sb`: Q4_K/Q5_K elements 64p + 8t.. and
// 64p + 32 + 8t.. (sub-blocks 2p and 2p + 1; p = sub / 4, t = sub % 4), Q6_K
// 128h + 32s + 8t.. and 64 later (h = sub / 8, s = sub / 4 % 2). `e` gets the first
// run's element within the row.
template <int F>
__device__ __forceinline__ KRuns k_runs(const u8* row, int sb, int sub, int* e) {
    KRuns k;
    int t = sub & 3;
    if (F == F_Q4K || F == F_Q5K) {
        int p = sub >> 2;
        const u8* b = row + (F == F_Q4K ? 144 : 176) * sb;
        u32 dm = ld32(b);
        int sc0, m0, sc1, m1;
        k_scale_min(b + 4, 2 * p, &sc0, &m0);
        k_scale_min(b + 4, 2 * p + 1, &sc1, &m1);
        float d = h2f_lo(dm), dmin = h2f_hi(dm);
        k.f0 = d * (float)sc0, k.f1 = d * (float)sc1, k.n0 = dmin * (float)m0, k.n1 = dmin * (float)m1;
        uint2 q = *(const uint2*)(b + (F == F_Q4K ? 16 : 48) + 32 * p + 8 * t);
        k.c[0] = q.x & 0x0f0f0f0f, k.c[1] = q.y & 0x0f0f0f0f;
        k.c[2] = (q.x >> 4) & 0x0f0f0f0f, k.c[3] = (q.y >> 4) & 0x0f0f0f0f;
        if (F == F_Q5K) {
            uint2 h = *(const uint2*)(b + 16 + 8 * t);
            k.c[0] |= ((h.x >> (2 * p)) & 0x01010101) << 4, k.c[1] |= ((h.y >> (2 * p)) & 0x01010101) << 4;
            k.c[2] |= ((h.x >> (2 * p + 1)) & 0x01010101) << 4, k.c[3] |= ((h.y >> (2 * p + 1)) & 0x01010101) << 4;
        }
        *e = 256 * sb + 64 * p + 8 * t;
    } else {
        int h = sub >> 3, s = (sub >> 2) & 1;
        const u8* b = row + 210 * sb;
        const u8* ql = b + 64 * h + 32 * s + 8 * t;
        const u8* qh = b + 128 + 32 * h + 8 * t;
        u32 qa = ld32_2(ql), qb = ld32_2(ql + 4), ha = ld32_2(qh), hb = ld32_2(qh + 4);
        k.c[0] = (qa & 0x0f0f0f0f) | (((ha >> (2 * s)) & 0x03030303) << 4);
        k.c[1] = (qb & 0x0f0f0f0f) | (((hb >> (2 * s)) & 0x03030303) << 4);
        k.c[2] = ((qa >> 4) & 0x0f0f0f0f) | (((ha >> (2 * s + 4)) & 0x03030303) << 4);
        k.c[3] = ((qb >> 4) & 0x0f0f0f0f) | (((hb >> (2 * s + 4)) & 0x03030303) << 4);
        int ee = 128 * h + 32 * s + 8 * t;
        float d = h2f((u16)ld16(b + 208));
        k.f0 = d * (float)((const i8*)b)[192 + (ee >> 4)], k.f1 = d * (float)((const i8*)b)[192 + ((ee + 64) >> 4)];
        k.n0 = k.n1 = 0.0f;
        *e = 256 * sb + ee;
    }
    return k;
}

// The integer loop for exactly NR input rows (as rows_loop), `xrow(r)` giving input
// row r's index in `in`. A warp takes two super-blocks at a time, sixteen lanes
// each; a lane's codes are eight bytes, sixteen weights. A row's integer sums are
// exact (a 16-bit row's byte products joined as 256 hi + lo first), then scaled
// in the same order whatever the batch, so a row's bits do not depend on its
// neighbours. The blocks' sums that the formats fold in (Q4_K/Q5_K's mins, Q6_K's
// -32 offset per 16) are added by one lane of each run's block or group.
template <int F, int NR, class X>
__device__ __forceinline__ void rows_loop_q(const u8* row, int nr, X xrow, const QIn& in, float* acc) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane & 15, t = sub & 3;
    int cols = in.cols, blocks = cols >> 5;
    long long ri[NR];
    bool wide[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) {
        ri[r] = xrow(min(r, nr - 1));
        wide[r] = in.wide[ri[r]] != 0;
    }
    float a[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) a[r] = 0.0f;
    const int gap = F == F_Q6K ? 64 : 32;
    for (int sb = 2 * warp + (lane >> 4); sb < cols >> 8; sb += 2 * MM_WARPS) {
        int e;
        KRuns k = k_runs<F>(row, sb, sub, &e);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const i8* xq = in.q + ri[r] * cols;
            uint2 x0 = *(const uint2*)(xq + e), x1 = *(const uint2*)(xq + e + gap);
            int i0 = dp4a(k.c[1], x0.y, dp4a(k.c[0], x0.x, 0));
            int i1 = dp4a(k.c[3], x1.y, dp4a(k.c[2], x1.x, 0));
            if (wide[r]) {
                const i8* xl = in.q + ((long long)in.n + ri[r]) * cols;
                uint2 l0 = *(const uint2*)(xl + e), l1 = *(const uint2*)(xl + e + gap);
                i0 = i0 * 256 + dp4a(k.c[1], l0.y, dp4a(k.c[0], l0.x, 0));
                i1 = i1 * 256 + dp4a(k.c[3], l1.y, dp4a(k.c[2], l1.x, 0));
            }
            if (F == F_Q6K && (t & 1) == 0) {
                const int* s16 = in.s16 + ri[r] * 2 * blocks;
                i0 -= 32 * s16[e >> 4];
                i1 -= 32 * s16[(e + gap) >> 4];
            }
            const float* d = in.d + ri[r] * blocks;
            float v = (float)i0 * (k.f0 * d[e >> 5]) + (float)i1 * (k.f1 * d[(e + gap) >> 5]);
            if (F != F_Q6K && t == 0) {
                const float* sx = in.sx + ri[r] * blocks;
                v -= k.n0 * sx[e >> 5] + k.n1 * sx[(e + gap) >> 5];
            }
            a[r] += v;
        }
    }
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = a[r];
}

// mm_block on quantized inputs: output `o` of up to MM_ROWS input rows against weight
// row `row`; xrow(r) is input row r's index in `in`.
template <int F, class X, class Y>
__device__ __forceinline__ void mmq_block(const u8* row, int nr, X xrow, const QIn& in, Y store) {
    float acc[MM_ROWS];
#pragma unroll
    for (int r = 0; r < MM_ROWS; r++) acc[r] = 0.0f;
    if (nr == 1) rows_loop_q<F, 1>(row, nr, xrow, in, acc);
    else if (nr == 2) rows_loop_q<F, 2>(row, nr, xrow, in, acc);
    else if (nr <= 4) rows_loop_q<F, 4>(row, nr, xrow, in, acc);
    else rows_loop_q<F, 8>(row, nr, xrow, in, acc);
    block_sums<1>(acc, nr, store);
}

struct DenseRow {
    int r0;
    __device__ long long operator()(int r) const { return r0 + r; }
};
struct GatherRow {
    const u32* rows;
    int start;
    __device__ long long operator()(int r) const { return rows ? (long long)rows[start + r] : start + r; }
};

// mm on quantized inputs: y[r, o] = x[r, :] · W[o, :]. Grid (out, ceil(n / MM_ROWS)).
template <int F>
__device__ void mmq(const u8* w, long long row_bytes, int out, QIn in, float* y) {
    int o = blockIdx.x;
    int r0 = blockIdx.y * MM_ROWS;
    mmq_block<F>(w + (long long)o * row_bytes, min(MM_ROWS, in.n - r0), DenseRow{r0}, in, DenseY{y, out, o, r0});
}

// mm_grouped on quantized inputs.
template <int F>
__device__ void mmq_grouped(const unsigned long long* ws, long long row_bytes, int out, QIn in, const u32* xrow,
                            const Work* work, float* y, const u32* yrow) {
    int o = blockIdx.x;
    Work it = work[blockIdx.y];
    if (it.n == 0 || ws[it.expert] == 0) return;
    const u8* row = (const u8*)ws[it.expert] + (long long)o * row_bytes;
    mmq_block<F>(row, it.n, GatherRow{xrow, it.start}, in, ScatterY{y, yrow, out, o, it.start});
}

// ---- Tensor-core products: a prompt's rows against K-quant weights ----
//
// Rows at 8 bits (a prompt's, Precision::Fast) take int8 `mma` against the weights'
// codes: a block of four warps computes 64 outputs (16 a warp, mma's M) of up to
// MT_ROWS input rows (groups of eight, mma's N), each warp over the whole row, so
// every (output, row) sum is one thread's. A sub-block's integer sum is exact (Q6_K's
// two groups of 16 joined by their scales in integers too), then scaled and added in
// the row's block order: a row's bits do not depend on the rows beside it, nor on
// where in a tile it falls. Rows at 16 bits (decode rows) are not stored: the float
// products give those their bits (backend.rs's `Path::FloatThenTensor`).

#define MT_WARPS 4
#define MT_OUT (16 * MT_WARPS)
#define MT_ROWS 32
#define MT_GROUPS (MT_ROWS / 8)

// c += A (16 x 32, rows of weight codes) * B (32 x 8, input rows' codes), as s8.
__device__ __forceinline__ void mma_k32(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();  // backend.rs takes these kernels from compute capability 8.0 on
#endif
}
// c = A (16 x 16) * B (16 x 8), as s8.
__device__ __forceinline__ void mma_k16(int* c, u32 a0, u32 a1, u32 b0) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
#else
    __trap();
#endif
}

// Q6_K's 6-bit codes q (four a word) as the signed bytes q - 32.
__device__ __forceinline__ u32 q6_signed(u32 q) {
    u32 low = ~q & 0x20202020;  // q < 32: the result's top two bits are set
    return (q ^ 0x20202020) | (low << 1) | (low << 2);
}

// Copies to shared memory that do not hold the thread (sm_80's cp.async): 16 bytes
// (global, around L1) or 8, a group of them committed, and a wait for all but the last
// `N` groups committed.
__device__ __forceinline__ void cp_async16(void* smem, const void* g) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(smem)), "l"(g)
                 : "memory");
#endif
}
__device__ __forceinline__ void cp_async8(void* smem, const void* g) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"((unsigned)__cvta_generic_to_shared(smem)), "l"(g)
                 : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// A block's tile of input rows, a super-block (256 columns) at a time, in shared
// memory: every warp reads all the tile's rows (each computes 16 outputs over the whole
// row), so the block loads them once, the next super-block's copies in flight while
// this one's are used. Rows of MT_XLD bytes: 256 codes and 16 of padding, so the eight
// rows a warp's lanes read in one load fall on distinct banks. (Each lane loading its
// inputs' codes and block scales from global memory at every mma: a 512-token
// prompt's products waited on those loads 77% of the time on an H100.)
#define MT_XLD 272
// Each warp's 16 weight rows of a Q4_K or Q5_K super-block come the same way (rows of
// its format's 144 or 176 bytes: the eight rows a warp's lanes read in one load fall on
// distinct banks in both); Q6_K's 210-byte blocks are not whole 16-byte copies and are
// read from global memory.
#define MT_WLD 176
struct MtStage {
    u8 x[2][MT_ROWS * MT_XLD];
    float d[2][MT_ROWS * 8], sx[2][MT_ROWS * 8];
    u8 w[2][MT_WARPS][16 * MT_WLD];
};

// The lane's part of the tile: the row whose codes it gives to mma's B (8 * group + g)
// and the two whose sums it holds (8 * group + 2t, + 1), as rows of the tile (rows
// past its n repeat its last).
struct MtRows {
    int b[MT_GROUPS];
    int c[MT_GROUPS][2];
};

// The thread's share of loading a super-block of the tile: four runs of 16 codes and
// two of the rows' block scales and sums (rows past n are not loaded, nor read).
struct MtLoads {
    const i8* x[4];
    const float* d;
    const float* sx;
    // The warp's weight rows: w's rows o .. o + 15 (the last, out - 1, past it).
    const u8* w;
    long long row_bytes;
    int out, o;
};

// Starts the copies of super-block sb of the tile (and of the warp's weight rows, for
// Q4_K and Q5_K) into buffer `buf`, as a group.
template <int F>
__device__ __forceinline__ void mt_stage(MtStage& st, const MtLoads& l, int sb, int buf) {
    int tid = threadIdx.x;
    if (F == F_Q4K || F == F_Q5K) {
        const int bytes = F == F_Q4K ? 144 : 176, runs = bytes / 16;
        int lane = tid & 31, warp = tid >> 5;
        for (int c = lane; c < 16 * runs; c += 32) {
            int r = c / runs, k = c % runs;
            const u8* src = l.w + (long long)min(l.o + r, l.out - 1) * l.row_bytes + bytes * sb + 16 * k;
            cp_async16(&st.w[buf][warp][r * bytes + 16 * k], src);
        }
    }
#pragma unroll
    for (int q = 0; q < 4; q++) {
        int c = tid + 128 * q;
        if (l.x[q]) cp_async16(&st.x[buf][(c >> 4) * MT_XLD + 16 * (c & 15)], l.x[q] + 256 * sb + 16 * (c & 15));
    }
    if (l.d) {
        int at = (tid >> 2) * 8 + 2 * (tid & 3);
        cp_async8(&st.d[buf][at], l.d + 8 * sb + 2 * (tid & 3));
        cp_async8(&st.sx[buf][at], l.sx + 8 * sb + 2 * (tid & 3));
    }
    cp_async_commit();
}

// acc[grp][i] += the sub-block's sums scaled: c[i] of weight row a (i < 2) or b, input
// row c[grp][i & 1] of the tile; `f` the weight rows' scales, `m` their mins'
// (Q4_K/Q5_K; zero for Q6_K), block `blk` of the super-block, from buffer `buf`.
__device__ __forceinline__ void mt_scale(float* acc, const int* c, float fa, float fb, float ma, float mb,
                                         const int* rc, const MtStage& st, int buf, int blk) {
    float d0 = st.d[buf][rc[0] * 8 + blk], d1 = st.d[buf][rc[1] * 8 + blk];
    float s0 = st.sx[buf][rc[0] * 8 + blk], s1 = st.sx[buf][rc[1] * 8 + blk];
    acc[0] = __fmaf_rn(-ma, s0, __fmaf_rn((float)c[0], __fmul_rn(fa, d0), acc[0]));
    acc[1] = __fmaf_rn(-ma, s1, __fmaf_rn((float)c[1], __fmul_rn(fa, d1), acc[1]));
    acc[2] = __fmaf_rn(-mb, s0, __fmaf_rn((float)c[2], __fmul_rn(fb, d0), acc[2]));
    acc[3] = __fmaf_rn(-mb, s1, __fmaf_rn((float)c[3], __fmul_rn(fb, d1), acc[3]));
}

// Four bytes of tile row `row`'s codes at byte `at` of the super-block in buffer `buf`.
__device__ __forceinline__ u32 mt_x(const MtStage& st, int buf, int row, int at) {
    return *(const u32*)&st.x[buf][row * MT_XLD + at];
}

// The warp's 16 outputs (weight rows wa: g, wb: g + 8 of them, for lane g = lane / 4)
// over the whole row for `groups` groups of eight input rows, into acc[group][4]
// (mma's C: outputs g, g, g + 8, g + 8 of input rows 2t, 2t + 1, 2t, 2t + 1).
template <int F>
__device__ __forceinline__ void mt_loop(const u8* wa, const u8* wb, const MtRows& r, int groups, const QIn& in,
                                        MtStage& st, const MtLoads& loads, float (*acc)[4]) {
    int t = threadIdx.x & 3;
    int n_sb = in.cols >> 8;
    mt_stage<F>(st, loads, 0, 0);
    for (int sb = 0; sb < n_sb; sb++) {
        int buf = sb & 1;
        // The next super-block's copies go out before this one's are waited for; the
        // buffer they fill was last read before the previous iteration's barrier.
        if (sb + 1 < n_sb)
            mt_stage<F>(st, loads, sb + 1, buf ^ 1);
        else
            cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (F == F_Q4K || F == F_Q5K) {
            const int bytes = F == F_Q4K ? 144 : 176, qs = F == F_Q4K ? 16 : 48;
            int g = (threadIdx.x & 31) >> 2;
            const u8* ba = &st.w[buf][threadIdx.x >> 5][g * bytes];
            const u8* bb = &st.w[buf][threadIdx.x >> 5][(g + 8) * bytes];
            u32 dma = ld32(ba), dmb = ld32(bb);
            u32 ha0 = 0, ha1 = 0, hb0 = 0, hb1 = 0;
            if (F == F_Q5K) ha0 = ld32(ba + 16 + 4 * t), ha1 = ld32(ba + 32 + 4 * t), hb0 = ld32(bb + 16 + 4 * t), hb1 = ld32(bb + 32 + 4 * t);
            for (int p = 0; p < 4; p++) {
                // Sub-blocks 2p and 2p + 1 share these bytes (low and high nibbles);
                // a lane's are elements 4t.. and 16 + 4t.. of the weight rows a, b.
                u32 qa0 = ld32(ba + qs + 32 * p + 4 * t), qa1 = ld32(ba + qs + 32 * p + 16 + 4 * t);
                u32 qb0 = ld32(bb + qs + 32 * p + 4 * t), qb1 = ld32(bb + qs + 32 * p + 16 + 4 * t);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int j = 2 * p + h;
                    u32 a0 = (qa0 >> (4 * h)) & 0x0f0f0f0f, a1 = (qb0 >> (4 * h)) & 0x0f0f0f0f;
                    u32 a2 = (qa1 >> (4 * h)) & 0x0f0f0f0f, a3 = (qb1 >> (4 * h)) & 0x0f0f0f0f;
                    if (F == F_Q5K) {
                        a0 |= ((ha0 >> j) & 0x01010101) << 4, a1 |= ((hb0 >> j) & 0x01010101) << 4;
                        a2 |= ((ha1 >> j) & 0x01010101) << 4, a3 |= ((hb1 >> j) & 0x01010101) << 4;
                    }
                    int sca, mna, scb, mnb;
                    k_scale_min(ba + 4, j, &sca, &mna);
                    k_scale_min(bb + 4, j, &scb, &mnb);
                    float fa = h2f_lo(dma) * (float)sca, ma = h2f_hi(dma) * (float)mna;
                    float fb = h2f_lo(dmb) * (float)scb, mb = h2f_hi(dmb) * (float)mnb;
#pragma unroll
                    for (int grp = 0; grp < MT_GROUPS; grp++) {
                        if (grp >= groups) break;
                        int c[4] = {0, 0, 0, 0};
                        mma_k32(c, a0, a1, a2, a3, mt_x(st, buf, r.b[grp], 32 * j + 4 * t),
                                mt_x(st, buf, r.b[grp], 32 * j + 16 + 4 * t));
                        mt_scale(acc[grp], c, fa, fb, ma, mb, r.c[grp], st, buf, j);
                    }
                }
            }
        } else {
            // Q6_K: per half h, strips s and s + 2 share `ql` bytes (low and high
            // nibbles), all four strips the half's `qh` bytes (two bits each).
            const u8* ba = wa + 210 * sb;
            const u8* bb = wb + 210 * sb;
            float da = h2f((u16)ld16(ba + 208)), db = h2f((u16)ld16(bb + 208));
            for (int hh = 0; hh < 2; hh++) {
                u32 ha0 = ld32_2(ba + 128 + 32 * hh + 4 * t), ha1 = ld32_2(ba + 128 + 32 * hh + 16 + 4 * t);
                u32 hb0 = ld32_2(bb + 128 + 32 * hh + 4 * t), hb1 = ld32_2(bb + 128 + 32 * hh + 16 + 4 * t);
                for (int s = 0; s < 2; s++) {
                    const u8* la = ba + 64 * hh + 32 * s;
                    const u8* lb = bb + 64 * hh + 32 * s;
                    u32 qa0 = ld32_2(la + 4 * t), qa1 = ld32_2(la + 16 + 4 * t);
                    u32 qb0 = ld32_2(lb + 4 * t), qb1 = ld32_2(lb + 16 + 4 * t);
#pragma unroll
                    for (int nib = 0; nib < 2; nib++) {
                        int strip = s + 2 * nib;
                        u32 a0 = q6_signed(((qa0 >> (4 * nib)) & 0x0f0f0f0f) | (((ha0 >> (2 * strip)) & 0x03030303) << 4));
                        u32 a1 = q6_signed(((qb0 >> (4 * nib)) & 0x0f0f0f0f) | (((hb0 >> (2 * strip)) & 0x03030303) << 4));
                        u32 a2 = q6_signed(((qa1 >> (4 * nib)) & 0x0f0f0f0f) | (((ha1 >> (2 * strip)) & 0x03030303) << 4));
                        u32 a3 = q6_signed(((qb1 >> (4 * nib)) & 0x0f0f0f0f) | (((hb1 >> (2 * strip)) & 0x03030303) << 4));
                        // The strip's two groups of 16 and their scales.
                        int g16 = 8 * hh + 2 * strip;
                        int sa0 = ((const i8*)ba)[192 + g16], sa1 = ((const i8*)ba)[193 + g16];
                        int sb0 = ((const i8*)bb)[192 + g16], sb1 = ((const i8*)bb)[193 + g16];
                        int e = 128 * hh + 32 * strip;  // within the super-block
#pragma unroll
                        for (int grp = 0; grp < MT_GROUPS; grp++) {
                            if (grp >= groups) break;
                            int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
                            mma_k16(lo, a0, a1, mt_x(st, buf, r.b[grp], e + 4 * t));
                            mma_k16(hi, a2, a3, mt_x(st, buf, r.b[grp], e + 16 + 4 * t));
                            int c[4] = {lo[0] * sa0 + hi[0] * sa1, lo[1] * sa0 + hi[1] * sa1,
                                        lo[2] * sb0 + hi[2] * sb1, lo[3] * sb0 + hi[3] * sb1};
                            mt_scale(acc[grp], c, da, db, 0.0f, 0.0f, r.c[grp], st, buf, e >> 5);
                        }
                    }
                }
            }
        }
        __syncthreads();  // the buffer is read before the next iteration's copies fill it again
    }
}

// The block's 64 outputs from o0 (of `out`) for the tile's n (<= MT_ROWS) input rows,
// xrow(r) giving row r's index in `in`; `store(o, r, v)` for each row at 8 bits.
template <int F, class X, class Y>
__device__ __forceinline__ void mt_block(const u8* w, long long row_bytes, int out, int o0, int n, X xrow,
                                         const QIn& in, Y store) {
    __shared__ __align__(16) MtStage st;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int oa = o0 + 16 * warp + g, ob = oa + 8;
    const u8* wa = w + (long long)min(oa, out - 1) * row_bytes;
    const u8* wb = w + (long long)min(ob, out - 1) * row_bytes;
    MtRows r;
#pragma unroll
    for (int grp = 0; grp < MT_GROUPS; grp++) {
        r.b[grp] = min(8 * grp + g, n - 1);
        r.c[grp][0] = min(8 * grp + 2 * t, n - 1);
        r.c[grp][1] = min(8 * grp + 2 * t + 1, n - 1);
    }
    MtLoads loads;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        int row = (threadIdx.x + 128 * q) >> 4;
        loads.x[q] = row < n ? in.q + xrow(row) * in.cols : nullptr;
    }
    int blocks = in.cols >> 5, row = threadIdx.x >> 2;
    loads.d = row < n ? in.d + xrow(row) * blocks : nullptr;
    loads.sx = row < n ? in.sx + xrow(row) * blocks : nullptr;
    loads.w = w;
    loads.row_bytes = row_bytes;
    loads.out = out;
    loads.o = o0 + 16 * warp;
    float acc[MT_GROUPS][4];
#pragma unroll
    for (int grp = 0; grp < MT_GROUPS; grp++)
        for (int i = 0; i < 4; i++) acc[grp][i] = 0.0f;
    int groups = (n + 7) >> 3;
    mt_loop<F>(wa, wb, r, groups, in, st, loads, acc);
#pragma unroll
    for (int grp = 0; grp < MT_GROUPS; grp++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int row = 8 * grp + 2 * t + (i & 1), o = i < 2 ? oa : ob;
            if (row < n && o < out && in.wide[xrow(row)] == 0) store(o, row, acc[grp][i]);
        }
    }
}

// y[r, o] = x[r, :] · W[o, :] for the rows at 8 bits, for each matrix of `m` (q, k
// and v in one launch: k's and v's few blocks alone left most of the GPU idle). Grid
// (m.end[last], ceil(n / MT_ROWS)), a matrix's blocks ceil(out / MT_OUT); block 32 *
// MT_WARPS.
template <int F>
__device__ void mmt(const Many& m, QIn in) {
    ManyPick p = many_pick(m, MT_OUT);
    int r0 = blockIdx.y * MT_ROWS;
    mt_block<F>((const u8*)p.w, p.row_bytes, p.out, p.o, min(MT_ROWS, in.n - r0), DenseRow{r0}, in,
                DenseY{(float*)p.y, p.out, 0, r0});
}

// mm_grouped for the rows at 8 bits, over tiles (`Work` items of up to MT_ROWS
// compact rows of one expert). Grid (ceil(out / MT_OUT), tiles).
template <int F>
__device__ void mmt_grouped(const unsigned long long* ws, long long row_bytes, int out, QIn in, const u32* xrow,
                            const Work* tiles, float* y, const u32* yrow) {
    Work it = tiles[blockIdx.y];
    if (it.n == 0 || ws[it.expert] == 0) return;
    mt_block<F>((const u8*)ws[it.expert], row_bytes, out, blockIdx.x * MT_OUT, it.n, GatherRow{xrow, it.start}, in,
                ScatterY{y, yrow, out, 0, it.start});
}

// out[i, :] = W[tokens[i], :] * scale. Grid (n, ceil(cols / 4 / 128)), block 128:
// a thread per four elements.
template <int F>
__device__ void embed(const u8* w, long long row_bytes, int cols, const u32* tokens, float scale, float* out) {
    int i = blockIdx.x;
    int e = 4 * (blockIdx.y * blockDim.x + threadIdx.x);
    if (e >= cols) return;
    float v[4];
    deq4<F>(w + (long long)tokens[i] * row_bytes, e, cols, v);
    float* o = out + (long long)i * cols + e;
    for (int k = 0; k < 4 && e + k < cols; k++) o[k] = v[k] * scale;
}

#ifdef SLUICE_FORMAT
// The decode rows' products (mmo_, mmgo_, mmglu_) are a wave or two of small blocks
// each waiting on its loads, so their speed is how many blocks an SM holds: bounded to
// 48 registers a thread (ten blocks of 128 an SM, q/k/v's 1280 blocks in one wave of an
// H100's 132 SMs) where the compiler took 64 (eight; decode 190.8 -> 202.0 tok/s on
// the Qwen3-30B-A3B geometry). Twelve blocks (40 registers) lost 3%; unrolling the
// loop by two, loads of two runs together at 84 registers, lost 7%. Since Q4_K and
// Q5_K take sixteen weights a lane (K16) the bound is six blocks (80 registers): at
// ten that loop spilled 88-152 bytes and decoded 185-192 tok/s, at eight 201-219, at
// six 215-218 against 192-201 for the eight-weight loop (an H100, stop 57).
#define DECODE_BOUNDS __launch_bounds__(128, 6)
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
// The products for rows of prompts and batches (mm_, mmg_, and mmq_, mmgq_ below)
// do not wait at their entry: they are launched after the kernel before them has
// ended (device.rs's `launches_of`), since the wait cost them where it gained nothing
// (on an H100, eight sequences decoding 283 tok/s with it against 322 without, a
// 64-token prompt 931 against 957). The decode rows' products (mmo_, mmgo_, mmglu_)
// and the small kernels wait, and start early.
#define FORMAT_KERNELS(F, name)                                                                                  \
    extern "C" __global__ void CAT(mmg_, name)(const unsigned long long* ws, long long row_bytes, int out,       \
                                               int cols, const float* x, const u32* xrow, const Work* work,      \
                                               float* y, const u32* yrow) {                                      \
        mm_grouped<F>(ws, row_bytes, out, cols, x, xrow, work, y, yrow);                                         \
    }                                                                                                            \
    extern "C" __global__ void DECODE_BOUNDS CAT(mmgo_, name)(Many m, int cols, const float* x, const u32* xrow, \
                                                const Work* work, int ro, const u32* yrow) {                     \
        grid_entry();                                                                                            \
        mm_grouped_outputs<F>(m, cols, x, xrow, work, ro, yrow);                                                 \
    }                                                                                                            \
    extern "C" __global__ void DECODE_BOUNDS CAT(mmglu_, name)(const unsigned long long* wg,                     \
                                                 const unsigned long long* wu, long long row_bytes, int out,     \
                                                 int cols, const float* x, const u32* xrow, const Work* work,    \
                                                 float* y, int kind, float alpha, float limit) {                 \
        grid_entry();                                                                                            \
        mm_grouped_glu<F>(wg, wu, row_bytes, out, cols, x, xrow, work, y, kind, alpha, limit);                   \
    }                                                                                                            \
    extern "C" __global__ void CAT(mm_, name)(const u8* w, long long row_bytes, int out, int cols,               \
                                              const float* x, int n, float* y) {                                 \
        mm<F>(w, row_bytes, out, cols, x, n, y);                                                                 \
    }                                                                                                            \
    extern "C" __global__ void DECODE_BOUNDS CAT(mmo_, name)(Many m, int cols, const float* x, int n, int ro) {  \
        grid_entry();                                                                                            \
        mm_outputs<F>(m, cols, x, n, ro);                                                                        \
    }                                                                                                            \
    extern "C" __global__ void CAT(embed_, name)(const u8* w, long long row_bytes, int cols, const u32* tok,     \
                                                 float scale, float* out) {                                      \
        grid_entry();                                                                                            \
        embed<F>(w, row_bytes, cols, tok, scale, out);                                                           \
    }

FORMAT_KERNELS(SLUICE_FORMAT, SLUICE_FORMAT_NAME)

#if SLUICE_FORMAT == F_Q4K || SLUICE_FORMAT == F_Q5K || SLUICE_FORMAT == F_Q6K
// The integer products (backend.rs: `Products::Integer`); the quantized input as one
// QIn argument (backend.rs's `QIn`).
extern "C" __global__ void CAT(mmgq_, SLUICE_FORMAT_NAME)(const unsigned long long* ws, long long row_bytes, int out,
                                                         QIn in, const u32* xrow, const Work* work, float* y,
                                                         const u32* yrow) {
    mmq_grouped<SLUICE_FORMAT>(ws, row_bytes, out, in, xrow, work, y, yrow);
}
extern "C" __global__ void CAT(mmq_, SLUICE_FORMAT_NAME)(const u8* w, long long row_bytes, int out, QIn in,
                                                        float* y) {
    mmq<SLUICE_FORMAT>(w, row_bytes, out, in, y);
}
// The tensor-core products (backend.rs: `Path::Tensor`), with the integer products'
// quantized input. Five blocks an SM (45 KB of staging each): the weights' staging
// took the compiler to 114-126 registers, four blocks; bounded, 92-96 and no spills.
#define TENSOR_BOUNDS __launch_bounds__(32 * MT_WARPS, 5)
extern "C" __global__ void TENSOR_BOUNDS CAT(mmgt_, SLUICE_FORMAT_NAME)(const unsigned long long* ws,
                                                                       long long row_bytes, int out, QIn in,
                                                                       const u32* xrow, const Work* tiles, float* y,
                                                                       const u32* yrow) {
    mmt_grouped<SLUICE_FORMAT>(ws, row_bytes, out, in, xrow, tiles, y, yrow);
}
extern "C" __global__ void TENSOR_BOUNDS CAT(mmt_, SLUICE_FORMAT_NAME)(Many m, QIn in) {
    mmt<SLUICE_FORMAT>(m, in);
}
#endif
#else

// ---- Element-wise operations (n elements; grid-stride loops) ----

#define EACH(n) for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)


extern "C" __global__ void add(float* x, const float* y, long long n) { grid_entry(); EACH(n) x[i] += y[i]; }
extern "C" __global__ void mul(float* x, const float* y, long long n) { grid_entry(); EACH(n) x[i] *= y[i]; }
extern "C" __global__ void scale(float* x, float s, long long n) { grid_entry(); EACH(n) x[i] *= s; }
extern "C" __global__ void mul_row(float* x, const float* v, int cols, long long n) { grid_entry(); EACH(n) x[i] *= v[i % cols]; }
extern "C" __global__ void add_row(float* x, const float* v, int cols, long long n) { grid_entry(); EACH(n) x[i] += v[i % cols]; }
extern "C" __global__ void scale_rows(float* x, const float* s, int cols, long long n) { grid_entry(); EACH(n) x[i] *= s[i / cols]; }
extern "C" __global__ void activate(float* x, int a, long long n) { grid_entry(); EACH(n) x[i] = act(a, x[i]); }
extern "C" __global__ void softcap(float* x, float cap, long long n) { grid_entry(); EACH(n) x[i] = tanhf(x[i] / cap) * cap; }
extern "C" __global__ void glu(float* g, const float* u, int kind, float alpha, float limit, long long n) {
    grid_entry();
    EACH(n) g[i] = glu_of(kind, alpha, limit, g[i], u[i]);
}
// out[r, :] = x[idx[r], :] (cols wide).
extern "C" __global__ void gather_rows(const float* x, const u32* idx, int cols, float* out, long long n) {
    grid_entry();
    EACH(n) out[i] = x[(long long)idx[i / cols] * cols + i % cols];
}
// out[idx[r], :] = x[r, :].
extern "C" __global__ void scatter_rows(const float* x, const u32* idx, int cols, float* out, long long n) {
    grid_entry();
    EACH(n) out[(long long)idx[i / cols] * cols + i % cols] = x[i];
}
// x[j, :] += bias[ex[j] * cols ..] for each compact row j (per-expert biases).
extern "C" __global__ void add_expert_bias(float* x, const float* bias, const u32* ex, int cols, long long n) {
    grid_entry();
    EACH(n) x[i] += bias[(long long)ex[i / cols] * cols + i % cols];
}
// out[r, c] = x[r, start + c] for c < len.
extern "C" __global__ void columns(const float* x, int cols, int start, int len, float* out, long long n) {
    grid_entry();
    EACH(n) out[i] = x[(i / len) * cols + start + i % len];
}
// Columns start..start + len of each of `heads` heads, from src to dst, row by row:
// n = rows * heads * len.
extern "C" __global__ void copy_columns(float* dst, int dcols, int dstart, const float* src, int scols, int sstart,
                                        int heads, int len, long long n) {
    grid_entry();
    EACH(n) {
        long long r = i / ((long long)heads * len);
        int rest = (int)(i % ((long long)heads * len)), h = rest / len, j = rest % len;
        dst[r * dcols + h * (dcols / heads) + dstart + j] = src[r * scols + h * (scols / heads) + sstart + j];
    }
}
// out[r, :] = sum over j < k of w[r * k + j] * ys[r * k + j, :], in j order. The
// first COMBINE_HELD terms' loads are issued together before the sum takes them.
#define COMBINE_HELD 8
extern "C" __global__ void combine(const float* ys, const float* w, int k, int cols, float* out, long long n) {
    grid_entry();
    EACH(n) {
        long long r = i / cols, c = i % cols;
        float wv[COMBINE_HELD], yv[COMBINE_HELD];
#pragma unroll
        for (int j = 0; j < COMBINE_HELD; j++) {
            wv[j] = j < k ? w[r * k + j] : 0.0f;
            yv[j] = j < k ? ys[(r * k + j) * cols + c] : 0.0f;
        }
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < COMBINE_HELD; j++)
            if (j < k) s += wv[j] * yv[j];
        for (int j = COMBINE_HELD; j < k; j++) s += w[r * k + j] * ys[(r * k + j) * cols + c];
        out[i] = s;
    }
}

// ---- Activations quantized for the integer products ----

// Each row of x ([n, cols], cols a multiple of 32) quantized per 32 elements bit for
// bit as sluice_cpu::quant::act does it: 8 bits, d = max|x| / 127, or 16 bits,
// d = max|x| / 32512 with the code split into a rounded high byte and the rest;
// code = rint(x * (1 / d)), NaNs to 0. Row r is 16-bit if `uniform` is 1, or where
// uniform is -1 if flags[map ? map[r] : r] is (map: the compact rows of a grouped
// product, flags the step's rows). Writes QIn's arrays (kernels' `QIn`). A warp per
// block of 32, a lane per element; block 256.
extern "C" __global__ void quantize_act(const float* x, int n, int cols, int uniform, const u32* flags,
                                        const u32* map, i8* q, float* d, float* sx, int* s16, u32* wide) {
    grid_entry();
    long long g = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31, blocks = cols >> 5;
    if (g >= (long long)n * blocks) return;  // whole warps
    int r = (int)(g / blocks), b = (int)(g % blocks);
    int w = uniform >= 0 ? uniform : (int)flags[map ? map[r] : r];
    long long at = (long long)r * cols + 32 * b + lane;
    float v = x[at];
    // max |x| as bit patterns, NaNs (the patterns above infinity's) as 0.
    u32 bits = __float_as_uint(v) & 0x7fffffffu;
    if (bits > 0x7f800000u) bits = 0;
    for (int off = 16; off > 0; off >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffff, bits, off));
    float lim = w ? 32512.0f : 127.0f;
    float db = __fdiv_rn(__uint_as_float(bits), lim);
    float id = db != 0.0f ? __fdiv_rn(1.0f, db) : 0.0f;
    float t = rintf(__fmul_rn(v, id));
    t = t != t ? 0.0f : fminf(fmaxf(t, w ? -32512.0f : -128.0f), lim);
    int code = (int)t;
    if (w) {
        int top = (code + 128) >> 8;
        q[at] = (i8)top;
        q[(long long)n * cols + at] = (i8)(code - 256 * top);
    } else {
        q[at] = (i8)code;
    }
    // Each half's sum (lanes 0..16 and 16..32), exact.
    int s = code;
    for (int off = 8; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
    int s1 = __shfl_xor_sync(0xffffffff, s, 16);
    if (lane == 0) {
        long long k = (long long)r * blocks + b;
        d[k] = db;
        sx[k] = __fmul_rn(db, (float)(s + s1));
        s16[2 * k] = s;
        s16[2 * k + 1] = s1;
        if (b == 0) wide[r] = w;
    }
}

// ---- Norms and RoPE ----

// The sum of one double a thread over a block of 256, by one tree whatever kernel
// calls it: a group's norm takes the same bits in rms_norm and norm_rope.
__device__ __forceinline__ double block_sum_256(double v) {
    __shared__ double part[256];
    part[threadIdx.x] = v;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    return part[0];
}

// 1 / rms of a group of `group` elements whose squares' sums, one a thread of the
// block's 256, are `ss`.
__device__ __forceinline__ float group_inv_rms(double ss, int group, float eps) {
    return powf((float)(block_sum_256(ss) / group) + eps, -0.5f);
}

// y[g] = x[g] * rsqrt(mean(x[g]^2) + eps) * (weight + offset) for each group of
// `group` elements, x first taking `add` (x += add, kept) where one is given: the
// residual's sum and the next block's input in one pass. y may be x. One block of
// 256 per group.
//
// Each thread takes elements threadIdx.x + 256 i, their loads issued NORM_BATCH at a
// time before any is used (a loop that loads, adds and stores one element at a time
// waits on each load in turn: 7 us a 2048-element row on an H100). The sums' order
// is the elements' order either way. A group of at most 256 * NORM_BATCH (a hidden
// row of up to 2048) is `held`: its elements and weights are loaded once, together,
// and stay in registers across the sum, rather than loaded again after it.
#define NORM_BATCH 8
extern "C" __global__ void rms_norm(float* x, const float* add, float* y, int group, const float* weight,
                                    float offset, float eps) {
    grid_entry();
    long long at = (long long)blockIdx.x * group;
    float* g = x + at;
    double ss = 0.0;
    bool held = group <= 256 * NORM_BATCH;
    float v[NORM_BATCH], w[NORM_BATCH];
    for (int i0 = threadIdx.x; i0 < group; i0 += 256 * NORM_BATCH) {
#pragma unroll
        for (int k = 0; k < NORM_BATCH; k++) {
            int i = i0 + 256 * k;
            v[k] = i < group ? (add ? g[i] + add[at + i] : g[i]) : 0.0f;
            if (held) w[k] = i < group && weight ? weight[i] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < NORM_BATCH; k++) {
            int i = i0 + 256 * k;
            if (i < group) {
                if (add) g[i] = v[k];
                ss += (double)v[k] * (double)v[k];
            }
        }
    }
    float inv = group_inv_rms(ss, group, eps);
    for (int i0 = threadIdx.x; i0 < group; i0 += 256 * NORM_BATCH) {
#pragma unroll
        for (int k = 0; k < NORM_BATCH && !held; k++) {
            int i = i0 + 256 * k;
            v[k] = i < group ? g[i] : 0.0f;
            w[k] = i < group && weight ? weight[i] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < NORM_BATCH; k++) {
            int i = i0 + 256 * k;
            if (i < group) {
                float u = v[k] * inv;
                y[at + i] = weight ? u * (w[k] + offset) : u;
            }
        }
    }
}

// The rotation of one pair (x1, x2) of a head at `pos` by RoPE's pair p: by
// pos * inv_freq[p], times `factor`.
__device__ __forceinline__ void rope_pair(float* x1, float* x2, u32 pos, float inv_freq, float factor) {
    float a = (float)pos * inv_freq;
    float c = cosf(a) * factor, s = sinf(a) * factor;
    float u = *x1, v = *x2;
    // Which product a multiply-add takes is written out, so that every kernel
    // rotating a pair (rope, norm_rope) gives the same bits.
    *x1 = __fmaf_rn(u, c, -__fmul_rn(v, s));
    *x2 = __fmaf_rn(v, c, __fmul_rn(u, s));
}

// Element indices of RoPE's pair p in a head of hd: style 0 p with p + hd/2 (NeoX
// halves), 1 2p with 2p + 1.
__device__ __forceinline__ int2 rope_ends(int style, int p, int hd) {
    return style == 0 ? make_int2(p, p + hd / 2) : make_int2(2 * p, 2 * p + 1);
}

// rms_norm over each head (hd elements, with a weight) and then rope, in one
// launch and bit for bit the two one after the other (a query's or key's per-head
// norm and rotation). Block (head, row) of 256; each thread normalizes and turns
// the pairs it owns. The heads of x (cols wide) come first, then those of x2 (cols2
// wide, normed with weight2; none where cols2 is 0): a step's queries and keys.
extern "C" __global__ void norm_rope(float* x, int cols, const float* weight, float* x2, int cols2,
                                     const float* weight2, int hd, float offset, float eps, const u32* positions,
                                     const float* inv_freq, int pairs, int style, float factor) {
    grid_entry();
    int h = blockIdx.x, r = blockIdx.y, heads = cols / hd;
    if (h >= heads) {
        h -= heads, x = x2, cols = cols2, weight = weight2;
    }
    float* g = x + (long long)r * cols + (long long)h * hd;
    double ss = 0.0;
    for (int i = threadIdx.x; i < hd; i += 256) ss += (double)g[i] * (double)g[i];
    // A thread's first pair (its only one in a head of up to 512): its elements,
    // weights, position and frequency loaded with the sum's elements, not after it.
    int2 e = rope_ends(style, threadIdx.x, hd);
    bool first = (int)threadIdx.x < hd / 2, turns = (int)threadIdx.x < pairs;
    float a1 = first ? g[e.x] : 0.0f, a2 = first ? g[e.y] : 0.0f;
    float w1 = first ? weight[e.x] : 0.0f, w2 = first ? weight[e.y] : 0.0f;
    float f = first && turns ? inv_freq[threadIdx.x] : 0.0f;
    u32 pos = positions[r];
    float inv = group_inv_rms(ss, hd, eps);
    for (int p = threadIdx.x; p < hd / 2; p += 256) {
        if (p != (int)threadIdx.x) {
            e = rope_ends(style, p, hd);
            a1 = g[e.x], a2 = g[e.y], w1 = weight[e.x], w2 = weight[e.y];
            turns = p < pairs;
            f = turns ? inv_freq[p] : 0.0f;
        }
        float x1 = a1 * inv * (w1 + offset), x2 = a2 * inv * (w2 + offset);
        if (turns) rope_pair(&x1, &x2, pos, f, factor);
        g[e.x] = x1;
        g[e.y] = x2;
    }
}

// RoPE on every head of every row: row r at positions[r]; pairs < `pairs` rotate
// by positions * inv_freq (style 0: i with i + head_dim/2; 1: 2i with 2i + 1).
extern "C" __global__ void rope(float* x, int cols, int head_dim, const u32* positions, const float* inv_freq,
                                int pairs, int style, float factor, long long n_pairs_total) {
    grid_entry();
    int heads = cols / head_dim;
    EACH(n_pairs_total) {
        long long r = i / ((long long)heads * pairs);
        int rest = (int)(i % ((long long)heads * pairs));
        int h = rest / pairs, p = rest % pairs;
        float* hx = x + r * cols + (long long)h * head_dim;
        int2 e = rope_ends(style, p, head_dim);
        rope_pair(hx + e.x, hx + e.y, positions[r], inv_freq[p], factor);
    }
}

// ---- KV cache and attention ----

// Writes rows skip..rows of `k` and of `v` ([rows, kv_dim] each) to the caches `kc`
// and `vc`, whose next position is `len`: slot len + i, or (len + i) % ring for a
// ring (ring > 0). One launch for both (the first half of the indices keys).
__device__ __forceinline__ void kv_write_rows(float* kc, float* vc, const float* k, const float* v, int rows,
                                              int kv_dim, long long len, int ring, int skip) {
    long long n = (long long)(rows - skip) * kv_dim;
    EACH(2 * n) {
        bool is_k = i < n;
        long long at = is_k ? i : i - n;
        long long r = skip + at / kv_dim;
        long long pos = len + r;
        long long slot = ring > 0 ? pos % ring : pos;
        (is_k ? kc : vc)[slot * kv_dim + at % kv_dim] = (is_k ? k : v)[r * kv_dim + at % kv_dim];
    }
}

// kv_write_rows for up to KV_LAYERS layers of one sequence in one launch (a step's new
// positions, every layer at once; or one layer's): layer blockIdx.y's caches, rows and
// shape from `w`. As backend.rs's `KvWrites`.
#define KV_LAYERS 32
struct KvWrites {
    unsigned long long kc[KV_LAYERS], vc[KV_LAYERS], k[KV_LAYERS], v[KV_LAYERS];
    long long len[KV_LAYERS];
    int kv_dim[KV_LAYERS], ring[KV_LAYERS], skip[KV_LAYERS];
};
extern "C" __global__ void kv_write_layers(KvWrites w, int rows) {
    grid_entry();
    int l = blockIdx.y;
    kv_write_rows((float*)w.kc[l], (float*)w.vc[l], (const float*)w.k[l], (const float*)w.v[l], rows, w.kv_dim[l],
                  w.len[l], w.ring[l], w.skip[l]);
}

// One row of a sequence: its position, the positions its cache holds before the
// chunk (`start`), the batch row of the sequence's first new row, and which cache.
struct RowMeta {
    int pos;
    int start;
    int first;
    int seq;
    // Where the row's chosen positions start in `sel` and how many (QSA); sel < 0: all
    // positions up to its own (or its window's).
    int sel;
    int n_sel;
};

// The positions a row attends to: `len` of them, the t-th at att_pos(...).
__device__ __forceinline__ int att_len(RowMeta m, int window) {
    if (m.sel >= 0) return m.n_sel;
    int lo = window > 0 ? max(0, m.pos + 1 - window) : 0;
    return m.pos + 1 - lo;
}

// Warps per attention block; the most blocks one row's positions are split over.
// The head dimensions a lane accumulates are the kernel's template parameter DIMS
// (32 lanes x DIMS: attention_128, _256 and _576 below), so that a model with small
// heads keeps no registers for wide ones; a lane's sums do not depend on DIMS.
#define ATT_WARPS 4
#define ATT_MAX_SPLITS 16
// Positions a warp takes at once (the loop in attention); SLUICE_CUDA_VARIANT=1, 8 or
// 16 for the measurement of one, eight or sixteen (a 64-position split's warp has 16).
#if defined(SLUICE_VARIANT) && (SLUICE_VARIANT == 1 || SLUICE_VARIANT == 8 || SLUICE_VARIANT == 16)
#define ATT_GROUP SLUICE_VARIANT
#else
#define ATT_GROUP 4
#endif

// Positions per block for a row attending to `len` positions: 64, or more once a
// row would need more than ATT_MAX_SPLITS blocks. A function of the row alone, so
// that a row's sums are the same in any batch.
__device__ __forceinline__ int att_split_len(int len) {
    int per = (len + ATT_MAX_SPLITS - 1) / ATT_MAX_SPLITS;
    return max(64, (per + 63) / 64 * 64);
}

// Causal attention, split over positions: block (head, row, split) takes one run of
// the row's positions and writes its partial (max score, sum of exponentials, and
// the exponential-weighted sum of values) to `part`; attention_merge joins a row's
// partials. Keys and values before `start` come from the sequence's cache (device
// pointers kc[seq], vc[seq], a ring of `ring[seq]` slots if nonzero), later ones from
// the chunk's own rows. A warp takes every ATT_WARPS-th position of the run,
// ATT_GROUP at a time, with a running maximum (online softmax), its lanes across the
// head's dimensions (coalesced reads of each key and value row). `part` holds zdim
// partials of hd + 2 floats per (row, head); dynamic shared memory hd + ATT_WARPS *
// (hd + 2) floats.
template <int DIMS>
__device__ __forceinline__ void attention_dims(const float* q, const float* k_new, const float* v_new,
                                               const unsigned long long* kc, const unsigned long long* vc,
                                               const int* ring, const RowMeta* meta, const unsigned* sel,
                                               int n_heads, int n_kv_heads, int hd, float scale, int window,
                                               float cap, int zdim, float* part) {
    extern __shared__ float smem[];
    float* qs = smem;
    int h = blockIdx.x, row = blockIdx.y, split = blockIdx.z;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    RowMeta m = meta[row];
    int lo = window > 0 ? max(0, m.pos + 1 - window) : 0;
    int len = att_len(m, window);
    int sl = att_split_len(len);
    int t0 = split * sl, t1 = min(len, t0 + sl);
    if (t0 >= len) return;  // the merge reads only the row's own splits
    int kv_dim = n_kv_heads * hd, kvh = h / (n_heads / n_kv_heads);
    const float* kcache = (const float*)kc[m.seq];
    const float* vcache = (const float*)vc[m.seq];
    int rg = ring[m.seq];
    const float* qv = q + ((long long)row * n_heads + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = qv[d];
    __syncthreads();
    const float NEG = __int_as_float(0xff800000);  // -inf
    float mx = NEG, l = 0.0f;
    float acc[DIMS];
#pragma unroll
    for (int i = 0; i < DIMS; i++) acc[i] = 0.0f;
    // ATT_GROUP of the warp's positions at a time: their keys' loads issued together,
    // their scores reduced together, one rescale of the sums for the group, their
    // values' loads issued together (a position at a time, each waiting on its own
    // loads, took 23 us a decode layer of 512 positions on an H100). A position past
    // the run reads the run's last position and weighs 0.
    for (int tb = t0 + warp; tb < t1; tb += ATT_WARPS * ATT_GROUP) {
        const float* kr[ATT_GROUP];
        const float* vr[ATT_GROUP];
        float s[ATT_GROUP];
#pragma unroll
        for (int g = 0; g < ATT_GROUP; g++) {
            int t = min(tb + g * ATT_WARPS, t1 - 1);
            int j = m.sel >= 0 ? (int)sel[m.sel + t] : lo + t;
            long long at = j < m.start ? (long long)(rg > 0 ? j % rg : j) * kv_dim : -1;
            kr[g] = (at >= 0 ? kcache + at : k_new + (long long)(m.first + j - m.start) * kv_dim) + kvh * hd;
            vr[g] = (at >= 0 ? vcache + at : v_new + (long long)(m.first + j - m.start) * kv_dim) + kvh * hd;
            s[g] = 0.0f;
        }
        for (int d = lane; d < hd; d += 32) {
            float qd = qs[d];
#pragma unroll
            for (int g = 0; g < ATT_GROUP; g++) s[g] += qd * kr[g][d];
        }
        float mn = mx;
#pragma unroll
        for (int g = 0; g < ATT_GROUP; g++) {
            for (int off = 16; off > 0; off >>= 1) s[g] += __shfl_xor_sync(0xffffffff, s[g], off);
            s[g] *= scale;
            if (cap > 0.0f) s[g] = tanhf(s[g] / cap) * cap;
            if (tb + g * ATT_WARPS < t1) mn = fmaxf(mn, s[g]);
        }
        float c = expf(mx - mn), p[ATT_GROUP];
        l *= c;
#pragma unroll
        for (int g = 0; g < ATT_GROUP; g++) {
            p[g] = tb + g * ATT_WARPS < t1 ? expf(s[g] - mn) : 0.0f;
            l += p[g];
        }
#pragma unroll
        for (int i = 0; i < DIMS; i++) {
            int d = lane + 32 * i;
            if (d < hd) {
                float a = acc[i] * c;
#pragma unroll
                for (int g = 0; g < ATT_GROUP; g++) a += p[g] * vr[g][d];
                acc[i] = a;
            }
        }
        mx = mn;
    }
    // The warps' partials, joined in warp order.
    float* wp = smem + hd + warp * (hd + 2);
    if (lane == 0) {
        wp[0] = mx;
        wp[1] = l;
    }
#pragma unroll
    for (int i = 0; i < DIMS; i++) {
        int d = lane + 32 * i;
        if (d < hd) wp[2 + d] = acc[i];
    }
    __syncthreads();
    float M = NEG;
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, smem[hd + w * (hd + 2)]);
    float* pp = part + (((long long)row * n_heads + h) * zdim + split) * (hd + 2);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) {
            const float* x = smem + hd + w * (hd + 2);
            if (x[1] > 0.0f) o += x[2 + d] * expf(x[0] - M);
        }
        pp[2 + d] = o;
    }
    if (threadIdx.x == 0) {
        float L = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) {
            const float* x = smem + hd + w * (hd + 2);
            if (x[1] > 0.0f) L += x[1] * expf(x[0] - M);
        }
        pp[0] = M;
        pp[1] = L;
    }
}

// The entry points, by the widest head each takes (the backend picks the narrowest
// that fits): 128 (Qwen, Llama), 256 (Gemma 3, Gemma 4's sliding layers), 576
// (Gemma 4's global 512, DeepSeek-V3's latent 512 + 64 RoPE).
#define ATTENTION_ENTRY(NAME, DIMS)                                                                         \
    extern "C" __global__ void NAME(const float* q, const float* k_new, const float* v_new,                \
                                    const unsigned long long* kc, const unsigned long long* vc,            \
                                    const int* ring, const RowMeta* meta, const unsigned* sel, int n_heads, \
                                    int n_kv_heads, int hd, float scale, int window, float cap, int zdim,  \
                                    float* part) {                                                         \
        grid_entry();                                                                                      \
        attention_dims<DIMS>(q, k_new, v_new, kc, vc, ring, meta, sel, n_heads, n_kv_heads, hd, scale,     \
                             window, cap, zdim, part);                                                     \
    }
ATTENTION_ENTRY(attention_128, 4)
ATTENTION_ENTRY(attention_256, 8)
ATTENTION_ENTRY(attention_576, 18)

// A prompt's rows, a kv head's query heads and a tile of a sequence's rows together
// (rows at 8 bits that are one of several of their sequence in the step; backend.rs's
// `tile_rows`): block (kv head, tile) holds the tile's PT_Q query vectors (rows x the
// query heads sharing the kv head) in shared memory and takes the positions PT_T at a
// time, keys and values read once for all of them rather than once a query head and
// row (attention_128 read them per (head, row, 64 positions): 254 us a layer of a
// 512-token prompt on an H100). No splits: the block goes through every position up
// to its last row's, so it writes the output itself.
//
// A score is one thread's sum over the head's dimensions in order, a weight and a
// query's running max and sum one group of four lanes', a value's sum one thread's
// over the positions in order, each in passes of PT_T positions at multiples of PT_T:
// none depends on which tile a row is in or where in it, and a query skips the
// positions after its own (no pass it has no position in, no sum of a masked one), so
// a row's bits are its own whatever rows share its tile. Heads of at most PT_MAX_HD
// dimensions, a multiple of four; no window, no chosen positions (backend.rs checks).
#define PT_Q 64
#define PT_T 64
#define PT_MAX_HD 128
#define PT_THREADS 256
#define PT_LD (PT_MAX_HD + 4)  // floats a query's or position's row in shared memory
#define PT_PLD (PT_Q + 1)      // floats a position's scores (then weights), a query each
// Dynamic shared memory: queries, keys (then values), scores, and each query's max,
// sum and rescale (backend.rs's `TILE_SHARED`).
#define PT_SHARED ((PT_Q * PT_LD + PT_T * PT_LD + PT_T * PT_PLD + 3 * PT_Q) * 4)
#define TILE_BOUNDS __launch_bounds__(PT_THREADS)
extern "C" __global__ void TILE_BOUNDS attention_tile(
    const float* q, const float* k_new, const float* v_new, const unsigned long long* kc,
    const unsigned long long* vc, const RowMeta* meta, const int2* tiles, int n_heads, int n_kv_heads, int hd,
    float scale, float cap, const float* sinks, float* out) {
    extern __shared__ float4 pt_smem[];
    float* Qs = (float*)pt_smem;
    float* KVs = Qs + PT_Q * PT_LD;
    float* Ps = KVs + PT_T * PT_LD;
    float* Ms = Ps + PT_T * PT_PLD;
    float* Ls = Ms + PT_Q;
    float* Cs = Ls + PT_Q;
    const float NEG = __int_as_float(0xff800000);  // -inf
    int kvh = blockIdx.x, tid = threadIdx.x;
    // The tiles with the most positions first (they ascend in the list), so that the
    // long ones do not start last.
    int2 tile = tiles[gridDim.y - 1 - blockIdx.y];
    int G = n_heads / n_kv_heads, nq = tile.y * G, hd4 = hd / 4, kv_dim = n_kv_heads * hd;
    RowMeta m0 = meta[tile.x];
    int last = m0.pos;
    for (int r = 1; r < tile.y; r++) last = max(last, meta[tile.x + r].pos);
    const float* kcache = (const float*)kc[m0.seq];
    const float* vcache = (const float*)vc[m0.seq];
    // The tile's queries (zeros past them), each query's max and sum.
    for (int i = tid; i < PT_Q * hd4; i += PT_THREADS) {
        int qi = i / hd4, d4 = i % hd4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (qi < nq) {
            long long head = (long long)(tile.x + qi / G) * n_heads + kvh * G + qi % G;
            v = ((const float4*)(q + head * hd))[d4];
        }
        ((float4*)(Qs + qi * PT_LD))[d4] = v;
    }
    for (int i = tid; i < PT_Q; i += PT_THREADS) {
        Ms[i] = NEG;
        Ls[i] = 0.0f;
    }
    // Thread roles. Scores: queries tq + 16 i by positions tt + 16 j (strided, so that
    // the eight lanes of a 16-byte shared load read eight rows on distinct banks).
    // Weights: query tid / 4, positions (tid % 4) * 16 on. Values: queries tq + 16 i by
    // dimensions 4 td + 64 h.
    int tq = tid / 16, tt = tid % 16;
    int pos[4];  // the position of query tq + 16 i's row (-1: no query)
#pragma unroll
    for (int i = 0; i < 4; i++) pos[i] = tq + 16 * i < nq ? meta[tile.x + (tq + 16 * i) / G].pos : -1;
    int wq = tid / 4, wpart = tid % 4;
    int wpos = wq < nq ? meta[tile.x + wq / G].pos : -1;
    float acc[4][8];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[i][e] = 0.0f;
    // The row of position t's key or value: the cache's before the chunk, the chunk's
    // own rows after.
    auto kv_row = [&](const float* cache, const float* fresh, int t) {
        return (t < m0.start ? cache + (long long)t * kv_dim : fresh + (long long)(m0.first + t - m0.start) * kv_dim) +
               kvh * hd;
    };
    for (int t0 = 0; t0 <= last; t0 += PT_T) {
        __syncthreads();  // the last pass's values and weights are read
        for (int i = tid; i < PT_T * hd4; i += PT_THREADS) {
            int t = i / hd4, d4 = i % hd4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (t0 + t <= last) v = ((const float4*)kv_row(kcache, k_new, t0 + t))[d4];
            ((float4*)(KVs + t * PT_LD))[d4] = v;
        }
        __syncthreads();
        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) s[i][j] = 0.0f;
        for (int d4 = 0; d4 < hd4; d4++) {
            float4 a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = ((const float4*)(Qs + (tq + 16 * i) * PT_LD))[d4];
#pragma unroll
            for (int j = 0; j < 4; j++) b[j] = ((const float4*)(KVs + (tt + 16 * j) * PT_LD))[d4];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    float x = __fmaf_rn(a[i].x, b[j].x, s[i][j]);
                    x = __fmaf_rn(a[i].y, b[j].y, x);
                    x = __fmaf_rn(a[i].z, b[j].z, x);
                    s[i][j] = __fmaf_rn(a[i].w, b[j].w, x);
                }
        }
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int t = tt + 16 * j;
                float x = __fmul_rn(s[i][j], scale);
                if (cap > 0.0f) x = tanhf(x / cap) * cap;
                Ps[t * PT_PLD + tq + 16 * i] = t0 + t <= pos[i] ? x : NEG;
            }
        __syncthreads();  // the scores are written and the keys read
        // The values, into the keys' place, while the weights are made.
        for (int i = tid; i < PT_T * hd4; i += PT_THREADS) {
            int t = i / hd4, d4 = i % hd4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (t0 + t <= last) v = ((const float4*)kv_row(vcache, v_new, t0 + t))[d4];
            ((float4*)(KVs + t * PT_LD))[d4] = v;
        }
        // Weights: a query's running max over this pass, the rescale of what it has
        // summed so far, exp(score - max), and their sum (the four lanes' runs of 16,
        // joined by one butterfly, the same in each lane). Every lane takes part in the
        // shuffles; a query with no position in the pass (or none) writes nothing.
        {
            bool live = wpos >= t0;
            float tm = NEG;
            for (int t = wpart * 16; t < wpart * 16 + 16; t++) tm = fmaxf(tm, Ps[t * PT_PLD + wq]);
            tm = fmaxf(tm, __shfl_xor_sync(0xffffffff, tm, 1));
            tm = fmaxf(tm, __shfl_xor_sync(0xffffffff, tm, 2));
            float mx = Ms[wq], mn = fmaxf(mx, tm);
            float sum = 0.0f;
            for (int t = wpart * 16; t < wpart * 16 + 16; t++) {
                float x = Ps[t * PT_PLD + wq];
                float p = x == NEG ? 0.0f : expf(x - mn);
                if (live) Ps[t * PT_PLD + wq] = p;
                sum += p;
            }
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            if (live && wpart == 0) {
                float c = expf(mx - mn);  // 0 at a query's first pass (mx -inf, mn finite)
                Ms[wq] = mn;
                Ls[wq] = __fmaf_rn(Ls[wq], c, sum);
                Cs[wq] = c;
            }
        }
        __syncthreads();  // weights and values written
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (pos[i] < t0) continue;
            float c = Cs[tq + 16 * i];
            int n = min(PT_T, pos[i] - t0 + 1);  // the query's positions in the pass
#pragma unroll
            for (int e = 0; e < 8; e++) acc[i][e] = __fmul_rn(acc[i][e], c);
            for (int t = 0; t < n; t++) {
                float p = Ps[t * PT_PLD + tq + 16 * i];
                float4 v0 = ((const float4*)(KVs + t * PT_LD))[tt];
                float4 v1 = ((const float4*)(KVs + t * PT_LD))[tt + 16];
                acc[i][0] = __fmaf_rn(p, v0.x, acc[i][0]);
                acc[i][1] = __fmaf_rn(p, v0.y, acc[i][1]);
                acc[i][2] = __fmaf_rn(p, v0.z, acc[i][2]);
                acc[i][3] = __fmaf_rn(p, v0.w, acc[i][3]);
                acc[i][4] = __fmaf_rn(p, v1.x, acc[i][4]);
                acc[i][5] = __fmaf_rn(p, v1.y, acc[i][5]);
                acc[i][6] = __fmaf_rn(p, v1.z, acc[i][6]);
                acc[i][7] = __fmaf_rn(p, v1.w, acc[i][7]);
            }
        }
    }
    __syncthreads();
    // Out: each query's sums over its softmax's denominator (with the head's sink,
    // where the model has them), as attention_merge joins a row's splits.
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int qi = tq + 16 * i;
        if (qi >= nq) continue;
        int head = kvh * G + qi % G;
        float mx = Ms[qi], M = mx;
        float sink = sinks ? sinks[head] : 0.0f;
        if (sinks) M = fmaxf(M, sink);
        float L = sinks ? expf(sink - M) : 0.0f;
        float f = expf(mx - M);
        L += Ls[qi] * f;
        float inv = 1.0f / L;
        float* o = out + ((long long)(tile.x + qi / G) * n_heads + head) * hd;
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int d = 4 * (tt + 16 * h) + e;
                if (d < hd) o[d] = acc[i][4 * h + e] * f * inv;
            }
    }
}

// out[row, head] = the join of the row's attention partials, in split order. Grid
// (heads, rows), block 128. `sinks` (may be null): one logit per head that joins the
// softmax's denominator without a value (gpt-oss).
extern "C" __global__ void attention_merge(const float* part, const RowMeta* meta, const float* sinks, int n_heads,
                                           int hd, int window, int zdim, float* out) {
    grid_entry();
    int h = blockIdx.x, row = blockIdx.y;
    RowMeta m = meta[row];
    int len = att_len(m, window);
    int sl = att_split_len(len), ns = (len + sl - 1) / sl;
    const float* base = part + ((long long)row * n_heads + h) * zdim * (hd + 2);
    // Every split's maximum and sum, and a thread's first dimension of each, loaded
    // together before any is used (ns <= ATT_MAX_SPLITS: backend.rs's
    // `attention_splits`); the sums are the same expressions, in split order.
    float mx[ATT_MAX_SPLITS], sum[ATT_MAX_SPLITS], val[ATT_MAX_SPLITS];
    int d0 = threadIdx.x;
#pragma unroll
    for (int s = 0; s < ATT_MAX_SPLITS; s++) {
        bool in = s < ns;
        mx[s] = in ? base[s * (hd + 2)] : 0.0f;
        sum[s] = in ? base[s * (hd + 2) + 1] : 0.0f;
        val[s] = in && d0 < hd ? base[s * (hd + 2) + 2 + d0] : 0.0f;
    }
    float sink = sinks ? sinks[h] : 0.0f;
    float M = __int_as_float(0xff800000);
#pragma unroll
    for (int s = 0; s < ATT_MAX_SPLITS; s++)
        if (s < ns) M = fmaxf(M, mx[s]);
    if (sinks) M = fmaxf(M, sink);
    float L = sinks ? expf(sink - M) : 0.0f;
#pragma unroll
    for (int s = 0; s < ATT_MAX_SPLITS; s++)
        if (s < ns) L += sum[s] * expf(mx[s] - M);
    float inv = 1.0f / L;
    for (int d = d0; d < hd; d += blockDim.x) {
        if (d != d0) {
#pragma unroll
            for (int s = 0; s < ATT_MAX_SPLITS; s++) val[s] = s < ns ? base[s * (hd + 2) + 2 + d] : 0.0f;
        }
        float o = 0.0f;
#pragma unroll
        for (int s = 0; s < ATT_MAX_SPLITS; s++)
            if (s < ns) o += val[s] * expf(mx[s] - M);
        out[((long long)row * n_heads + h) * hd + d] = o * inv;
    }
}

// ---- Gated DeltaNet (Qwen3.5's linear attention), as sluice_cpu::delta ----

// The causal depthwise convolution of each sequence's rows (silu after), and each
// sequence's new convolution tail. A sequence's state starts with its last kern - 1
// inputs, channel-minor. Grid (channel blocks, sequences), block 128.
extern "C" __global__ void delta_conv(const float* mixed, const float* w, const unsigned long long* state_in,
                                      const unsigned long long* state_out, const int* first, const int* rows, int c,
                                      int kern, float* conv) {
    grid_entry();
    int ch = blockIdx.x * blockDim.x + threadIdx.x, s = blockIdx.y;
    if (ch >= c) return;
    const float* st = (const float*)state_in[s];
    float* so = (float*)state_out[s];
    int f = first[s], n = rows[s], h = kern - 1;
    // Input `i` of the window: the state's for i < kern - 1, then the sequence's rows.
    #define WIN(i) ((i) < h ? st[(long long)(i) * c + ch] : mixed[(long long)(f + (i) - h) * c + ch])
    for (int t = 0; t < n; t++) {
        float acc = 0.0f;
        for (int j = 0; j < kern; j++) acc += w[(long long)ch * kern + j] * WIN(t + j);
        conv[(long long)(f + t) * c + ch] = silu(acc);
    }
    for (int r = 0; r < h; r++) so[(long long)r * c + ch] = WIN(n + r);
    #undef WIN
}

#define DELTA_MAX_DK 256

// The gated delta rule: one block per (value head, sequence), a thread per value dim
// holding its column of the head's [dk, dv] state through the sequence's rows.
// `order` 0: value head j reads key head j / (hv / hk); 1: j % hk.
extern "C" __global__ void delta_rule(const float* conv, const float* b, const float* a, const float* a_neg,
                                      const float* dt_bias, const unsigned long long* state_in,
                                      const unsigned long long* state_out, const int* first, const int* rows, int hk,
                                      int hv, int dk, int dv, int order, long long skip, float* out) {
    grid_entry();
    int j = blockIdx.x, s = blockIdx.y, e = threadIdx.x;
    if (e >= dv) return;
    int kh = order == 0 ? j / (hv / hk) : j % hk;
    long long c = 2LL * hk * dk + (long long)hv * dv;
    const float* st = (const float*)state_in[s] + skip + (long long)j * dk * dv;
    float* so = (float*)state_out[s] + skip + (long long)j * dk * dv;
    float S[DELTA_MAX_DK];
    for (int i = 0; i < dk; i++) S[i] = st[(long long)i * dv + e];
    float scale = rsqrtf((float)dk);
    int f = first[s], n = rows[s];
    for (int t = 0; t < n; t++) {
        const float* row = conv + (long long)(f + t) * c;
        const float *q = row + (long long)kh * dk, *k = row + (long long)hk * dk + (long long)kh * dk;
        float qs = 0.0f, ks = 0.0f;
        for (int i = 0; i < dk; i++) {
            qs += q[i] * q[i];
            ks += k[i] * k[i];
        }
        float qn = scale / sqrtf(qs + 1e-6f), kn = 1.0f / sqrtf(ks + 1e-6f);
        long long r = (long long)(f + t) * hv + j;
        float beta = 1.0f / (1.0f + expf(-b[r]));
        float x = a[r] + dt_bias[j];
        float decay = expf(a_neg[j] * (x > 20.0f ? x : log1pf(expf(x))));
        float kv = 0.0f;
        for (int i = 0; i < dk; i++) {
            S[i] *= decay;
            kv += k[i] * kn * S[i];
        }
        float delta = (row[2LL * hk * dk + (long long)j * dv + e] - kv) * beta;
        float o = 0.0f;
        for (int i = 0; i < dk; i++) {
            S[i] += k[i] * kn * delta;
            o += q[i] * qn * S[i];
        }
        out[r * dv + e] = o;
    }
    for (int i = 0; i < dk; i++) so[(long long)i * dv + e] = S[i];
}

// ---- Routing ----

#define ROUTE_MAX_PER_LANE 8  // experts per lane: up to 256 experts

// Each row's top-k experts and weights, one warp per row (block 128: four rows), as
// sluice_cpu::router chooses them: kind 0 softmax then top-k (renormalised over the
// k if `renorm`), kind 1 top-k of the logits then softmax over the k. Ties go to the
// lower expert index, as the CPU's top-k breaks them. `bias` (may be null) is added
// to the logits first; `scale` (may be null) multiplies each chosen weight.
__device__ void route_row(int row, const float* logits, int rows, int e, int k, int kind, int renorm,
                          const float* bias, const float* scale, u32* ids, float* weights) {
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float NEG = __int_as_float(0xff800000);
    float v[ROUTE_MAX_PER_LANE];
    float mx = NEG;
#pragma unroll
    for (int j = 0; j < ROUTE_MAX_PER_LANE; j++) {
        int x = lane + 32 * j;
        v[j] = x < e ? logits[(long long)row * e + x] + (bias ? bias[x] : 0.0f) : NEG;
        mx = fmaxf(mx, v[j]);
    }
    if (kind == 0) {
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, off));
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < ROUTE_MAX_PER_LANE; j++) {
            v[j] = lane + 32 * j < e ? expf(v[j] - mx) : 0.0f;
            sum += v[j];
        }
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, off);
#pragma unroll
        for (int j = 0; j < ROUTE_MAX_PER_LANE; j++) v[j] = lane + 32 * j < e ? v[j] / sum : NEG;
    }
    // k rounds of a warp arg-max over the experts not chosen yet.
    u32 taken = 0;
    float chosen_v = 0.0f, total = 0.0f, top = NEG;
    int chosen_i = 0;
    for (int r = 0; r < k; r++) {
        float bv = NEG;
        int bi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < ROUTE_MAX_PER_LANE; j++) {
            int x = lane + 32 * j;
            if (x < e && !(taken >> j & 1) && (v[j] > bv || bi == 0x7fffffff)) {
                bv = v[j];
                bi = x;
            }
        }
        for (int off = 16; off > 0; off >>= 1) {
            float ov = __shfl_xor_sync(0xffffffff, bv, off);
            int oi = __shfl_xor_sync(0xffffffff, bi, off);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
        if (r == 0) top = bv;
        if (lane == r) {
            chosen_v = bv;
            chosen_i = bi;
        }
        total += kind == 0 ? bv : expf(bv - top);
    }
    if (lane < k) {
        float w = kind == 0 ? (renorm ? chosen_v / total : chosen_v) : expf(chosen_v - top) / total;
        if (scale) w *= scale[chosen_i];
        ids[(long long)row * k + lane] = chosen_i;
        weights[(long long)row * k + lane] = w;
    }
}
extern "C" __global__ void route_top_k(const float* logits, int rows, int e, int k, int kind, int renorm,
                                       const float* bias, const float* scale, u32* ids, float* weights) {
    grid_entry();
    route_row(blockIdx.x * 4 + (threadIdx.x >> 5), logits, rows, e, k, kind, renorm, bias, scale, ids, weights);
}

// The grouped products' plan from the routing: the (row, slot)s of `j` = rows * k
// routed to each expert, expert after expert (slots in order within one), as
// `slots` and their rows; `expert_of` each compact row's expert; work items of up to
// MM_ROWS compact rows of one expert, the `n_work` items padded with empty ones, and
// likewise `tiles` of up to MT_ROWS for the tensor-core products. One block.
//
// The counts come from shared-memory atomics (a count does not depend on their
// order); the placing is by warps, each owning a run of experts and reading the ids 32
// at a time: a lane whose id is its warp's puts it after the lanes before it with the
// same id (`__match_any_sync`), so each expert's slots stay in order. (A thread per
// expert reading all the ids, twice, took 366 us of a 512-token prompt's layer.)
__device__ void plan_block(const u32* ids, int j, int k, int e, u32* slots, u32* rows, u32* expert_of, Work* work,
                           int n_work, Work* tiles, int n_tiles) {
    extern __shared__ int count[];  // e counts, e starts, e first work items (then cursors), e first tiles
    int* start = count + e;
    int* first = start + e;
    int* first_tile = first + e;
    for (int x = threadIdx.x; x < e; x += blockDim.x) count[x] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < j; s += blockDim.x)
        if (ids[s] < (u32)e) atomicAdd(&count[ids[s]], 1);
    __syncthreads();
    // Where each expert's rows and work items start: the prefix sums over the experts,
    // by the first warp (each lane a run of experts, then a scan across the lanes).
    if (threadIdx.x < 32) {
        int lane = threadIdx.x, per = (e + 31) / 32, x0 = min(e, lane * per), x1 = min(e, x0 + per);
        int c = 0, w = 0, tw = 0;
        for (int x = x0; x < x1; x++)
            c += count[x], w += (count[x] + MM_ROWS - 1) / MM_ROWS, tw += (count[x] + MT_ROWS - 1) / MT_ROWS;
        int ci = c, wi = w, ti = tw;
        for (int off = 1; off < 32; off <<= 1) {
            int a = __shfl_up_sync(0xffffffff, ci, off), b = __shfl_up_sync(0xffffffff, wi, off);
            int d = __shfl_up_sync(0xffffffff, ti, off);
            if (lane >= off) ci += a, wi += b, ti += d;
        }
        int at = ci - c, wk = wi - w, tk = ti - tw;
        for (int x = x0; x < x1; x++) {
            start[x] = at;
            first[x] = wk;
            first_tile[x] = tk;
            at += count[x];
            wk += (count[x] + MM_ROWS - 1) / MM_ROWS;
            tk += (count[x] + MT_ROWS - 1) / MT_ROWS;
        }
    }
    __syncthreads();
    for (int x = threadIdx.x; x < e; x += blockDim.x) {
        for (int i = 0; i * MM_ROWS < count[x]; i++) {
            Work it;
            it.expert = x;
            it.start = start[x] + i * MM_ROWS;
            it.n = min(MM_ROWS, count[x] - i * MM_ROWS);
            it.pad = 0;
            work[first[x] + i] = it;
        }
        for (int i = 0; i * MT_ROWS < count[x]; i++)
            tiles[first_tile[x] + i] = Work{x, start[x] + i * MT_ROWS, min(MT_ROWS, count[x] - i * MT_ROWS), 0};
    }
    __syncthreads();
    int used = first[e - 1] + (count[e - 1] + MM_ROWS - 1) / MM_ROWS;
    int used_tiles = first_tile[e - 1] + (count[e - 1] + MT_ROWS - 1) / MT_ROWS;
    for (int i = used + threadIdx.x; i < n_work; i += blockDim.x) work[i] = Work{0, 0, 0, 0};
    for (int i = used_tiles + threadIdx.x; i < n_tiles; i += blockDim.x) tiles[i] = Work{0, 0, 0, 0};
    __syncthreads();  // every thread has read `first`: it becomes each expert's cursor
    int* cursor = first;
    for (int x = threadIdx.x; x < e; x += blockDim.x) cursor[x] = start[x];
    __syncthreads();
    int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int per = (e + warps - 1) / warps, x0 = warp * per, x1 = min(e, x0 + per);
    unsigned before = (1u << lane) - 1;
    // PLAN_AHEAD runs of 32 ids loaded before the first is placed.
    const int PLAN_AHEAD = 4;
    for (int s0 = 0; s0 < j && x0 < x1; s0 += 32 * PLAN_AHEAD) {
        u32 got[PLAN_AHEAD];
#pragma unroll
        for (int r = 0; r < PLAN_AHEAD; r++) {
            int s = s0 + 32 * r + lane;
            got[r] = s < j ? ids[s] : 0xffffffffu;
        }
#pragma unroll
        for (int r = 0; r < PLAN_AHEAD; r++) {
            int s = s0 + 32 * r + lane;
            u32 id = got[r];
            bool mine = id >= (u32)x0 && id < (u32)x1;
            unsigned same = __match_any_sync(0xffffffff, id);
            if (mine) {
                int at = cursor[id] + __popc(same & before);
                slots[at] = s;
                rows[at] = s / k;
                expert_of[at] = id;
            }
            __syncwarp();
            if (mine && (same & before) == 0) cursor[id] += __popc(same);
            __syncwarp();
        }
    }
}
extern "C" __global__ void plan_experts(const u32* ids, int j, int k, int e, u32* slots, u32* rows, u32* expert_of,
                                        Work* work, int n_work, Work* tiles, int n_tiles) {
    grid_entry();
    plan_block(ids, j, k, e, slots, rows, expert_of, work, n_work, tiles, n_tiles);
}

// plan_block for one row's k <= 32 ids, all different (a decode step's one row, as
// route_row chooses them), by the block's first warp: an expert's one slot, work item
// and tile go where plan_block puts them, at the count of the chosen experts below
// it, without plan_block's counts, scans and barriers over every expert. Then the
// work items and tiles past them are zeroed, as plan_block does.
__device__ void plan_one_row(const u32* ids, int k, int e, u32* slots, u32* rows, u32* expert_of, Work* work,
                             int n_work, Work* tiles, int n_tiles) {
    __shared__ int chosen;
    if (threadIdx.x < 32) {
        int lane = threadIdx.x;
        u32 id = lane < k ? ids[lane] : 0xffffffffu;
        int below = 0, valid = 0;
        for (int m = 0; m < k; m++) {
            u32 other = __shfl_sync(0xffffffff, id, m);
            if (other < (u32)e) valid++, below += other < id;
        }
        if (id < (u32)e) {
            slots[below] = lane;
            rows[below] = 0;
            expert_of[below] = id;
            work[below] = Work{(int)id, below, 1, 0};
            tiles[below] = Work{(int)id, below, 1, 0};
        }
        if (lane == 0) chosen = valid;
    }
    __syncthreads();
    for (int i = chosen + threadIdx.x; i < n_work; i += blockDim.x) work[i] = Work{0, 0, 0, 0};
    for (int i = chosen + threadIdx.x; i < n_tiles; i += blockDim.x) tiles[i] = Work{0, 0, 0, 0};
}

// route_top_k and then plan_experts in one block of 128 (a warp per row), for at most
// four rows (decode): the plan of the ids this block has just written.
extern "C" __global__ void route_plan(const float* logits, int rows, int e, int k, int kind, int renorm,
                                      const float* bias, const float* scale, u32* ids, float* weights, u32* slots,
                                      u32* rows_of, u32* expert_of, Work* work, int n_work, Work* tiles,
                                      int n_tiles) {
    grid_entry();
    route_row(threadIdx.x >> 5, logits, rows, e, k, kind, renorm, bias, scale, ids, weights);
    __syncthreads();  // the ids in global memory, visible to the whole block after it
    if (rows == 1 && k <= 32) plan_one_row(ids, k, e, slots, rows_of, expert_of, work, n_work, tiles, n_tiles);
    else plan_block(ids, rows * k, k, e, slots, rows_of, expert_of, work, n_work, tiles, n_tiles);
}

#endif  // SLUICE_FORMAT
