//! The state a group's ops share with its watchdog: the communicator handle, the ops in
//! flight and whether the group was aborted. Apart from the group so that the group, its
//! stream and its watchdog all read it without importing each other.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaEvent};
use candle_core::cuda_backend::cudarc::nccl::sys as nccl;

use crate::communicator::OpKind;
use crate::site::Site;

/// The raw communicator handle, only ever used under `NcclGroup::issue` (see `group.rs`'s
/// module doc).
pub(super) struct RawComm(pub(super) nccl::ncclComm_t);
// SAFETY: see "Send and Sync" in `group.rs`'s module doc: the handle is an opaque pointer NCCL lets any
// thread use, it never changes after creation, and calls through it are serialised by the
// group's issue mutex (ncclCommAbort excepted, which NCCL allows from another thread).
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

/// An op whose `done` event the watchdog watches.
pub(super) struct InFlight {
    pub(super) op: OpKind,
    pub(super) seq: u64,
    /// Where the op was issued.
    pub(super) site: Site,
    pub(super) issued: Instant,
    pub(super) done: Arc<CudaEvent>,
}

pub(super) struct Shared {
    pub(super) name: String,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) timeout: Duration,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) comm: RawComm,
    pub(super) in_flight: Mutex<VecDeque<InFlight>>,
    /// Set once the group was aborted: every later op fails with this error's text.
    pub(super) poisoned: Mutex<Option<(OpKind, u64, Site)>>,
    pub(super) aborted: AtomicBool,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::SeqCst) && !self.comm.0.is_null() {
            // SAFETY: the handle came from ncclCommInitRank, is not aborted, and nothing else
            // can use it any more (this is the last reference to the group).
            let _ = unsafe { nccl::ncclCommDestroy(self.comm.0) };
        }
    }
}
