//! The rendezvous store: set / get / wait / add / barrier, deadlines, job ids, late servers.

use std::time::{Duration, Instant};

use mtrain_comm::store::{StoreClient, StoreServer};

const T: Duration = Duration::from_secs(5);

fn server(job: &str) -> (StoreServer, String) {
    let s = StoreServer::start_for_job("127.0.0.1:0", job).expect("server");
    let addr = s.local_addr().to_string();
    (s, addr)
}

#[test]
fn set_get_add_wait_and_barrier_across_clients() {
    let (_server, addr) = server("job-a");
    std::thread::scope(|s| {
        for i in 0..4i64 {
            let addr = addr.clone();
            s.spawn(move || {
                let c = StoreClient::connect(&addr, "job-a", T).expect("connect");
                c.set(&format!("addr/{i}"), format!("host{i}").as_bytes())
                    .expect("set");
                // get blocks until the other clients have set their keys.
                for j in 0..4 {
                    assert_eq!(
                        c.get(&format!("addr/{j}")).expect("get"),
                        format!("host{j}").into_bytes()
                    );
                }
                let n = c.add("counter", i + 1).expect("add");
                assert!((1..=10).contains(&n));
                c.barrier("after-add", 4, Instant::now() + T)
                    .expect("barrier");
                assert_eq!(c.add("counter", 0).expect("read counter"), 1 + 2 + 3 + 4);
                c.wait(&["addr/0", "addr/3"], Instant::now() + T)
                    .expect("wait for present keys");
            });
        }
    });
}

#[test]
fn wait_times_out_naming_the_missing_keys() {
    let (_server, addr) = server("job-b");
    let c = StoreClient::connect(&addr, "job-b", T).expect("connect");
    c.set("present", b"1").expect("set");
    let start = Instant::now();
    let err = c
        .wait(
            &["present", "absent"],
            Instant::now() + Duration::from_millis(200),
        )
        .expect_err("absent key")
        .to_string();
    assert!(
        start.elapsed() >= Duration::from_millis(200) && start.elapsed() < Duration::from_secs(3)
    );
    assert!(
        err.contains("timed out after")
            && err.contains("\"absent\"")
            && !err.contains("\"present\""),
        "{err}"
    );
    let err = c
        .barrier("short", 2, Instant::now() + Duration::from_millis(100))
        .expect_err("alone")
        .to_string();
    assert!(err.contains("barrier 'short' of 2 clients"), "{err}");
}

#[test]
fn a_client_of_another_job_is_rejected() {
    let (_server, addr) = server("job-c");
    let err = StoreClient::connect(&addr, "other-job", T)
        .expect_err("wrong job")
        .to_string();
    assert!(
        err.contains("serves job 'job-c'") && err.contains("'other-job'"),
        "{err}"
    );
    StoreClient::connect(&addr, "job-c", T).expect("the right job still gets in");
}

#[test]
fn clients_retry_until_the_server_starts() {
    // Reserve a free port, release it, and start the server there a little later.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let late = std::thread::spawn({
        let addr = addr.clone();
        move || {
            std::thread::sleep(Duration::from_millis(300));
            let s = StoreServer::start_for_job(&addr, "job-d").expect("late server");
            std::thread::sleep(Duration::from_millis(500));
            drop(s);
        }
    });
    let start = Instant::now();
    let c = StoreClient::connect(&addr, "job-d", T).expect("connects once the server is up");
    assert!(start.elapsed() >= Duration::from_millis(250));
    c.set("k", b"v").expect("set");
    late.join().expect("server thread");
    let err = StoreClient::connect("127.0.0.1:1", "job-d", Duration::from_millis(200))
        .expect_err("nobody there")
        .to_string();
    assert!(
        err.contains("could not reach the rendezvous store at 127.0.0.1:1"),
        "{err}"
    );
}

#[test]
fn cpu_backend_init_hosts_the_store_on_rank_0() {
    use candle_core::{Device, Tensor};
    use mtrain_comm::{Backend, CpuBackend, CpuOptions, LaunchEnv, ReduceOp};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let sums: Vec<f32> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                s.spawn(move || {
                    // Ranks 1 and 2 start first and wait for rank 0's store.
                    if rank == 0 {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    let env = LaunchEnv {
                        rank,
                        local_rank: rank,
                        world_size: 3,
                        local_world_size: 3,
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                        store_port: port,
                        job_id: "init-test".into(),
                        store_external: false,
                    };
                    let b = CpuBackend::init(
                        &env,
                        CpuOptions {
                            timeout: T,
                            trace: false,
                            ..CpuOptions::default()
                        },
                    )
                    .expect("init");
                    let x = Tensor::new(&[rank as f32], &Device::Cpu).expect("x");
                    let y = b.world().all_reduce(&x, ReduceOp::Sum).expect("all_reduce");
                    // Rank 0 hosts the store: keep it up until everyone is done with it.
                    b.world().barrier().expect("barrier");
                    y.to_vec1::<f32>().expect("vec")[0]
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    assert_eq!(sums, vec![3.0; 3]);
}
