//! Sharded initialisation against one device, bit for bit (CPU, ranks as threads).
//!
//! Every layout builds its ranks from the seeded initialisation ([`SeededInit`]), each rank
//! drawing only the pieces it holds. For every rank and every piece it reports
//! ([`ParallelModel::pieces`]), the local values must be exactly the elements of the
//! single-device tensors of [`init_weights`] at the piece's runs (compared as bit patterns, in
//! the compute dtype), and the pieces of all ranks together must cover every element of every
//! parameter. Under mixed precision the fp32 masters, gathered, must be the fp32 initial weights
//! exactly.

mod common;

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use mtrain_comm::cpu::run_local;
use mtrain_comm::DeviceMesh;
use mtrain_model::init::param_specs;
use mtrain_model::source::Piece;
use mtrain_model::{init_weights, GptConfig, SeededInit};
use mtrain_parallel::fsdp::ZeroStage;
use mtrain_parallel::mixed_precision::MixedPrecision;
use mtrain_parallel::parallelize::{parallelize, ParallelPlan};
use mtrain_parallel::pipeline::ScheduleKind;

use common::{plan, tiny_gpt, with_moe, zero};

const SEED: u64 = 11;
const BATCH: usize = 8;

/// A rank's elements of `t` flattened, as f32 bit patterns.
fn bits(t: &Tensor) -> Vec<u32> {
    let v = t.to_dtype(DType::F32).and_then(|t| t.flatten_all());
    let v = v.and_then(|t| t.to_vec1::<f32>()).expect("values");
    v.into_iter().map(f32::to_bits).collect()
}

/// Builds `plan` on every rank from the seeded source and checks each rank's pieces against
/// the one-device initialisation; then checks that all ranks' pieces cover every element.
fn check_init_equals_one_device(cfg: &GptConfig, plan: &ParallelPlan) {
    let world = plan.dims.world_size();
    let plan = &plan.validate(cfg, world, BATCH).expect("plan validates");
    let want = init_weights(cfg, SEED).expect("init");
    let dtype = match plan.precision.is_mixed() {
        true => plan.precision.param_dtype,
        false => DType::F32,
    };
    let per_rank: Vec<Vec<Piece>> = run_local(world, Duration::from_secs(120), |backend| {
        let mesh = DeviceMesh::new(&backend, plan.dims).expect("mesh");
        let source = SeededInit::new(cfg, SEED).expect("source");
        let model = parallelize(cfg, &source, plan, &mesh, &Device::Cpu).expect("parallelize");
        let local = model.local_weights();
        let pieces = model.pieces();
        for p in &pieces {
            let t = local
                .get(&p.local)
                .unwrap_or_else(|| panic!("no local `{}`", p.local));
            let got = t.flatten_all().and_then(|t| t.narrow(0, p.offset, p.len()));
            let full = want[&p.name].flatten_all().expect("flat");
            let runs = p.runs.iter().map(|r| full.narrow(0, r.start, r.len()));
            let runs = runs.collect::<candle_core::Result<Vec<_>>>().expect("runs");
            let expect = Tensor::cat(&runs, 0)
                .and_then(|t| t.to_dtype(dtype))
                .expect("cat");
            assert!(
                bits(&got.expect("local piece")) == bits(&expect),
                "rank {}: `{}` at {:?} (in `{}` from {}) differs from one device",
                mesh.rank(),
                p.name,
                p.runs,
                p.local,
                p.offset
            );
        }
        if plan.precision.is_mixed() {
            for (name, t) in model.full_state().expect("full state") {
                assert!(bits(&t) == bits(&want[&name]), "master `{name}` differs");
            }
        }
        pieces
    });
    for (name, shape, _) in param_specs(cfg) {
        let mut covered = vec![false; shape.iter().product()];
        for p in per_rank.iter().flatten().filter(|p| p.name == name) {
            assert_eq!(p.full_shape, shape, "`{name}`'s full shape");
            for r in &p.runs {
                covered[r.clone()].iter_mut().for_each(|c| *c = true);
            }
        }
        let missing = covered.iter().filter(|c| !**c).count();
        assert_eq!(missing, 0, "`{name}`: {missing} elements held by no rank");
    }
}

fn cfg() -> GptConfig {
    tiny_gpt(4, 4, 32)
}

#[test]
fn ddp_and_zero_start_from_one_device() {
    check_init_equals_one_device(&cfg(), &plan(2, 1, 1, 1));
    for stage in [ZeroStage::One, ZeroStage::Two, ZeroStage::Three] {
        let p = ParallelPlan {
            data: zero(stage),
            ..plan(4, 1, 1, 1)
        };
        check_init_equals_one_device(&cfg(), &p);
    }
}

#[test]
fn tp_and_sequence_parallel_start_from_one_device() {
    check_init_equals_one_device(&cfg(), &plan(1, 1, 2, 1));
    let sp = ParallelPlan {
        sequence_parallel: true,
        ..plan(1, 1, 4, 1)
    };
    check_init_equals_one_device(&cfg(), &sp);
}

#[test]
fn pipelines_start_from_one_device() {
    check_init_equals_one_device(&cfg(), &plan(1, 2, 1, 1));
    let interleaved = ParallelPlan {
        schedule: ScheduleKind::Interleaved1F1B { virtual_stages: 2 },
        ..plan(1, 2, 1, 1)
    };
    check_init_equals_one_device(&cfg(), &interleaved);
    let v = ParallelPlan {
        schedule: ScheduleKind::ZeroBubbleV,
        microbatches: 4,
        data: zero(ZeroStage::Three),
        ..plan(2, 2, 1, 1)
    };
    check_init_equals_one_device(&cfg(), &v);
}

#[test]
fn experts_start_from_one_device() {
    check_init_equals_one_device(&with_moe(cfg()), &plan(2, 1, 1, 2));
    check_init_equals_one_device(&with_moe(cfg()), &plan(4, 1, 1, 2));
}

#[test]
fn compositions_start_from_one_device() {
    check_init_equals_one_device(&cfg(), &plan(2, 2, 2, 1));
    let zero3 = ParallelPlan {
        data: zero(ZeroStage::Three),
        sequence_parallel: true,
        ..plan(2, 2, 2, 1)
    };
    check_init_equals_one_device(&cfg(), &zero3);
}

#[test]
fn mixed_precision_pieces_and_masters_start_from_one_device() {
    for data in [plan(2, 1, 1, 1).data, zero(ZeroStage::Three)] {
        let p = ParallelPlan {
            data,
            precision: MixedPrecision::bf16(DType::F32),
            ..plan(2, 1, 2, 1)
        };
        check_init_equals_one_device(&cfg(), &p);
    }
}
