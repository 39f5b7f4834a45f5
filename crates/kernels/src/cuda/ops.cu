// CUDA kernels of the fused ops, the device side of `src/ops/*.rs`: the same
// arithmetic as the CPU kernels (f32 accumulation for f16 and bf16 storage, two-pass layer norm
// statistics, exp-normalised softmax, GELU's tanh approximation with tanh written as
// 1 - 2 / (exp(2u) + 1)), with block-wide reductions in a fixed tree order, so every result is
// deterministic run to run (not bitwise equal to the CPU's sequential sums).
//
// Compiled by build.rs with nvcc to PTX (compute capability from CUDA_COMPUTE_CAP) and checked
// with ptxas; every kernel exists as `<name>_f32`, `<name>_f16` and `<name>_bf16`.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// ---------------------------------------------------------------------------------------------
// element access: load to f32, store from f32 (round to nearest even, as the `half` crate does)

__device__ __forceinline__ float ld(float v) { return v; }
__device__ __forceinline__ float ld(__half v) { return __half2float(v); }
__device__ __forceinline__ float ld(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T st(float v);
template <> __device__ __forceinline__ float st<float>(float v) { return v; }
template <> __device__ __forceinline__ __half st<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 st<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// ---------------------------------------------------------------------------------------------
// block-wide reductions (blockDim.x a multiple of 32, at most 1024). Every warp folds the
// per-warp partials with the same xor tree, so every thread returns the same value and the
// order of additions is fixed by the block size alone.

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

template <typename A> __device__ A block_sum(A v) {
    __shared__ A partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // the previous call's readers are done with `partial`
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : A(0);
    return warp_sum(v);
}

__device__ float block_max(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : -INFINITY;
    return warp_max(v);
}

// ---------------------------------------------------------------------------------------------
// layer norm over the last dimension `d`: one block per row

template <typename T>
__device__ void row_stats(const T* x, int d, float eps, float* mean, float* rstd) {
    float s = 0.f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) s += ld(x[j]);
    const float m = block_sum(s) / (float)d;
    float v = 0.f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const float c = ld(x[j]) - m;
        v += c * c;
    }
    *mean = m;
    *rstd = 1.f / sqrtf(block_sum(v) / (float)d + eps);
}

template <typename T>
__device__ void layer_norm_fwd(const T* x, const T* w, const T* b, T* y, int d, float eps) {
    const size_t off = (size_t)blockIdx.x * d;
    float mean, rstd;
    row_stats(x + off, d, eps, &mean, &rstd);
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        y[off + j] = st<T>((ld(x[off + j]) - mean) * rstd * ld(w[j]) + ld(b[j]));
}

// dx for each row (block per row) and the row's statistics, for the column sums below
template <typename T>
__device__ void layer_norm_bwd_rows(const T* x, const T* w, const T* dy, T* dx, float* stats,
                                    int d, float eps) {
    const size_t off = (size_t)blockIdx.x * d;
    float mean, rstd;
    row_stats(x + off, d, eps, &mean, &rstd);
    float sg = 0.f, sgx = 0.f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const float xh = (ld(x[off + j]) - mean) * rstd;
        const float g = ld(dy[off + j]) * ld(w[j]);
        sg += g;
        sgx += g * xh;
    }
    const float mean_g = block_sum(sg) / (float)d;
    const float mean_gx = block_sum(sgx) / (float)d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const float xh = (ld(x[off + j]) - mean) * rstd;
        const float g = ld(dy[off + j]) * ld(w[j]);
        dx[off + j] = st<T>(rstd * (g - mean_g - xh * mean_gx));
    }
    if (threadIdx.x == 0) {
        stats[2 * blockIdx.x] = mean;
        stats[2 * blockIdx.x + 1] = rstd;
    }
}

// d(weight) and d(bias): one thread per column, rows summed in order
template <typename T>
__device__ void layer_norm_bwd_cols(const T* x, const T* dy, const float* stats, T* dw, T* db,
                                    int n, int d) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    float sw = 0.f, sb = 0.f;
    for (int r = 0; r < n; ++r) {
        const size_t i = (size_t)r * d + j;
        const float g = ld(dy[i]);
        sw += g * (ld(x[i]) - stats[2 * r]) * stats[2 * r + 1];
        sb += g;
    }
    dw[j] = st<T>(sw);
    db[j] = st<T>(sb);
}

// ---------------------------------------------------------------------------------------------
// causal softmax over the last dimension `tk` of `[.., tq, tk]`: flat row `r` sees its first
// `r % tq + tk - tq + 1` entries; the rest are exactly zero. One block per row.

__device__ __forceinline__ int visible(int row, int tq, int tk) { return row % tq + tk - tq + 1; }

template <typename T>
__device__ void causal_softmax_fwd(const T* x, T* y, int tq, int tk, float scale) {
    const int n = visible(blockIdx.x, tq, tk);
    const size_t off = (size_t)blockIdx.x * tk;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, ld(x[off + j]) * scale);
    m = block_max(m);
    float s = 0.f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += __expf(ld(x[off + j]) * scale - m);
    const float inv = 1.f / block_sum(s);
    for (int j = threadIdx.x; j < tk; j += blockDim.x)
        y[off + j] = j < n ? st<T>(__expf(ld(x[off + j]) * scale - m) * inv) : st<T>(0.f);
}

template <typename T>
__device__ void causal_softmax_bwd(const T* y, const T* dy, T* dx, int tq, int tk, float scale) {
    const int n = visible(blockIdx.x, tq, tk);
    const size_t off = (size_t)blockIdx.x * tk;
    float dot = 0.f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) dot += ld(y[off + j]) * ld(dy[off + j]);
    dot = block_sum(dot);
    for (int j = threadIdx.x; j < tk; j += blockDim.x)
        dx[off + j] =
            j < n ? st<T>(scale * ld(y[off + j]) * (ld(dy[off + j]) - dot)) : st<T>(0.f);
}

// ---------------------------------------------------------------------------------------------
// GELU, tanh approximation (GPT-2's `gelu_new`)

#define SQRT_2_OVER_PI 0.7978845608028654f
#define GELU_COEF 0.044715f

__device__ __forceinline__ float tanh_k(float u) { return 1.f - 2.f / (__expf(2.f * u) + 1.f); }

__device__ __forceinline__ float gelu_val(float x) {
    return 0.5f * x * (1.f + tanh_k(SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x)));
}

__device__ __forceinline__ float gelu_grad(float x) {
    const float x2 = x * x;
    const float t = tanh_k(SQRT_2_OVER_PI * (x + GELU_COEF * x2 * x));
    return 0.5f * (1.f + t) +
           0.5f * x * (1.f - t * t) * SQRT_2_OVER_PI * (1.f + 3.f * GELU_COEF * x2);
}

template <typename T> __device__ void gelu_fwd(const T* x, T* y, size_t len) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) y[i] = st<T>(gelu_val(ld(x[i])));
}

template <typename T> __device__ void gelu_bwd(const T* x, const T* dy, T* dx, size_t len) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) dx[i] = st<T>(ld(dy[i]) * gelu_grad(ld(x[i])));
}

// gelu(x + b), b broadcast over the last dimension `n`
template <typename T> __device__ void bias_gelu_fwd(const T* x, const T* b, T* y, size_t len, int n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) y[i] = st<T>(gelu_val(ld(x[i]) + ld(b[i % n])));
}

template <typename T>
__device__ void bias_gelu_bwd_rows(const T* x, const T* b, const T* dy, T* dx, size_t len, int n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) dx[i] = st<T>(ld(dy[i]) * gelu_grad(ld(x[i]) + ld(b[i % n])));
}

// d(bias): one thread per column, the unrounded products summed over rows in order
template <typename T>
__device__ void bias_gelu_bwd_cols(const T* x, const T* b, const T* dy, T* db, int rows, int n) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    const float bj = ld(b[j]);
    float s = 0.f;
    for (int r = 0; r < rows; ++r) {
        const size_t i = (size_t)r * n + j;
        s += ld(dy[i]) * gelu_grad(ld(x[i]) + bj);
    }
    db[j] = st<T>(s);
}

// ---------------------------------------------------------------------------------------------
// cross-entropy of logits `[n, v]` against u32 targets, mean over the targets that are not
// `ignore` (when `has_ignore`)

__device__ __forceinline__ bool counted(uint32_t t, int has_ignore, uint32_t ignore) {
    return !(has_ignore && t == ignore);
}

// per-row loss (0 for an ignored row), one block per row
template <typename T>
__device__ void cross_entropy_rows(const T* x, const uint32_t* t, double* loss, int v,
                                   int has_ignore, uint32_t ignore) {
    const uint32_t target = t[blockIdx.x];
    if (!counted(target, has_ignore, ignore)) {
        if (threadIdx.x == 0) loss[blockIdx.x] = 0.0;
        return;
    }
    const size_t off = (size_t)blockIdx.x * v;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, ld(x[off + j]));
    m = block_max(m);
    float s = 0.f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) s += __expf(ld(x[off + j]) - m);
    s = block_sum(s);
    if (threadIdx.x == 0) loss[blockIdx.x] = (double)(m + logf(s) - ld(x[off + target]));
}

// the mean over counted rows: one block; each thread sums a fixed stride of rows in order
extern "C" __global__ void cross_entropy_mean(const double* loss, const uint32_t* t, float* out,
                                              int n, int has_ignore, uint32_t ignore) {
    double s = 0.0;
    int c = 0;
    for (int r = threadIdx.x; r < n; r += blockDim.x) {
        s += loss[r];
        c += counted(t[r], has_ignore, ignore) ? 1 : 0;
    }
    s = block_sum(s);
    c = block_sum(c);
    if (threadIdx.x == 0) out[0] = c == 0 ? 0.f : (float)(s / (double)c);
}

// the number of counted targets, for the backward's scale
extern "C" __global__ void cross_entropy_count(const uint32_t* t, int* out, int n, int has_ignore,
                                               uint32_t ignore) {
    int c = 0;
    for (int r = threadIdx.x; r < n; r += blockDim.x) c += counted(t[r], has_ignore, ignore) ? 1 : 0;
    c = block_sum(c);
    if (threadIdx.x == 0) out[0] = c;
}

// grad * (softmax - onehot) / count, zero rows for ignored targets; one block per row
template <typename T>
__device__ void cross_entropy_bwd(const T* x, const uint32_t* t, const int* count, T* dx, int v,
                                  int has_ignore, uint32_t ignore, double grad) {
    const uint32_t target = t[blockIdx.x];
    const size_t off = (size_t)blockIdx.x * v;
    const int c = count[0];
    if (!counted(target, has_ignore, ignore) || c == 0) {
        for (int j = threadIdx.x; j < v; j += blockDim.x) dx[off + j] = st<T>(0.f);
        return;
    }
    const float scale = (float)(grad / (double)c);
    float m = -INFINITY;
    for (int j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, ld(x[off + j]));
    m = block_max(m);
    float s = 0.f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) s += __expf(ld(x[off + j]) - m);
    s = block_sum(s);
    const float k = scale / s;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        const float e = __expf(ld(x[off + j]) - m);
        dx[off + j] = (uint32_t)j == target ? st<T>((e / s - 1.f) * scale) : st<T>(e * k);
    }
}

// ---------------------------------------------------------------------------------------------
// the Llama family: RMSNorm (one block per row), SwiGLU, rotary embedding and repeated
// key/value heads (one thread per element)

template <typename T> __device__ float row_rstd(const T* x, int d, float eps) {
    float s = 0.f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const float v = ld(x[j]);
        s += v * v;
    }
    return 1.f / sqrtf(block_sum(s) / (float)d + eps);
}

template <typename T> __device__ void rms_norm_fwd(const T* x, const T* w, T* y, int d, float eps) {
    const size_t off = (size_t)blockIdx.x * d;
    const float rstd = row_rstd(x + off, d, eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        y[off + j] = st<T>(ld(x[off + j]) * rstd * ld(w[j]));
}

// dx for each row (block per row) and the row's rstd, for the column sums below
template <typename T>
__device__ void rms_norm_bwd_rows(const T* x, const T* w, const T* dy, T* dx, float* stats, int d,
                                  float eps) {
    const size_t off = (size_t)blockIdx.x * d;
    const float rstd = row_rstd(x + off, d, eps);
    float sgx = 0.f;
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        sgx += ld(dy[off + j]) * ld(w[j]) * ld(x[off + j]) * rstd;
    const float mean_gx = block_sum(sgx) / (float)d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const float xh = ld(x[off + j]) * rstd;
        dx[off + j] = st<T>(rstd * (ld(dy[off + j]) * ld(w[j]) - xh * mean_gx));
    }
    if (threadIdx.x == 0) stats[blockIdx.x] = rstd;
}

// d(weight): one thread per column, rows summed in order
template <typename T>
__device__ void rms_norm_bwd_cols(const T* x, const T* dy, const float* stats, T* dw, int n,
                                  int d) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    float sw = 0.f;
    for (int r = 0; r < n; ++r) {
        const size_t i = (size_t)r * d + j;
        sw += ld(dy[i]) * ld(x[i]) * stats[r];
    }
    dw[j] = st<T>(sw);
}

__device__ __forceinline__ float sigmoid_f(float g) { return 1.f / (1.f + __expf(-g)); }

// y [rows, n] = silu(x[.., :n]) * x[.., n:] for x [rows, 2n]; `len` = rows * n
template <typename T> __device__ void swiglu_fwd(const T* x, T* y, size_t len, int n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    const size_t base = (i / n) * 2 * n + i % n;
    const float g = ld(x[base]);
    y[i] = st<T>(g * sigmoid_f(g) * ld(x[base + n]));
}

template <typename T> __device__ void swiglu_bwd(const T* x, const T* dy, T* dx, size_t len, int n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    const size_t base = (i / n) * 2 * n + i % n;
    const float g = ld(x[base]), u = ld(x[base + n]), d = ld(dy[i]);
    const float s = sigmoid_f(g), silu = g * s;
    dx[base + n] = st<T>(d * silu);
    dx[base] = st<T>(d * u * (s + silu * (1.f - s)));
}

// the first `heads` heads of `head_dim` of each row of x [rows, width] rotated by the angles of
// position `row % seq` from table [seq, head_dim] (cos, then sin); `sign` -1 is the inverse
template <typename T>
__device__ void rotary(const T* x, const T* table, T* y, size_t len, int seq, int width,
                       int head_dim, int heads, int interleaved, float sign) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    const size_t r = i / width;
    const int c = (int)(i % width);
    if (c >= heads * head_dim) {
        y[i] = x[i];
        return;
    }
    const int e = c % head_dim, half = head_dim / 2;
    int f, partner, first;
    if (interleaved) {
        f = e / 2;
        first = (e % 2) == 0;
        partner = first ? e + 1 : e - 1;
    } else {
        f = e % half;
        first = e < half;
        partner = first ? e + half : e - half;
    }
    const T* t = table + (r % seq) * head_dim;
    const float co = ld(t[f]), si = sign * ld(t[half + f]);
    const float a = ld(x[i]), b = ld(x[i - e + partner]);
    y[i] = first ? st<T>(a * co - b * si) : st<T>(a * co + b * si);
}

// y [batch, kv * groups, inner]: head h a copy of head h / groups of x [batch, kv, inner]
template <typename T>
__device__ void repeat_kv(const T* x, T* y, size_t len, int kv, int inner, int groups) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    const size_t row = i / inner;
    const int e = (int)(i % inner), heads = kv * groups;
    const size_t b = row / heads;
    const int h = (int)(row % heads);
    y[i] = x[(b * kv + h / groups) * inner + e];
}

// dx [batch, kv, inner]: each head the sum of its `groups` heads of dy, in order
template <typename T>
__device__ void repeat_kv_sum(const T* dy, T* dx, size_t len, int kv, int inner, int groups) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    const size_t row = i / inner;
    const int e = (int)(i % inner);
    const size_t b = row / kv;
    const int h = (int)(row % kv);
    float acc = 0.f;
    for (int g = 0; g < groups; ++g)
        acc += ld(dy[((b * kv + h) * groups + g) * inner + e]);
    dx[i] = st<T>(acc);
}

// ---------------------------------------------------------------------------------------------
// the exported entry points, one per element type

#define KILN_OPS(T, S)                                                                          \
    extern "C" __global__ void layer_norm_fwd_##S(const T* x, const T* w, const T* b, T* y,     \
                                                  int d, float eps) {                           \
        layer_norm_fwd<T>(x, w, b, y, d, eps);                                                  \
    }                                                                                           \
    extern "C" __global__ void layer_norm_bwd_rows_##S(const T* x, const T* w, const T* dy,     \
                                                       T* dx, float* stats, int d, float eps) { \
        layer_norm_bwd_rows<T>(x, w, dy, dx, stats, d, eps);                                    \
    }                                                                                           \
    extern "C" __global__ void layer_norm_bwd_cols_##S(const T* x, const T* dy,                 \
                                                       const float* stats, T* dw, T* db, int n, \
                                                       int d) {                                 \
        layer_norm_bwd_cols<T>(x, dy, stats, dw, db, n, d);                                     \
    }                                                                                           \
    extern "C" __global__ void causal_softmax_fwd_##S(const T* x, T* y, int tq, int tk,         \
                                                      float scale) {                            \
        causal_softmax_fwd<T>(x, y, tq, tk, scale);                                             \
    }                                                                                           \
    extern "C" __global__ void causal_softmax_bwd_##S(const T* y, const T* dy, T* dx, int tq,   \
                                                      int tk, float scale) {                    \
        causal_softmax_bwd<T>(y, dy, dx, tq, tk, scale);                                        \
    }                                                                                           \
    extern "C" __global__ void gelu_fwd_##S(const T* x, T* y, size_t len) {                     \
        gelu_fwd<T>(x, y, len);                                                                 \
    }                                                                                           \
    extern "C" __global__ void gelu_bwd_##S(const T* x, const T* dy, T* dx, size_t len) {       \
        gelu_bwd<T>(x, dy, dx, len);                                                            \
    }                                                                                           \
    extern "C" __global__ void bias_gelu_fwd_##S(const T* x, const T* b, T* y, size_t len,      \
                                                 int n) {                                       \
        bias_gelu_fwd<T>(x, b, y, len, n);                                                      \
    }                                                                                           \
    extern "C" __global__ void bias_gelu_bwd_rows_##S(const T* x, const T* b, const T* dy,      \
                                                      T* dx, size_t len, int n) {               \
        bias_gelu_bwd_rows<T>(x, b, dy, dx, len, n);                                            \
    }                                                                                           \
    extern "C" __global__ void bias_gelu_bwd_cols_##S(const T* x, const T* b, const T* dy,      \
                                                      T* db, int rows, int n) {                 \
        bias_gelu_bwd_cols<T>(x, b, dy, db, rows, n);                                           \
    }                                                                                           \
    extern "C" __global__ void cross_entropy_rows_##S(const T* x, const uint32_t* t,            \
                                                      double* loss, int v, int has_ignore,      \
                                                      uint32_t ignore) {                        \
        cross_entropy_rows<T>(x, t, loss, v, has_ignore, ignore);                               \
    }                                                                                           \
    extern "C" __global__ void cross_entropy_bwd_##S(const T* x, const uint32_t* t,             \
                                                     const int* count, T* dx, int v,            \
                                                     int has_ignore, uint32_t ignore,           \
                                                     double grad) {                             \
        cross_entropy_bwd<T>(x, t, count, dx, v, has_ignore, ignore, grad);                     \
    }

KILN_OPS(float, f32)
KILN_OPS(__half, f16)
KILN_OPS(__nv_bfloat16, bf16)

#define KILN_LLAMA_OPS(T, S)                                                                    \
    extern "C" __global__ void rms_norm_fwd_##S(const T* x, const T* w, T* y, int d,            \
                                                float eps) {                                    \
        rms_norm_fwd<T>(x, w, y, d, eps);                                                       \
    }                                                                                           \
    extern "C" __global__ void rms_norm_bwd_rows_##S(const T* x, const T* w, const T* dy,       \
                                                     T* dx, float* stats, int d, float eps) {   \
        rms_norm_bwd_rows<T>(x, w, dy, dx, stats, d, eps);                                      \
    }                                                                                           \
    extern "C" __global__ void rms_norm_bwd_cols_##S(const T* x, const T* dy,                   \
                                                     const float* stats, T* dw, int n, int d) { \
        rms_norm_bwd_cols<T>(x, dy, stats, dw, n, d);                                           \
    }                                                                                           \
    extern "C" __global__ void swiglu_fwd_##S(const T* x, T* y, size_t len, int n) {            \
        swiglu_fwd<T>(x, y, len, n);                                                            \
    }                                                                                           \
    extern "C" __global__ void swiglu_bwd_##S(const T* x, const T* dy, T* dx, size_t len,       \
                                              int n) {                                          \
        swiglu_bwd<T>(x, dy, dx, len, n);                                                       \
    }                                                                                           \
    extern "C" __global__ void rotary_##S(const T* x, const T* table, T* y, size_t len,         \
                                          int seq, int width, int head_dim, int heads,          \
                                          int interleaved, float sign) {                        \
        rotary<T>(x, table, y, len, seq, width, head_dim, heads, interleaved, sign);            \
    }                                                                                           \
    extern "C" __global__ void repeat_kv_##S(const T* x, T* y, size_t len, int kv, int inner,   \
                                             int groups) {                                      \
        repeat_kv<T>(x, y, len, kv, inner, groups);                                             \
    }                                                                                           \
    extern "C" __global__ void repeat_kv_sum_##S(const T* dy, T* dx, size_t len, int kv,        \
                                                 int inner, int groups) {                       \
        repeat_kv_sum<T>(dy, dx, len, kv, inner, groups);                                       \
    }

KILN_LLAMA_OPS(float, f32)
KILN_LLAMA_OPS(__half, f16)
KILN_LLAMA_OPS(__nv_bfloat16, bf16)
