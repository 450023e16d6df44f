use super::*;
use crate::testing::{cuda, rel_err};

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
}

/// Three steps of the fused update against the candle AdamW path (`plain_update`, the
/// path `step` takes without the kernel) on the same CUDA tensors, the second with the
/// gradient scaled by a clip coefficient of 0.37: p, m, v within a
/// relative error of 1e-6, the bf16 copy equal to candle's cast of the new p, and the
/// variant without the copy equal to the one with it. `offset` starts p one element into a
/// larger buffer, so p is not 16-byte aligned and the first step takes the one-at-a-time
/// loop for every element (later steps read the kernel's own, aligned, outputs).
fn check(n: usize, gdtype: DType, decay: bool, offset: bool) {
    let dev = cuda();
    let p0 = match offset {
        true => Tensor::randn(0f32, 1f32, n + 1, &dev)
            .unwrap()
            .narrow(0, 1, n)
            .unwrap(),
        false => Tensor::randn(0f32, 1f32, n, &dev).unwrap(),
    };
    let zeros = Tensor::zeros(n, DType::F32, &dev).unwrap();
    let (mut fp, mut fm, mut fv) = (p0.clone(), zeros.clone(), zeros);
    let (mut rp, mut rm, mut rv): (Tensor, Option<Tensor>, Option<Tensor>) = (p0, None, None);
    let what = format!("n={n} grad {gdtype:?} decay={decay} offset={offset}");
    for step in 1..=3u64 {
        let g = (Tensor::randn(0f32, 1f32, n, &dev).unwrap() * 0.1)
            .unwrap()
            .to_dtype(gdtype)
            .unwrap();
        let h = AdamWHyper {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: if decay { 0.1 } else { 0.0 },
            step,
            grad_scale: if step == 2 { 0.37 } else { 1.0 },
        };
        assert!(fuses(&fp, &g), "{what}: kernel refused its inputs");
        let out = fused(&fp, &g, &fm, &fv, &h, true).unwrap();
        let plain = fused(&fp, &g, &fm, &fv, &h, false).unwrap();
        let (p, m, v) = plain_update(&rp, &g, rm.as_ref(), rv.as_ref(), &h).unwrap();
        for (name, a, r) in [("p", &out.p, &p), ("m", &out.m, &m), ("v", &out.v, &v)] {
            let e = rel_err(a, r);
            assert!(e < 1e-6, "{what} step {step}: {name} rel err {e} >= 1e-6");
            assert_eq!(a.dtype(), DType::F32);
            assert_eq!(a.dims(), &[n]);
        }
        if step == 1 {
            // The first step moves every element by about lr (m̂/√v̂ = ±1): the comparison
            // above is not between two unchanged copies of p0.
            let moved = rel_err(&out.p, &fp);
            assert!(moved > 1e-3, "{what}: p moved by only {moved} relative");
        }
        let copy = out.copy.as_ref().expect("a bf16 copy was asked for");
        assert_eq!(copy.dtype(), DType::BF16);
        assert_eq!(
            f32s(copy),
            f32s(&out.p.to_dtype(DType::BF16).unwrap()),
            "{what} step {step}: bf16 copy differs from candle's cast"
        );
        assert!(plain.copy.is_none());
        for (name, a, b) in [
            ("p", &plain.p, &out.p),
            ("m", &plain.m, &out.m),
            ("v", &plain.v, &out.v),
        ] {
            assert_eq!(
                f32s(a),
                f32s(b),
                "{what} step {step}: {name} without the copy"
            );
        }
        (fp, fm, fv) = (out.p, out.m, out.v);
        (rp, rm, rv) = (p, Some(m), Some(v));
    }
}

#[test]
fn matches_candle_adamw() {
    // 1: the scalar tail only; 1000: whole 16-byte words; 300001: words then a 1-element
    // tail, across many blocks of the grid-stride loop.
    for n in [1, 1000, 300_001] {
        for gdtype in [DType::F32, DType::BF16] {
            for decay in [true, false] {
                check(n, gdtype, decay, false);
            }
        }
    }
    check(1000, DType::F32, true, true);
    check(1000, DType::BF16, false, true);
}
