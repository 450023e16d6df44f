use super::*;

#[test]
fn the_device_coefficient_is_the_host_rule_rounded_once() -> Result<()> {
    let devices = crate::testing::devices();
    for dev in devices {
        for sq in [
            0.0,
            0.25,
            1.0,
            1.0 + 1e-9,
            2.0,
            53.7,
            1e12,
            f64::INFINITY,
            f64::NAN,
        ] {
            for max in [1.0, 0.5, 0.0, -1.0] {
                let got = clip_coef_on_device(&Tensor::new(sq, &dev)?, max)?;
                assert_eq!(got.dtype(), DType::F32);
                assert!(got.device().same_device(&dev));
                let got = got.to_scalar::<f32>()?;
                let want = clip_coef(sq.sqrt(), max) as f32;
                assert_eq!(got.to_bits(), want.to_bits(), "{dev:?} sq {sq} max {max}");
            }
        }
        let err = clip_coef_on_device(&Tensor::new(1f32, &dev)?, 1.0).unwrap_err();
        assert!(err.to_string().contains("one f64"), "{err}");
    }
    Ok(())
}
