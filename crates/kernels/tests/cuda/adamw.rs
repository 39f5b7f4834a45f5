//! AdamW on CUDA (the `adamw_f32` kernel of `step.cu`) against kiln-optim's CPU AdamW: bitwise
//! equal parameters and moments after several steps, with weight decay and both lerp branches.

#[cfg(feature = "cuda")]
#[test]
fn adamw_on_cuda_equals_the_cpu_bitwise() {
    use kiln_optim::{AdamW, AdamWConfig, Optimizer};
    let dev = match candle_core::Device::new_cuda(0) {
        Ok(candle_core::Device::Cuda(d)) => d,
        other => {
            println!("adamw_on_cuda_equals_the_cpu_bitwise: skipped, no CUDA device: {other:?}");
            return;
        }
    };
    let n = (1 << 20) + 37;
    let vals = |salt: u64| -> Vec<f32> {
        (0..n as u64)
            .map(|i| {
                let h = kiln_state::splitmix64(i ^ (salt << 40));
                ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
            })
            .collect()
    };
    // beta1 0.9 takes lerp's small-weight branch, beta1 0.3 the other
    for beta1 in [0.9, 0.3] {
        let cfg = AdamWConfig {
            beta1,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut cpu = AdamW::new(n, cfg).unwrap();
        let mut p_cpu = vals(1);
        let mut p = dev.clone_htod(&p_cpu).unwrap();
        let mut m = dev.alloc_zeros::<f32>(n).unwrap();
        let mut v = dev.alloc_zeros::<f32>(n).unwrap();
        for step in 1..=4u64 {
            let grads = vals(10 + step);
            let lr = 1e-3 * step as f32;
            cpu.step(&mut p_cpu, &grads, lr).unwrap();
            let g = dev.clone_htod(&grads).unwrap();
            let c = cfg.step_consts(cfg.weight_decay, lr, step);
            // kiln-optim's constants, field by field, as the kernel takes them
            let c = kiln_kernels::cuda::AdamWConsts {
                decay: c.decay,
                lerp_w: c.lerp_w,
                lerp_w_comp: c.lerp_w_comp,
                beta2: c.beta2,
                one_minus_beta2: c.one_minus_beta2,
                bc2_sqrt: c.bc2_sqrt,
                eps: c.eps,
                neg_step_size: c.neg_step_size,
                small_weight: c.small_weight(),
            };
            kiln_kernels::cuda::adamw_step(&dev, &mut p, &g, &mut m, &mut v, &c).unwrap();
        }
        let back = |s: &candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>| {
            dev.clone_dtoh(s).unwrap()
        };
        let (p_gpu, m_gpu, v_gpu) = (back(&p), back(&m), back(&v));
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&p_gpu), bits(&p_cpu), "beta1 {beta1}: parameters");
        assert_eq!(bits(&m_gpu), bits(cpu.exp_avg()), "beta1 {beta1}: exp_avg");
        assert_eq!(
            bits(&v_gpu),
            bits(cpu.exp_avg_sq()),
            "beta1 {beta1}: exp_avg_sq"
        );
        println!("beta1 {beta1}: {n} elements, 4 steps, CUDA bitwise equal to the CPU");
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn adamw_on_cuda_equals_the_cpu_bitwise() {
    println!("adamw_on_cuda_equals_the_cpu_bitwise: skipped, built without the cuda feature");
}
