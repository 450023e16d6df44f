//! What the parallel crate's integration tests share: the relative errors every comparison
//! against the single-device run is measured with, deterministic tensors, the tiny GPT configs,
//! the plan shorthands, AdamW, and the optimizer items of a reference run that holds every
//! parameter whole.
//!
//! Each test file includes this module (`mod common;`) and uses its own subset of it.
#![allow(dead_code)]

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use mtrain_comm::MeshDims;
use mtrain_model::optim::{AdamW, AdamWConfig, OptimItem};
use mtrain_model::{GptConfig, MoeConfig, Param};
use mtrain_parallel::fsdp::{FsdpConfig, ZeroStage};
use mtrain_parallel::parallelize::{DataParallelKind, ParallelPlan};

/// ‖a − b‖ / ‖b‖ computed in f64 (‖b‖ floored at 1e-12); an error names differing shapes.
pub fn try_rel(a: &Tensor, b: &Tensor) -> Result<f64, String> {
    if a.dims() != b.dims() {
        return Err(format!("shapes differ: {:?} vs {:?}", a.dims(), b.dims()));
    }
    let sq = |t: &Tensor| -> candle_core::Result<f64> { t.sqr()?.sum_all()?.to_scalar::<f64>() };
    let sums = || -> candle_core::Result<(f64, f64)> {
        let (a, b) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
        Ok((sq(&(&a - &b)?)?, sq(&b)?))
    };
    let (d, n) = sums().map_err(|e| e.to_string())?;
    Ok((d / n.max(1e-24)).sqrt())
}

/// ‖a − b‖ / ‖b‖ in f64 (‖b‖ floored at 1e-12); panics on differing shapes.
pub fn rel(a: &Tensor, b: &Tensor) -> f64 {
    try_rel(a, b).unwrap_or_else(|e| panic!("relative error: {e}"))
}

/// |a − b| / |b| (|b| floored at 1e-12).
pub fn rel_f(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// A deterministic tensor with entries in [-1, 1).
pub fn det(shape: &[usize], seed: u64) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).expect("tensor")
}

/// AdamW with its default hyperparameters.
pub fn adamw() -> AdamW {
    AdamW::new(AdamWConfig::default())
}

/// A dense GPT small enough for a test: vocabulary 64, context 16.
pub fn tiny_gpt(n_layer: usize, n_head: usize, n_embd: usize) -> GptConfig {
    GptConfig {
        vocab_size: 64,
        block_size: 16,
        n_layer,
        n_head,
        n_embd,
        moe: None,
    }
}

/// `cfg` with every MLP replaced by 4 experts, top-2 routing, capacity factor 1.0 (tight
/// enough that tokens are dropped, so drops are compared too) and both auxiliary losses on.
pub fn with_moe(cfg: GptConfig) -> GptConfig {
    GptConfig {
        moe: Some(MoeConfig {
            n_experts: 4,
            top_k: 2,
            capacity_factor: 1.0,
            aux_loss_coef: 0.01,
            z_loss_coef: 0.001,
        }),
        ..cfg
    }
}

/// The plan of a dp × pp × tp mesh with ep carved out of dp; two micro-batches when pipelined.
pub fn plan(dp: usize, pp: usize, tp: usize, ep: usize) -> ParallelPlan {
    ParallelPlan {
        microbatches: if pp > 1 { 2 } else { 1 },
        ..ParallelPlan::new(MeshDims::new(dp, pp, tp, ep))
    }
}

/// ZeRO at `stage`, with prefetch.
pub fn zero(stage: ZeroStage) -> DataParallelKind {
    DataParallelKind::Zero(FsdpConfig {
        stage,
        ..FsdpConfig::default()
    })
}

/// `plan(dp, pp, tp, 1)` with `cp` ranks splitting each sequence (the ring's blocks, the
/// chunked embedding, losses and gradients averaged over dp × cp).
pub fn cp_plan(cp: usize, dp: usize, pp: usize, tp: usize) -> ParallelPlan {
    let p = plan(dp, pp, tp, 1);
    ParallelPlan {
        dims: p.dims.with_cp(cp),
        ..p
    }
}

/// The optimizer items of whole parameters: each parameter for which `grad` gives a gradient,
/// decayed when it is a matrix or an embedding (≥ 2-D), as nanoGPT does.
pub fn optim_items<'a>(
    params: &'a [Param],
    grad: impl Fn(&str) -> Option<&'a Tensor>,
) -> Vec<OptimItem<'a>> {
    params
        .iter()
        .filter_map(|p| {
            grad(p.name()).map(|g| OptimItem {
                name: p.name(),
                param: p,
                grad: g,
                decay: g.dims().len() >= 2,
            })
        })
        .collect()
}

/// Runs `f` on a pool of the threads `mtrain`'s launcher gives each of `ranks` workers on this
/// machine (its cores over the ranks, at least one), as the workers' `RAYON_NUM_THREADS` does:
/// ranks that are threads of one test process would otherwise share one pool and contend for
/// every core, a slowdown the command does not have.
pub fn on_rank_threads<R: Send>(ranks: usize, f: impl FnOnce() -> R + Send) -> R {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    rayon::ThreadPoolBuilder::new()
        .num_threads((cores / ranks).max(1))
        .build()
        .expect("pool")
        .install(f)
}

/// One rank's medians of (step, exposed communication): without an overlap mode, and with it.
pub type Medians = ((Duration, Duration), (Duration, Duration));

/// The middle of `v` once sorted.
pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// One step of each after a warm-up one, then `steps` of each in turn (so a load change on the
/// machine hits both): the medians of their (step, exposed) times. `inline(n)` and `mode(n)`
/// run step n without the overlap and with it.
pub fn alternate(
    steps: usize,
    mut inline: impl FnMut(usize) -> (Duration, Duration),
    mut mode: impl FnMut(usize) -> (Duration, Duration),
) -> Medians {
    inline(0);
    mode(0);
    let (mut a, mut c) = (vec![], vec![]);
    for n in 0..steps {
        a.push(inline(n));
        c.push(mode(n));
    }
    let med = |v: &[(Duration, Duration)]| {
        (
            median(v.iter().map(|x| x.0).collect()),
            median(v.iter().map(|x| x.1).collect()),
        )
    };
    (med(&a), med(&c))
}

/// The overlap tests' three claims, on every rank: the link is slow (the inline run waits at
/// least 40% of its step), the mode exposes at most `ratio` of the inline run's communication,
/// and the step gets shorter by what was hidden less 15% of the step (the step-to-step noise
/// of a 2-core machine other builds share). `measure` gives every rank's medians and a line on
/// the setting (compute, link); a load change between its calibration and its runs can leave
/// the link faster than that, or slow one mode's steps and not the other's, so a failed
/// measurement is taken again, at most 3 times: the claims must all hold in one of them.
/// `group` names the communication (`tp`, `ep`), `mode` the overlap.
pub fn overlap_claims(
    group: &str,
    mode: &str,
    ratio: f64,
    mut measure: impl FnMut() -> (Vec<Medians>, String),
) {
    for tries in 1..=3 {
        let (per_rank, setting) = measure();
        let mut failed = None;
        for (rank, ((step_none, exp_none), (step_mode, exp_mode))) in
            per_rank.into_iter().enumerate()
        {
            let (s_none, e_none) = (step_none.as_secs_f64(), exp_none.as_secs_f64());
            let (s_mode, e_mode) = (step_mode.as_secs_f64(), exp_mode.as_secs_f64());
            eprintln!(
                "rank {rank} ({setting}); inline: step {:.1} ms, exposed {group} {:.1} ms ({:.0}%); \
                 {mode}: step {:.1} ms, exposed {group} {:.1} ms ({:.2}x)",
                s_none * 1e3,
                e_none * 1e3,
                100.0 * e_none / s_none,
                s_mode * 1e3,
                e_mode * 1e3,
                e_mode / e_none,
            );
            let (saved_exposure, saved_step) = (e_none - e_mode, s_none - s_mode);
            let problem = if e_none < 0.4 * s_none {
                Some(format!(
                    "the link is not slow enough: inline communication {exp_none:?} of a {step_none:?} step"
                ))
            } else if e_mode > ratio * e_none {
                Some(format!(
                    "{mode} exposes {exp_mode:?}, more than {ratio}× the inline {exp_none:?}"
                ))
            } else if saved_step < saved_exposure - 0.15 * s_none {
                Some(format!(
                    "the step got {:.1} ms shorter for {:.1} ms less exposure",
                    saved_step * 1e3,
                    saved_exposure * 1e3
                ))
            } else {
                None
            };
            if let Some(p) = problem {
                failed.get_or_insert(format!("rank {rank}: {p}"));
            }
        }
        match failed {
            None => return,
            Some(p) if tries == 3 => {
                panic!("{p} (the third measurement; the two before failed too)")
            }
            Some(p) => eprintln!("{p}; measuring again"),
        }
    }
}
