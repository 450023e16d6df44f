use super::*;

/// A clip coefficient handed over as one f32 on the device (`GradScale::OnDevice`, what the
/// training loop passes) gives the same parameters, moments and bf16 copies, bit for bit, as
/// the same number handed over by the host, on the CPU and (on a CUDA build) on CUDA, with
/// the gradients of one dtype (the one in-place launch reads it there) and of two (each
/// tensor's own kernel, the number read back first).
#[test]
fn a_scale_on_the_device_equals_the_same_scale_from_the_host() -> Result<()> {
    let devices = mtrain_kernels::testing::devices();
    let sizes = [4097usize, 33, 1, 3 * 65536 + 5];
    let wave = |n: usize, phase: f32| -> Vec<f32> {
        (0..n).map(|i| (i as f32 * 0.37 + phase).cos()).collect()
    };
    for dev in &devices {
        for gdtypes in [
            [DType::BF16; 4],
            [DType::F32, DType::BF16, DType::F32, DType::BF16],
        ] {
            let run = |on_device: bool| -> Result<Vec<Vec<f32>>> {
                let params: Vec<Param> = sizes
                    .iter()
                    .enumerate()
                    .map(|(k, n)| {
                        Param::new(format!("w{k}"), Tensor::from_vec(wave(*n, 0.1), *n, dev)?)
                    })
                    .collect::<Result<_>>()?;
                let copies: Vec<Param> = sizes
                    .iter()
                    .enumerate()
                    .map(|(k, n)| Param::new(format!("c{k}"), Tensor::zeros(*n, DType::BF16, dev)?))
                    .collect::<Result<_>>()?;
                let copy_refs: Vec<&Param> = copies.iter().collect();
                let names: Vec<String> = (0..sizes.len()).map(|k| format!("w{k}")).collect();
                let mut opt = AdamW::new(AdamWConfig::default());
                for step in 0..3 {
                    let grads: Vec<Tensor> = sizes
                        .iter()
                        .zip(gdtypes)
                        .map(|(n, dt)| {
                            Tensor::from_vec(wave(*n, 2.0 + step as f32), *n, dev)?.to_dtype(dt)
                        })
                        .collect::<Result<_>>()?;
                    let items: Vec<OptimItem> = (0..sizes.len())
                        .map(|k| OptimItem {
                            name: &names[k],
                            param: &params[k],
                            grad: &grads[k],
                            decay: k % 2 == 0,
                        })
                        .collect();
                    // An awkward clip coefficient, as the loop's kernel would round it.
                    let c = clip_coef(7.3 + step as f64, 1.0) as f32;
                    let scale = match on_device {
                        true => GradScale::OnDevice(Tensor::new(c, dev)?),
                        false => GradScale::By(c as f64),
                    };
                    opt.step_with_copies(3e-3, scale, &items, Some(&copy_refs))?;
                }
                let st = opt.state()?;
                let mut out = Vec::new();
                for (k, name) in names.iter().enumerate() {
                    for t in [
                        params[k].tensor(),
                        copies[k].tensor(),
                        st.m[name].clone(),
                        st.v[name].clone(),
                    ] {
                        out.push(t.to_dtype(DType::F32)?.to_vec1::<f32>()?);
                    }
                }
                Ok(out)
            };
            let (host, device) = (run(false)?, run(true)?);
            for (a, b) in host.iter().zip(&device) {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "{dev:?} {gdtypes:?}: the device scale changed the step"
                );
            }
        }
    }
    Ok(())
}
