// sluice's CUDA kernels, compiled by NVRTC when the backend starts (kernels.rs).
//
// Weights stay in their stored format in device memory; every product dequantizes
// 32 elements at a time ("pieces": a 32-element block, a K-quant sub-block, or 32
// plain values) into registers and multiplies in f32. The layouts are ggml's, as
// sluice_core::quant::dequantize_block reads them.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;

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

__device__ __forceinline__ float half_at(const u8* b) { return h2f((u16)b[0] | ((u16)b[1] << 8)); }

__device__ __forceinline__ u32 u32_at(const u8* b) {
    return (u32)b[0] | ((u32)b[1] << 8) | ((u32)b[2] << 16) | ((u32)b[3] << 24);
}

// Element i of a 32-element block's 16 bytes of nibbles: low nibbles first.
__device__ __forceinline__ int nib(const u8* qs, int i) {
    return i < 16 ? (qs[i] & 15) : (qs[i - 16] >> 4);
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

// Piece p of a row (elements 32p..32p+32; `cols` bounds the plain formats' last one).
template <int F>
__device__ __forceinline__ void deq32(const u8* row, int p, int cols, float* v) {
    if (F == F_F32 || F == F_F16 || F == F_BF16) {
        int c0 = 32 * p;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            int c = c0 + i;
            float x = 0.0f;
            if (c < cols) {
                if (F == F_F32) x = ((const float*)row)[c];
                else if (F == F_F16) x = h2f(((const u16*)row)[c]);
                else x = __uint_as_float((u32)((const u16*)row)[c] << 16);
            }
            v[i] = x;
        }
    } else if (F == F_Q8_0) {
        const u8* b = row + 34 * p;
        float d = half_at(b);
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = (float)(i8)b[2 + i] * d;
    } else if (F == F_Q4_0) {
        const u8* b = row + 18 * p;
        float d = half_at(b);
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = d * (float)(nib(b + 2, i) - 8);
    } else if (F == F_Q4_1) {
        const u8* b = row + 20 * p;
        float d = half_at(b), m = half_at(b + 2);
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = d * (float)nib(b + 4, i) + m;
    } else if (F == F_Q5_0) {
        const u8* b = row + 22 * p;
        float d = half_at(b);
        u32 qh = u32_at(b + 2);
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = d * (float)((int)(nib(b + 6, i) | ((qh >> i) & 1) << 4) - 16);
    } else if (F == F_Q5_1) {
        const u8* b = row + 24 * p;
        float d = half_at(b), m = half_at(b + 2);
        u32 qh = u32_at(b + 4);
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = d * (float)(nib(b + 8, i) | (((qh >> i) & 1) << 4)) + m;
    } else if (F == F_MXFP4) {
        const u8* b = row + 17 * p;
        float d = e8m0_half(b[0]);
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = d * (float)MXFP4_VALUES[nib(b + 1, i)];
    } else if (F == F_Q4K || F == F_Q5K) {
        const int bytes = F == F_Q4K ? 144 : 176;
        const u8* b = row + bytes * (p >> 3);
        int j = p & 7;
        float d = half_at(b), dmin = half_at(b + 2);
        int sc, m;
        k_scale_min(b + 4, j, &sc, &m);
        float scale = d * (float)sc, mn = dmin * (float)m;
        const u8* qs = b + (F == F_Q4K ? 16 : 48) + 32 * (j >> 1);
        const u8* qh = b + 16;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int q = (j & 1) ? (qs[l] >> 4) : (qs[l] & 15);
            if (F == F_Q5K) q |= ((qh[l] >> j) & 1) << 4;
            v[l] = scale * (float)q - mn;
        }
    } else if (F == F_Q6K) {
        const u8* b = row + 210 * (p >> 3);
        int j = p & 7, h = j >> 2, s = j & 3;
        const u8* ql = b + 64 * h + 32 * (s & 1);
        const u8* qh = b + 128 + 32 * h;
        const i8* scales = (const i8*)(b + 192);
        float d = half_at(b + 208);
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int lo = s < 2 ? (ql[l] & 15) : (ql[l] >> 4);
            int hi = (qh[l] >> (2 * s)) & 3;
            int q = (lo | (hi << 4)) - 32;
            int e = 128 * h + 32 * s + l;
            v[l] = (d * (float)scales[e >> 4]) * (float)q;
        }
    }
}

// Output rows per block (one warp each) and input rows per pass of the weights.
#define MM_WARPS 4
#define MM_ROWS 8

// The shared body of the products: one warp computes output `o` of up to MM_ROWS
// input rows against weight row `row`, a lane per piece. `X` gives input row r's
// address, `Y` stores its result.
template <int F, class X, class Y>
__device__ __forceinline__ void mm_warp(const u8* row, int cols, int nr, X xrow, Y store) {
    int lane = threadIdx.x & 31;
    float acc[MM_ROWS];
#pragma unroll
    for (int r = 0; r < MM_ROWS; r++) acc[r] = 0.0f;
    int pieces = (cols + 31) >> 5;
    for (int p = lane; p < pieces; p += 32) {
        float v[32];
        deq32<F>(row, p, cols, v);
        int c0 = 32 * p;
        int m = min(32, cols - c0);
#pragma unroll
        for (int r = 0; r < MM_ROWS; r++) {
            if (r < nr) {
                const float* xr = xrow(r) + c0;
                float s = 0.0f;
                if (m == 32) {
#pragma unroll
                    for (int i = 0; i < 32; i += 4) {
                        float4 t = *(const float4*)(xr + i);
                        s += v[i] * t.x + v[i + 1] * t.y + v[i + 2] * t.z + v[i + 3] * t.w;
                    }
                } else {
                    for (int i = 0; i < m; i++) s += v[i] * xr[i];
                }
                acc[r] += s;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MM_ROWS; r++) {
        float s = acc[r];
        for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffff, s, off);
        if (lane == 0 && r < nr) store(r, s);
    }
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
    __device__ void operator()(int r, float s) const { y[(long long)(r0 + r) * out + o] = s; }
};

// y[r, o] = x[r, :] · W[o, :] for r < n, o < out. Grid (ceil(out / MM_WARPS),
// ceil(n / MM_ROWS)), block 32 * MM_WARPS. Each warp reads its weight row once per
// MM_ROWS input rows.
template <int F>
__device__ void mm(const u8* w, long long row_bytes, int out, int cols, const float* x, int n, float* y) {
    int o = blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
    if (o >= out) return;
    int r0 = blockIdx.y * MM_ROWS;
    mm_warp<F>(w + (long long)o * row_bytes, cols, min(MM_ROWS, n - r0), DenseX{x, cols, r0}, DenseY{y, out, o, r0});
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
    __device__ void operator()(int r, float s) const {
        long long i = rows ? rows[start + r] : start + r;
        y[i * out + o] = s;
    }
};

// Every routed expert of a layer in one launch: for each work item, y[yrow[j]] =
// W_e · x[xrow[j]] over its compact rows j (an index array may be null: j itself).
// Grid (ceil(out / MM_WARPS), items).
template <int F>
__device__ void mm_grouped(const unsigned long long* ws, long long row_bytes, int out, int cols, const float* x,
                           const u32* xrow, const Work* work, float* y, const u32* yrow) {
    int o = blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
    if (o >= out) return;
    Work it = work[blockIdx.y];
    const u8* row = (const u8*)ws[it.expert] + (long long)o * row_bytes;
    mm_warp<F>(row, cols, it.n, GatherX{x, xrow, cols, it.start}, ScatterY{y, yrow, out, o, it.start});
}

// out[i, :] = W[tokens[i], :] * scale. Grid (n, ceil(pieces / 128)), block 128.
template <int F>
__device__ void embed(const u8* w, long long row_bytes, int cols, const u32* tokens, float scale, float* out) {
    int i = blockIdx.x;
    int p = blockIdx.y * blockDim.x + threadIdx.x;
    if (32 * p >= cols) return;
    float v[32];
    deq32<F>(w + (long long)tokens[i] * row_bytes, p, cols, v);
    float* o = out + (long long)i * cols + 32 * p;
    int m = min(32, cols - 32 * p);
    for (int k = 0; k < m; k++) o[k] = v[k] * scale;
}

#define FORMAT_KERNELS(F, name)                                                                         \
    extern "C" __global__ void mmg_##name(const unsigned long long* ws, long long row_bytes, int out, int cols, \
                                          const float* x, const u32* xrow, const Work* work, float* y,        \
                                          const u32* yrow) {                                                  \
        mm_grouped<F>(ws, row_bytes, out, cols, x, xrow, work, y, yrow);                                      \
    }                                                                                                         \
    extern "C" __global__ void mm_##name(const u8* w, long long row_bytes, int out, int cols,           \
                                         const float* x, int n, float* y) {                             \
        mm<F>(w, row_bytes, out, cols, x, n, y);                                                        \
    }                                                                                                   \
    extern "C" __global__ void embed_##name(const u8* w, long long row_bytes, int cols, const u32* tok, \
                                            float scale, float* out) {                                  \
        embed<F>(w, row_bytes, cols, tok, scale, out);                                                  \
    }

FORMAT_KERNELS(F_F32, f32)
FORMAT_KERNELS(F_F16, f16)
FORMAT_KERNELS(F_BF16, bf16)
FORMAT_KERNELS(F_Q8_0, q8_0)
FORMAT_KERNELS(F_Q4_0, q4_0)
FORMAT_KERNELS(F_Q4_1, q4_1)
FORMAT_KERNELS(F_Q5_0, q5_0)
FORMAT_KERNELS(F_Q5_1, q5_1)
FORMAT_KERNELS(F_MXFP4, mxfp4)
FORMAT_KERNELS(F_Q4K, q4_k)
FORMAT_KERNELS(F_Q5K, q5_k)
FORMAT_KERNELS(F_Q6K, q6_k)

// ---- Element-wise operations (n elements; grid-stride loops) ----

#define EACH(n) for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
}
// Activation codes: 0 SiLU, 1 GELU (tanh).
__device__ __forceinline__ float act(int a, float x) { return a == 0 ? silu(x) : gelu_tanh(x); }

extern "C" __global__ void add(float* x, const float* y, long long n) { EACH(n) x[i] += y[i]; }
extern "C" __global__ void mul(float* x, const float* y, long long n) { EACH(n) x[i] *= y[i]; }
extern "C" __global__ void scale(float* x, float s, long long n) { EACH(n) x[i] *= s; }
extern "C" __global__ void mul_row(float* x, const float* v, int cols, long long n) { EACH(n) x[i] *= v[i % cols]; }
extern "C" __global__ void add_row(float* x, const float* v, int cols, long long n) { EACH(n) x[i] += v[i % cols]; }
extern "C" __global__ void activate(float* x, int a, long long n) { EACH(n) x[i] = act(a, x[i]); }
extern "C" __global__ void softcap(float* x, float cap, long long n) { EACH(n) x[i] = tanhf(x[i] / cap) * cap; }
// glu: 0/1 gated with that activation; 2 gpt-oss's clamped SwiGLU.
extern "C" __global__ void glu(float* g, const float* u, int kind, float alpha, float limit, long long n) {
    EACH(n) {
        if (kind == 2) {
            float x = fminf(g[i], limit);
            float v = fminf(fmaxf(u[i], -limit), limit);
            g[i] = x / (1.0f + expf(-alpha * x)) * (v + 1.0f);
        } else {
            g[i] = act(kind, g[i]) * u[i];
        }
    }
}
// out[r, :] = x[idx[r], :] (cols wide).
extern "C" __global__ void gather_rows(const float* x, const u32* idx, int cols, float* out, long long n) {
    EACH(n) out[i] = x[(long long)idx[i / cols] * cols + i % cols];
}
// out[idx[r], :] = x[r, :].
extern "C" __global__ void scatter_rows(const float* x, const u32* idx, int cols, float* out, long long n) {
    EACH(n) out[(long long)idx[i / cols] * cols + i % cols] = x[i];
}
// x[j, :] += bias[ex[j] * cols ..] for each compact row j (per-expert biases).
extern "C" __global__ void add_expert_bias(float* x, const float* bias, const u32* ex, int cols, long long n) {
    EACH(n) x[i] += bias[(long long)ex[i / cols] * cols + i % cols];
}
// out[r, c] = x[r, start + c] for c < len.
extern "C" __global__ void columns(const float* x, int cols, int start, int len, float* out, long long n) {
    EACH(n) out[i] = x[(i / len) * cols + start + i % len];
}
// out[r, :] = sum over j < k of w[r * k + j] * ys[r * k + j, :], in j order.
extern "C" __global__ void combine(const float* ys, const float* w, int k, int cols, float* out, long long n) {
    EACH(n) {
        long long r = i / cols, c = i % cols;
        float s = 0.0f;
        for (int j = 0; j < k; j++) s += w[r * k + j] * ys[(r * k + j) * cols + c];
        out[i] = s;
    }
}

// ---- Norms and RoPE ----

// x[g] = x[g] * rsqrt(mean(x[g]^2) + eps) * (weight + offset) for each group of
// `group` elements. One block of 256 per group.
extern "C" __global__ void rms_norm(float* x, int group, const float* weight, float offset, float eps) {
    __shared__ double part[256];
    float* g = x + (long long)blockIdx.x * group;
    double ss = 0.0;
    for (int i = threadIdx.x; i < group; i += blockDim.x) ss += (double)g[i] * (double)g[i];
    part[threadIdx.x] = ss;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    float inv = powf((float)(part[0] / group) + eps, -0.5f);
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        float v = g[i] * inv;
        g[i] = weight ? v * (weight[i] + offset) : v;
    }
}

// RoPE on every head of every row: row r at positions[r]; pairs < `pairs` rotate
// by positions * inv_freq (style 0: i with i + head_dim/2; 1: 2i with 2i + 1).
extern "C" __global__ void rope(float* x, int cols, int head_dim, const u32* positions, const float* inv_freq,
                                int pairs, int style, float factor, long long n_pairs_total) {
    int heads = cols / head_dim;
    EACH(n_pairs_total) {
        long long r = i / ((long long)heads * pairs);
        int rest = (int)(i % ((long long)heads * pairs));
        int h = rest / pairs, p = rest % pairs;
        float a = (float)positions[r] * inv_freq[p];
        float c = cosf(a) * factor, s = sinf(a) * factor;
        float* hx = x + r * cols + (long long)h * head_dim;
        int ia = style == 0 ? p : 2 * p, ib = style == 0 ? p + head_dim / 2 : 2 * p + 1;
        float x1 = hx[ia], x2 = hx[ib];
        hx[ia] = x1 * c - x2 * s;
        hx[ib] = x2 * c + x1 * s;
    }
}

// ---- KV cache and attention ----

// Writes rows skip..rows of `src` ([rows, kv_dim]) to a cache whose next position is
// `len`: slot len + i, or (len + i) % ring for a ring (ring > 0).
extern "C" __global__ void kv_write(float* cache, const float* src, int rows, int kv_dim, long long len, int ring,
                                    int skip) {
    long long n = (long long)(rows - skip) * kv_dim;
    EACH(n) {
        long long r = skip + i / kv_dim;
        long long pos = len + r;
        long long slot = ring > 0 ? pos % ring : pos;
        cache[slot * kv_dim + i % kv_dim] = src[r * kv_dim + i % kv_dim];
    }
}

// One row of a sequence: its position, the positions its cache holds before the
// chunk (`start`), the batch row of the sequence's first new row, and which cache.
struct RowMeta {
    int pos;
    int start;
    int first;
    int seq;
};

// Causal attention, one block per (head, row). Keys and values before `start` come
// from the sequence's cache (device pointers kc[seq], vc[seq], a ring of `ring[seq]`
// slots if nonzero), later ones from the chunk's own rows. `scores` holds max_len
// floats per (row, head).
extern "C" __global__ void attention(const float* q, const float* k_new, const float* v_new,
                                     const unsigned long long* kc, const unsigned long long* vc, const int* ring,
                                     const RowMeta* meta, int n_heads, int n_kv_heads, int hd, float scale,
                                     int window, float cap, float* scores, int max_len, float* out) {
    extern __shared__ float qs[];
    __shared__ float red[32];
    int h = blockIdx.x, row = blockIdx.y;
    RowMeta m = meta[row];
    int kv_dim = n_kv_heads * hd, kvh = h / (n_heads / n_kv_heads);
    int lo = window > 0 ? max(0, m.pos + 1 - window) : 0;
    int len = m.pos + 1 - lo;
    const float* kcache = (const float*)kc[m.seq];
    const float* vcache = (const float*)vc[m.seq];
    int rg = ring[m.seq];
    const float* qv = q + ((long long)row * n_heads + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = qv[d];
    __syncthreads();
    float* sc = scores + ((long long)row * n_heads + h) * max_len;
    float mx = __int_as_float(0xff800000);  // -inf
    for (int t = threadIdx.x; t < len; t += blockDim.x) {
        int j = lo + t;
        const float* kr = j < m.start ? kcache + (long long)(rg > 0 ? j % rg : j) * kv_dim
                                      : k_new + (long long)(m.first + j - m.start) * kv_dim;
        kr += kvh * hd;
        float s = 0.0f;
        for (int d = 0; d < hd; d++) s += qs[d] * kr[d];
        s *= scale;
        if (cap > 0.0f) s = tanhf(s / cap) * cap;
        sc[t] = s;
        mx = fmaxf(mx, s);
    }
    // Block max, then the sum of exponentials.
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_down_sync(0xffffffff, mx, off));
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    if (threadIdx.x == 0) {
        float v = red[0];
        for (int w = 1; w < warps; w++) v = fmaxf(v, red[w]);
        red[0] = v;
    }
    __syncthreads();
    mx = red[0];
    __syncthreads();
    float sum = 0.0f;
    for (int t = threadIdx.x; t < len; t += blockDim.x) {
        float e = expf(sc[t] - mx);
        sc[t] = e;
        sum += e;
    }
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_down_sync(0xffffffff, sum, off);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float v = 0.0f;
        for (int w = 0; w < warps; w++) v += red[w];
        red[0] = v;
    }
    __syncthreads();
    float inv = 1.0f / red[0];
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int t = 0; t < len; t++) {
            int j = lo + t;
            const float* vr = j < m.start ? vcache + (long long)(rg > 0 ? j % rg : j) * kv_dim
                                          : v_new + (long long)(m.first + j - m.start) * kv_dim;
            acc += sc[t] * vr[kvh * hd + d];
        }
        out[((long long)row * n_heads + h) * hd + d] = acc * inv;
    }
}
