//! The NCCL backend of one process: the options every group shares, how the members of a group
//! agree on its NCCL unique id, and the creation of groups (the world first).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::nccl::sys as nccl;
use candle_core::Device;

use super::factory::{GroupFactory, IdExchange, NcclOptions};
use super::group::{check, NcclGroup};
use crate::communicator::{Backend, Comm, CommError, OpKind, Result};

/// An [`IdExchange`] for ranks that are threads of one process (one GPU per thread).
#[derive(Debug, Default)]
pub struct InProcessExchange {
    pub(super) values: Mutex<std::collections::HashMap<String, Vec<u8>>>,
    pub(super) changed: std::sync::Condvar,
}

impl IdExchange for InProcessExchange {
    fn publish(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut values = self.values.lock().unwrap_or_else(|p| p.into_inner());
        values.insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut values = self.values.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(v) = values.get(key) {
                return Ok(v.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CommError::Store(format!(
                    "key '{key}' not published within {timeout:?}"
                )));
            }
            values = self
                .changed
                .wait_timeout(values, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Creates NCCL groups for one process driving one GPU.
pub struct NcclBackend {
    pub(super) factory: GroupFactory,
    pub(super) world_size: usize,
    pub(super) world: Comm,
    /// Rank 0 of a launched job hosts the rendezvous store for as long as the backend lives.
    pub(super) _store_server: Option<crate::store::StoreServer>,
}

impl std::fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclBackend(rank {} of {}, {:?})",
            self.factory.rank, self.world_size, self.factory.device
        )
    }
}

impl NcclBackend {
    /// The backend of global rank `rank` of `world_size`, computing on `device` (a CUDA device,
    /// usually `Device::new_cuda(local_rank)`). `exchange` is required when `world_size > 1`.
    /// Every rank must call this at the same time: it creates the world communicator.
    pub fn new(
        device: Device,
        rank: usize,
        world_size: usize,
        exchange: Option<Arc<dyn IdExchange>>,
        opts: NcclOptions,
    ) -> Result<Self> {
        if rank >= world_size {
            return Err(CommError::InvalidArgument {
                op: OpKind::Barrier,
                group: "world".into(),
                msg: format!("rank {rank} is not below world size {world_size}"),
            });
        }
        let ctx = device.as_cuda_device()?.cuda_stream().context().clone();
        let factory = GroupFactory {
            device,
            ctx,
            rank,
            exchange,
            opts,
            epoch: Instant::now(),
            groups_created: AtomicU64::new(0),
        };
        let ranks: Vec<usize> = (0..world_size).collect();
        let world = factory.create_group(&ranks, "world")?;
        Ok(Self {
            factory,
            world_size,
            world,
            _store_server: None,
        })
    }

    /// The backend of a launched worker: GPU `env.local_rank`, NCCL ids exchanged through the
    /// job's rendezvous store (hosted by rank 0 at `MASTER_ADDR:MASTER_PORT`).
    pub fn init(env: &crate::env::LaunchEnv, opts: NcclOptions) -> Result<Self> {
        env.validate()?;
        let device = Device::new_cuda(env.local_rank)?;
        if env.world_size == 1 {
            return Self::new(device, 0, 1, None, opts);
        }
        let (server, client) = crate::store::rendezvous(env, opts.timeout)?;
        let exchange: Arc<dyn IdExchange> = Arc::new(client);
        let mut backend = Self::new(device, env.rank, env.world_size, Some(exchange), opts)?;
        backend._store_server = server;
        Ok(backend)
    }

    /// The version of the NCCL library loaded at run time, e.g. 22809 for 2.28.9.
    pub fn nccl_version() -> Result<i32> {
        let mut v = 0;
        // SAFETY: `v` is a valid out-pointer.
        unsafe { check(nccl::ncclGetVersion(&mut v)) }.map_err(CommError::Store)?;
        Ok(v)
    }
}

impl GroupFactory {
    pub(super) fn create_group(&self, ranks: &[usize], name: &str) -> Result<Comm> {
        let generation = self.groups_created.fetch_add(1, Ordering::SeqCst);
        let group_rank = ranks.iter().position(|&r| r == self.rank).ok_or_else(|| {
            CommError::InvalidArgument {
                op: OpKind::Barrier,
                group: name.into(),
                msg: format!("rank {} is not a member of group {ranks:?}", self.rank),
            }
        })?;
        let id = self.unique_id(ranks, name, generation, group_rank)?;
        NcclGroup::init(self, ranks, group_rank, name, id)
    }

    /// The first member creates the id; the others read it from the store.
    pub(super) fn unique_id(
        &self,
        ranks: &[usize],
        name: &str,
        generation: u64,
        group_rank: usize,
    ) -> Result<nccl::ncclUniqueId> {
        let key = format!(
            "nccl/{generation}/{name}/{}",
            ranks
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        let store_err = |e: String| CommError::Store(format!("NCCL id for group '{name}': {e}"));
        if group_rank == 0 {
            let mut id = std::mem::MaybeUninit::<nccl::ncclUniqueId>::uninit();
            // SAFETY: ncclGetUniqueId fills the whole 128-byte id it is given.
            let id = unsafe {
                check(nccl::ncclGetUniqueId(id.as_mut_ptr())).map_err(store_err)?;
                id.assume_init()
            };
            if ranks.len() > 1 {
                let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
                self.exchange(name)?.publish(&key, &bytes)?;
            }
            Ok(id)
        } else {
            let bytes = self.exchange(name)?.fetch(&key, self.opts.timeout)?;
            if bytes.len() != 128 {
                return Err(store_err(format!(
                    "store key '{key}' holds {} bytes, an NCCL id has 128",
                    bytes.len()
                )));
            }
            let mut internal = [0 as std::ffi::c_char; 128];
            for (dst, src) in internal.iter_mut().zip(bytes) {
                *dst = src as std::ffi::c_char;
            }
            Ok(nccl::ncclUniqueId { internal })
        }
    }

    pub(super) fn exchange(&self, group: &str) -> Result<&Arc<dyn IdExchange>> {
        self.exchange.as_ref().ok_or_else(|| {
            CommError::Store(format!(
                "group '{group}' spans several ranks but the NCCL backend was created without a store"
            ))
        })
    }
}

impl Backend for NcclBackend {
    fn world(&self) -> Comm {
        self.world.clone()
    }

    fn new_group(&self, ranks: &[usize], name: &str) -> Result<Comm> {
        if ranks.is_empty() || ranks.windows(2).any(|w| w[0] >= w[1]) {
            return Err(CommError::InvalidArgument {
                op: OpKind::Barrier,
                group: name.into(),
                msg: format!("group ranks must be sorted, distinct and non-empty, got {ranks:?}"),
            });
        }
        if let Some(&r) = ranks.iter().find(|&&r| r >= self.world_size) {
            return Err(CommError::InvalidArgument {
                op: OpKind::Barrier,
                group: name.into(),
                msg: format!("rank {r} is not below world size {}", self.world_size),
            });
        }
        self.factory.create_group(ranks, name)
    }

    fn device(&self) -> Device {
        self.factory.device.clone()
    }
}
