//! The watchdog: a thread per group that aborts the communicator when an op outlives the
//! group's timeout, so a mismatched or abandoned collective fails instead of hanging.

use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::Duration;

use candle_core::cuda_backend::cudarc::nccl::sys as nccl;

use super::shared::Shared;
use crate::communicator::OpKind;
use crate::site::Site;

/// Abort the group after a stalled op; later ops fail fast with a timeout naming it.
pub(super) fn abort(shared: &Shared, op: OpKind, seq: u64, site: Site) {
    if shared.aborted.swap(true, Ordering::SeqCst) {
        return;
    }
    *shared.poisoned.lock().unwrap_or_else(|p| p.into_inner()) = Some((op, seq, site));
    tracing::error!(
        group = %shared.name,
        rank = shared.rank,
        seq,
        %site,
        "{op} did not finish within {:?}; aborting the NCCL communicator",
        shared.timeout
    );
    // SAFETY: NCCL documents ncclCommAbort as safe to call while another thread is blocked in
    // the communicator; `aborted` guarantees it runs once and Drop then skips ncclCommDestroy.
    let _ = unsafe { nccl::ncclCommAbort(shared.comm.0) };
}

/// Polls the `done` events of the ops in flight; aborts the group when one is older than the
/// timeout. Exits when the group is dropped.
pub(super) fn spawn_watchdog(shared: Weak<Shared>) {
    let spawned = std::thread::Builder::new()
        .name("nccl-watchdog".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_millis(20));
            let Some(shared) = shared.upgrade() else {
                return;
            };
            if shared.aborted.load(Ordering::SeqCst) {
                return;
            }
            if shared.ctx.bind_to_thread().is_err() {
                return;
            }
            let mut stalled = None;
            {
                let mut q = shared.in_flight.lock().unwrap_or_else(|p| p.into_inner());
                while let Some(front) = q.front() {
                    if front.done.is_complete() {
                        q.pop_front();
                    } else {
                        if front.issued.elapsed() > shared.timeout {
                            stalled = Some((front.op, front.seq, front.site));
                        }
                        break;
                    }
                }
            }
            if let Some((op, seq, site)) = stalled {
                abort(&shared, op, seq, site);
                return;
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("no NCCL watchdog thread ({e}): a stalled collective will hang");
    }
}
