//! The step `mtrain plan` predicts from measured passes, against its model's closed forms: each
//! pipeline stage's share of the FLOPs (the head on the last stage), the busiest rank's compute,
//! and on a CPU node of more ranks than cores the node's work spread over its cores with every
//! collective exposed. `scripts/check-plan.sh` holds the same predictions against runs.

use clap::Parser;
use mtrain_parallel::parallelize::ValidPlan;
use mtrain_trainer::cli::Cli;
use mtrain_trainer::config::TrainConfig;
use mtrain_trainer::tools::plan::machine::{ClusterArgs, Machine};
use mtrain_trainer::tools::plan::predict::{predict, stage_shares, Measured, Prediction};

/// The config and checked plan of `mtrain plan ARGS` on one node of `world` ranks.
fn resolved(world: &str, args: &[&str]) -> (TrainConfig, ValidPlan) {
    let mut v = vec!["mtrain", "plan", "--gpus", world, "--gpus-per-node", world];
    v.extend(args);
    let cli = Cli::try_parse_from(v)
        .unwrap()
        .with_cluster_world()
        .unwrap();
    let r = mtrain_trainer::resolve::resolve(&cli, None).unwrap();
    (r.run.cfg().clone(), r.run.plan)
}

/// One node of `gpus` ranks over NVLink 4, sharing `cores` cores when given.
fn node(gpus: usize, cores: Option<usize>) -> Machine {
    ClusterArgs {
        gpus: Some(gpus),
        gpus_per_node: Some(gpus),
        intra: Some("nvlink4".into()),
        cores_per_node: cores,
        ..ClusterArgs::default()
    }
    .machine(gpus)
    .unwrap()
}

const PASSES: Measured = Measured {
    forward_s: 0.010,
    backward_s: Some(0.025),
};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1e-3)
}

fn exposed_all(p: &Prediction) -> bool {
    p.groups.iter().all(|g| close(g.exposed_s, g.total_s))
}

#[test]
fn the_last_stage_carries_the_head() {
    let (cfg, plan) = resolved("4", &["--pp", "2", "--dp", "2", "--microbatches", "4"]);
    let model = cfg.gpt_config().unwrap();
    let layout = plan.stage_layout(model.n_layer).unwrap();
    let w = stage_shares(&model, &layout, cfg.seq_len);
    // The tiny GPT: 4 blocks of width 64, vocabulary 256; the head's 6·V·C per token.
    let total = model.flops_per_token(cfg.seq_len);
    let head = 6.0 * 256.0 * 64.0;
    assert!(close(w[0], 2.0 * (total - head) / 4.0 / total), "{w:?}");
    assert!(close(w[1] - w[0], head / total), "{w:?}");
    assert!(close(w.iter().sum::<f64>(), 1.0));
    // On a device per rank the busiest rank is the last stage: 4 micro-batches of its share.
    let p = predict(&cfg, &plan, &node(4, None), Some(PASSES)).unwrap();
    assert!(close(p.compute_s, 4.0 * 0.035 * w[1]), "{}", p.compute_s);
}

#[test]
fn ranks_sharing_cores_wait_for_them_and_hide_nothing() {
    let (cfg, plan) = resolved("4", &["--dp", "4", "--fsdp"]);
    let own = predict(&cfg, &plan, &node(4, None), Some(PASSES)).unwrap();
    let four = predict(&cfg, &plan, &node(4, Some(4)), Some(PASSES)).unwrap();
    let two = predict(&cfg, &plan, &node(4, Some(2)), Some(PASSES)).unwrap();
    // As many cores as ranks: as if each had its own device.
    assert_eq!(own, four);
    // Four ranks on two cores: each rank's passes take twice as long, and ZeRO's gathers and
    // reduce-scatters no longer hide behind them.
    let comm: f64 = two.groups.iter().map(|g| g.total_s).sum();
    assert!(comm > 0.0 && exposed_all(&two), "{two:?}");
    assert!(close(two.step_s, 2.0 * 0.035 + comm), "{two:?}");
    assert!(own.exposed_s() < comm, "{own:?}");
}

#[test]
fn a_shared_node_stretches_the_pipeline_between_its_work_and_half_speed() {
    let (cfg, plan) = resolved("4", &["--pp", "4", "--microbatches", "4"]);
    let model = cfg.gpt_config().unwrap();
    let w = stage_shares(
        &model,
        &plan.stage_layout(model.n_layer).unwrap(),
        cfg.seq_len,
    );
    let own = predict(&cfg, &plan, &node(4, None), Some(PASSES)).unwrap();
    let two = predict(&cfg, &plan, &node(4, Some(2)), Some(PASSES)).unwrap();
    // On its own cores 1F1B takes at least every pass of the slowest stage plus the others'
    // first forward and last backward: (M − 1) · (f + b) · w_3 + (f + b).
    let fb = 0.035;
    assert!(own.step_s >= 3.0 * fb * w[3] + fb, "{own:?}");
    // On two cores the passes share them: never faster than the 4 stages' 4 micro-batches
    // over 2 cores, never slower than every pass at half speed; and the fill and the drain,
    // where fewer than two ranks work, add to the work bound.
    assert!(two.step_s > 4.0 * fb / 2.0 * 1.05, "{two:?}");
    assert!(two.step_s <= 2.0 * own.step_s, "{two:?} {own:?}");
    assert!(two.step_s > own.step_s);
}

/// Interleaved: each chunk is priced at its own share (the simulator is given each model
/// stage's costs), so a rank's chunks add up to its part of the model, not v times it.
#[test]
fn interleaved_chunks_add_up_to_the_ranks_part() {
    let args = [
        "--pp",
        "2",
        "--schedule",
        "interleaved",
        "--microbatches",
        "4",
    ];
    let (cfg, plan) = resolved("2", &args);
    let model = cfg.gpt_config().unwrap();
    let layout = plan.stage_layout(model.n_layer).unwrap();
    let w = stage_shares(&model, &layout, cfg.seq_len);
    assert_eq!(w.len(), 4);
    // Rank 1 holds model stages 1 and 3 (the head's).
    let p = predict(&cfg, &plan, &node(2, None), Some(PASSES)).unwrap();
    assert!(close(p.compute_s, 4.0 * 0.035 * (w[1] + w[3])), "{p:?}");
    assert!(
        p.step_s >= p.compute_s && p.step_s < 2.0 * p.compute_s,
        "{p:?}"
    );
}
