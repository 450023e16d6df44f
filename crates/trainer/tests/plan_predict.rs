//! The step `mtrain plan` predicts from measured passes, against its model's closed forms: each
//! pipeline stage's share of the FLOPs (the head on the last stage), the busiest rank's compute,
//! and on a CPU node every collective exposed and, with more ranks than cores, the node's work
//! spread over its cores. `scripts/check-plan.sh` holds the same predictions against runs.

use clap::Parser;
use mtrain_parallel::analysis::comm_cost::Group;
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
    tp_whole: 0.0,
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

/// A tp rank runs the measured passes' tp-split part at 1/tp and their whole part (LayerNorms,
/// residual adds: `--tp-whole`) in full; sequence parallelism splits that part too.
#[test]
fn a_tp_rank_runs_the_work_tp_leaves_whole_in_full() {
    let args = ["--tp", "2", "--pp", "2", "--microbatches", "2"];
    let (cfg, plan) = resolved("4", &args);
    let model = cfg.gpt_config().unwrap();
    let w = stage_shares(&model, &plan.stage_layout(model.n_layer).unwrap(), cfg.seq_len);
    let with = |whole: f64, plan: &ValidPlan| {
        let m = Measured { tp_whole: whole, ..PASSES };
        predict(&cfg, plan, &node(4, None), Some(m)).unwrap().compute_s
    };
    // The busiest rank holds the last stage: 2 micro-batches of its share of f + b, of which
    // a fifth is run whole and four fifths halved: 0.2 + 0.8 / 2 = 0.6 of it.
    let busiest = 2.0 * 0.035 * w[1];
    assert!(close(with(0.0, &plan), busiest * 0.5), "{}", with(0.0, &plan));
    assert!(close(with(0.2, &plan), busiest * 0.6), "{}", with(0.2, &plan));
    assert!(close(with(1.0, &plan), busiest), "{}", with(1.0, &plan));
    // The whole part costs step time too, beyond the compute line.
    let step = |whole: f64| {
        let m = Measured { tp_whole: whole, ..PASSES };
        predict(&cfg, &plan, &node(4, None), Some(m)).unwrap().step_s
    };
    assert!(step(0.2) > step(0.0) + 2.0 * 0.035 * w[1] * 0.1 * 0.99, "{} {}", step(0.2), step(0.0));
    // Sequence parallelism: each rank normalises 1/tp of the sequence, so all of it is halved.
    let mut sp = args.to_vec();
    sp.push("--sequence-parallel");
    let (_, sp_plan) = resolved("4", &sp);
    assert!(sp_plan.sequence_parallel);
    assert!(close(with(0.2, &sp_plan), busiest * 0.5), "{}", with(0.2, &sp_plan));
}

#[test]
fn ranks_sharing_cores_wait_for_them_and_hide_nothing() {
    let (cfg, plan) = resolved("4", &["--dp", "4", "--fsdp"]);
    let own = predict(&cfg, &plan, &node(4, None), Some(PASSES)).unwrap();
    let four = predict(&cfg, &plan, &node(4, Some(4)), Some(PASSES)).unwrap();
    let two = predict(&cfg, &plan, &node(4, Some(2)), Some(PASSES)).unwrap();
    let comm: f64 = two.groups.iter().map(|g| g.total_s).sum();
    // As many cores as ranks: each rank computes as on its own device, but ZeRO's gathers and
    // reduce-scatters, work of the same cores, hide behind nothing.
    assert!(close(four.compute_s, own.compute_s), "{four:?}");
    assert!(comm > 0.0 && exposed_all(&four), "{four:?}");
    assert!(close(four.step_s, 0.035 + comm), "{four:?}");
    // Four ranks on two cores: each rank's passes take twice as long as well.
    assert!(exposed_all(&two), "{two:?}");
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

/// The cp ring (tiny GPT: B = 16 sequences of T = 64, width 64, 4 blocks, f32; cp 2 on
/// NVLink 4): a pass carries 2·16·32·64·4 B = 256 KiB, α + S/β = 1 µs + 0.65536 µs; per block
/// and micro-step one K, V pass forward, one K, V and one dK, dV pass backward, one last dK, dV
/// pass home: 16 passes, 26.486 µs. Behind passes of a second each, the attention beside a
/// pass (milliseconds) hides it, all but the 4 last passes (6.621 µs); behind nanosecond
/// passes nothing is hidden.
#[test]
fn the_cp_ring_hides_behind_attention_but_its_last_pass() {
    let (cfg, plan) = resolved("2", &["--cp", "2"]);
    assert_eq!((cfg.batch_size, cfg.seq_len), (16, 64));
    let pass = 1e-6 + 262_144.0 / 400e9;
    let cp = |p: &Prediction| {
        let g = p.groups.iter().find(|g| g.group == Group::Cp).expect("a cp row");
        (g.total_s, g.exposed_s)
    };
    let slow = Measured {
        forward_s: 1.0,
        backward_s: Some(2.0),
        tp_whole: 0.0,
    };
    let (total, exposed) = cp(&predict(&cfg, &plan, &node(2, None), Some(slow)).unwrap());
    assert!(close(total, 16.0 * pass), "{total}");
    assert!(close(exposed, 4.0 * pass), "{exposed}");
    let fast = Measured {
        forward_s: 1e-9,
        backward_s: Some(2e-9),
        tp_whole: 0.0,
    };
    let p = predict(&cfg, &plan, &node(2, None), Some(fast)).unwrap();
    let (total, exposed) = cp(&p);
    assert!(close(total, 16.0 * pass) && (total - exposed).abs() < 1e-9, "{total} {exposed}");
    // Each rank computes half of the sequence: half of one rank's passes of the micro-batch.
    assert!(close(p.compute_s, 1.5e-9), "{}", p.compute_s);
}

/// The tiny MoE (configs/moe-tiny.toml: 4 layers, width 64, 4 experts, top-2, f32) at dp 2 ×
/// ep 2, 16 sequences of 64 tokens a rank: each token all-to-all carries k·N = 2048 rows of
/// 256 B (balanced routing, under the capacity of 640 an expert), and the expert side gathers
/// them once, reading and writing 512 KiB each; dispatch and combine both ways, 4 layers: 16
/// gathers, 16 MiB a step, at the copy bandwidth. At ep 1 every expert is at home: none.
#[test]
fn expert_parallel_ranks_gather_their_token_rows() {
    let moe = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/moe-tiny.toml");
    let copying = |gb_s: f64| {
        ClusterArgs {
            gpus: Some(2),
            gpus_per_node: Some(2),
            intra: Some("nvlink4".into()),
            copy_gb_s: Some(gb_s),
            ..ClusterArgs::default()
        }
        .machine(2)
        .unwrap()
    };
    let at = |args: &[&str], gb_s: f64| {
        let mut v = vec!["--config", moe, "--dp", "2"];
        v.extend(args);
        let (cfg, plan) = resolved("2", &v);
        predict(&cfg, &plan, &copying(gb_s), Some(PASSES)).unwrap()
    };
    let ep = ["--ep", "2"];
    let p = at(&ep, 10.0);
    let bytes = 16.0 * 2.0 * (2048.0 * 64.0 * 4.0);
    assert!(close(p.permute_s, bytes / 10e9), "{}", p.permute_s);
    // In the passes: half the bandwidth, the step longer by the permutations once more.
    let slow = at(&ep, 5.0);
    assert!(close(slow.step_s - p.step_s, p.permute_s), "{} {}", slow.step_s, p.step_s);
    assert!(close(slow.compute_s - p.compute_s, p.permute_s));
    // The rows are k·N of width C: each of top-k, tokens and width halves them.
    for fewer in [
        &["--set", "model.moe.top_k=1"][..],
        &["--batch-size", "8"],
        &["--set", "model.n_embd=32"],
    ] {
        let mut args = ep.to_vec();
        args.extend(fewer);
        let half = at(&args, 10.0).permute_s;
        assert!(close(half, p.permute_s / 2.0), "{fewer:?}: {half}");
    }
    // Every expert on every rank: no exchange, nothing to gather, whatever the bandwidth.
    let home = at(&[], 10.0);
    assert_eq!(home.permute_s, 0.0);
    assert_eq!(home, at(&[], 5.0));
}
