//! A worker's watch on its job: when the rendezvous store stops answering, the job is gone.
//!
//! mtrain's own launcher kills its workers through the parent-death signal
//! ([`crate::launch`]). A worker started by something else (torchrun, Slurm, by hand), or on
//! another node than the process serving the store, has no such tie, and a collective stuck on a
//! vanished peer would only fail at `--comm-timeout`. So every worker that does not serve the
//! store itself keeps a second connection to it and asks it a trivial question (`add(key, 0)`)
//! every [`POLL_INTERVAL`]: a store whose process died answers with a reset or end of file at
//! once, a host that vanished with silence past the client's margin (5 s). Either way the
//! watcher calls its `on_lost` (the binary exits) within about a second, or six for a lost host.
//!
//! At the end of a job the store may close before a rank exits (rank 0 serves it and leaves
//! first), so the watch is [`StoreWatch::disarm`]ed before the final barrier.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use mtrain_comm::store::StoreClient;
use mtrain_comm::CommError;

/// How often the watcher asks the store whether it is still there.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// The counter the watcher reads (adding 0 changes nothing and never blocks).
const LIVENESS_KEY: &str = "mtrain/liveness";

/// A background thread polling the store; stops when dropped.
pub struct StoreWatch {
    armed: Arc<AtomicBool>,
    /// Dropping the sender wakes and ends the thread.
    _stop: mpsc::Sender<()>,
}

impl StoreWatch {
    /// Connect to the store at `addr` as job `job_id` and poll it every `interval`; when a poll
    /// fails while the watch is armed, `on_lost` is called once, from the watcher thread, with
    /// the store client's message.
    pub fn start(
        addr: &str,
        job_id: &str,
        interval: Duration,
        on_lost: impl FnOnce(String) + Send + 'static,
    ) -> Result<Self, CommError> {
        let client = StoreClient::connect(addr, job_id, Duration::from_secs(10))?;
        let armed = Arc::new(AtomicBool::new(true));
        let (stop, stopped) = mpsc::channel::<()>();
        let watching = armed.clone();
        std::thread::Builder::new()
            .name("store-watch".into())
            .spawn(move || loop {
                match stopped.recv_timeout(interval) {
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    // Dropped (or, never, sent to): the watch is over.
                    _ => return,
                }
                if let Err(e) = client.add(LIVENESS_KEY, 0) {
                    if watching.load(Ordering::SeqCst) {
                        on_lost(e.to_string());
                    }
                    return;
                }
            })?;
        Ok(Self { armed, _stop: stop })
    }

    /// From now on the store's disappearance is expected (the job is finishing), not fatal.
    pub fn disarm(&self) {
        self.armed.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Instant;

    /// Reads one length-prefixed message of the store's wire format.
    fn read_msg(conn: &mut TcpStream) -> Vec<u8> {
        let mut len = [0u8; 4];
        conn.read_exact(&mut len).unwrap();
        let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
        conn.read_exact(&mut body).unwrap();
        body
    }

    fn write_msg(conn: &mut TcpStream, body: &[u8]) {
        conn.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
        conn.write_all(body).unwrap();
    }

    /// A store that admits the watcher, answers `answers` polls, then closes the connection as
    /// a dying process does. Returns its address.
    fn store_that_dies_after(answers: usize) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            read_msg(&mut conn); // Hello
            write_msg(&mut conn, br#""Ok""#);
            for _ in 0..answers {
                read_msg(&mut conn); // Add
                write_msg(&mut conn, br#"{"Count":0}"#);
            }
        });
        addr
    }

    #[test]
    fn a_vanished_store_is_reported_within_a_poll() {
        let addr = store_that_dies_after(2);
        let (tx, rx) = mpsc::channel();
        let start = Instant::now();
        let _watch = StoreWatch::start(&addr, "job", Duration::from_millis(50), move |why| {
            let _ = tx.send(why);
        })
        .unwrap();
        let why = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("store loss reported");
        assert!(why.contains(&addr), "{why}");
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn a_disarmed_watch_stays_quiet() {
        let addr = store_that_dies_after(3);
        let (tx, rx) = mpsc::channel();
        let watch = StoreWatch::start(&addr, "job", Duration::from_millis(50), move |why| {
            let _ = tx.send(why);
        })
        .unwrap();
        watch.disarm();
        assert!(rx.recv_timeout(Duration::from_millis(600)).is_err());
    }
}
