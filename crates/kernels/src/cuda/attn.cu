// Fused causal attention of kiln-model (`ops::causal_attention`), flash-attention-2 style:
// forward, D = rowsum(dO * o), and the dK/dV and dQ kernels of the backward. Storage is f32,
// f16 or bf16; all arithmetic is f32. No seq x seq matrix exists in global memory: blocks own
// a tile of rows and stream tiles of the other side through shared memory, the forward with
// an online softmax (running max and sum per row), the backward recomputing each probability
// as exp(scale q.k - L) from the forward's per-row logsumexp L (an f32 buffer).
//
// Layout: q, k, v, o, dO are contiguous [heads, t, dh] (heads = batch * heads), L and D
// [heads, t]. Grid x is the head, grid y the row tile; the tiles that do the most work (the
// last query tiles, the first key tiles) are scheduled first.
//
// Tiling per instantiation DMAX (16, 32, 64, 128 or 256; the head dim rounded up, the rest of
// each row zero): G = DMAX / 16 consecutive threads share one row, thread g of a group holding
// its 16 dims as 4 float4 chunks, chunk c covering dims 4 (g + G c) .. + 3, so the lanes of a
// group read consecutive 16-byte words of a shared row (no bank conflicts) and a dot product
// is 16 multiply-adds per thread plus log2(G) shuffles. A block owns BQ = min(64, 256 / G)
// rows (BQ * G <= 256 threads) and streams tiles of BK = min(64, 4096 / DMAX) rows, two f32
// tiles of at most 32 KiB in static shared memory. src/cuda/attn.rs launches with the same
// numbers.
//
// Compiled by build.rs with nvcc to PTX (compute capability from CUDA_COMPUTE_CAP) and checked
// with ptxas; the kernels are `attn_fwd_<dtype>_d<DMAX>`, `attn_bwd_dkv_<dtype>_d<DMAX>`,
// `attn_bwd_dq_<dtype>_d<DMAX>` and `attn_delta_<dtype>`.

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
// tiling

template <int DMAX> struct Tile {
    static_assert(DMAX % 16 == 0 && DMAX >= 16 && DMAX <= 256, "DMAX: 16..256, a multiple of 16");
    static constexpr int G = DMAX / 16;                         // threads per row
    static constexpr int BQ = (256 / G) < 64 ? (256 / G) : 64;  // rows a block owns
    static constexpr int THREADS = BQ * G;
    static constexpr int BK = (4096 / DMAX) < 64 ? (4096 / DMAX) : 64;  // streamed rows
    static_assert(BK % 16 == 0, "the forward walks key tiles 16 keys at a time");
    static_assert(THREADS % 32 == 0, "groups must tile whole warps");
};

// sum over the G lanes of a group (G a power of two dividing 32; whole warps take part)
template <int G> __device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// this thread's 16 dims of row `row` of a [t, dh] matrix, times `scale`; zero outside the
// matrix (row >= t, or a dim >= dh)
template <typename T, int G>
__device__ __forceinline__ void load_row(float4 (&r)[4], const T* m, int row, int t, int dh,
                                         float scale, int g) {
    const bool valid = row < t;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const int d = 4 * (g + G * c);
        float x[4];
#pragma unroll
        for (int e = 0; e < 4; ++e)
            x[e] = (valid && d + e < dh) ? ld(m[(size_t)row * dh + d + e]) * scale : 0.f;
        r[c] = make_float4(x[0], x[1], x[2], x[3]);
    }
}

// writes this thread's dims of row `row` (< t) of a [t, dh] matrix, times `scale`
template <typename T, int G>
__device__ __forceinline__ void store_row(T* m, const float4 (&r)[4], int row, int dh,
                                          float scale, int g) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const int d = 4 * (g + G * c);
        const float x[4] = {r[c].x, r[c].y, r[c].z, r[c].w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (d + e < dh) m[(size_t)row * dh + d + e] = st<T>(x[e] * scale);
    }
}

// rows r0 .. r0 + ROWS - 1 of a [t, dh] matrix into shared `dst` (rows DMAX floats apart),
// times `scale`, zero outside the matrix; every thread of the block takes part
template <typename T, int DMAX, int ROWS>
__device__ __forceinline__ void load_tile(float* dst, const T* m, int r0, int t, int dh,
                                          float scale) {
    for (int i = threadIdx.x; i < ROWS * DMAX; i += blockDim.x) {
        const int row = r0 + i / DMAX, d = i % DMAX;
        dst[i] = (row < t && d < dh) ? ld(m[(size_t)row * dh + d]) * scale : 0.f;
    }
}

// this thread's part of the dot product of its registers with shared row `row`
template <int G>
__device__ __forceinline__ float dot_part(const float4 (&a)[4], const float* row, int g) {
    const float4* r = reinterpret_cast<const float4*>(row);
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const float4 b = r[g + G * c];
        s = fmaf(a[c].x, b.x, s);
        s = fmaf(a[c].y, b.y, s);
        s = fmaf(a[c].z, b.z, s);
        s = fmaf(a[c].w, b.w, s);
    }
    return s;
}

// acc += p * (this thread's dims of shared row `row`)
template <int G>
__device__ __forceinline__ void axpy_row(float4 (&acc)[4], float p, const float* row, int g) {
    const float4* r = reinterpret_cast<const float4*>(row);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const float4 b = r[g + G * c];
        acc[c].x = fmaf(p, b.x, acc[c].x);
        acc[c].y = fmaf(p, b.y, acc[c].y);
        acc[c].z = fmaf(p, b.z, acc[c].z);
        acc[c].w = fmaf(p, b.w, acc[c].w);
    }
}

// the same with the row in registers
__device__ __forceinline__ void axpy_reg(float4 (&acc)[4], float p, const float4 (&b)[4]) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        acc[c].x = fmaf(p, b[c].x, acc[c].x);
        acc[c].y = fmaf(p, b[c].y, acc[c].y);
        acc[c].z = fmaf(p, b[c].z, acc[c].z);
        acc[c].w = fmaf(p, b[c].w, acc[c].w);
    }
}

__device__ __forceinline__ void scale_reg(float4 (&acc)[4], float a) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        acc[c].x *= a;
        acc[c].y *= a;
        acc[c].z *= a;
        acc[c].w *= a;
    }
}

// this thread's float4 chunks of shared row `row`
template <int G>
__device__ __forceinline__ void read_row(float4 (&r)[4], const float* row, int g) {
    const float4* s = reinterpret_cast<const float4*>(row);
#pragma unroll
    for (int c = 0; c < 4; ++c) r[c] = s[g + G * c];
}

// ---------------------------------------------------------------------------------------------
// forward: a block owns BQ query rows and walks the key tiles up to its last row. Scores are
// taken 16 keys at a time; masked keys (j > i) score -inf and weigh exactly zero, a row whose
// running max is still -inf (no visible key yet, only rows past t) adds nothing, so no NaN.

template <typename T, int DMAX>
__device__ void attn_fwd(const T* q, const T* k, const T* v, T* o, float* lse, int t, int dh,
                         float scale) {
    using P = Tile<DMAX>;
    constexpr int G = P::G, BQ = P::BQ, BK = P::BK;
    __shared__ __align__(16) float ks[BK * DMAX];
    __shared__ __align__(16) float vs[BK * DMAX];
    const size_t head = (size_t)blockIdx.x * t * dh;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BQ;
    const int g = threadIdx.x % G;
    const int row = q0 + threadIdx.x / G;
    float4 qr[4], acc[4];
    load_row<T, G>(qr, q + head, row, t, dh, scale, g);  // scores come out scaled
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    float m = -INFINITY, l = 0.f;
    const int kend = min(t, q0 + BQ);  // the keys any row of this block sees
    for (int k0 = 0; k0 < kend; k0 += BK) {
        __syncthreads();  // the previous tile's readers are done
        load_tile<T, DMAX, BK>(ks, k + head, k0, kend, dh, 1.f);
        load_tile<T, DMAX, BK>(vs, v + head, k0, kend, dh, 1.f);
        __syncthreads();
        const int nk = min(BK, kend - k0);
        for (int j0 = 0; j0 < nk; j0 += 16) {
            float s[16];
            float cmax = -INFINITY;
#pragma unroll
            for (int jj = 0; jj < 16; ++jj) {
                const int key = k0 + j0 + jj;
                const float x = group_sum<G>(dot_part<G>(qr, ks + (j0 + jj) * DMAX, g));
                // key <= row < t: visible (row >= t: padding, sees nothing)
                s[jj] = (key <= row && row < t) ? x : -INFINITY;
                cmax = fmaxf(cmax, s[jj]);
            }
            const float m_new = fmaxf(m, cmax);
            // m == -inf: nothing accumulated yet (acc and l are zero), nothing to rescale
            const float alpha = m == -INFINITY ? 0.f : __expf(m - m_new);
            l *= alpha;
            scale_reg(acc, alpha);
#pragma unroll
            for (int jj = 0; jj < 16; ++jj) {
                const float p = s[jj] == -INFINITY ? 0.f : __expf(s[jj] - m_new);
                l += p;
                axpy_row<G>(acc, p, vs + (j0 + jj) * DMAX, g);
            }
            m = m_new;
        }
    }
    if (row < t) {
        // l >= 1: the row's largest score contributes exp(0)
        store_row<T, G>(o + head, acc, row, dh, 1.f / l, g);
        if (g == 0) lse[(size_t)blockIdx.x * t + row] = m + logf(l);
    }
}

// ---------------------------------------------------------------------------------------------
// D = rowsum(dO * o): one warp per row

template <typename T>
__device__ void attn_delta(const T* o, const T* d_o, float* delta, int rows, int dh) {
    const int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;  // the whole warp leaves together
    const size_t off = (size_t)row * dh;
    float s = 0.f;
    for (int d = lane; d < dh; d += 32) s = fmaf(ld(o[off + d]), ld(d_o[off + d]), s);
    s = group_sum<32>(s);
    if (lane == 0) delta[row] = s;
}

// ---------------------------------------------------------------------------------------------
// dK, dV: a block owns BQ key rows and walks the query tiles from its first key to the end:
// p = exp(scale q.k - L), ds = p (dO.v - D), dv += p dO, dk += ds (scale q).

template <typename T, int DMAX>
__device__ void attn_bwd_dkv(const T* q, const T* k, const T* v, const T* d_o, const float* lse,
                             const float* delta, T* dk, T* dv, int t, int dh, float scale) {
    using P = Tile<DMAX>;
    constexpr int G = P::G, BQ = P::BQ, BK = P::BK;
    __shared__ __align__(16) float qs[BK * DMAX];
    __shared__ __align__(16) float gs[BK * DMAX];
    __shared__ float ls[BK];
    __shared__ float ds_[BK];
    const size_t head = (size_t)blockIdx.x * t * dh;
    const float* lse_h = lse + (size_t)blockIdx.x * t;
    const float* delta_h = delta + (size_t)blockIdx.x * t;
    const int k0 = blockIdx.y * BQ;  // the first key tiles see the most queries: first
    const int g = threadIdx.x % G;
    const int key = k0 + threadIdx.x / G;
    float4 kr[4], vr[4], dka[4], dva[4];
    load_row<T, G>(kr, k + head, key, t, dh, 1.f, g);
    load_row<T, G>(vr, v + head, key, t, dh, 1.f, g);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        dka[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        dva[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int i0 = k0; i0 < t; i0 += BK) {
        __syncthreads();
        load_tile<T, DMAX, BK>(qs, q + head, i0, t, dh, scale);
        load_tile<T, DMAX, BK>(gs, d_o + head, i0, t, dh, 1.f);
        for (int i = threadIdx.x; i < BK; i += blockDim.x) {
            const bool in = i0 + i < t;
            ls[i] = in ? lse_h[i0 + i] : 0.f;
            ds_[i] = in ? delta_h[i0 + i] : 0.f;
        }
        __syncthreads();
        const int ni = min(BK, t - i0);
        for (int i = 0; i < ni; ++i) {
            const int qrow = i0 + i;  // < t
            float4 qv[4], gv[4];
            read_row<G>(qv, qs + i * DMAX, g);
            read_row<G>(gv, gs + i * DMAX, g);
            const float s = group_sum<G>(dot_part<G>(kr, qs + i * DMAX, g));
            const float dp = group_sum<G>(dot_part<G>(vr, gs + i * DMAX, g));
            const bool visible = key <= qrow;  // and so key < t
            const float p = visible ? __expf(s - ls[i]) : 0.f;
            const float ds = p * (dp - ds_[i]);
            axpy_reg(dva, p, gv);
            axpy_reg(dka, ds, qv);  // qv carries the scale
        }
    }
    if (key < t) {
        store_row<T, G>(dk + head, dka, key, dh, 1.f, g);
        store_row<T, G>(dv + head, dva, key, dh, 1.f, g);
    }
}

// ---------------------------------------------------------------------------------------------
// dQ: a block owns BQ query rows and walks the key tiles up to its last row:
// dq = scale sum_j ds_j k_j.

template <typename T, int DMAX>
__device__ void attn_bwd_dq(const T* q, const T* k, const T* v, const T* d_o, const float* lse,
                            const float* delta, T* dq, int t, int dh, float scale) {
    using P = Tile<DMAX>;
    constexpr int G = P::G, BQ = P::BQ, BK = P::BK;
    __shared__ __align__(16) float ks[BK * DMAX];
    __shared__ __align__(16) float vs[BK * DMAX];
    const size_t head = (size_t)blockIdx.x * t * dh;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BQ;
    const int g = threadIdx.x % G;
    const int row = q0 + threadIdx.x / G;
    const bool valid = row < t;
    float4 qr[4], gr[4], dqa[4];
    load_row<T, G>(qr, q + head, row, t, dh, scale, g);
    load_row<T, G>(gr, d_o + head, row, t, dh, 1.f, g);
#pragma unroll
    for (int c = 0; c < 4; ++c) dqa[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    const float L = valid ? lse[(size_t)blockIdx.x * t + row] : 0.f;
    const float D = valid ? delta[(size_t)blockIdx.x * t + row] : 0.f;
    const int kend = min(t, q0 + BQ);
    for (int k0 = 0; k0 < kend; k0 += BK) {
        __syncthreads();
        load_tile<T, DMAX, BK>(ks, k + head, k0, kend, dh, 1.f);
        load_tile<T, DMAX, BK>(vs, v + head, k0, kend, dh, 1.f);
        __syncthreads();
        const int nk = min(BK, kend - k0);
        for (int j = 0; j < nk; ++j) {
            const int key = k0 + j;
            float4 kv[4];
            read_row<G>(kv, ks + j * DMAX, g);
            const float s = group_sum<G>(dot_part<G>(qr, ks + j * DMAX, g));
            const float dp = group_sum<G>(dot_part<G>(gr, vs + j * DMAX, g));
            const float p = (valid && key <= row) ? __expf(s - L) : 0.f;
            axpy_reg(dqa, p * (dp - D), kv);
        }
    }
    if (valid) store_row<T, G>(dq + head, dqa, row, dh, scale, g);
}

// ---------------------------------------------------------------------------------------------
// the exported entry points

#define ATTN_D(T, S, D)                                                                          \
    extern "C" __global__ void __launch_bounds__(Tile<D>::THREADS)                               \
        attn_fwd_##S##_d##D(const T* q, const T* k, const T* v, T* o, float* lse, int t, int dh, \
                            float scale) {                                                       \
        attn_fwd<T, D>(q, k, v, o, lse, t, dh, scale);                                           \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(Tile<D>::THREADS) attn_bwd_dkv_##S##_d##D(     \
        const T* q, const T* k, const T* v, const T* d_o, const float* lse, const float* delta,  \
        T* dk, T* dv, int t, int dh, float scale) {                                              \
        attn_bwd_dkv<T, D>(q, k, v, d_o, lse, delta, dk, dv, t, dh, scale);                      \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(Tile<D>::THREADS) attn_bwd_dq_##S##_d##D(      \
        const T* q, const T* k, const T* v, const T* d_o, const float* lse, const float* delta,  \
        T* dq, int t, int dh, float scale) {                                                     \
        attn_bwd_dq<T, D>(q, k, v, d_o, lse, delta, dq, t, dh, scale);                           \
    }

#define ATTN(T, S)                                                                               \
    ATTN_D(T, S, 16)                                                                             \
    ATTN_D(T, S, 32)                                                                             \
    ATTN_D(T, S, 64)                                                                             \
    ATTN_D(T, S, 128)                                                                            \
    ATTN_D(T, S, 256)                                                                            \
    extern "C" __global__ void attn_delta_##S(const T* o, const T* d_o, float* delta, int rows,  \
                                              int dh) {                                          \
        attn_delta<T>(o, d_o, delta, rows, dh);                                                  \
    }

ATTN(float, f32)
ATTN(__half, f16)
ATTN(__nv_bfloat16, bf16)
