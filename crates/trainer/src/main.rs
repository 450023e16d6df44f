//! The `mtrain` binary: parse the command line, then either launch this node's workers or be one.
//!
//! ```text
//!   mtrain --tp 2 --pp 2          RANK unset, world 4  -> launcher: spawn 4 workers, supervise
//!     '-- worker (RANK=r)         RANK set             -> a backend from the environment,
//!                                                         train::run_with / bench-comm
//!   backend: CPU -> TCP; CUDA, a GPU per local rank -> NCCL on GPU LOCAL_RANK;
//!            CUDA, fewer GPUs than local ranks -> GPU LOCAL_RANK mod #GPUs, collectives
//!            through CUDA IPC (or `--comm staged`: the CPU backend, through the host), once
//!            the launcher checked that each GPU's ranks fit its free memory (`gpu_fit`)
//!   mtrain                        RANK unset, world 1  -> train in this process, no spawning
//!   mtrain plan | prepare | sample | plot | export     -> single-process tools, never launched
//!   mtrain parity --vs "..."                           -> runs this binary twice (1 rank, the layout)
//! ```
//!
//! Every command that runs on ranks resolves the configuration (its `[parallel]` table under the
//! layout flags) and the layout the same way, before launching and again in each worker, so a
//! worker sees the job its launcher saw.
//!
//! Errors are printed with their chain of causes and the process exits non-zero, so a failing
//! worker is seen by the launcher, which stops the job and names the rank.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use mtrain_comm::cpu::{CpuBackend, CpuOptions};
use mtrain_comm::env::LaunchEnv;
use mtrain_comm::Backend;
use mtrain_trainer::cli::{Cli, Command};
use mtrain_trainer::config::DeviceKind;
use mtrain_trainer::launch::{self, LaunchError};
use mtrain_trainer::layout::{CommChoice, Layout};
use mtrain_trainer::liveness::{self, StoreWatch};
use mtrain_trainer::resolve::{resolve, Resolved, RunOptions};
use mtrain_trainer::tools::{bench_comm, explain, hf, parity, plan, plot, prepare, sample};
use mtrain_trainer::train;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

#[global_allocator]
static ALLOC: mtrain_trainer::memory::CountingAlloc = mtrain_trainer::memory::CountingAlloc;

/// Exit code after Ctrl-C / SIGTERM, as a shell reports a SIGINT death (128 + 2).
const EXIT_INTERRUPTED: u8 = 130;
/// Exit code of a worker whose job vanished under it (its rendezvous store stopped answering).
const EXIT_JOB_LOST: i32 = 1;

fn main() -> ExitCode {
    mtrain_trainer::compute_pool::init();
    let cli = Cli::parse();
    let env = match LaunchEnv::from_env() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Under mtrain's own launcher every line already arrives as `[rank N] ...`.
    let prefixed_by_launcher =
        std::env::var_os(mtrain_trainer::launch::LINES_PREFIXED_VAR).is_some();
    init_tracing(
        env.as_ref()
            .filter(|_| !prefixed_by_launcher)
            .map(|e| e.rank),
    );
    match run(cli, env) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let interrupted = matches!(
                err.downcast_ref::<LaunchError>(),
                Some(LaunchError::Interrupted { .. })
            );
            eprintln!("error: {err}");
            for cause in err.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            if interrupted {
                ExitCode::from(EXIT_INTERRUPTED)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Logs go to stderr; `RUST_LOG` filters them (default `info`). In a worker started by an
/// external launcher every line starts with `rank=N`, so interleaved output can be told apart.
fn init_tracing(rank: Option<usize>) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false);
    let result = match rank {
        Some(r) => builder
            .event_format(RankPrefix(
                r,
                tracing_subscriber::fmt::format().with_target(false),
            ))
            .try_init(),
        None => builder.try_init(),
    };
    if let Err(e) = result {
        eprintln!("warning: logging not initialised: {e}");
    }
}

/// Event format that writes `rank=N ` and then the wrapped format's line.
struct RankPrefix<F>(usize, F);

impl<S, N, F> FormatEvent<S, N> for RankPrefix<F>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'w> FormatFields<'w> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        write!(writer, "rank={} ", self.0)?;
        self.1.format_event(ctx, writer, event)
    }
}

fn run(cli: Cli, env: Option<LaunchEnv>) -> anyhow::Result<()> {
    let launched_world = env.as_ref().map(|e| e.world_size);
    match &cli.command {
        Some(Command::Plan(plan)) => {
            if plan.args.collective.collective.is_some() {
                let (one, cluster) = (&plan.args.collective, &plan.args.cluster);
                print!("{}", plan::arithmetic::run(one, cluster)?);
                return Ok(());
            }
            let cli = cli.with_cluster_world()?;
            let Resolved { layout, run } = resolve(&cli, None)?;
            let check = &mtrain_trainer::resolve::check_plan;
            plan::run(run.cfg(), &layout, &run.plan, &plan.args, check)
        }
        Some(Command::Prepare(args)) => {
            let summary = prepare::prepare(args)?;
            println!(
                "wrote {}: vocab {}, {} train + {} val tokens, {:.2} bytes/token; a model trained on it takes vocab_size {}",
                args.out.display(),
                summary.vocab_size,
                summary.train_tokens,
                summary.val_tokens,
                summary.bytes_per_token,
                mtrain_trainer::data::padded_vocab(summary.vocab_size)
            );
            Ok(())
        }
        Some(Command::Sample(args)) => {
            let sampled = sample::sample(args)?;
            println!("{}", sampled.text);
            eprintln!("{}", sampled.rate_line());
            if let Some((table, written)) = &sampled.ops {
                eprintln!("{table}");
                for path in written {
                    eprintln!("wrote {}", path.display());
                }
            }
            Ok(())
        }
        Some(Command::Export(args)) => {
            let s = hf::export(args)?;
            println!(
                "wrote {}: step {} of {}, {} parameters, vocab {}{}; transformers' GPT2LMHeadModel and AutoTokenizer load it with from_pretrained",
                args.hf.display(),
                s.step,
                s.checkpoint.display(),
                s.n_params,
                s.vocab_size,
                if s.dropped_rows > 0 {
                    format!(" ({} padding rows of the embedding left out)", s.dropped_rows)
                } else {
                    String::new()
                }
            );
            Ok(())
        }
        Some(Command::BenchComm(bench)) => {
            let args = &bench.args;
            let cfg = cli
                .config()
                .context("resolving the configuration (its [parallel] table)")?;
            let layout_args = cli.command_layout()?;
            layout_args.check_device(args.device)?;
            let layout = layout_args.resolve(&cfg.parallel, launched_world)?;
            // No model to plan for: only the mesh's own numbers are checked.
            layout.dims.validate(layout.world_size)?;
            if args.nccl_debug && args.device == DeviceKind::Cuda {
                // Before NCCL starts here, and inherited by the workers launched below.
                bench_comm::nccl_debug::set_env();
            }
            distributed(&layout, env, args.device, None, |backend| {
                bench_comm::run(args, backend)?;
                Ok(())
            })
        }
        Some(Command::Parity(args)) => parity::run(args),
        Some(Command::Explain(args)) => {
            print!("{}", explain::explain(args).map_err(anyhow::Error::msg)?);
            Ok(())
        }
        Some(Command::Plot(args)) => {
            for path in plot::plot(args)? {
                println!("wrote {}", path.display());
            }
            Ok(())
        }
        None => {
            // Resolve the config and check the plan before launching, so a bad flag or a layout
            // that cannot work fails once, with the arithmetic, not once per rank.
            let Resolved { layout, run } = resolve(&cli, launched_world)?;
            if env.is_none() && layout.world_size > 1 {
                // The launcher checks the run directory once, before any worker starts;
                // rank 0 then claims it (`train::run_with`).
                mtrain_trainer::run_dir::check(run.cfg())?;
            }
            distributed(&layout, env, run.cfg().device, Some(&run), |backend| {
                if backend.world().rank() == 0 {
                    let d = layout.dims;
                    let cp = match d.cp {
                        1 => String::new(),
                        cp => format!(" cp={cp}"),
                    };
                    tracing::info!(
                        "layout dp={} pp={}{cp} tp={} ep={} (world {})",
                        d.dp,
                        d.pp,
                        d.tp,
                        d.ep,
                        layout.world_size
                    );
                }
                train::run_with(backend, &run)?;
                Ok(())
            })
        }
    }
}

/// Run `job` on every rank of `layout`: here (world 1), as this worker (RANK set), or by
/// launching this node's workers, which re-enter here as workers. A training `run` is checked
/// against the GPUs' free memory before the launch when its ranks share GPUs.
fn distributed(
    layout: &Layout,
    env: Option<LaunchEnv>,
    device: DeviceKind,
    run: Option<&RunOptions>,
    job: impl FnOnce(&dyn Backend) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let env = match env {
        Some(env) => env,
        None if layout.world_size == 1 => LaunchEnv::single(),
        None => {
            if device == DeviceKind::Cuda {
                announce_shared_gpus(layout.launch.nproc_per_node, layout.comm)?;
                if let Some(run) = run {
                    check_gpu_memory(layout, run)?;
                }
            }
            let args: Vec<OsString> = std::env::args_os().skip(1).collect();
            launch::launch(&layout.launch, &args)?;
            return Ok(());
        }
    };
    inject_failure(env.rank)?;
    let backend = make_backend(&env, device, layout).with_context(|| {
        if env.world_size > 1 {
            format!("rank {}: joining the job at {}", env.rank, env.store_addr())
        } else {
            "starting the collective backend".to_string()
        }
    })?;
    let watch = watch_job(&env)?;
    if device == DeviceKind::Cpu {
        let cpus = mtrain_trainer::compute_pool::pin_threads(env.local_rank);
        if !cpus.is_empty() {
            tracing::debug!("compute threads pinned to CPUs {cpus:?}");
        }
    }
    job(backend.as_ref())?;
    if env.world_size > 1 {
        // Leave together: once every rank is past this barrier nobody waits for data from a
        // peer any more (and rank 0, which may be serving the store, is the last to need it).
        // Dropping the backend flushes each connection's queued bytes before the process exits.
        if let Some(w) = &watch {
            w.disarm();
        }
        backend.world().barrier().context("final barrier")?;
        drop(backend);
    }
    Ok(())
}

/// Exit when the job's rendezvous store goes away ([`liveness`]): the launcher or rank 0 that
/// served it is gone, so this worker is an orphan. Not needed in a world of one, nor in the
/// process that serves the store itself.
fn watch_job(env: &LaunchEnv) -> anyhow::Result<Option<StoreWatch>> {
    if env.world_size == 1 || (env.rank == 0 && !env.store_external) {
        return Ok(None);
    }
    let (addr, rank) = (env.store_addr(), env.rank);
    let watched = addr.clone();
    let watch = StoreWatch::start(&addr, &env.job_id, liveness::POLL_INTERVAL, move |why| {
        eprintln!(
            "error: rank {rank}: the job's rendezvous store at {watched} stopped answering, so its launcher or rank 0 is gone; exiting"
        );
        eprintln!("  caused by: {why}");
        std::process::exit(EXIT_JOB_LOST);
    })
    .with_context(|| format!("rank {rank}: watching the rendezvous store at {addr}"))?;
    Ok(Some(watch))
}

/// The collective backend for this process: TCP on CPU, NCCL on the GPU of `LOCAL_RANK`.
fn make_backend(
    env: &LaunchEnv,
    device: DeviceKind,
    layout: &Layout,
) -> anyhow::Result<Box<dyn Backend>> {
    match device {
        DeviceKind::Cpu => {
            let algo = mtrain_trainer::tools::cost::algo_choice(
                layout.algo,
                layout.algo_table.as_deref(),
                layout.link.as_ref(),
                env.world_size,
            )
            .with_context(|| format!("--algo {}", layout.algo))?;
            let opts = CpuOptions {
                timeout: layout.comm_timeout,
                trace: layout.trace,
                algo,
                link: layout.link,
            };
            Ok(Box::new(CpuBackend::init(env, opts)?))
        }
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => {
            use mtrain_comm::ipc::{IpcBackend, IpcOptions};
            use mtrain_comm::nccl::{NcclBackend, NcclOptions};
            let gpus = visible_gpus()?;
            let shared = env.local_world_size > gpus;
            let cpu = CpuOptions {
                timeout: layout.comm_timeout,
                trace: layout.trace,
                algo: mtrain_trainer::tools::cost::algo_choice(
                    layout.algo,
                    layout.algo_table.as_deref(),
                    layout.link.as_ref(),
                    env.world_size,
                )?,
                link: layout.link,
            };
            // Ranks are placed round-robin on the GPUs.
            let device = || candle_core::Device::new_cuda(env.local_rank % gpus);
            match (layout.comm, shared) {
                (CommChoice::Nccl, true) => anyhow::bail!(
                    "--comm nccl: {} ranks on {gpus} GPU(s), and NCCL refuses two ranks on one GPU; use --comm ipc (or auto)",
                    env.local_world_size
                ),
                (CommChoice::Nccl, false) | (CommChoice::Auto, false) => {
                    let opts = NcclOptions { timeout: layout.comm_timeout, ..Default::default() };
                    Ok(Box::new(NcclBackend::init(env, opts)?))
                }
                (CommChoice::Ipc, _) | (CommChoice::Auto, true) => {
                    let mut opts = IpcOptions::from_env(layout.comm_timeout)?;
                    if gpus == 1 && std::env::var_os("MTRAIN_IPC_ONE_SHOT_MAX").is_none() {
                        // Every rank reads the same memory: two-shot's halved reads buy nothing
                        // and its extra phase costs a context switch (docs/journal.md, one GPU).
                        opts.one_shot_max = usize::MAX;
                    }
                    Ok(Box::new(IpcBackend::init(env, device()?, cpu, opts)?))
                }
                (CommChoice::Staged, _) => {
                    let inner = CpuBackend::init(env, cpu)?;
                    Ok(Box::new(mtrain_comm::StagedBackend { inner, device: device()? }))
                }
            }
        }
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => anyhow::bail!(
            "--device cuda needs a build with the `cuda` feature (scripts/build-gpu.sh); this binary is CPU-only"
        ),
    }
}

/// The CUDA GPUs this process sees (CUDA_VISIBLE_DEVICES applies); none is an error.
#[cfg(feature = "cuda")]
fn visible_gpus() -> anyhow::Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    let n = CudaContext::device_count()
        .map_err(|e| anyhow::anyhow!("--device cuda: counting the CUDA GPUs failed: {e:?}"))?;
    anyhow::ensure!(
        n > 0,
        "--device cuda: no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)"
    );
    Ok(n as usize)
}

/// The launcher's word, before any worker starts, when this node has more ranks than GPUs: the
/// ranks share the GPUs round-robin, and which backend runs their collectives.
fn announce_shared_gpus(local_ranks: usize, comm: CommChoice) -> anyhow::Result<()> {
    #[cfg(feature = "cuda")]
    {
        let gpus = visible_gpus()?;
        if local_ranks > gpus {
            let how = match comm {
                CommChoice::Staged => "through the CPU backend, staged through the host",
                CommChoice::Nccl => anyhow::bail!(
                    "--comm nccl: {local_ranks} ranks on {gpus} GPU(s), and NCCL refuses two ranks on one GPU; use --comm ipc (or auto)"
                ),
                CommChoice::Ipc | CommChoice::Auto => {
                    "through CUDA IPC, each reading its peers' GPU memory"
                }
            };
            tracing::warn!(
                "{local_ranks} ranks on {gpus} GPU(s): ranks share GPUs round-robin (rank r on GPU r mod {gpus}) and run their collectives {how}; speed figures are not multi-GPU figures"
            );
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (local_ranks, comm);
    Ok(())
}

/// Before the launch, with fewer GPUs than this node's ranks: the ranks each GPU will hold must
/// fit its free memory (`gpu_fit`: the memory model's prediction per rank against cuMemGetInfo).
fn check_gpu_memory(layout: &Layout, run: &RunOptions) -> anyhow::Result<()> {
    #[cfg(feature = "cuda")]
    {
        use mtrain_trainer::tools::gpu_fit;
        if layout.launch.nproc_per_node > visible_gpus()? && !gpu_fit::skipped() {
            let free = mtrain_trainer::gpu_memory::free_memory().map_err(|e| {
                anyhow::anyhow!("reading the GPUs' free memory before the launch: {e}")
            })?;
            gpu_fit::check_launch(run.cfg(), &run.plan, &layout.launch, &free)?;
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (layout, run);
    Ok(())
}

/// Test hook for the launcher's fail-fast path: `MTRAIN_FAIL_RANK=r` makes worker `r` fail at
/// start-up with an error, or die of SIGABRT when `MTRAIN_FAIL_MODE=abort`.
fn inject_failure(rank: usize) -> anyhow::Result<()> {
    let Ok(target) = std::env::var("MTRAIN_FAIL_RANK") else {
        return Ok(());
    };
    if target.trim().parse::<usize>().ok() != Some(rank) {
        return Ok(());
    }
    if std::env::var("MTRAIN_FAIL_MODE").as_deref() == Ok("abort") {
        eprintln!("MTRAIN_FAIL_RANK={rank}: aborting");
        std::process::abort();
    }
    anyhow::bail!("MTRAIN_FAIL_RANK={rank}: failing on purpose")
}
