//! The cluster `mtrain plan` prices a layout on: the flags (`--gpus 64 --gpus-per-node 8 --gpu
//! h100-sxm --intra nvlink4 --inter ib-ndr`), the [`Machine`] they describe, and the price of
//! each process group on the link it spans ([`mtrain_parallel::analysis::cluster`]).
//!
//! A link is a preset name (`nvlink4`, `nvlink3`, `pcie4`, `pcie5`, `ib-ndr`, `ib-hdr`, `roce`)
//! or the path of an α-β table written by `bench-comm --fit` on the user's machine.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Args;
use mtrain_comm::{MeshDims, OpKind};
use mtrain_parallel::analysis::cluster::{group_model, span, Gpu, Link, Span};
use mtrain_parallel::analysis::comm_cost::{human_time, CostModel, Group};

use super::compute::{ComputeRule, Shares};
use crate::tools::cost::AlphaBetaTable;

/// The cluster flags of `mtrain plan`.
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Cluster")]
pub struct ClusterArgs {
    /// GPUs of the job (the world size): with --gpus-per-node, the nodes.
    #[arg(long, value_name = "N")]
    pub gpus: Option<usize>,

    /// GPUs in one node (default 8 with --gpus; the node's ranks share its intra link).
    #[arg(long, value_name = "G")]
    pub gpus_per_node: Option<usize>,

    /// GPU kind: h100-sxm (80 GB, 989 TFLOP/s bf16 dense), h200 (141 GB), a100-80gb (80 GB,
    /// 312 TFLOP/s), or custom with --gpu-memory-gb and --gpu-tflops.
    #[arg(long, value_name = "KIND")]
    pub gpu: Option<String>,

    /// Memory of one GPU in GB (decimal), over the kind's.
    #[arg(long, value_name = "GB")]
    pub gpu_memory_gb: Option<f64>,

    /// Dense bf16 TFLOP/s of one GPU, over the kind's.
    #[arg(long, value_name = "TFLOPS")]
    pub gpu_tflops: Option<f64>,

    /// HBM bandwidth of one GPU in TB/s, over the kind's (a custom kind needs it for the
    /// roofline rule; without it, a pass is its FLOPs at half the peak, or at --mfu).
    #[arg(long, value_name = "TBS")]
    pub gpu_hbm_tbs: Option<f64>,

    /// The link inside a node: a preset (nvlink4, nvlink3, pcie4, pcie5) or an α-β table from
    /// `bench-comm --fit` (default: nvlink4, nvlink3 on A100).
    #[arg(long, value_name = "LINK|FILE")]
    pub intra: Option<String>,

    /// The link between nodes, per GPU: a preset (ib-ndr, ib-hdr, roce) or an α-β table
    /// (default: ib-ndr, ib-hdr on A100).
    #[arg(long, value_name = "LINK|FILE")]
    pub inter: Option<String>,

    /// Price every pass as its FLOPs at this fraction of the GPU's peak (the MFU of a layout
    /// with no communication, bubble or recompute) instead of the roofline rule (compute.rs:
    /// matmuls, attention and memory-bound bytes each at the share of its roof they reach).
    #[arg(long, value_name = "F")]
    pub mfu: Option<f64>,

    /// CPU nodes: the cores a node's ranks share. With fewer cores than ranks, the ranks wait
    /// for cores and no collective overlaps compute (predict.rs); default: a device per rank.
    #[arg(long, value_name = "K")]
    pub cores_per_node: Option<usize>,

    /// Bytes a copy on one device reads and writes per second, in GB/s: what the
    /// expert-parallel permutations run at (predict.rs). A `--profile-ops` run measures it
    /// (its `ops.json`'s `roofs.measured.bytes_per_s`); default: the GPU's HBM bandwidth at the
    /// roofline rule's memory-bound share.
    #[arg(long, value_name = "GBS")]
    pub copy_gb_s: Option<f64>,
}

/// One link: a preset, or a fitted α-β table (its op- and size-specific fits).
#[derive(Debug, Clone)]
pub enum LinkSpec {
    Preset(Link),
    Table {
        path: PathBuf,
        table: AlphaBetaTable,
    },
}

impl LinkSpec {
    /// A preset name, else a table file.
    pub fn parse(text: &str) -> anyhow::Result<LinkSpec> {
        if let Some(l) = Link::preset(text) {
            return Ok(LinkSpec::Preset(l));
        }
        let path = PathBuf::from(text);
        if !path.exists() {
            let names: Vec<&str> = Link::PRESETS.iter().map(|l| l.name).collect();
            anyhow::bail!(
                "link `{text}` is neither a preset ({}) nor an α-β table file (write one with `mtrain bench-comm --fit FILE`)",
                names.join(", ")
            );
        }
        let table = AlphaBetaTable::load(&path)?;
        Ok(LinkSpec::Table { path, table })
    }

    /// The α-β of `op` over `n` ranks on this link.
    pub fn model(&self, op: OpKind, n: usize) -> CostModel {
        match self {
            LinkSpec::Preset(l) => l.model,
            LinkSpec::Table { table, .. } => table.model(op, n),
        }
    }

    /// `nvlink4 (α 1.0 µs, β 400 GB/s: source)` or the table's path and source.
    pub fn describe(&self) -> String {
        match self {
            LinkSpec::Preset(l) => format!(
                "{} (α {} per step, β {:.0} GB/s per GPU: {})",
                l.name,
                human_time(l.model.alpha_s),
                l.model.beta_bytes_per_s / 1e9,
                l.source
            ),
            LinkSpec::Table { path, table } => format!(
                "α-β table {} ({}; default α {}, β {:.2} GB/s, {} fits)",
                path.display(),
                table.source,
                human_time(table.default.alpha_s),
                table.default.beta_bytes_per_s / 1e9,
                table.fit.len()
            ),
        }
    }
}

/// The cluster a plan is priced on.
#[derive(Debug, Clone)]
pub struct Machine {
    pub gpu: Gpu,
    pub gpus: usize,
    pub gpus_per_node: usize,
    pub intra: LinkSpec,
    pub inter: LinkSpec,
    /// How a pass no run measured is priced.
    pub compute: ComputeRule,
    /// The cores a node's ranks share (CPU nodes); None: a device per rank.
    pub cores_per_node: Option<usize>,
    /// Bytes read and written per second by a copy on one device; None: not known (a custom
    /// GPU without a bandwidth), and copies are not priced.
    pub copy_bytes_per_s: Option<f64>,
    /// Spans worked out so far (one pass over the ranks each).
    spans: std::cell::RefCell<std::collections::HashMap<(MeshDims, Group), Span>>,
}

impl ClusterArgs {
    /// Whether any flag describes a cluster (else `plan` prices with `--alpha-beta` as before).
    pub fn given(&self) -> bool {
        self.gpus.is_some() || self.gpu.is_some() || self.intra.is_some() || self.inter.is_some()
    }

    /// The machine these flags describe for a job of `world` ranks (`--gpus`, else the layout's).
    pub fn machine(&self, world: usize) -> anyhow::Result<Machine> {
        let gpus = self.gpus.unwrap_or(world);
        let max = crate::launch::MAX_WORLD;
        if gpus > max {
            anyhow::bail!("--gpus {gpus} is above the largest supported world of {max} processes");
        }
        let per_node = self.gpus_per_node.unwrap_or(gpus.min(8));
        if per_node == 0 || gpus == 0 || !gpus.is_multiple_of(per_node) {
            anyhow::bail!(
                "--gpus {gpus} must be a positive multiple of --gpus-per-node {per_node} (whole nodes)"
            );
        }
        let kind = self.gpu.as_deref().unwrap_or("h100-sxm");
        let mut gpu = match (kind, Gpu::preset(kind)) {
            (_, Some(g)) => g,
            ("custom", None) => match (self.gpu_memory_gb, self.gpu_tflops) {
                (Some(gb), Some(tf)) => Gpu::custom("custom", gb, tf),
                _ => anyhow::bail!("--gpu custom needs --gpu-memory-gb and --gpu-tflops"),
            },
            (other, None) => {
                let names: Vec<&str> = Gpu::PRESETS.iter().map(|p| p.name).collect();
                anyhow::bail!(
                    "--gpu {other} is not a known kind: one of {}, or custom with --gpu-memory-gb and --gpu-tflops",
                    names.join(", ")
                )
            }
        };
        for (name, v) in [
            ("--gpu-memory-gb", self.gpu_memory_gb),
            ("--gpu-tflops", self.gpu_tflops),
            ("--gpu-hbm-tbs", self.gpu_hbm_tbs),
            ("--copy-gb-s", self.copy_gb_s),
        ] {
            if let Some(v) = v {
                crate::validate::positive(name, v).map_err(anyhow::Error::msg)?;
            }
        }
        if let Some(gb) = self.gpu_memory_gb {
            gpu.memory_bytes = (gb * 1e9) as u64;
        }
        if let Some(tf) = self.gpu_tflops {
            gpu.peak_flops = tf * 1e12;
        }
        if let Some(tbs) = self.gpu_hbm_tbs {
            gpu.hbm_bytes_per_s = Some(tbs * 1e12);
        }
        let a100 = gpu.name.starts_with("a100");
        let intra = LinkSpec::parse(self.intra.as_deref().unwrap_or(if a100 {
            "nvlink3"
        } else {
            "nvlink4"
        }))?;
        let inter = LinkSpec::parse(self.inter.as_deref().unwrap_or(if a100 {
            "ib-hdr"
        } else {
            "ib-ndr"
        }))?;
        if let Some(mfu) = self.mfu {
            if !(mfu > 0.0 && mfu <= 1.0) {
                anyhow::bail!("--mfu {mfu} must be in (0, 1]: a fraction of the GPU's peak");
            }
        }
        let compute = match (self.mfu, gpu.hbm_bytes_per_s) {
            (Some(mfu), _) => ComputeRule::Flops { mfu },
            (None, Some(hbm)) => ComputeRule::Roofline(Shares::default_on(hbm)),
            (None, None) => ComputeRule::Flops { mfu: 0.5 },
        };
        if self.cores_per_node == Some(0) {
            anyhow::bail!("--cores-per-node 0: a node needs at least one core");
        }
        let copy_bytes_per_s = self.copy_gb_s.map(|g| g * 1e9).or(gpu
            .hbm_bytes_per_s
            .map(|hbm| hbm * Shares::default_on(hbm).hbm));
        Ok(Machine {
            spans: Default::default(),
            cores_per_node: self.cores_per_node,
            copy_bytes_per_s,
            gpu,
            gpus,
            gpus_per_node: per_node,
            intra,
            inter,
            compute,
        })
    }
}

/// The groups a step's collectives run on.
pub const GROUPS: [Group; 8] = Group::ALL;

impl Machine {
    /// Ranks of a job of `world` on one node.
    pub fn ranks_per_node(&self, world: usize) -> usize {
        self.gpus_per_node.min(world).max(1)
    }

    /// The cores of a node whose ranks (of a job of `world`) outnumber them; None where every
    /// rank has its own device or core.
    pub fn shared_cores(&self, world: usize) -> Option<usize> {
        self.cores_per_node
            .filter(|&k| k < self.ranks_per_node(world))
    }

    /// How the groups of `group` lie on this machine's nodes.
    pub fn span(&self, dims: MeshDims, group: Group) -> Span {
        *self
            .spans
            .borrow_mut()
            .entry((dims, group))
            .or_insert_with(|| span(dims, group, self.gpus_per_node))
    }

    /// The α-β of `op` over `n` ranks of a group of `group` under `dims`: the link it spans.
    pub fn model(&self, dims: MeshDims, group: Group, op: OpKind, n: usize) -> CostModel {
        let s = self.span(dims, group);
        group_model(s, self.intra.model(op, n), self.inter.model(op, n))
    }

    /// The same op priced as if the group sat inside one node (the intra link).
    pub fn inside(&self, op: OpKind, n: usize) -> CostModel {
        self.intra.model(op, n)
    }

    /// The cluster section of `plan`: the GPU, the nodes, the links, and every group of `dims`
    /// with the link class it spans; a tp group across nodes is warned about with a
    /// `bytes`-sized all-reduce priced inside one node and across.
    pub fn render(&self, dims: MeshDims, tp_bytes: u64) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "cluster: {} x {} ({:.0} GB, {:.0} TFLOP/s bf16 dense), {} GPUs per node x {} node(s); {}",
            self.gpus,
            self.gpu.name,
            self.gpu.memory_bytes as f64 / 1e9,
            self.gpu.peak_flops / 1e12,
            self.gpus_per_node,
            self.gpus / self.gpus_per_node,
            super::compute::describe(self.compute)
        );
        let _ = writeln!(s, "  intra-node link: {}", self.intra.describe());
        let _ = writeln!(s, "  inter-node link: {}", self.inter.describe());
        for g in GROUPS {
            let sp = self.span(dims, g);
            // dcp is the dp group itself without context parallelism.
            if sp.size <= 1 || (g == Group::Dcp && dims.cp == 1) {
                continue;
            }
            let m = self.model(dims, g, OpKind::AllReduce, sp.size);
            let class = match sp.crosses() {
                false => "intra-node".to_string(),
                true => format!(
                    "inter-node: {} nodes, {} rank(s) of a group per node",
                    sp.nodes, sp.per_node
                ),
            };
            let _ = writeln!(
                s,
                "  {:<5} groups of {:>3}: {class} (α {} per step, β {:.1} GB/s)",
                g.name(),
                sp.size,
                human_time(m.alpha_s),
                m.beta_bytes_per_s / 1e9
            );
        }
        if let Some(w) = self.tp_warning(dims, tp_bytes) {
            s.push_str(&w);
        }
        s
    }

    /// The warning for a tp group that crosses nodes: one all-reduce of `bytes` (a block
    /// output) inside one node's link and across, or `None` when tp stays inside a node.
    pub fn tp_warning(&self, dims: MeshDims, bytes: u64) -> Option<String> {
        let sp = self.span(dims, Group::Tp);
        if !sp.crosses() {
            return None;
        }
        let n = sp.size;
        let inside = self
            .inside(OpKind::AllReduce, n)
            .time(OpKind::AllReduce, n, bytes);
        let across =
            self.model(dims, Group::Tp, OpKind::AllReduce, n)
                .time(OpKind::AllReduce, n, bytes);
        Some(format!(
            "warning: tp {n} spans {} nodes of {} GPUs: its all-reduce of a block output ({}) takes {} across nodes against {} inside one node ({:.1}x); keep tp within --gpus-per-node {}\n",
            sp.nodes,
            self.gpus_per_node,
            mtrain_parallel::analysis::comm_cost::human_bytes(bytes),
            human_time(across.total_s()),
            human_time(inside.total_s()),
            across.total_s() / inside.total_s(),
            self.gpus_per_node
        ))
    }
}
