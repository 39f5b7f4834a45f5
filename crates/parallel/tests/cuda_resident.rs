//! The device-resident step on CUDA against the host step on the CPU, bitwise: a model whose
//! gradients are exact on both devices (products of constants and powers of two), so every
//! difference would come from the step itself: gradient accumulation over micro-batches,
//! unscale and the inf/NaN check, the exact global norm, clipping, AdamW with a weight-decay
//! group, the parameter write-back, the update norms, a skipped overflow step, and checkpoint
//! state moving GPU -> CPU and CPU -> GPU. Needs the `cuda` feature and a GPU; anywhere else it
//! says why it did not run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::{Device, Tensor, Var};
    use kiln_comm::ThreadComm;
    use kiln_memory::{MicroBatch, SegmentParams, SegmentedModel};
    use kiln_parallel::{DataParallel, DataParallelConfig, StepReport};
    use kiln_precision::{DynamicLossScaler, DynamicScalerConfig, LossScaler};
    use kiln_state::Stateful;
    use kiln_testkit::{assert_bitwise_eq, run_ranks};

    const N0: usize = 3000;
    const N1: usize = 5000;

    /// Values in about [-2, 2] with exponents spread over 2^-20..2^1, some zero.
    fn values(n: usize, salt: u64) -> Vec<f32> {
        (0..n as u64)
            .map(|i| {
                let h = kiln_state::splitmix64(i ^ (salt << 40));
                if h % 97 == 0 {
                    return 0.0;
                }
                let m = (h >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0;
                m * 2f32.powi(-((h % 21) as i32))
            })
            .collect()
    }

    /// Segment 0: `h = x + sum(w0 * c0)`; segment 1: `loss = sum(h) + sum(x) * (sum(w1 * c1) +
    /// sum(b1 * c1))` (the targets are `x`). The gradients are `2 c0`, `sum(x) c1` (x holds a power of two and a
    /// zero): exact in f32 whatever the device.
    struct Linear {
        c0: Tensor,
        c1: Tensor,
    }

    impl SegmentedModel for Linear {
        fn num_segments(&self) -> usize {
            2
        }

        fn forward_segment(
            &self,
            i: usize,
            x: &Tensor,
            batch: &MicroBatch,
            p: &SegmentParams,
        ) -> candle_core::Result<Tensor> {
            let dev = x.device();
            if i == 0 {
                let s = (p.tensor("w0")? * self.c0.to_device(dev)?)?.sum_all()?;
                return x.broadcast_add(&s);
            }
            // x is h here; the targets are the step's input
            let c1 = self.c1.to_device(dev)?;
            let w = (p.tensor("w1")? * &c1)?.sum_all()?;
            let b = (p.tensor("b1")? * &c1)?.sum_all()?;
            x.sum_all()? + ((w + b)? * batch.targets().sum_all()?)?
        }
    }

    fn segments(dev: &Device) -> Vec<Vec<(String, Var)>> {
        let var = |n: usize, salt: u64| {
            Var::from_tensor(&Tensor::from_vec(values(n, salt), n, dev).unwrap()).unwrap()
        };
        vec![
            vec![("w0".to_string(), var(N0, 1))],
            vec![
                ("w1".to_string(), var(N1, 2)),
                ("b1".to_string(), var(N1, 3)),
            ],
        ]
    }

    /// The inputs of step `s`, two micro-batches; step 3 overflows.
    fn micro(s: usize, k: usize, dev: &Device) -> MicroBatch {
        let p = [0.5f32, 1.0, 2.0, 0.25, 4.0][(s + k) % 5];
        let x0 = if s == 3 && k == 1 { f32::INFINITY } else { p };
        let x = Tensor::new(&[x0, 0.0], dev).unwrap();
        MicroBatch::new(x.clone(), x).unwrap()
    }

    fn config() -> DataParallelConfig {
        DataParallelConfig {
            bucket_bytes: 4 * 1500, // several units
            max_grad_norm: Some(0.5),
            update_norms: true,
            ..Default::default()
        }
    }

    fn engine(dev: &Device, comm: &ThreadComm) -> DataParallel {
        engine_of(&segments(dev), comm)
    }

    fn engine_of(segs: &[Vec<(String, Var)>], comm: &ThreadComm) -> DataParallel {
        DataParallel::new(segs, comm, config())
            .unwrap()
            .with_weight_decay(&[("b1".to_string(), 0.0)])
            .unwrap()
    }

    fn scaler() -> DynamicLossScaler {
        DynamicLossScaler::new(DynamicScalerConfig {
            init_scale: 1024.0,
            growth_interval: 2,
            ..Default::default()
        })
        .unwrap()
    }

    fn run(
        engine: &mut DataParallel,
        model: &Linear,
        steps: std::ops::Range<usize>,
        scaler: &mut dyn LossScaler,
    ) -> Vec<StepReport> {
        let dev = engine.device().clone();
        steps
            .map(|s| {
                let mb: Vec<_> = (0..2).map(|k| micro(s, k, &dev)).collect();
                engine.step(model, &mb, 1e-2, scaler).unwrap()
            })
            .collect()
    }

    fn flat(e: &DataParallel) -> Vec<f32> {
        e.full_params()
            .unwrap()
            .into_iter()
            .flat_map(|(_, v)| v)
            .collect()
    }

    fn same_reports(a: &[StepReport], b: &[StepReport]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert_eq!(x.grad_norm.map(f64::to_bits), y.grad_norm.map(f64::to_bits));
            assert_eq!(x.clipped, y.clipped);
            assert_eq!(x.scale_event, y.scale_event);
            assert_eq!(x.loss_scale.to_bits(), y.loss_scale.to_bits());
            assert_eq!(
                x.param_norm.map(f64::to_bits),
                y.param_norm.map(f64::to_bits)
            );
            assert_eq!(
                x.update_ratio.map(f64::to_bits),
                y.update_ratio.map(f64::to_bits)
            );
        }
    }

    #[test]
    fn resident_step_equals_the_cpu_step_bitwise() {
        let gpu = match Device::new_cuda(0) {
            Ok(d) => d,
            Err(e) => {
                println!("resident_step_equals_the_cpu_step_bitwise: skipped, no CUDA device: {e}");
                return;
            }
        };
        let model = Linear {
            c0: Tensor::from_vec(values(N0, 7), N0, &Device::Cpu).unwrap(),
            c1: Tensor::from_vec(values(N1, 8), N1, &Device::Cpu).unwrap(),
        };
        run_ranks(1, |comm: ThreadComm| {
            let mut cpu = engine(&Device::Cpu, &comm);
            let gpu_vars = segments(&gpu);
            let mut dev = engine_of(&gpu_vars, &comm);
            assert!(!cpu.is_device_resident());
            assert!(dev.is_device_resident());
            let (mut sc, mut sd) = (scaler(), scaler());
            let rc = run(&mut cpu, &model, 0..6, &mut sc);
            let rd = run(&mut dev, &model, 0..6, &mut sd);
            assert!(rc.iter().any(|r| r.clipped), "clipping is exercised");
            assert!(rc[3].grad_norm.is_none(), "step 3 overflows");
            same_reports(&rc, &rd);
            assert_bitwise_eq(&flat(&dev), &flat(&cpu));
            // the model's own variables (on the GPU) hold the master values
            for (name, master) in cpu.full_params().unwrap() {
                let var = gpu_vars.iter().flatten().find(|(n, _)| *n == name).unwrap();
                let got = var.1.as_tensor().to_device(&Device::Cpu).unwrap();
                assert_bitwise_eq(&got.to_vec1::<f32>().unwrap(), &master);
            }
            // checkpoint state read from the device equals the CPU's, tensor by tensor
            let (a, b) = (cpu.state().unwrap(), dev.state().unwrap());
            let names: Vec<&str> = a.names().collect();
            assert_eq!(names, b.names().collect::<Vec<_>>());
            assert!(
                names.iter().any(|n| n.starts_with("exp_avg_sq/")),
                "{names:?}"
            );
            for name in names {
                assert_bitwise_eq(&b.get::<f32>(name).unwrap(), &a.get::<f32>(name).unwrap());
            }
            assert_eq!(a.meta_map(), b.meta_map());
            // GPU state into a fresh CPU engine, CPU state into a fresh GPU engine: both
            // continue exactly as the uninterrupted runs
            let mut cpu2 = engine(&Device::Cpu, &comm);
            cpu2.load_state(b).unwrap();
            let mut dev2 = engine(&gpu, &comm);
            dev2.load_state(a).unwrap();
            let (mut s2, mut s3, mut s4) = (sc.clone(), sc.clone(), sc.clone());
            let cont = run(&mut cpu, &model, 6..9, &mut sc);
            same_reports(&cont, &run(&mut cpu2, &model, 6..9, &mut s2));
            same_reports(&cont, &run(&mut dev2, &model, 6..9, &mut s3));
            same_reports(&cont, &run(&mut dev, &model, 6..9, &mut s4));
            for e in [&cpu2, &dev2, &dev] {
                assert_bitwise_eq(&flat(e), &flat(&cpu));
            }
            Ok(())
        });
        println!("resident_step_equals_the_cpu_step_bitwise: 9 steps, GPU == CPU bitwise");
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn resident_step_equals_the_cpu_step_bitwise() {
    println!("resident_step_equals_the_cpu_step_bitwise: skipped, built without the cuda feature");
}
