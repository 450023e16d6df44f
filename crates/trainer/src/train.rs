//! The training loop.
//!
//! ```text
//! for step in start..steps:
//!     lr = warmup + cosine(step)
//!     for k in 0..grad_accum:                            gradient accumulation (the loop's count)
//!         x, y = loader.next_batch()                     this rank's slice of the global batch
//!         loss = model.forward_backward(x, y, MicroStep { k, of: grad_accum })   grads summed
//!     coef = clip_coef(‖g‖, grad_clip)                   global-norm clipping, on the device
//!     model.optimizer_step(lr, coef)                     AdamW, then the gradients are cleared
//!     read ‖g‖ back for the log                          (the host never waits before AdamW)
//!     every eval_every steps: mean loss of eval_iters random batches of each split
//!     log (progress bar, metrics.jsonl, pipeline-rank{N}.jsonl), checkpoint every N, memory report
//! ```
//!
//! [`train_loop`] runs the step (`train_step`) and then its observers (`train/observe.rs`: the
//! evaluation, the step logs, the memory report, the checkpoint), which change nothing trained.
//!
//! The loop drives one model type, [`Distributed`], which owns the forward/backward (pipeline
//! schedules, FSDP gathers, DDP buckets) and the optimizer's view of the parameters (flat shards)
//! under every layout: a single device is the world of one, the plan whose every group has one
//! rank, run by the same step as every other layout (DDP over a group of one averages nothing).
//!
//! Resuming restores weights, AdamW moments and step, and the loader position; every batch is a
//! function of the seed and its coordinates (`crate::data::sampling`) and nothing else is random,
//! so a resumed run reproduces the uninterrupted loss series bit for bit.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use mtrain_comm::mesh::MeshDims;
use mtrain_comm::{Backend, DeviceMesh};
use mtrain_kernels::readback::ReadLater;
use mtrain_model::optim::{clip_coef_on_device, lr_at, AdamWConfig, GradScale, LrSchedule};
use mtrain_model::init::param_specs;
use mtrain_model::source::ParamSource;
use mtrain_model::{GptConfig, SeededInit};
use mtrain_parallel::holdings::Holdings;
use serde::Serialize;

use crate::checkpoint;
use crate::config::{ParallelConfig, TrainConfig};
use crate::data::{DataLoader, Dataset};
use crate::distributed::Distributed;
use crate::fsio::JsonLines;
use crate::memory::{
    checkpoint_bytes, run_peak_line, startup_bytes, startup_line, AnalyticMemory, BackwardPath,
    CpuProbe, MemoryProbe, MemoryTracker, ModelStateLayout, Phase,
};
use crate::micro_step::MicroStep;
use crate::phases::{PhaseTimer, StepPhase, StepPhases};
use crate::roofline::OpsProfiler;
use crate::progress::{self, Progress};

use observe::{evaluation, save_checkpoint, MemoryReports, StepLogs};

pub use crate::progress::StepMetrics;
pub use crate::resolve::RunOptions;

mod observe;

/// What a run did.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// The first step this run executed (non-zero after a resume).
    pub start_step: u64,
    /// Training loss of every executed step, in order.
    pub losses: Vec<f64>,
    /// (step, validation loss) of every evaluation.
    pub val_losses: Vec<(u64, f64)>,
    /// (step, training-split loss) of every evaluation.
    pub train_eval_losses: Vec<(u64, f64)>,
    /// Mean tokens per second over the run.
    pub tokens_per_s: f64,
    /// Directory of the last checkpoint written, if any.
    pub last_checkpoint: Option<PathBuf>,
    /// Analytic model-state bytes of this rank.
    pub layout: ModelStateLayout,
}

/// Train with `cfg` on the ranks of `backend`, laid out as `dims` with the default plan.
pub fn run(
    cfg: &TrainConfig,
    backend: &dyn Backend,
    dims: MeshDims,
) -> anyhow::Result<TrainSummary> {
    run_with(backend, &RunOptions::new(cfg, dims)?)
}

/// Train the run `opts` describes (its configuration and plan, checked where it was made:
/// [`crate::resolve`]) on the ranks of `backend`: the whole model on one rank, or this rank's
/// part of the plan ([`Distributed`]) on a mesh.
pub fn run_with(backend: &dyn Backend, opts: &RunOptions) -> anyhow::Result<TrainSummary> {
    let cfg = opts.cfg();
    // Checkpoints record the configuration with the layout this run actually has.
    let cfg = &TrainConfig {
        parallel: ParallelConfig::of_plan(&opts.plan),
        ..cfg.clone()
    };
    // Rank 0 claims the run directory (held until the run ends) before any rank writes to it.
    let _claim = match backend.world().rank() {
        0 => Some(crate::run_dir::claim(cfg)?),
        _ => None,
    };
    // The other ranks wait here until rank 0 holds the directory.
    backend
        .world()
        .barrier()
        .context("waiting for rank 0 to claim the run directory")?;
    run_plan(cfg, backend, opts)
}

/// What every run prepares before it builds its model.
struct Setup {
    dataset: Dataset,
    /// Heap bytes before any part of the model exists (0 without `--mem-report`).
    state_baseline: u64,
    /// Where the initial weights come from, the same on every rank: the seeded initialisation
    /// (each rank draws only its pieces) or a Hugging Face file's full tensors.
    weights: Box<dyn ParamSource>,
    adamw: AdamWConfig,
}

/// Open the data (checking it fits the model's vocabulary), read the memory baseline while
/// nothing of the model exists yet, and name the initial weights' source (the seed's, or
/// `--init-from`'s file).
fn setup(cfg: &TrainConfig, gcfg: &GptConfig, device: &Device) -> anyhow::Result<Setup> {
    // On CUDA, memory a step frees stays reserved for the next step instead of going back to
    // the driver at each synchronise (the loss read-back, the gradient norm; used memory, which
    // the memory report shows, is unchanged), and kernels are ordered by the stream, without an
    // event per buffer (`mtrain_kernels::configure_device`).
    mtrain_kernels::configure_device(device)?;
    let dataset =
        Dataset::open(&cfg.data).with_context(|| format!("opening data `{}`", cfg.data))?;
    if dataset.vocab_size > gcfg.vocab_size {
        bail!(
            "the data's vocab_size {} exceeds the model's {}",
            dataset.vocab_size,
            gcfg.vocab_size
        );
    }
    let state_baseline = if cfg.mem_report {
        model_state_baseline(device)?
    } else {
        0
    };
    let weights: Box<dyn ParamSource> = match (&cfg.init_from, &cfg.resume) {
        (Some(path), None) => {
            let w = crate::tools::hf::load(path, gcfg)?;
            tracing::info!(path = %path.display(), "initial weights from a Hugging Face GPT-2 file");
            Box::new(w)
        }
        _ => Box::new(SeededInit::new(gcfg, cfg.seed)?),
    };
    let adamw = AdamWConfig {
        beta1: cfg.beta1,
        beta2: cfg.beta2,
        eps: cfg.eps,
        weight_decay: cfg.weight_decay,
    };
    Ok(Setup {
        dataset,
        state_baseline,
        weights,
        adamw,
    })
}

/// Training and validation loaders for data-parallel rank `dp_rank` of `dp_size`.
fn loaders(
    cfg: &TrainConfig,
    dataset: &Dataset,
    dp_rank: usize,
    dp_size: usize,
) -> anyhow::Result<(DataLoader, DataLoader)> {
    let train = DataLoader::new(
        dataset.train.clone(),
        cfg.seq_len,
        cfg.batch_size,
        dp_rank,
        dp_size,
        cfg.seed,
    )?
    .with_grad_accum(cfg.grad_accum)?
    .with_sampling(cfg.sampling)?;
    // The validation split is only evaluated, at random offsets.
    let val = DataLoader::new(
        dataset.val.clone(),
        cfg.seq_len,
        cfg.batch_size,
        dp_rank,
        dp_size,
        cfg.seed,
    )?;
    Ok((train, val))
}

/// Every run, one device included (the world of one, where every group has one rank and no
/// collective is issued): mesh, plan, this rank's part, its data slice, the loop; traces written
/// and every group's last operations printed when something fails.
fn run_plan(
    cfg: &TrainConfig,
    backend: &dyn Backend,
    opts: &RunOptions,
) -> anyhow::Result<TrainSummary> {
    let plan = &opts.plan;
    let dims = plan.dims;
    let world = backend.world().size();
    let gcfg = cfg.gpt_config()?;
    let device = backend.device();
    let mesh = DeviceMesh::new(backend, dims).context("building the device mesh")?;
    let rank = mesh.rank();
    let groups = crate::trace::mesh_groups(&mesh);
    if opts.trace {
        for g in &groups {
            g.tracer().set_recording(true);
        }
    }
    let timeline = crate::trace::Timeline::new(&groups, opts.trace);
    let result = (|| {
        let Setup {
            dataset,
            state_baseline,
            weights,
            adamw,
        } = setup(cfg, &gcfg, &device)?;
        let probe = memory_probe(&device);
        if cfg.mem_report {
            probe.reset_peak(); // the startup peak: building the model
        }
        // Resuming: the checkpoint, under whatever layout wrote it, is the model's source.
        let watch = observe::HeapWatch::start();
        let resumed = match &cfg.resume {
            Some(resume) => Some(resume_checkpoint(cfg, resume, &device, &gcfg)?),
            None => None,
        };
        let from_ckpt = resumed.as_ref().map(|c| c.weights());
        let source: &dyn ParamSource = match &from_ckpt {
            Some(w) => &**w,
            None => weights.as_ref(),
        };
        let mut model = Distributed::new(&gcfg, source, plan, &mesh, &device, adamw)?
            .with_timeline(timeline.clone());
        drop((from_ckpt, weights));
        if let Some(c) = &resumed {
            model.load_moments(c)?;
            watch.record(cfg, &model, (rank, c.meta.step), "load", 0)?;
        }
        if cfg.mem_report {
            let table = Holdings::of_rank(&gcfg, plan, mesh.coords)?;
            // A resumed rank builds from the checkpoint: its own pieces through one piece's
            // buffer, the moments included.
            let analytic = match &resumed {
                Some(_) => {
                    let (pieces, largest) = checkpoint_bytes(&table, plan);
                    startup_bytes(&table, plan).max(pieces + largest)
                }
                None => startup_bytes(&table, plan),
            };
            let measured = probe.peak().saturating_sub(state_baseline);
            eprintln!("{}", startup_line(rank, analytic, measured, probe.name()));
        }
        if rank == 0 && world > 1 {
            let dp = match plan.dp_buckets() {
                Some(_) => "gradients averaged in buckets during the backward",
                None => "gradients averaged per parameter",
            };
            tracing::info!("dp {}: {dp}", dims.dp);
        }
        // dp rank d reads rows d·B..(d+1)·B of every global batch; tp/pp ranks share them.
        let (d, n) = (mesh.coords.dp, dims.dp);
        let (loader, val) = loaders(cfg, &dataset, d, n)?;
        let start = resumed.as_ref().map_or(0, |c| c.meta.step);
        let mut ops = OpsProfiler::new((cfg, &gcfg), start, &mesh, &groups, &device);
        let summary = train_loop(
            cfg,
            &gcfg,
            &mut model,
            (loader, val),
            &device,
            rank,
            (dims.dp, world),
            state_baseline,
            resumed.as_ref(),
            ops.as_mut(),
        )?;
        Ok(summary)
    })();
    if opts.trace {
        crate::trace::write_rank_trace(&cfg.run_dir, rank, &groups, Some(&timeline))?;
        // Every rank's part is on disk once all have passed the barrier; rank 0 joins them.
        if result.is_ok() {
            mesh.world
                .barrier()
                .context("waiting for every rank's trace")?;
            if rank == 0 {
                let path = crate::trace::merge_chrome_traces(&cfg.run_dir, dims.world_size())?;
                tracing::info!(rank, path = %path.display(), "Chrome trace written (ui.perfetto.dev)");
            }
        }
    }
    if result.is_err() {
        eprint!("{}", crate::trace::recent_ops(rank, &groups));
    }
    result
}

/// The checkpoint `cfg.resume` points to ("latest": this run directory's newest that verifies),
/// checked against the run's model (its `[model]` settings and every parameter's shape).
fn resume_checkpoint(
    cfg: &TrainConfig,
    resume: &Path,
    device: &Device,
    gcfg: &GptConfig,
) -> anyhow::Result<checkpoint::Checkpoint> {
    let ckpt = if resume == Path::new("latest") {
        checkpoint::load_latest_valid(&cfg.run_dir, device, |e| {
            tracing::warn!("skipping a damaged checkpoint: {e}");
        })?
    } else {
        checkpoint::load(&checkpoint::resolve(resume)?, device)?
    };
    ckpt.check_model(gcfg)?;
    let shapes = param_specs(gcfg).into_iter().map(|(n, s, _)| (n, s)).collect();
    ckpt.check_shapes(&shapes)?;
    Ok(ckpt)
}

/// The loop itself, over this rank's [`Distributed`] model; `(dp, devices)`: the data-parallel degree
/// scales the token count, the number of devices the peak FLOP/s of the MFU; `state_baseline`
/// is the memory probe's reading taken right before `model` was built (the memory report's
/// model state is the level after each optimizer step minus it); `resumed`: the checkpoint the
/// model was built from, whose step and data position the loop continues from.
#[allow(clippy::too_many_arguments)]
pub fn train_loop(
    cfg: &TrainConfig,
    gcfg: &GptConfig,
    model: &mut Distributed,
    (mut loader, val): (DataLoader, DataLoader),
    device: &Device,
    rank: usize,
    (dp, devices): (usize, usize),
    state_baseline: u64,
    resumed: Option<&checkpoint::Checkpoint>,
    mut ops: Option<&mut OpsProfiler>,
) -> anyhow::Result<TrainSummary> {
    let _span = tracing::info_span!("train", rank).entered();
    let mut start_step = 0;
    if let Some(ckpt) = resumed {
        loader.set_position(ckpt.meta.data_position);
        start_step = ckpt.meta.step;
        tracing::info!(rank, step = start_step, dir = %ckpt.dir.display(), "resumed");
    }
    let lead = rank == 0;
    std::fs::create_dir_all(&cfg.run_dir)
        .with_context(|| format!("creating {}", cfg.run_dir.display()))?;
    // Rank 0 claimed the directory in `run_with`; its id goes into every metrics line.
    let run_id = match lead {
        true => crate::run_dir::read_run_info(&cfg.run_dir)?.map(|i| i.run_id),
        false => None,
    };
    // Every rank appends its memory reports and step reports (one write per line, O_APPEND).
    let mut logs = StepLogs::open(cfg, rank)?;
    let mut mem_reports = MemoryReports::open(cfg)?;

    let sched = LrSchedule {
        lr: cfg.lr,
        min_lr: cfg.min_lr,
        warmup_steps: cfg.warmup_steps,
        total_steps: cfg.steps,
    };
    let tokens_per_step = (cfg.batch_size * cfg.seq_len * cfg.grad_accum * dp) as f64;
    let flops_per_token = gcfg.flops_per_token(cfg.seq_len);
    let (peak, placeholder) = cfg.peak_flops();
    let layout = model.memory_layout();
    let analytic_of = |model: &Distributed| {
        let run = cfg.step_run(BackwardPath::on(cfg.backward(), device));
        let step = model.step_memory(gcfg, cfg.batch_size, run);
        AnalyticMemory::new(&model.memory_layout(), step, model.comm_bytes())
    };
    let analytic = analytic_of(model);
    if lead {
        tracing::info!(
            params = layout.n_params,
            flops_per_token,
            peak_flops = peak,
            "MFU is per device: against {peak:.3e} FLOP/s on each of {devices} device(s){}",
            if placeholder {
                " (an assumed CPU peak, a placeholder: set peak_flops for a real figure)"
            } else {
                ""
            }
        );
    }

    let bar = Progress::new(cfg.steps, start_step, lead);
    let probe = memory_probe(device);
    let mut tracker = MemoryTracker::with_baseline(probe.as_ref(), state_baseline);
    let mut summary = TrainSummary {
        start_step,
        losses: Vec::new(),
        val_losses: Vec::new(),
        train_eval_losses: Vec::new(),
        tokens_per_s: 0.0,
        last_checkpoint: None,
        layout,
    };
    let run_start = Instant::now();
    for step in start_step..cfg.steps {
        let lr = lr_at(step, &sched);
        let epoch = loader.epoch();
        if let Some(o) = ops.as_deref_mut() {
            o.begin(step);
        }
        let done = train_step(cfg, model, &mut loader, device, &mut tracker, (step, lr))?;
        if let Some(o) = ops.as_deref_mut() {
            if o.end(step, done.secs)? {
                crate::tools::plot::run_roofline(&cfg.run_dir)?;
            }
        }
        let tokens_per_s = tokens_per_step / done.secs.max(1e-9);
        let mfu = flops_per_token * tokens_per_s / (peak * devices as f64);
        summary.losses.push(done.loss);

        let last = step + 1 == cfg.steps;
        let evals = evaluation(cfg, model, (&loader, &val), step, device)?;
        if let Some((t, v)) = evals {
            summary.train_eval_losses.push((step, t));
            summary.val_losses.push((step, v));
        }
        let m = StepMetrics {
            step,
            run: run_id.clone(),
            loss: done.loss,
            lr,
            grad_norm: done.grad_norm,
            step_ms: done.secs * 1e3,
            tokens_per_s,
            mfu,
            epoch,
            train_eval_loss: evals.map(|e| e.0),
            val_loss: evals.map(|e| e.1),
            parallel: model.step_report(),
            phase_ms: done.phases.as_ref().map(|p| p.wall.clone()),
            phase_host_ms: done.phases.map(|p| p.host),
        };
        bar.step_done(step, done.loss);
        let log_now = cfg.log_every > 0 && (step % cfg.log_every == 0 || last);
        logs.record(&m, model, &bar, log_now)?;
        if cfg.mem_report {
            // MoE rows depend on where this step's router sent the tokens.
            let analytic = match model.routing_is_measured() {
                true => analytic_of(model),
                false => analytic,
            };
            let when = (step == start_step, last, log_now);
            mem_reports.record(&tracker, analytic, (step, rank), when, &bar)?;
        }
        if cfg.mem_report && last {
            bar.log(|| eprintln!("{}", run_peak_line(rank, "through the steps")));
        }
        if let Some(dir) = save_checkpoint(cfg, model, &loader, step, (rank, &bar))? {
            summary.last_checkpoint = Some(dir);
        }
    }
    bar.finish();
    if cfg.mem_report {
        eprintln!("{}", run_peak_line(rank, "at the end of the run"));
    }
    let executed = cfg.steps.saturating_sub(start_step);
    summary.tokens_per_s =
        executed as f64 * tokens_per_step / run_start.elapsed().as_secs_f64().max(1e-9);
    if logs.logs_steps {
        let line = progress::done_line(
            executed,
            summary.losses.last().copied(),
            summary.val_losses.last().map(|v| v.1),
            summary.tokens_per_s,
        );
        tracing::info!("{line}");
    }
    Ok(summary)
}

/// What one optimizer step did.
struct StepDone {
    /// The mean loss over the step's micro-steps.
    loss: f64,
    /// The global gradient norm before clipping.
    grad_norm: f64,
    /// Wall time of the step, seconds.
    secs: f64,
    /// Time per phase, with `profile_phases`.
    phases: Option<StepPhases>,
}

/// The dropout of micro-step `index` of `step` (None without dropout). Its key is the seed with
/// a constant mixed in, so the masks' counters never meet the batch sampler's under one key.
fn dropout_draw(cfg: &TrainConfig, step: u64, index: usize) -> Option<mtrain_model::StepDraw> {
    /// "dropout" in ASCII.
    const DROPOUT_KEY: u64 = 0x0064_726f_706f_7574;
    (cfg.dropout > 0.0).then_some(mtrain_model::StepDraw {
        p: cfg.dropout,
        seed: cfg.seed ^ DROPOUT_KEY,
        step,
        micro: index as u32,
    })
}

/// The step itself: `grad_accum` micro-steps of forward and backward on the loader's next
/// batches (the loop's count, [`MicroStep`]), the global gradient norm, AdamW at `lr` with the
/// clip coefficient. The tracker marks each phase under `mem_report`; the phase timer times
/// them under `profile_phases`.
fn train_step(
    cfg: &TrainConfig,
    model: &mut Distributed,
    loader: &mut DataLoader,
    device: &Device,
    tracker: &mut MemoryTracker,
    (step, lr): (u64, f64),
) -> anyhow::Result<StepDone> {
    let t0 = Instant::now();
    let _hot = device.is_cpu().then(crate::compute_pool::Hot::start);
    if cfg.mem_report {
        tracker.begin();
    }
    let mut loss = 0.0;
    let mut timer = cfg
        .profile_phases
        .then(|| PhaseTimer::start(device))
        .transpose()?;
    for index in 0..cfg.grad_accum {
        let (x, y) = loader.next_batch().to_tensors(device)?; // (B, T), (B, T)
        lap(&mut timer, StepPhase::Data)?;
        let mut lap_err = None;
        let mut mark = |p: Phase| {
            if cfg.mem_report {
                tracker.mark(p)
            }
            let phase = match p {
                Phase::AfterForward => StepPhase::Forward,
                _ => StepPhase::Backward,
            };
            if let Err(e) = lap(&mut timer, phase) {
                lap_err.get_or_insert(e);
            }
        };
        let micro = MicroStep {
            index,
            of: cfg.grad_accum,
            dropout: dropout_draw(cfg, step, index),
        };
        loss += model.forward_backward(&x, &y, micro, &mut mark)? / cfg.grad_accum as f64;
        if let Some(e) = lap_err {
            return Err(e.into());
        }
    }
    if !loss.is_finite() {
        bail!("loss became {loss} at step {step} (lr {lr:.3e}); lower --lr or check the data");
    }
    // The norm stays on the device until the step that needs it is queued: its clip
    // coefficient is computed there and the optimizer reads it there. Its copy to the host is
    // queued before AdamW, so the host waits for the norm, not for AdamW.
    let norm_sq = model.grad_sq_norm()?; // () f64
    lap(&mut timer, StepPhase::GradNorm)?;
    let scale = clip_coef_on_device(&norm_sq, cfg.grad_clip)?; // () f32
    let norm_read = ReadLater::start(&norm_sq)?;
    model.optimizer_step(lr, GradScale::OnDevice(scale))?;
    let grad_norm = norm_read.wait()?.sqrt();
    lap(&mut timer, StepPhase::Optimizer)?;
    if cfg.mem_report {
        tracker.mark(Phase::AfterOptimizer);
    }
    Ok(StepDone {
        loss,
        grad_norm,
        secs: t0.elapsed().as_secs_f64(),
        phases: timer.map(PhaseTimer::finish),
    })
}

/// Mean loss over `iters` batches of `split`'s loader drawn at random for the evaluation at
/// `step` (nanoGPT's estimate_loss; fresh batches at every evaluation, the same ones in a
/// resumed run and under every layout).
pub fn evaluate(
    model: &mut Distributed,
    split: &DataLoader,
    step: u64,
    iters: usize,
    device: &Device,
) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for i in 0..iters {
        let (x, y) = split.eval_batch(step, i as u32).to_tensors(device)?; // (B, T), (B, T)
        total += model.eval_loss(&x, &y)?;
    }
    Ok(total / iters as f64)
}

/// Reads `device`'s memory probe after warm-up matrix products, so the compute kernels'
/// per-thread workspace is part of the baseline, not of the model state measured from it.
///
/// On CPU, gemm keeps an L2-sized packing buffer in every thread that ran a product (1 MiB per
/// thread on a machine with 1 MiB of L2 per core): a small product runs on the calling thread and
/// shows the buffer's size; larger ones run on the compute pool's threads, and which threads take
/// part is up to work stealing, so they repeat until the level has grown by one buffer per pool
/// thread (or 64 products, about 0.3 s on one core, have run).
pub fn model_state_baseline(device: &Device) -> anyhow::Result<u64> {
    let probe = memory_probe(device);
    let product = |n: usize| -> anyhow::Result<()> {
        let a = Tensor::ones((n, n), DType::F32, device)?;
        a.matmul(&a)?.sum_all()?.to_scalar::<f32>()?;
        Ok(())
    };
    let before = probe.current();
    product(16)?;
    let start = probe.current();
    let per_thread = start.saturating_sub(before) * 9 / 10;
    let pool = candle_core::utils::get_num_threads() as u64;
    if per_thread > 0 && pool > 1 {
        for _ in 0..64 {
            product(384)?;
            if probe.current() >= start + pool * per_thread {
                break;
            }
            std::thread::yield_now();
        }
    }
    Ok(probe.current())
}

/// The probe that measures `device`: the CUDA memory pool on a GPU, the counting allocator on CPU.
pub fn memory_probe(device: &Device) -> Box<dyn MemoryProbe> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        match crate::gpu_memory::CudaMemoryProbe::new(device) {
            Ok(p) => return Box::new(p),
            Err(e) => tracing::warn!("GPU memory probe unavailable ({e}); reporting host heap"),
        }
    }
    let _ = device;
    Box::new(CpuProbe)
}

/// Ends phase `p` of the step when the phases are being timed.
fn lap(timer: &mut Option<PhaseTimer>, p: StepPhase) -> candle_core::Result<()> {
    match timer {
        Some(t) => t.lap(p),
        None => Ok(()),
    }
}

fn open_append(path: &Path) -> anyhow::Result<JsonLines> {
    Ok(JsonLines::open_append(path)?)
}

fn write_json_line(f: &mut JsonLines, value: &impl Serialize) -> anyhow::Result<()> {
    Ok(f.write(value)?)
}
