//! α-β fits, tables and `plan --compare`.
//!
//! - `fit_recovers_alpha_and_beta`: points generated from known α, β by the model's own step
//!   counts give them back (rel ≤ 1e-9), for every op kind bench-comm measures.
//! - `table_round_trips_and_falls_back`: a saved table loads equal; an unfitted op uses the
//!   default, a fitted op at another size uses the nearest fit.
//! - `compare_finds_no_byte_difference_on_a_real_trace`: a tp 2 × dp 2 layout runs one step on
//!   threads with tracing, writes `trace-rank*.jsonl` through the trainer's writer, and the
//!   comparison flags no byte difference on any rank.

use candle_core::{DType, Device, Tensor};
use mtrain_comm::cpu::{run_local_with, CpuOptions};
use mtrain_comm::{DeviceMesh, MeshDims, OpKind};
use mtrain_model::optim::{AdamW, AdamWConfig};
use mtrain_model::{init_weights, GptConfig};
use mtrain_parallel::analysis::comm_cost::{CostModel, StepShape};
use mtrain_parallel::parallelize::{parallelize, ParallelPlan};
use mtrain_trainer::tools::cost::{compare, fit_alpha_beta, plan_section, AlphaBetaTable, Fit};
use mtrain_trainer::trace::write_rank_trace;

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

#[test]
fn fit_recovers_alpha_and_beta() {
    let truth = CostModel {
        alpha_s: 40e-6,
        beta_bytes_per_s: 2.5e9,
    };
    for op in [
        OpKind::AllReduce,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::AllToAll,
        OpKind::Broadcast,
        OpKind::Send,
    ] {
        for n in [2usize, 4] {
            let points: Vec<(f64, f64)> = (10..24)
                .map(|k| {
                    let s = (1u64 << k) as f64;
                    // bench-comm's all-gather size is the output; the model takes one shard.
                    let input = if op == OpKind::AllGather {
                        s / n as f64
                    } else {
                        s
                    };
                    (s, truth.time(op, n, input as u64).total_s())
                })
                .collect();
            let fit = fit_alpha_beta(op, n, &points).expect("fit");
            assert!(
                rel(fit.alpha_s, truth.alpha_s) < 1e-6,
                "{op} n={n}: {fit:?}"
            );
            assert!(
                rel(fit.beta_bytes_per_s, truth.beta_bytes_per_s) < 1e-6,
                "{op} n={n}: {fit:?}"
            );
            assert!(fit.r2 > 0.999_999);
        }
    }
    let e = fit_alpha_beta(OpKind::AllReduce, 2, &[(8.0, 1e-3)]).unwrap_err();
    assert!(e.to_string().contains("at least 2 sizes"), "{e}");
}

#[test]
fn table_round_trips_and_falls_back() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("m.toml");
    let mut t = AlphaBetaTable::cpu_default();
    t.upsert(Fit {
        op: "all_reduce".into(),
        ranks: 2,
        alpha_s: 1e-4,
        beta_bytes_per_s: 1e9,
        r2: 0.99,
        points: 10,
        command: "mtrain bench-comm --fit".into(),
    });
    t.save(&path).expect("save");
    let back = AlphaBetaTable::load(&path).expect("load");
    assert_eq!(back, t);
    assert_eq!(back.model(OpKind::AllReduce, 4).alpha_s, 1e-4); // nearest fit
    assert_eq!(
        back.model(OpKind::AllGather, 2),
        CostModel::CPU_LOOPBACK_DEFAULT
    );
    std::fs::write(&path, "backend = 3").expect("write");
    let e = AlphaBetaTable::load(&path).unwrap_err();
    assert!(e.to_string().contains("m.toml"), "{e}");
}

fn cfg() -> GptConfig {
    GptConfig {
        vocab_size: 64,
        block_size: 16,
        n_layer: 2,
        n_head: 4,
        n_embd: 32,
        moe: None,
    }
}

#[test]
fn compare_finds_no_byte_difference_on_a_real_trace() {
    let cfg = cfg();
    let (batch, seq) = (4, 8);
    let plan = ParallelPlan::new(MeshDims::new(2, 1, 2, 1))
        .validate(&cfg, 4, batch)
        .expect("plan validates");
    let dir = tempfile::tempdir().expect("tmp");
    let run_dir = dir.path().to_path_buf();
    let opts = CpuOptions {
        trace: true,
        ..CpuOptions::default()
    };
    run_local_with(4, opts, |backend| {
        let mesh = DeviceMesh::new(&backend, plan.dims).expect("mesh");
        let weights = init_weights(&cfg, 3).expect("init");
        let mut model = parallelize(&cfg, &weights, &plan, &mesh, &Device::Cpu).expect("model");
        let groups = [
            mesh.world.clone(),
            mesh.tp.clone(),
            mesh.pp.clone(),
            mesh.dp.clone(),
            mesh.ep.clone(),
            mesh.edp.clone(),
        ];
        for g in &groups {
            g.tracer().clear();
        }
        let b = batch / plan.dims.dp;
        let ids: Vec<u32> = (0..b * seq)
            .map(|i| ((i * 7 + mesh.coords.dp * 3) % cfg.vocab_size) as u32)
            .collect();
        let idx = Tensor::from_vec(ids.clone(), (b, seq), &Device::Cpu).expect("idx");
        let tgt = Tensor::from_vec(
            ids.iter().map(|v| (v + 1) % 64).collect::<Vec<u32>>(),
            (b, seq),
            &Device::Cpu,
        )
        .expect("tgt");
        let mut opt = AdamW::new(AdamWConfig::default());
        model.forward_backward(&idx, &tgt, 1.0, true).expect("fb");
        model.optimizer_step(&mut opt, 1e-3, None).expect("step");
        write_rank_trace(&run_dir, mesh.rank(), &groups, None).expect("trace");
    });
    let shape = StepShape {
        batch,
        seq_len: seq,
        dtype: DType::F32,
    };
    let table = AlphaBetaTable::cpu_default();
    let out = compare(&run_dir, &cfg, &plan, shape, 1, &table).expect("compare");
    println!("{out}");
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with(char::is_numeric))
        .collect();
    // 4 ranks × (tp all_reduce, dp all_reduce, world all_reduce).
    assert_eq!(rows.len(), 12, "{out}");
    for r in &rows {
        assert!(!r.contains("bytes >2x"), "byte difference: {r}");
        assert!(
            !r.contains("not traced") && !r.contains("not predicted"),
            "{r}"
        );
    }
    let section = plan_section(&cfg, &plan, shape, 1, &table).expect("section");
    assert!(section.contains("block output (g)"), "{section}");
    assert!(section.contains("default (not measured)"), "{section}");
    let empty = tempfile::tempdir().expect("tmp");
    let e = compare(empty.path(), &cfg, &plan, shape, 1, &table).unwrap_err();
    assert!(e.to_string().contains("--trace"), "{e}");
}

#[test]
fn shipped_tables_parse() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/alpha-beta");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("configs/alpha-beta") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            let t = AlphaBetaTable::load(&path).expect("table parses");
            assert!(
                t.default.alpha_s > 0.0 && t.default.beta_bytes_per_s > 0.0,
                "{path:?}"
            );
            n += 1;
        }
    }
    assert!(n >= 2, "expected the CPU and NVLink tables in {dir:?}");
}
