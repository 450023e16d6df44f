//! `mtrain plan` on a cluster: the 70B-class preset planned without building it, its groups'
//! link classes and memory arithmetic, and `--search`'s ranked layouts with tp across nodes
//! flagged.

use clap::Parser;
use mtrain_trainer::cli::Cli;
use mtrain_trainer::config::TrainConfig;
use mtrain_trainer::resolve::check_plan;
use mtrain_trainer::tools::plan::machine::{ClusterArgs, Machine};
use mtrain_trainer::tools::plan::search::{render, search};

fn config(name: &str) -> String {
    format!("{}/../../configs/{name}.toml", env!("CARGO_MANIFEST_DIR"))
}

fn h100s(gpus: usize) -> Machine {
    let args = ClusterArgs {
        gpus: Some(gpus),
        gpus_per_node: Some(8),
        gpu: Some("h100-sxm".into()),
        ..ClusterArgs::default()
    };
    args.machine(gpus).unwrap()
}

/// `mtrain plan` resolves the 70B preset on 64 GPUs without building it or asking this
/// machine's memory; training the same command line is refused for this machine's memory
/// where it has less than the model's fp32 weights (4 x 64.9e9 bytes).
#[test]
fn the_70b_preset_plans_anywhere_and_training_still_refuses_it() {
    let path = config("gpt-70b");
    let argv = |plan: bool| {
        let mut v = vec!["mtrain"];
        if plan {
            v.extend(["plan", "--gpus", "64", "--gpus-per-node", "8"]);
        } else {
            v.extend([
                "--nnodes",
                "8",
                "--nproc-per-node",
                "8",
                "--master-port",
                "29500",
            ]);
        }
        v.extend(["--config", path.as_str(), "--tp", "8", "--pp", "4"]);
        v.extend(["--batch-size", "8", "--microbatches", "8"]);
        Cli::try_parse_from(v).unwrap()
    };
    let cli = argv(true).with_cluster_world().unwrap();
    let r = mtrain_trainer::resolve::resolve(&cli, None).unwrap();
    assert_eq!((r.layout.world_size, r.run.plan.dims.dp), (64, 2));
    let model = r.run.cfg().gpt_config().unwrap();
    assert_eq!(model.n_params(), 64_878_690_304);
    if mtrain_trainer::validate::host_memory_bytes().is_some_and(|m| m < 4 * 64_878_690_304) {
        let e = mtrain_trainer::resolve::resolve(&argv(false), None).unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("fp32 weights") && e.contains("this machine has"),
            "{e}"
        );
    }
    // The plan's cluster section: groups with their link classes, the arithmetic, peaks.
    let machine = h100s(64);
    let ranks = mtrain_trainer::tools::plan::rank_memory(r.run.cfg(), &r.run.plan).unwrap();
    let text = mtrain_trainer::tools::plan::render_cluster(
        r.run.cfg(),
        &r.run.plan,
        &machine,
        &ranks,
        None,
    )
    .unwrap();
    for want in [
        "tp    groups of   8: intra-node",
        "pp    groups of   4: inter-node: 4 nodes, 1 rank(s) of a group per node",
        "dp    groups of   2: inter-node: 2 nodes",
        "16 x 64.88e9 parameters = 1038 GB; at least 13 cards of 80 GB",
        "pp rank 3: peak",
        "predicted step:",
    ] {
        assert!(text.contains(want), "{want}\n{text}");
    }
    assert!(!text.contains("warning: tp"), "{text}");
}

/// The search of the 70B preset on 64 H100s (8 per node) for 1024 sequences: at least five
/// fitting layouts, fastest first, each within memory; the fitting tp 16 layouts (two
/// nodes) are flagged, and the plan of one warns with both figures.
#[test]
fn the_70b_search_ranks_fitting_layouts_and_flags_tp_across_nodes() {
    let path = config("gpt-70b");
    let text = std::fs::read_to_string(&path).unwrap();
    let cfg = TrainConfig::from_toml_str(&text, &path).unwrap();
    let machine = h100s(64);
    let (found, tried) = search(&cfg, &machine, 1024, &check_plan).unwrap();
    assert!(
        found.len() >= 5 && tried > found.len(),
        "{} of {tried}",
        found.len()
    );
    for w in found.windows(2) {
        assert!(w[0].prediction.step_s <= w[1].prediction.step_s);
    }
    for f in &found {
        assert!(f.peak_bytes as f64 <= 0.95 * 80e9, "{:?}", f.dims);
        assert_eq!(f.dims.world_size(), 64);
        assert_eq!(f.tp_crosses, f.dims.tp > 8, "{:?}", f.dims);
    }
    let best = &found[0];
    assert!(best.dims.tp <= 8, "{:?}", best.dims);
    let listing = render(&found, tried, 10, &machine, "configs/gpt-70b.toml");
    assert!(listing.contains("FLAGGED: tp spans nodes"), "{listing}");
    assert!(
        listing.contains("launch the fastest: mtrain --config configs/gpt-70b.toml --nnodes 8 --nproc-per-node 8"),
        "{listing}"
    );
    let tp16 = found
        .iter()
        .find(|f| f.dims.tp == 16)
        .expect("a tp 16 layout fits");
    let w = machine.tp_warning(tp16.dims, 64 << 20).unwrap();
    assert!(
        w.starts_with("warning: tp 16 spans 2 nodes of 8 GPUs"),
        "{w}"
    );
    assert!(
        w.contains("across nodes against") && w.contains("inside one node"),
        "{w}"
    );
}
