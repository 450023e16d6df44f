use super::*;
use candle_core::Device;

/// Three steps of `step_with_copies` on CUDA against the same steps on the CPU, where every
/// item takes the candle path: parameters and moments within a relative error of 1e-6, the
/// bf16 copies equal to the cast of the CUDA parameters; the second step clips (a gradient
/// scale of 0.37). With gradients all bf16 or all f32 the CUDA step is the one in-place
/// launch (`adamw::step_in_place`, tensors of one, a tail, several 65536-element chunks);
/// with both dtypes mixed each tensor takes its own fused kernel. Fails without a CUDA device.
#[test]
fn cuda_fused_steps_match_the_cpu_path() -> Result<()> {
    let gpu = mtrain_kernels::testing::cuda();
    let cpu = Device::Cpu;
    let mixed = [DType::F32, DType::BF16, DType::BF16, DType::F32];
    for (gdtypes, in_place) in [
        (mixed, false),
        ([DType::BF16; 4], true),
        ([DType::F32; 4], true),
    ] {
        let sizes = [
            (4097usize, true),
            (33, false),
            (1, true),
            (3 * 65536 + 5, true),
        ];
        let wave = |n: usize, phase: f32| -> Vec<f32> {
            (0..n).map(|i| (i as f32 * 0.71 + phase).sin()).collect()
        };
        let run = |dev: &Device| -> Result<(Vec<Tensor>, Vec<Tensor>, AdamWState)> {
            let params: Vec<Param> = sizes
                .iter()
                .enumerate()
                .map(|(k, (n, _))| {
                    Param::new(format!("w{k}"), Tensor::from_vec(wave(*n, 0.3), *n, dev)?)
                })
                .collect::<Result<_>>()?;
            let copies: Vec<Param> = sizes
                .iter()
                .enumerate()
                .map(|(k, (n, _))| {
                    Param::new(format!("c{k}"), Tensor::zeros(*n, DType::BF16, dev)?)
                })
                .collect::<Result<_>>()?;
            let copy_refs: Vec<&Param> = copies.iter().collect();
            let mut opt = AdamW::new(AdamWConfig::default());
            for step in 0..3 {
                let grads: Vec<Tensor> = sizes
                    .iter()
                    .zip(gdtypes)
                    .map(|((n, _), dt)| {
                        let g = Tensor::from_vec(wave(*n, 1.0 + step as f32), *n, dev)?;
                        (g * 0.1)?.to_dtype(dt)
                    })
                    .collect::<Result<_>>()?;
                let names: Vec<String> = (0..sizes.len()).map(|k| format!("w{k}")).collect();
                let items: Vec<OptimItem> = (0..sizes.len())
                    .map(|k| OptimItem {
                        name: &names[k],
                        param: &params[k],
                        grad: &grads[k],
                        decay: sizes[k].1,
                    })
                    .collect();
                if dev.is_cuda() {
                    let ps: Vec<Tensor> = params.iter().map(|p| p.tensor()).collect();
                    let cs: Vec<Tensor> = copies.iter().map(|p| p.tensor()).collect();
                    let probe: Vec<adamw::InPlace> = (0..sizes.len())
                        .map(|k| adamw::InPlace {
                            p: &ps[k],
                            g: &grads[k],
                            m: &ps[k],
                            v: &ps[k],
                            copy: Some(&cs[k]),
                            weight_decay: 0.0,
                        })
                        .collect();
                    assert_eq!(adamw::fuses_in_place(&probe), in_place, "{gdtypes:?}");
                }
                let scale = if step == 1 { 0.37 } else { 1.0 };
                opt.step_with_copies(3e-3, scale, &items, Some(&copy_refs))?;
            }
            Ok((
                params.iter().map(|p| p.tensor()).collect(),
                copies.iter().map(|p| p.tensor()).collect(),
                opt.state()?,
            ))
        };
        let rel = |a: &Tensor, b: &Tensor| -> Result<f64> {
            let a = a.to_device(&cpu)?.to_dtype(DType::F64)?;
            let b = b.to_device(&cpu)?.to_dtype(DType::F64)?;
            let num = (a - &b)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
            Ok((num / b.sqr()?.sum_all()?.to_scalar::<f64>()?).sqrt())
        };
        let (gp, gc, gs) = run(&gpu)?;
        let (cp, _, cs) = run(&cpu)?;
        for k in 0..sizes.len() {
            let name = format!("w{k}");
            for (what, a, b) in [
                ("p", &gp[k], &cp[k]),
                ("m", &gs.m[&name], &cs.m[&name]),
                ("v", &gs.v[&name], &cs.v[&name]),
            ] {
                let e = rel(a, b)?;
                assert!(e < 1e-6, "{gdtypes:?} {name} {what}: rel err {e} >= 1e-6");
            }
            assert_eq!(
                gc[k].to_dtype(DType::F32)?.to_vec1::<f32>()?,
                gp[k]
                    .to_dtype(DType::BF16)?
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?,
                "{gdtypes:?} {name}: bf16 copy"
            );
        }
        assert_eq!(gs.step, 3);
    }
    Ok(())
}
