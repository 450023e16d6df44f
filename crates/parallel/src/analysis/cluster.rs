//! The machine a plan is priced on: the GPU kind (memory, bf16 peak; with the rest of its
//! datasheet, the roofline's roofs and memory sizes), GPUs per node, and the
//! link classes inside and between nodes; and which link each process group of a mesh spans.
//!
//! Ranks fill nodes in order (rank r sits on node ⌊r / G⌋, G GPUs per node: the launcher's
//! `node_rank · nproc_per_node + local_rank`), and the mesh puts tp innermost, then cp, then
//! pp, then dp (`mtrain_comm::mesh`), so a group's ranks and the nodes they sit on follow from
//! the dimensions alone (a cp group shares dp, pp and tp; dcp, the gradient average under
//! context parallelism, shares pp and tp):
//!
//! ```text
//!   64 GPUs, 8 per node, tp 8 · pp 4 · dp 2      node 0: ranks 0-7 = one tp group
//!   tp group  [0..7]           1 node             → intra link (NVLink)
//!   pp group  [0, 8, 16, 24]   4 nodes, 1 each    → inter link, one GPU's NIC share
//!   dp group  [0, 32]          2 nodes, 1 each    → inter link, one GPU's NIC share
//!   tp 16:    [0..15]          2 nodes, 8 each    → inter link: flagged
//! ```
//!
//! A group inside one node runs on the intra link. A group across nodes runs its ring over the
//! inter link: each algorithm step pays the inter link's α, and the bytes of a step cross the
//! node boundary through the NICs. Links are given per GPU (a DGX H100 has one 400 Gb/s NIC per
//! GPU); when k ranks of the group share a node, NCCL's rings (one per channel, each on its own
//! NIC) drive the k GPUs' shares of the node's NICs together, so the group's β is k times the
//! per-GPU share, never more than the intra link's:
//!
//! ```text
//!   α_group = max(α_intra, α_inter)          β_group = min(β_intra, k · β_inter)
//! ```
//!
//! Every group of the same kind runs at once (each dp group reduces its gradients at the same
//! time), so the per-GPU share is what each gets: no group borrows another's NICs.

use mtrain_comm::MeshDims;

use super::comm_cost::{CostModel, Group};

/// One GPU kind: its memory and its dense bf16 peak.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpu {
    pub name: String,
    /// Bytes of device memory (decimal, as datasheets state them: 80 GB = 80·10⁹).
    pub memory_bytes: u64,
    /// Dense bf16 matrix-multiply peak, FLOP/s (no sparsity).
    pub peak_flops: f64,
    /// HBM bandwidth, bytes/s, where known (every preset; a custom kind with --gpu-hbm-tbs).
    pub hbm_bytes_per_s: Option<f64>,
}

/// A GPU kind's datasheet figures: the roofs of its roofline and the sizes of its memory
/// hierarchy (decimal units as the datasheets give them; KiB/MiB where the architecture
/// whitepapers do).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuSpec {
    pub name: &'static str,
    /// HBM capacity, GB (10⁹ bytes).
    pub memory_gb: u64,
    /// Dense bf16 tensor-core peak, TFLOP/s (no sparsity).
    pub bf16_tflops: f64,
    /// fp32 peak of the CUDA cores (not TF32 tensor cores), TFLOP/s.
    pub fp32_tflops: f64,
    /// HBM bandwidth, TB/s.
    pub hbm_tb_s: f64,
    /// L2 cache, MB.
    pub l2_mb: f64,
    /// Shared memory per SM at most (the rest of the SM's L1/shared block is L1), KiB.
    pub smem_kib: u64,
    /// Register file per SM, KiB (64 K 32-bit registers).
    pub regs_kib: u64,
    pub sms: u64,
    /// Where the figures come from.
    pub source: &'static str,
}

impl GpuSpec {
    /// The ridge point of the bf16 roofline: FLOPs per byte of HBM traffic at which a kernel
    /// stops being limited by bandwidth (peak / bandwidth).
    pub fn ridge(&self) -> f64 {
        self.bf16_tflops / self.hbm_tb_s
    }
}

impl Gpu {
    /// The presets, one table for the planner (memory, bf16 peak) and the roofline (all of it).
    pub const PRESETS: [GpuSpec; 3] = [
        // H100 datasheet (SXM5): 80 GB HBM3 at 3.35 TB/s, 989 TFLOPS bf16 dense (1,979 with
        // sparsity), 67 TFLOPS fp32; the Hopper architecture whitepaper: 132 SMs, 50 MB L2,
        // 228 KB of shared memory per SM (of 256 KB L1/shared), 256 KB of registers per SM.
        GpuSpec {
            name: "h100-sxm",
            memory_gb: 80,
            bf16_tflops: 989.0,
            fp32_tflops: 67.0,
            hbm_tb_s: 3.35,
            l2_mb: 50.0,
            smem_kib: 228,
            regs_kib: 256,
            sms: 132,
            source: "NVIDIA H100 datasheet (SXM5); NVIDIA H100 Tensor Core GPU Architecture whitepaper",
        },
        // H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, the H100's compute (989 TFLOPS bf16
        // dense, 67 fp32) on the same GH100 die: 132 SMs, 50 MB L2, 228 KB shared per SM.
        GpuSpec {
            name: "h200",
            memory_gb: 141,
            bf16_tflops: 989.0,
            fp32_tflops: 67.0,
            hbm_tb_s: 4.8,
            l2_mb: 50.0,
            smem_kib: 228,
            regs_kib: 256,
            sms: 132,
            source: "NVIDIA H200 datasheet (SXM); the H100 whitepaper for the GH100 die",
        },
        // A100 datasheet (80 GB SXM): HBM2e at 2,039 GB/s, 312 TFLOPS bf16 dense (624 with
        // sparsity), 19.5 TFLOPS fp32; the Ampere whitepaper: 108 SMs, 40 MB L2, 164 KB of
        // shared memory per SM (of 192 KB L1/shared), 256 KB of registers per SM.
        GpuSpec {
            name: "a100-80gb",
            memory_gb: 80,
            bf16_tflops: 312.0,
            fp32_tflops: 19.5,
            hbm_tb_s: 2.039,
            l2_mb: 40.0,
            smem_kib: 164,
            regs_kib: 256,
            sms: 108,
            source: "NVIDIA A100 datasheet (80 GB SXM); NVIDIA A100 Tensor Core GPU Architecture whitepaper",
        },
    ];

    /// The datasheet figures of preset `name`, or `None`.
    pub fn spec(name: &str) -> Option<&'static GpuSpec> {
        Self::PRESETS.iter().find(|p| p.name == name)
    }

    /// The preset of `name`, or `None`.
    pub fn preset(name: &str) -> Option<Gpu> {
        Self::spec(name).map(|p| Gpu {
            hbm_bytes_per_s: Some(p.hbm_tb_s * 1e12),
            ..Gpu::custom(p.name, p.memory_gb as f64, p.bf16_tflops)
        })
    }

    /// A GPU of `gb` decimal gigabytes and `tflops` dense bf16 TFLOP/s (its HBM bandwidth
    /// unknown).
    pub fn custom(name: &str, gb: f64, tflops: f64) -> Gpu {
        Gpu {
            name: name.to_string(),
            memory_bytes: (gb * 1e9) as u64,
            peak_flops: tflops * 1e12,
            hbm_bytes_per_s: None,
        }
    }
}

/// A link class: its α-β per GPU and where the figures come from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    pub name: &'static str,
    /// α per algorithm step, β per GPU and direction.
    pub model: CostModel,
    pub source: &'static str,
}

const fn link(name: &'static str, alpha_us: f64, gb_s: f64, source: &'static str) -> Link {
    Link {
        name,
        model: CostModel {
            alpha_s: alpha_us * 1e-6,
            beta_bytes_per_s: gb_s * 1e9,
        },
        source,
    }
}

impl Link {
    /// The presets. β is what one GPU sustains in one direction; α is per ring step, chosen so
    /// an 8-rank all-reduce (14 steps) pays the fixed latency NCCL shows on that link class.
    pub const PRESETS: [Link; 7] = [
        link(
            "nvlink4",
            1.0,
            400.0,
            "H100 SXM NVLink 4 through NVSwitch: 900 GB/s per GPU both ways (NVIDIA H100 \
             datasheet), about 400 GB/s usable per direction; 10-20 µs per 8-GPU all-reduce \
             (the seed chapter's constants), 1 µs per step",
        ),
        link(
            "nvlink3",
            1.0,
            250.0,
            "A100 SXM NVLink 3 through NVSwitch: 600 GB/s per GPU both ways (NVIDIA A100 \
             datasheet), about 250 GB/s usable per direction; 1 µs per step",
        ),
        link(
            "pcie4",
            5.0,
            25.0,
            "PCIe 4.0 x16: 32 GB/s per direction in theory (16 GT/s x 16 lanes), about 25 \
             usable; 5 µs per step through the host bridge (assumed: fit your own)",
        ),
        link(
            "pcie5",
            5.0,
            50.0,
            "PCIe 5.0 x16: 64 GB/s per direction in theory (32 GT/s x 16 lanes), about 50 \
             usable; 5 µs per step (assumed: fit your own)",
        ),
        link(
            "ib-ndr",
            5.0,
            50.0,
            "InfiniBand NDR, one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100): 50 GB/s per GPU \
             and direction; 5 µs per step through the NIC and NCCL's proxy (assumed: fit \
             your own)",
        ),
        link(
            "ib-hdr",
            5.0,
            25.0,
            "InfiniBand HDR, one 200 Gb/s NIC per GPU (DGX A100): 25 GB/s per GPU and \
             direction; 5 µs per step (assumed: fit your own)",
        ),
        link(
            "roce",
            8.0,
            50.0,
            "RoCE v2 on 400 GbE, one NIC per GPU: 50 GB/s per GPU and direction; 8 µs per \
             step, more than InfiniBand's for the Ethernet fabric (assumed: fit your own)",
        ),
    ];

    /// The preset of `name`, or `None`.
    pub fn preset(name: &str) -> Option<Link> {
        Self::PRESETS.iter().copied().find(|l| l.name == name)
    }
}

/// How the groups of one kind lie on the nodes: their size, the most nodes one spans, and the
/// fewest ranks of one such group that share a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub size: usize,
    pub nodes: usize,
    pub per_node: usize,
}

impl Span {
    /// Whether a group crosses the node boundary (and runs on the inter link).
    pub fn crosses(&self) -> bool {
        self.nodes > 1
    }
}

/// How the groups of `group` under `dims` lie on nodes of `gpus_per_node` consecutive ranks:
/// the widest group's node count, and among groups that cross, the fewest ranks on one node.
/// One pass over the ranks (a group is the ranks that share every other coordinate).
pub fn span(dims: MeshDims, group: Group, gpus_per_node: usize) -> Span {
    use std::collections::HashMap;
    let g = gpus_per_node.max(1);
    let mut on_node: HashMap<((usize, usize, usize, usize), usize), usize> = HashMap::new();
    for r in 0..dims.world_size() {
        let c = dims.coords(r);
        // The coordinates the group's ranks share.
        let key = match group {
            Group::Tp => (c.dp, c.pp, c.cp, 0),
            Group::Cp => (c.dp, c.pp, c.tp, 0),
            Group::Pp => (c.dp, c.cp, c.tp, 0),
            Group::Dp => (c.pp, c.cp, c.tp, 0),
            Group::Dcp => (c.pp, c.tp, 0, 0),
            Group::Ep => (c.edp, c.pp, c.cp, c.tp),
            Group::Edp => (c.ep, c.pp, c.cp, c.tp),
            Group::World => (0, 0, 0, 0),
        };
        *on_node.entry((key, r / g)).or_default() += 1;
    }
    // Per group: the nodes it touches and the fewest of its ranks on one of them.
    let mut per_group: HashMap<(usize, usize, usize, usize), (usize, usize)> = HashMap::new();
    for ((key, _), n) in on_node {
        let e = per_group.entry(key).or_insert((0, usize::MAX));
        *e = (e.0 + 1, e.1.min(n));
    }
    let size = group.size(dims);
    let mut out = Span {
        size,
        nodes: 1,
        per_node: size,
    };
    for (nodes, fewest) in per_group.into_values() {
        out.nodes = out.nodes.max(nodes);
        if nodes > 1 {
            out.per_node = out.per_node.min(fewest);
        }
    }
    out
}

/// The α-β of a group of `span` from the links' models for the same op and size: the intra
/// link inside a node; across nodes, the inter link's α (never below the intra link's) and
/// `per_node` GPUs' shares of the inter link, never above the intra link (module doc).
pub fn group_model(span: Span, intra: CostModel, inter: CostModel) -> CostModel {
    if !span.crosses() {
        return intra;
    }
    CostModel {
        alpha_s: intra.alpha_s.max(inter.alpha_s),
        beta_bytes_per_s: intra
            .beta_bytes_per_s
            .min(span.per_node as f64 * inter.beta_bytes_per_s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mtrain_comm::OpKind;

    /// The module doc's picture: 64 GPUs on 8-GPU nodes under tp 8 · pp 4 · dp 2, and tp 16.
    #[test]
    fn groups_span_the_nodes_the_mesh_puts_them_on() {
        let dims = MeshDims::new(2, 4, 8, 1);
        let s = |g| span(dims, g, 8);
        assert_eq!(
            s(Group::Tp),
            Span {
                size: 8,
                nodes: 1,
                per_node: 8
            }
        );
        assert_eq!(
            s(Group::Pp),
            Span {
                size: 4,
                nodes: 4,
                per_node: 1
            }
        );
        assert_eq!(
            s(Group::Dp),
            Span {
                size: 2,
                nodes: 2,
                per_node: 1
            }
        );
        assert_eq!(s(Group::World).nodes, 8);
        let tp16 = span(MeshDims::new(2, 2, 16, 1), Group::Tp, 8);
        assert_eq!(
            tp16,
            Span {
                size: 16,
                nodes: 2,
                per_node: 8
            }
        );
        // tp 2 · pp 2 on 2-GPU nodes: a pp group holds one rank of each of two nodes.
        let pp = span(MeshDims::new(1, 2, 2, 1), Group::Pp, 2);
        assert_eq!(
            pp,
            Span {
                size: 2,
                nodes: 2,
                per_node: 1
            }
        );
    }

    /// The one-pass span agrees with the mesh's own groups on every kind of a mixed mesh.
    #[test]
    fn the_span_is_the_mesh_groups() {
        use mtrain_comm::mesh::GroupKind;
        let kinds = [
            (Group::Tp, GroupKind::Tp),
            (Group::Cp, GroupKind::Cp),
            (Group::Pp, GroupKind::Pp),
            (Group::Dp, GroupKind::Dp),
            (Group::Dcp, GroupKind::Dcp),
            (Group::Ep, GroupKind::Ep),
            (Group::Edp, GroupKind::Edp),
        ];
        let meshes = [MeshDims::new(4, 3, 2, 2), MeshDims::new(2, 2, 2, 2).with_cp(2)];
        for (dims, g) in meshes.into_iter().flat_map(|d| [2, 4, 8].map(|g| (d, g))) {
            for (group, kind) in kinds {
                let mut want = Span {
                    size: group.size(dims),
                    nodes: 1,
                    per_node: group.size(dims),
                };
                for ranks in dims.groups(kind) {
                    let mut nodes: Vec<usize> = ranks.iter().map(|r| r / g).collect();
                    nodes.dedup();
                    want.nodes = want.nodes.max(nodes.len());
                    if nodes.len() > 1 {
                        let fewest = nodes
                            .iter()
                            .map(|n| ranks.iter().filter(|r| *r / g == *n).count())
                            .min()
                            .unwrap();
                        want.per_node = want.per_node.min(fewest);
                    }
                }
                assert_eq!(span(dims, group, g), want, "{dims:?}: {group:?} on nodes of {g}");
            }
        }
    }

    /// Inside a node the intra link; across, the inter link's α and k NIC shares, capped by the
    /// intra link: a dp all-reduce of 1 GB over 8 nodes (one rank each) at 50 GB/s, against the
    /// same group inside NVLink at 400 GB/s.
    #[test]
    fn a_group_across_nodes_pays_the_inter_link() {
        let (nv, ib) = (
            Link::preset("nvlink4").unwrap().model,
            Link::preset("ib-ndr").unwrap().model,
        );
        let inside = Span {
            size: 8,
            nodes: 1,
            per_node: 8,
        };
        assert_eq!(group_model(inside, nv, ib), nv);
        let across = Span {
            size: 8,
            nodes: 8,
            per_node: 1,
        };
        let m = group_model(across, nv, ib);
        assert!(
            (m.alpha_s - 5e-6).abs() < 1e-15 && m.beta_bytes_per_s == 50e9,
            "{m:?}"
        );
        let t = |m: CostModel| m.time(OpKind::AllReduce, 8, 1_000_000_000).total_s();
        // 14 steps: 2·7/8·1 GB / 50 GB/s + 14 · 5 µs = 35.07 ms; inside: 4.375 ms + 14 µs.
        assert!((t(m) - 0.035_07).abs() < 1e-9, "{}", t(m));
        assert!((t(nv) - 0.004_389).abs() < 1e-9, "{}", t(nv));
        let pooled = group_model(
            Span {
                size: 16,
                nodes: 2,
                per_node: 8,
            },
            nv,
            ib,
        );
        assert_eq!(
            pooled.beta_bytes_per_s, 400e9,
            "8 NIC shares, capped by NVLink"
        );
        let two = group_model(
            Span {
                size: 4,
                nodes: 2,
                per_node: 2,
            },
            nv,
            ib,
        );
        assert_eq!(two.beta_bytes_per_s, 100e9);
    }

    #[test]
    fn presets_are_found_by_name() {
        let h = Gpu::preset("h100-sxm").unwrap();
        assert_eq!((h.memory_bytes, h.peak_flops), (80_000_000_000, 989e12));
        assert_eq!(Gpu::preset("a100-80gb").unwrap().peak_flops, 312e12);
        assert_eq!(Gpu::preset("h200").unwrap().memory_bytes, 141_000_000_000);
        assert!(Gpu::preset("h100").is_none());
        for l in Link::PRESETS {
            assert_eq!(Link::preset(l.name), Some(l));
            assert!(l.model.alpha_s > 0.0 && l.model.beta_bytes_per_s > 0.0);
        }
    }
}
