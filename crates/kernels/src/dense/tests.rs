//! Tests of the parent module.

use super::*;
use crate::cpu_gemm;
use candle_core::{DType, Device, Var};

/// The gradient of `v` in `g`, an error naming `what` where there is none.
fn grad<'a>(
    g: &'a candle_core::backprop::GradStore,
    v: &Var,
    what: &str,
) -> candle_core::Result<&'a Tensor> {
    g.get(v)
        .ok_or_else(|| candle_core::Error::Msg(format!("no gradient for {what}")))
}

/// The linear op applied to `x`, `weight` and `bias` as `kiln_parallel::tp::linear` applies
/// it on the CPU, at this thread's precision.
fn linear_cpu(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Tensor> {
    match bias {
        Some(b) => x.apply_op3(weight, &b.contiguous()?, LinearBias::new()),
        None => x.apply_op2(weight, LinearNoBias::new()),
    }
}

/// The row-parallel bias add as `kiln_parallel::tp` applies it.
fn add_bias_cpu(y: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    y.contiguous()?.apply_op2(&b.contiguous()?, AddBias)
}

/// The bits of an f32 tensor's values, in order.
fn bits(t: &Tensor) -> candle_core::Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

fn rand(shape: &[usize], seed: u64) -> Vec<f64> {
    let n: usize = shape.iter().product();
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

/// Column sums in parallel strips are bitwise the rows summed in order, one column at a
/// time, for widths of one strip, several, and a partial last one.
#[test]
fn column_sums_are_the_ordered_sums() {
    for (rows, n) in [(3, 5), (300, 256), (301, 700)] {
        let dy: Vec<f32> = rand(&[rows, n], 9).iter().map(|&v| v as f32).collect();
        let got = column_sums(&dy, n);
        for (c, &g) in got.iter().enumerate() {
            let want = (0..rows).fold(0f64, |a, r| a + f64::from(dy[r * n + c])) as f32;
            assert_eq!(g.to_bits(), want.to_bits(), "{rows} x {n}, column {c}");
        }
    }
    assert!(column_sums::<f32>(&[], 0).is_empty());
}

/// The fused op against candle's composite (reshape, matmul with the transposed weight,
/// broadcast add) in f64: forward and all three gradients.
#[test]
fn linear_matches_composite_in_f64() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    for &(rows, inf, outf) in &[(1, 1, 1), (7, 5, 3), (64, 48, 80), (130, 70, 33)] {
        let x = Var::from_vec(rand(&[rows, inf], 1), (rows, inf), &dev)?;
        let w = Var::from_vec(rand(&[outf, inf], 2), (outf, inf), &dev)?;
        let b = Var::from_vec(rand(&[outf], 3), outf, &dev)?;
        let up = Tensor::from_vec(rand(&[rows, outf], 4), (rows, outf), &dev)?;
        for bias in [true, false] {
            let fused = linear_cpu(x.as_tensor(), w.as_tensor(), bias.then_some(b.as_tensor()))?;
            let reference = {
                let y = x.as_tensor().matmul(&w.as_tensor().t()?)?;
                if bias {
                    y.broadcast_add(b.as_tensor())?
                } else {
                    y
                }
            };
            let diff = |a: &Tensor, r: &Tensor| -> candle_core::Result<f64> {
                (a - r)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()
            };
            assert!(
                diff(&fused, &reference)? < 1e-12,
                "forward {rows}x{inf}x{outf}"
            );
            let gf = (fused * &up)?.sum_all()?.backward()?;
            let gr = (reference * &up)?.sum_all()?.backward()?;
            for (name, v) in [("x", &x), ("w", &w), ("b", &b)] {
                match (gf.get(v), gr.get(v)) {
                    (Some(a), Some(r)) => {
                        assert!(diff(a, r)? < 1e-12, "d{name} {rows}x{inf}x{outf}")
                    }
                    (None, None) => assert!(!bias && name == "b"),
                    (a, r) => assert!(
                        a.is_some() == r.is_some(),
                        "d{name}: one side has no gradient"
                    ),
                }
            }
        }
    }
    Ok(())
}

/// Every float dtype against f64, within its rounding.
#[test]
fn linear_every_dtype_within_rounding() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let (rows, inf, outf) = (96, 130, 70);
    let x = Tensor::from_vec(rand(&[rows, inf], 5), (rows, inf), &dev)?;
    let w = Tensor::from_vec(rand(&[outf, inf], 6), (outf, inf), &dev)?;
    let b = Tensor::from_vec(rand(&[outf], 7), outf, &dev)?;
    let reference = linear_cpu(&x, &w, Some(&b))?;
    for (dt, tol) in [(DType::F32, 1e-5), (DType::F16, 0.1), (DType::BF16, 0.3)] {
        let y = linear_cpu(&x.to_dtype(dt)?, &w.to_dtype(dt)?, Some(&b.to_dtype(dt)?))?;
        let worst = (y.to_dtype(DType::F64)? - &reference)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f64>()?;
        assert!(worst < tol, "{dt:?}: worst {worst}");
    }
    Ok(())
}

/// `MatmulPrecision::F16` is the f32 op on f16-rounded operands, bitwise: the forward, and
/// each gradient as the f32 products of the rounded upstream gradient with the rounded
/// weight and input. An operand beyond f16's range becomes infinite in the product.
#[test]
fn f16_precision_is_f32_on_rounded_operands() -> candle_core::Result<()> {
    rounded_precision_is_f32_on_rounded_operands(MatmulPrecision::F16, |x| {
        f16::from_f32(x).to_f32()
    })?;
    let dev = Device::Cpu;
    // beyond f16's range: an infinite product, as an f16 unit gives
    let big = Tensor::new(&[[70_000f32]], &dev)?;
    let one = Tensor::new(&[[1f32]], &dev)?;
    let inf_y = with_matmul_precision(MatmulPrecision::F16, || linear_cpu(&big, &one, None))?;
    assert!(inf_y.to_vec2::<f32>()?[0][0].is_infinite());
    Ok(())
}

/// `MatmulPrecision::Bf16` where the f32 kernel multiplies the rounded operands
/// ([`cpu_gemm::Bf16Kernel::Fma`], the choice on Intel CPUs) is the f32 op on bf16-rounded
/// operands, bitwise; on the dot-product kernel the same products in another order.
#[test]
fn bf16_precision_is_f32_on_rounded_operands() -> candle_core::Result<()> {
    if cpu_gemm::bf16_kernel() == cpu_gemm::Bf16Kernel::Dot {
        println!("bf16 products run on the dot-product kernel here: compared within 1e-4");
    }
    rounded_precision_is_f32_on_rounded_operands(MatmulPrecision::Bf16, |x| {
        bf16::from_f32(x).to_f32()
    })
}

/// The linear op at `precision` against the f32 op on operands rounded by `round`: the
/// forward bitwise (within 1e-4 on the bf16 dot product, whose pairs sum in another
/// order), the gradients within 1e-4, and not the f32 op's own result.
fn rounded_precision_is_f32_on_rounded_operands(
    precision: MatmulPrecision,
    round: fn(f32) -> f32,
) -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let (rows, inf, outf) = (37, 70, 45);
    let f32v = |v: Vec<f64>| v.into_iter().map(|x| x as f32 * 3.0).collect::<Vec<f32>>();
    let round = |v: &[f32]| v.iter().map(|&x| round(x)).collect::<Vec<_>>();
    let (x, w, up) = (
        f32v(rand(&[rows, inf], 11)),
        f32v(rand(&[outf, inf], 12)),
        f32v(rand(&[rows, outf], 13)),
    );
    let xv = Var::from_vec(x.clone(), (rows, inf), &dev)?;
    let wv = Var::from_vec(w.clone(), (outf, inf), &dev)?;
    let y = with_matmul_precision(precision, || {
        linear_cpu(xv.as_tensor(), wv.as_tensor(), None)
    })?;
    let g = (&y * Tensor::from_vec(up.clone(), (rows, outf), &dev)?)?
        .sum_all()?
        .backward()?;
    // the same products of rounded operands at full precision
    let xr = Tensor::from_vec(round(&x), (rows, inf), &dev)?;
    let wr = Tensor::from_vec(round(&w), (outf, inf), &dev)?;
    let upr = Tensor::from_vec(round(&up), (rows, outf), &dev)?;
    let want_y = linear_cpu(&xr, &wr, None)?;
    let want_dx = linear_cpu(&upr, &wr.t()?.contiguous()?, None)?;
    let want_dw = linear_cpu(&upr.t()?.contiguous()?, &xr.t()?.contiguous()?, None)?;
    let close = |a: &Tensor, b: &Tensor| -> candle_core::Result<f64> {
        (a - b)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()
            .map(f64::from)
    };
    let dot =
        precision == MatmulPrecision::Bf16 && cpu_gemm::bf16_kernel() == cpu_gemm::Bf16Kernel::Dot;
    if dot {
        assert!(close(&y, &want_y)? < 1e-4, "forward");
    } else {
        assert_eq!(bits(&y)?, bits(&want_y)?, "forward");
    }
    let dx = grad(&g, &xv, "dx")?;
    let dw = grad(&g, &wv, "dw")?;
    // dx and dW run the same rounded products through other operand layouts, whose
    // summation order may differ by rounding
    assert!(close(dx, &want_dx)? < 1e-4, "dx");
    assert!(close(dw, &want_dw)? < 1e-4, "dw");
    // and they are not the f32 op's
    let exact = linear_cpu(xv.as_tensor(), wv.as_tensor(), None)?;
    assert_ne!(bits(&y)?, bits(&exact)?);
    Ok(())
}

/// The bias op against candle's broadcast add: the forward bitwise, the gradient of `y`
/// passed on as it is, the bias gradient (summed in f64) within f32 rounding.
#[test]
fn add_bias_matches_broadcast_add() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let (b, t, n) = (3, 17, 40);
    let yv = Var::from_vec(
        rand(&[b, t, n], 21).into_iter().map(|v| v as f32).collect(),
        (b, t, n),
        &dev,
    )?;
    let bv = Var::from_vec(
        rand(&[n], 22).into_iter().map(|v| v as f32).collect(),
        n,
        &dev,
    )?;
    let up = Tensor::from_vec(
        rand(&[b, t, n], 23).into_iter().map(|v| v as f32).collect(),
        (b, t, n),
        &dev,
    )?;
    let mine = add_bias_cpu(yv.as_tensor(), bv.as_tensor())?;
    let theirs = yv.as_tensor().broadcast_add(bv.as_tensor())?;
    assert_eq!(bits(&mine)?, bits(&theirs)?);
    let gm = (&mine * &up)?.sum_all()?.backward()?;
    let gt = (&theirs * &up)?.sum_all()?.backward()?;
    assert_eq!(bits(grad(&gm, &yv, "dy")?)?, bits(grad(&gt, &yv, "dy")?)?);
    let worst = (grad(&gm, &bv, "db")? - grad(&gt, &bv, "db")?)?
        .abs()?
        .max(0)?
        .to_scalar::<f32>()?;
    assert!(worst < 1e-5, "bias gradient differs by {worst}");
    let bad = Tensor::zeros(n + 1, DType::F32, &dev)?;
    let err = add_bias_cpu(yv.as_tensor(), &bad)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("[41]") && err.contains("[3, 17, 40]"), "{err}");
    Ok(())
}

#[test]
fn mismatched_shapes_are_errors() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((4, 3), DType::F32, &dev)?;
    let w = Tensor::zeros((5, 2), DType::F32, &dev)?;
    let err = linear_cpu(&x, &w, None)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("[4, 3]") && err.contains("[5, 2]"), "{err}");
    let w = Tensor::zeros((5, 3), DType::F32, &dev)?;
    let b = Tensor::zeros(4, DType::F32, &dev)?;
    let err = linear_cpu(&x, &w, Some(&b))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("[5]"), "{err}");
    Ok(())
}

/// Each part of [`linear_backward_parts`], asked for alone or with others, is bitwise what
/// [`linear_backward`] gives it: for every float dtype, every precision of f32 products, with
/// and without the bias (a zero-bubble schedule computes `dx` first and `dW`, `db` later).
#[test]
fn backward_parts_are_bitwise_the_whole_backward() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let (rows, inf, outf) = (29, 67, 41);
    let to = |v: Vec<f64>, shape: (usize, usize), dt: DType| {
        Tensor::from_vec(v, shape, &dev).and_then(|t| t.to_dtype(dt))
    };
    let raw = |t: &Tensor| -> candle_core::Result<Vec<u64>> {
        Ok(t.to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1::<f64>()?
            .into_iter()
            .map(f64::to_bits)
            .collect())
    };
    let cases = [
        (DType::F32, MatmulPrecision::Highest),
        (DType::F32, MatmulPrecision::Bf16),
        (DType::F32, MatmulPrecision::F16),
        (DType::BF16, MatmulPrecision::Highest),
        (DType::F16, MatmulPrecision::Highest),
        (DType::F64, MatmulPrecision::Highest),
    ];
    for (dt, precision) in cases {
        let x = to(rand(&[rows, inf], 21), (rows, inf), dt)?;
        let w = to(rand(&[outf, inf], 22), (outf, inf), dt)?;
        let g = to(rand(&[rows, outf], 23), (rows, outf), dt)?;
        for bias in [false, true] {
            let (dx, dw, db) = linear_backward(&x, &w, &g, bias, precision)?;
            for mask in 1..8u8 {
                let want = LinearGrads {
                    x: mask & 1 != 0,
                    weight: mask & 2 != 0,
                    bias: bias && mask & 4 != 0,
                };
                let (px, pw, pb) = linear_backward_parts(&x, &w, &g, want, precision)?;
                let case = format!("{dt:?} {precision:?} bias {bias} {want:?}");
                assert_eq!(px.is_some(), want.x, "{case}");
                assert_eq!(pw.is_some(), want.weight, "{case}");
                assert_eq!(pb.is_some(), want.bias, "{case}");
                if let Some(px) = px {
                    assert_eq!(raw(&px)?, raw(&dx)?, "dx {case}");
                }
                if let Some(pw) = pw {
                    assert_eq!(raw(&pw)?, raw(&dw)?, "dW {case}");
                }
                if let (Some(pb), Some(db)) = (pb, &db) {
                    assert_eq!(raw(&pb)?, raw(db)?, "db {case}");
                }
            }
        }
    }
    Ok(())
}
