//! Two calculations `mtrain plan` prints by themselves: one collective priced on a named link
//! (`mtrain plan --collective all-reduce --bytes 128M --ranks 8 --intra nvlink4`), and the
//! model-state arithmetic of the 16-bytes-per-parameter rule (16Φ → bytes → cards).
//!
//! The worked example they reproduce (hidden 8192, bf16, 8 H100s, NVLink at about 400 GB/s per
//! direction and 10-20 µs of fixed latency per all-reduce): a decode step's all-reduce of one
//! token (8192 · 2 B = 16 KiB) is latency-bound at about the fixed latency; a prefill of 8192
//! tokens (128 MiB) sends 2·7/8 · 128 MiB = 224 MiB per rank, bandwidth-bound at about 0.56 ms.

use clap::Args;
use mtrain_comm::OpKind;
use mtrain_parallel::analysis::comm_cost::{human_bytes, human_time, CostModel};

use super::machine::{ClusterArgs, LinkSpec};
use crate::tools::bench_comm::{op_kind, parse_size, BenchOp};

/// The flags of one collective's price.
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "One collective")]
pub struct CollectiveArgs {
    /// Price one collective instead of a layout: its kind.
    #[arg(long, value_enum, value_name = "OP")]
    pub collective: Option<BenchOp>,

    /// Message size of --collective (each rank's tensor; for all-gather its shard): 16K, 128M, 1G (powers of 1024).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub bytes: Option<u64>,

    /// Ranks of --collective (default 8); more than --gpus-per-node runs across nodes.
    #[arg(long, value_name = "N")]
    pub ranks: Option<usize>,

    /// The collective's whole fixed latency (µs), spread over its algorithm steps (an 8-rank
    /// ring all-reduce has 14): over the link's α.
    #[arg(long, value_name = "US")]
    pub latency_us: Option<f64>,

    /// Bandwidth per rank and direction (GB/s, decimal), over the link's β.
    #[arg(long, value_name = "GB_S")]
    pub bandwidth_gb_s: Option<f64>,
}

/// One collective's price, as `plan --collective` prints it.
pub fn price(
    op: OpKind,
    n: usize,
    bytes: u64,
    model: CostModel,
    link: &str,
) -> (mtrain_parallel::analysis::comm_cost::OpTime, String) {
    let t = model.time(op, n, bytes);
    let (steps, step_bytes) =
        mtrain_parallel::analysis::comm_cost::algorithm_steps(op, n, bytes as f64);
    let text = format!(
        "{op} of {} over {n} ranks on {link} (α {} per step, β {:.1} GB/s): {steps} steps of {}, each rank sends {}; latency {} + transfer {} = {}, {}-bound\n",
        human_bytes(bytes),
        human_time(model.alpha_s),
        model.beta_bytes_per_s / 1e9,
        human_bytes(step_bytes as u64),
        human_bytes((steps as f64 * step_bytes) as u64),
        human_time(t.latency_s),
        human_time(t.bandwidth_s),
        human_time(t.total_s()),
        t.bound()
    );
    (t, text)
}

/// `mtrain plan --collective`: the collective of `args` on the cluster's links (inside one node
/// when the ranks fit in one, else across), α and β overridden by the flags.
pub fn run(args: &CollectiveArgs, cluster: &ClusterArgs) -> anyhow::Result<String> {
    let kind = args
        .collective
        .ok_or_else(|| anyhow::anyhow!("--collective names the op to price"))?;
    let bytes = args
        .bytes
        .ok_or_else(|| anyhow::anyhow!("--collective needs --bytes SIZE (e.g. 128M)"))?;
    let n = args.ranks.unwrap_or(8);
    let max = crate::launch::MAX_WORLD;
    if n == 0 || n > max {
        anyhow::bail!("--ranks {n} must be between 1 and the largest supported world of {max}");
    }
    let machine = cluster.machine(n.max(cluster.gpus.unwrap_or(n)))?;
    let op = op_kind(kind);
    let dims = mtrain_comm::MeshDims::new(n, 1, 1, 1);
    let mut model = machine.model(dims, mtrain_parallel::analysis::comm_cost::Group::Dp, op, n);
    let across = machine
        .span(dims, mtrain_parallel::analysis::comm_cost::Group::Dp)
        .crosses();
    let mut link = match (&machine.intra, &machine.inter, across) {
        (LinkSpec::Preset(l), _, false) => l.name.to_string(),
        (_, LinkSpec::Preset(l), true) => format!("{} across nodes", l.name),
        (_, _, true) => "the inter-node table".into(),
        (_, _, false) => "the intra-node table".into(),
    };
    if let Some(us) = args.latency_us {
        crate::validate::non_negative("--latency-us", us).map_err(anyhow::Error::msg)?;
        let steps = mtrain_parallel::analysis::comm_cost::algorithm_steps(op, n, bytes as f64).0;
        model.alpha_s = us * 1e-6 / steps.max(1) as f64;
        link = format!("{link}, {us} µs fixed latency");
    }
    if let Some(gb) = args.bandwidth_gb_s {
        crate::validate::positive("--bandwidth-gb-s", gb).map_err(anyhow::Error::msg)?;
        model.beta_bytes_per_s = gb * 1e9;
        link = format!("{link}, {gb} GB/s");
    }
    Ok(price(op, n, bytes, model, &link).1)
}

/// The 16-bytes-per-parameter rule for `n_params` parameters on cards of `card_bytes`: the
/// model state's bytes and the fewest cards that hold it (before activations).
pub fn model_state_cards(n_params: u64, card_bytes: u64) -> (u64, u64) {
    let bytes = 16 * n_params;
    (bytes, bytes.div_ceil(card_bytes.max(1)))
}

/// The arithmetic as `plan` prints it: `16 B x 64.88e9 parameters = 1,038 GB of model state ...`.
pub fn render_model_state(n_params: u64, card_bytes: u64) -> String {
    let (bytes, cards) = model_state_cards(n_params, card_bytes);
    format!(
        "model state (16 bytes per parameter: bf16 weights 2 + gradients 2, fp32 masters 4 + Adam moments 8): 16 x {:.2}e9 parameters = {:.0} GB; at least {cards} cards of {:.0} GB hold it, before activations\n",
        n_params as f64 / 1e9,
        bytes as f64 / 1e9,
        card_bytes as f64 / 1e9
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use mtrain_parallel::analysis::comm_cost::Bound;

    /// The seed's worked example with its own constants: 8 H100s, 400 GB/s, 10-20 µs per
    /// all-reduce. Decode (16 KiB) is latency-bound at about the fixed latency; prefill (128 MiB)
    /// bandwidth-bound: 2·7/8 · 128 MiB / 400 GB/s = 0.587 ms of transfer, 0.60 ms with 15 µs of
    /// latency (the seed's "224 MB / 400 GB/s ≈ 0.56 ms" reads MB and GB alike, both binary:
    /// at 400 GiB/s the same formula gives 0.547 + 0.015 = 0.562 ms).
    #[test]
    fn the_seed_worked_example_with_its_own_constants() {
        let hidden = 8192u64;
        let (decode, prefill) = (hidden * 2, 8192 * hidden * 2);
        assert_eq!((decode, prefill), (16 << 10, 128 << 20));
        for latency_us in [10.0, 15.0, 20.0] {
            let model = CostModel {
                alpha_s: latency_us * 1e-6 / 14.0,
                beta_bytes_per_s: 400e9,
            };
            let (d, text) = price(OpKind::AllReduce, 8, decode, model, "seed NVLink");
            assert_eq!(d.bound(), Bound::Latency, "{text}");
            assert!((d.latency_s - latency_us * 1e-6).abs() < 1e-12);
            assert!(d.bandwidth_s < 0.1e-6, "{text}"); // 1.75 · 16 KiB / 400 GB/s = 0.07 µs
            let (p, text) = price(OpKind::AllReduce, 8, prefill, model, "seed NVLink");
            assert_eq!(p.bound(), Bound::Bandwidth, "{text}");
            assert!((p.bandwidth_s - 1.75 * prefill as f64 / 400e9).abs() < 1e-12);
            assert!((p.bandwidth_s * 1e3 - 0.587).abs() < 0.001, "{text}");
            assert!(text.contains("each rank sends 224.0 MiB"), "{text}");
        }
        let gib = CostModel {
            alpha_s: 15e-6 / 14.0,
            beta_bytes_per_s: 400.0 * (1u64 << 30) as f64,
        };
        let (p, _) = price(OpKind::AllReduce, 8, prefill, gib, "seed NVLink, GiB/s");
        assert!((p.total_s() * 1e3 - 0.562).abs() < 0.001, "{p:?}");
        // The nvlink4 preset is these constants: 1 µs per step, 14 µs per 8-rank all-reduce.
        let nv = mtrain_parallel::analysis::cluster::Link::preset("nvlink4").unwrap();
        let (p, text) = price(OpKind::AllReduce, 8, prefill, nv.model, nv.name);
        assert!(
            text.starts_with("all_reduce of 128.0 MiB over 8 ranks on nvlink4"),
            "{text}"
        );
        assert!(
            text.contains("latency 14.0 µs + transfer 587.2 µs = 601.2 µs, bandwidth-bound"),
            "{text}"
        );
        assert!((p.total_s() - 601.2e-6).abs() < 0.1e-6);
    }

    /// 70B x 16 bytes = 1,120 GB → 14 cards of 80 GB (the seed's arithmetic); the 70B-class
    /// preset's 64.88B parameters → 1,038 GB → 13 cards.
    #[test]
    fn the_seventy_billion_memory_arithmetic() {
        let card = 80_000_000_000;
        assert_eq!(
            model_state_cards(70_000_000_000, card),
            (1_120_000_000_000, 14)
        );
        let text = render_model_state(70_000_000_000, card);
        assert!(
            text.contains("16 x 70.00e9 parameters = 1120 GB; at least 14 cards of 80 GB"),
            "{text}"
        );
        let preset = mtrain_model::GptConfig {
            vocab_size: 50304,
            block_size: 4096,
            n_layer: 80,
            n_head: 64,
            n_embd: 8192,
            moe: None,
        };
        let n = preset.n_params() as u64;
        assert_eq!(n, 64_878_690_304);
        assert_eq!(model_state_cards(n, card), (16 * n, 13));
    }
}
