// CUDA kernels of the data-parallel engine's optimizer step.
//
// `adamw_f32` is kiln-optim's AdamW kernel (`adamw_block` in crates/optim/src/adamw.rs)
// operation for operation: each multiply, add, division and square root is an IEEE-rounded
// intrinsic (`__fmul_rn`, `__fadd_rn`, ...), which nvcc never contracts into a fused
// multiply-add, in the CPU kernel's order. The per-step constants come from the host
// (`AdamWConfig::step_consts`), so a device step gives bitwise the CPU's parameters and
// moments.

#include <stddef.h>

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
