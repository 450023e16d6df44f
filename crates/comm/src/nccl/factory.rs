//! What every group of an NCCL backend is created from: the device and context, how the
//! members of a group agree on its unique id ([`IdExchange`]) and the options every group
//! shares. Below both the backend (which creates groups, `backend.rs`) and the group (which is
//! created from it, `group.rs`), so neither imports the other for it.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::CudaContext;
use candle_core::Device;

use crate::communicator::Result;

/// How ranks of a group agree on the group's NCCL unique id: the first rank publishes it, the
/// others read it. A launched job passes its rendezvous store; a single process needs none.
pub trait IdExchange: Send + Sync {
    /// Store `value` under `key`.
    fn publish(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Block until `key` exists (at most `timeout`) and return its value.
    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
}

impl IdExchange for crate::store::StoreClient {
    fn publish(&self, key: &str, value: &[u8]) -> Result<()> {
        self.set(key, value)
    }

    fn fetch(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.get_timeout(key, timeout)
    }
}

/// Settings shared by every group of an `NcclBackend`.
#[derive(Debug, Clone)]
pub struct NcclOptions {
    /// An op still running after this long aborts its group with [`crate::CommError::Timeout`].
    pub timeout: Duration,
    /// Exchange a header before every op and fail with [`crate::CommError::Mismatch`] when ranks
    /// disagree (one host rendezvous per op: for debugging).
    pub check_args: bool,
    /// Record every op in each group's tracer (otherwise only the last few are kept).
    pub trace: bool,
}

impl Default for NcclOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            check_args: false,
            trace: false,
        }
    }
}

/// What every group of a backend is created from.
pub(super) struct GroupFactory {
    pub(super) device: Device,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) rank: usize,
    pub(super) exchange: Option<Arc<dyn IdExchange>>,
    pub(super) opts: NcclOptions,
    pub(super) epoch: Instant,
    pub(super) groups_created: AtomicU64,
}
