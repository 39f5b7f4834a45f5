// CUDA kernels of the data-parallel engine's optimizer step.
//
// `adamw_f32` is kiln-optim's AdamW kernel (`adamw_block` in crates/optim/src/adamw.rs)
// operation for operation: each multiply, add, division and square root is an IEEE-rounded
// intrinsic (`__fmul_rn`, `__fadd_rn`, ...), which nvcc never contracts into a fused
// multiply-add, in the CPU kernel's order. The per-step constants come from the host
// (`AdamWConfig::step_consts`), so a device step gives bitwise the CPU's parameters and
// moments.

#include <stddef.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v, size_t n,
                                     float decay, float lerp_w, float lerp_w_comp, float beta2,
                                     float one_minus_beta2, float bc2_sqrt, float eps,
                                     float neg_step_size, int small_w) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float gi = g[i], mi = m[i];
    const float pd = __fmul_rn(p[i], decay);
    // m = lerp(m, g, 1 - beta1), in the branch PyTorch's lerp takes for this weight
    const float mn = small_w ? __fadd_rn(mi, __fmul_rn(lerp_w, __fsub_rn(gi, mi)))
                             : __fsub_rn(gi, __fmul_rn(__fsub_rn(gi, mi), lerp_w_comp));
    const float vn = __fadd_rn(__fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(one_minus_beta2, gi), gi));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vn), bc2_sqrt), eps);
    p[i] = __fadd_rn(pd, __fdiv_rn(__fmul_rn(neg_step_size, mn), denom));
    m[i] = mn;
    v[i] = vn;
}

// ---------------------------------------------------------------------------------------------
// The rest of the device-resident step (kiln-parallel's engine, data_parallel/resident.rs).
// Each kernel is the CPU path's arithmetic, element by element, with IEEE-rounded intrinsics.

// Gradient accumulation into the flat f32 buffer (the CPU's `tensor_into_slice`): the gradient
// widened to f32 (exact), then copied or added.
#define ACCUM(NAME, T, TO_F32)                                                                   \
    extern "C" __global__ void NAME(float* dst, const T* src, size_t n, int overwrite) {       \
        const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;                        \
        if (i >= n) return;                                                                     \
        const float s = TO_F32(src[i]);                                                         \
        dst[i] = overwrite ? s : __fadd_rn(dst[i], s);                                          \
    }
__device__ __forceinline__ float id_f32(float x) { return x; }
ACCUM(accum_grad_f32, float, id_f32)
ACCUM(accum_grad_f16, __half, __half2float)
ACCUM(accum_grad_bf16, __nv_bfloat16, __bfloat162float)

// The exact sum of squares of kiln-optim's `SquareSum`, binned on the device: x = mant *
// 2^(e - 150), so x^2 = mant^2 * 2^(2e - 300) with mant^2 < 2^48. Each square is split into
// its high and low 24 bits and added to the integer bins of its exponent (`bins[e]`: high
// halves, `bins[256 + e]`: low halves), first in shared memory, then once per block into
// global memory. A u64 bin overflows only after 2^40 elements, and integer addition is
// associative, so the bins (and the norm the host computes from them) do not depend on the
// order of the threads: the value is the CPU's, bit for bit. Subnormals go to exponent 1
// without the implicit bit, as on the CPU; NaN sets flags bit 0, infinity bit 1.
//
// With `scale` set, each element is first multiplied by `inv` and written back (the loss
// scaler's unscale, fused with its inf/NaN check and the norm).
extern "C" __global__ void square_bins(float* x, size_t n, float inv, int scale,
                                       unsigned long long* bins, unsigned int* flags) {
    __shared__ unsigned long long hi[256];
    __shared__ unsigned long long lo[256];
    __shared__ unsigned int fl;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        hi[i] = 0;
        lo[i] = 0;
    }
    if (threadIdx.x == 0) fl = 0;
    __syncthreads();
    unsigned int mine = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = x[i];
        if (scale) {
            v = __fmul_rn(v, inv);
            x[i] = v;
        }
        const unsigned int bits = __float_as_uint(v);
        const unsigned int e = (bits >> 23) & 0xff;
        const unsigned long long frac = bits & 0x7fffff;
        if (e == 255) {
            mine |= frac ? 1u : 2u;
            continue;
        }
        unsigned long long sq;
        unsigned int bin;
        if (e == 0) {
            if (frac == 0) continue;
            sq = frac * frac;
            bin = 1;
        } else {
            const unsigned long long mant = frac | 0x800000ull;
            sq = mant * mant;
            bin = e;
        }
        atomicAdd(&hi[bin], sq >> 24);
        atomicAdd(&lo[bin], sq & 0xffffffull);
    }
    if (mine) atomicOr(&fl, mine);
    __syncthreads();
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        if (hi[i]) atomicAdd(&bins[i], hi[i]);
        if (lo[i]) atomicAdd(&bins[256 + i], lo[i]);
    }
    if (threadIdx.x == 0 && fl) atomicOr(flags, fl);
}

// Clipping (kiln-optim's `clip_to_norm`): g *= coef.
extern "C" __global__ void scale_f32(float* g, size_t n, float coef) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) g[i] = __fmul_rn(g[i], coef);
}

// The update of a step (for the update-to-weight ratio): old = now - old.
extern "C" __global__ void delta_f32(float* old, const float* now, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) old[i] = __fsub_rn(now[i], old[i]);
}

// The fp32 master values into the model's variables, rounded to nearest even as the CPU's
// `half` conversions round.
extern "C" __global__ void write_param_f32(float* dst, const float* src, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}
extern "C" __global__ void write_param_f16(__half* dst, const float* src, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __float2half_rn(src[i]);
}
extern "C" __global__ void write_param_bf16(__nv_bfloat16* dst, const float* src, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __float2bfloat16_rn(src[i]);
}
