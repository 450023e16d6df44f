//! `IpcBackend`: the CPU backend's rendezvous and host groups, with every group's collectives
//! on GPU memory through CUDA IPC.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::Device;

use super::group::{IpcGroup, IpcOptions};
use crate::communicator::{Backend, Comm, Result};
use crate::cpu::{CpuBackend, CpuOptions};
use crate::env::LaunchEnv;
use crate::store::StoreClient;

/// A backend whose groups are [`IpcGroup`]s on `device`: the ranks of one node, each a process,
/// on one GPU or several.
pub struct IpcBackend {
    cpu: CpuBackend,
    device: Device,
    opts: IpcOptions,
    store: Option<Arc<StoreClient>>,
    /// How many groups of each (name, ranks) this process created, to tell repeats apart.
    created: Mutex<HashMap<String, usize>>,
    world: Comm,
}

impl IpcBackend {
    /// Join the job described by `env` (the CPU backend's rendezvous) and map the world
    /// group's buffers on `device`.
    pub fn init(
        env: &LaunchEnv,
        device: Device,
        cpu: CpuOptions,
        opts: IpcOptions,
    ) -> Result<Self> {
        let timeout = cpu.timeout;
        let cpu = CpuBackend::init(env, cpu)?;
        let store = match env.world_size > 1 {
            true => Some(Arc::new(StoreClient::connect(
                &env.store_addr(),
                &env.job_id,
                timeout,
            )?)),
            false => None,
        };
        let mut b = Self {
            world: cpu.world(),
            cpu,
            device,
            opts,
            store,
            created: Mutex::new(HashMap::new()),
        };
        let all: Vec<usize> = (0..env.world_size).collect();
        b.world = b.group(b.cpu.world(), &all, "world")?;
        Ok(b)
    }

    /// The world group on the CPU backend (the host twin of every IPC group's ranks).
    pub fn host_world(&self) -> Comm {
        self.cpu.world()
    }

    /// The rendezvous store (absent in a one-process job).
    pub fn store(&self) -> Option<Arc<StoreClient>> {
        self.store.clone()
    }

    fn group(&self, host: Comm, ranks: &[usize], name: &str) -> Result<Comm> {
        let base = format!("{name}{ranks:?}");
        let k = {
            let mut created = self.created.lock().unwrap_or_else(|p| p.into_inner());
            let k = created.entry(base.clone()).or_insert(0);
            *k += 1;
            *k - 1
        };
        let key = format!("{base}#{k}");
        Ok(Arc::new(IpcGroup::new(
            host,
            self.store.clone(),
            key,
            &self.device,
            self.opts.clone(),
        )?))
    }
}

impl Backend for IpcBackend {
    fn world(&self) -> Comm {
        self.world.clone()
    }
    fn new_group(&self, ranks: &[usize], name: &str) -> Result<Comm> {
        self.group(self.cpu.new_group(ranks, name)?, ranks, name)
    }
    fn device(&self) -> Device {
        self.device.clone()
    }
}
