//! How the CPU linear op multiplies f32 tensors, per thread: PyTorch's
//! `torch.set_float32_matmul_precision`.

/// How the CPU linear op multiplies f32 tensors: PyTorch's
/// `torch.set_float32_matmul_precision`, for the linear layers of one thread.
///
/// With [`MatmulPrecision::Bf16`] the operands of every f32 product are rounded to bf16 and
/// the products accumulate in f32, the result staying f32: the tensors around the product,
/// their gradients and every other op stay f32. Where the CPU's `avx512_bf16` dot product
/// outruns f32 FMA (twice its rate on AMD Zen 4) the operands are rounded as they are packed
/// for it; elsewhere (Intel Xeons without AMX, where it runs at half FMA's rate) they are
/// rounded as they are packed for the f32 kernel (see [`crate::bf16_kernel`]). This is how
/// kiln-model computes in bf16 on the CPU (see `GptOptions::compute_dtype`), where candle's
/// element-wise bf16 kernels are slower than its f32 ones. [`MatmulPrecision::F16`] does the
/// same with f16 operands (kiln-model's f16 compute on the CPU). Tensors stored in bf16, f16
/// or f64 are multiplied in their own type whatever the setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatmulPrecision {
    /// f32 operands (the default).
    #[default]
    Highest,
    /// bf16 operands, f32 accumulation and result.
    Bf16,
    /// f16 operands (rounded to nearest even, beyond 65504 to infinity), f32 accumulation and
    /// result: what an f16 matrix unit with f32 accumulation computes. This CPU family has no
    /// f16 dot product, so the operands are rounded as they are packed for the f32 kernel
    /// (rounded copies through gemm's kernel where the CPU lacks AVX-512). A scaled gradient
    /// too large for f16 becomes infinite in the product, so a dynamic loss scaler sees the
    /// overflow it exists for.
    F16,
}

thread_local! {
    static PRECISION: std::cell::Cell<MatmulPrecision> =
        const { std::cell::Cell::new(MatmulPrecision::Highest) };
}

/// Runs `f` with this thread's f32 linear products at `precision`, restoring the previous
/// setting afterwards (also when `f` unwinds). The setting is read when an op is built in the
/// forward; its backward uses the same precision whichever thread runs it.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kiln_kernels::dense::LinearNoBias;
/// use kiln_kernels::{with_matmul_precision, MatmulPrecision};
/// let x = Tensor::new(&[[1.0f32 + 1.0 / 1024.0]], &Device::Cpu)?;
/// let w = Tensor::new(&[[1.0f32]], &Device::Cpu)?;
/// let exact = x.apply_op2(&w, LinearNoBias::new())?.to_vec2::<f32>()?[0][0];
/// let rounded = with_matmul_precision(MatmulPrecision::Bf16, || {
///     x.apply_op2(&w, LinearNoBias::new())
/// })?;
/// assert_eq!(exact, 1.0 + 1.0 / 1024.0);
/// assert_eq!(rounded.to_vec2::<f32>()?[0][0], 1.0); // x rounded to bf16's 8 bits
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn with_matmul_precision<R>(precision: MatmulPrecision, f: impl FnOnce() -> R) -> R {
    struct Restore(MatmulPrecision);
    impl Drop for Restore {
        fn drop(&mut self) {
            PRECISION.with(|p| p.set(self.0));
        }
    }
    let _restore = Restore(PRECISION.with(|p| p.replace(precision)));
    f()
}

/// This thread's current [`MatmulPrecision`].
pub fn matmul_precision() -> MatmulPrecision {
    PRECISION.with(|p| p.get())
}
