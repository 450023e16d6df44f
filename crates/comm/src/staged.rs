//! A group whose ranks compute on a GPU but run their collectives through a host backend, as
//! gloo does for CUDA tensors: every input is copied to the host, the inner group (the CPU
//! backend) runs the op, and the result is copied to this group's device.
//!
//! ```text
//!   x (on device) ─ to host ─> inner group's op ─ result (host) ─ to device ─> Work's value
//! ```
//!
//! Several ranks can then share one GPU, which NCCL refuses: the tensor-parallel tapes are
//! tested on a single GPU this way, ranks as threads. Semantics, errors and the trace are the
//! inner group's; only where the tensors live differs.

use std::fmt;

use candle_core::{DType, Device, Shape, Tensor};

use crate::communicator::{Backend, Comm, Communicator, PendingWork, ReduceOp, Result, Work};
use crate::trace::Tracer;

/// `inner`'s collectives on tensors of `device`: inputs are staged through the host, results
/// come back on `device`.
pub fn staged(inner: Comm, device: &Device) -> Comm {
    std::sync::Arc::new(Staged {
        inner,
        device: device.clone(),
    })
}

/// A backend whose every group is [`staged`] onto `device`, so a [`crate::DeviceMesh`] built on
/// it runs any layout on one GPU, with the inner backend's ranks (threads of `run_local`, say).
pub struct StagedBackend<B> {
    /// The backend that runs the collectives.
    pub inner: B,
    /// Where the ranks compute.
    pub device: Device,
}

impl<B: Backend> Backend for StagedBackend<B> {
    fn world(&self) -> Comm {
        staged(self.inner.world(), &self.device)
    }
    fn new_group(&self, ranks: &[usize], name: &str) -> Result<Comm> {
        Ok(staged(self.inner.new_group(ranks, name)?, &self.device))
    }
    fn device(&self) -> Device {
        self.device.clone()
    }
}

struct Staged {
    inner: Comm,
    device: Device,
}

impl fmt::Debug for Staged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Staged({:?} on {:?})", self.inner, self.device)
    }
}

/// The inner op's result, copied to the device when it is waited for.
struct OnDevice {
    work: Work,
    device: Device,
}

impl PendingWork<Tensor> for OnDevice {
    fn wait(self: Box<Self>) -> Result<Tensor> {
        Ok(self.work.wait()?.to_device(&self.device)?)
    }
    fn is_done(&self) -> bool {
        self.work.is_done()
    }
}

/// `$call` on the host copy `$h` of `$x`, its result brought back to the device. A macro, not a
/// closure, so the call keeps the caller's [`Site`](crate::Site) (closures cannot pass it on).
macro_rules! on_host {
    ($s:ident, $x:expr, $h:ident => $call:expr) => {
        match $x.to_device(&Device::Cpu) {
            Ok($h) => $s.back($call),
            Err(e) => Work::ready(Err(e.into())),
        }
    };
}

impl Staged {
    /// The inner group's `work`, its result on this group's device.
    fn back(&self, work: Work) -> Work {
        Work::new(Box::new(OnDevice {
            work,
            device: self.device.clone(),
        }))
    }
}

impl Communicator for Staged {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn global_ranks(&self) -> &[usize] {
        self.inner.global_ranks()
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn tracer(&self) -> &Tracer {
        self.inner.tracer()
    }

    fn all_reduce_async(&self, x: &Tensor, op: ReduceOp) -> Work {
        on_host!(self, x, h => self.inner.all_reduce_async(&h, op))
    }
    fn reduce_async(&self, x: &Tensor, root: usize, op: ReduceOp) -> Work {
        on_host!(self, x, h => self.inner.reduce_async(&h, root, op))
    }
    fn broadcast_async(&self, x: &Tensor, root: usize) -> Work {
        on_host!(self, x, h => self.inner.broadcast_async(&h, root))
    }
    fn all_gather_async(&self, x: &Tensor) -> Work {
        on_host!(self, x, h => self.inner.all_gather_async(&h))
    }
    fn reduce_scatter_async(&self, x: &Tensor, op: ReduceOp) -> Work {
        on_host!(self, x, h => self.inner.reduce_scatter_async(&h, op))
    }
    fn scatter_async(&self, x: &Tensor, root: usize) -> Work {
        on_host!(self, x, h => self.inner.scatter_async(&h, root))
    }
    fn gather_async(&self, x: &Tensor, root: usize) -> Work {
        on_host!(self, x, h => self.inner.gather_async(&h, root))
    }
    fn all_to_all_async(&self, x: &Tensor, send_splits: &[usize], recv_splits: &[usize]) -> Work {
        on_host!(self, x, h => self.inner.all_to_all_async(&h, send_splits, recv_splits))
    }
    fn send_async(&self, x: &Tensor, dst: usize) -> Work<()> {
        match x.to_device(&Device::Cpu) {
            Ok(host) => self.inner.send_async(&host, dst),
            Err(e) => Work::ready(Err(e.into())),
        }
    }
    fn recv_async(&self, src: usize, shape: &Shape, dtype: DType) -> Work {
        self.back(self.inner.recv_async(src, shape, dtype))
    }
    fn barrier_async(&self) -> Work<()> {
        self.inner.barrier_async()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::cpu::run_local;

    /// Each op through the staged group equals the inner group's on the same values, and the
    /// result is on the group's device: the CPU, and on a build with the `cuda` feature the first
    /// GPU too (none there fails the test).
    #[test]
    fn staged_ops_equal_the_inner_groups() {
        let mut devices = vec![Device::Cpu];
        if cfg!(feature = "cuda") {
            devices.push(Device::new_cuda(0).unwrap_or_else(|e| {
                panic!("a build with the `cuda` feature checks the staged group on a CUDA device, and none could be opened: {e}")
            }));
        }
        for dev in devices {
            let got = run_local(2, Duration::from_secs(30), |b| {
                let world = b.world();
                let g = staged(world.clone(), &dev);
                let r = world.rank() as f32;
                let x = Tensor::new(&[[r, 1.0], [2.0 * r, 3.0]], &Device::Cpu).unwrap();
                let xd = x.to_device(&dev).unwrap();
                let pairs = [
                    (
                        world.all_reduce(&x, ReduceOp::Sum),
                        g.all_reduce(&xd, ReduceOp::Sum),
                    ),
                    (world.all_gather(&x), g.all_gather(&xd)),
                    (
                        world.reduce_scatter(&x, ReduceOp::Sum),
                        g.reduce_scatter(&xd, ReduceOp::Sum),
                    ),
                    (world.broadcast(&x, 1), g.broadcast(&xd, 1)),
                    (
                        world.all_to_all(&x, &[1, 1], &[1, 1]),
                        g.all_to_all(&xd, &[1, 1], &[1, 1]),
                    ),
                ];
                let mut same = true;
                for (want, got) in pairs {
                    let (want, got) = (want.unwrap(), got.unwrap());
                    same &= got.device().same_device(&dev);
                    same &= got
                        .to_device(&Device::Cpu)
                        .unwrap()
                        .to_vec2::<f32>()
                        .unwrap()
                        == want.to_vec2::<f32>().unwrap();
                }
                let peer = 1 - world.rank();
                if world.rank() == 0 {
                    g.send(&xd, peer).unwrap();
                } else {
                    let y = g.recv(peer, x.shape(), DType::F32).unwrap();
                    same &= y.device().same_device(&dev);
                    same &= y.to_device(&Device::Cpu).unwrap().to_vec2::<f32>().unwrap()
                        == [[0.0, 1.0], [0.0, 3.0]];
                }
                same
            });
            assert_eq!(got, vec![true, true], "{dev:?}");
        }
    }
}
