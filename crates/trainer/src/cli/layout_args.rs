//! The layout flags ([`LayoutArgs`]): how many processes, on how many nodes, where they meet,
//! and how they are arranged; and [`LayoutArgs::resolve`], which infers what was left out (the
//! table in `cli.rs`'s doc). Each degree is also a `[parallel]` key
//! ([`super::parallel_overrides`]); whether the numbers fit together is the plan's check.

use std::time::Duration;

use clap::Args;
use mtrain_comm::cpu::{LinkEmulator, Topology};
use mtrain_comm::mesh::MeshDims;
use mtrain_parallel::analysis::cluster::Link;

use super::merged;
use crate::config::{DeviceKind, ParallelConfig};
use crate::launch::{LaunchSpec, MAX_WORLD};
use crate::layout::{AlgoFlag, CommChoice, Layout, LayoutError, MAX_COMM_TIMEOUT_S};

/// `--nnodes` when not given.
const DEFAULT_NNODES: usize = 1;
/// `--master-addr` when not given.
const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
/// `--comm-timeout` when not given (seconds).
const DEFAULT_COMM_TIMEOUT_S: f64 = 300.0;

/// How many processes, where they meet, and how they are arranged.
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Layout")]
pub struct LayoutArgs {
    /// Data-parallel degree; inferred as world / (tp·pp) when omitted.
    #[arg(long, value_name = "D")]
    pub dp: Option<usize>,

    /// Tensor-parallel degree (innermost: consecutive ranks); default 1.
    #[arg(long, value_name = "T")]
    pub tp: Option<usize>,

    /// Pipeline-parallel degree (number of stages); default 1.
    #[arg(long, value_name = "P")]
    pub pp: Option<usize>,

    /// Expert-parallel degree, carved out of dp (must divide dp); default 1.
    #[arg(long, value_name = "E")]
    pub ep: Option<usize>,

    /// Context-parallel degree: ranks that split each sequence into 2·cp chunks and pass K and
    /// V around a ring (between tp and pp in the rank order); default 1.
    #[arg(long, value_name = "C")]
    pub cp: Option<usize>,

    /// Worker processes on this node; defaults to dp·cp·tp·pp / nnodes.
    #[arg(long, alias = "nproc_per_node", value_name = "N")]
    pub nproc_per_node: Option<usize>,

    /// Number of nodes in the job (default 1).
    #[arg(long, value_name = "N")]
    pub nnodes: Option<usize>,

    /// This node's index, 0..nnodes (default 0).
    #[arg(long, alias = "node_rank", value_name = "R")]
    pub node_rank: Option<usize>,

    /// Host of rank 0, which serves the rendezvous store (default 127.0.0.1).
    #[arg(long, alias = "master_addr", value_name = "ADDR")]
    pub master_addr: Option<String>,

    /// Port of the rendezvous store; a free port is picked on a single node when omitted.
    #[arg(long, alias = "master_port", value_name = "PORT")]
    pub master_port: Option<u16>,

    /// Seconds a collective may wait for a peer before failing with a message naming it
    /// (default 300).
    #[arg(long, value_name = "SECONDS")]
    pub comm_timeout: Option<f64>,

    /// The collective backend on GPUs: nccl (one GPU per rank), ipc (the node's ranks read each
    /// other's GPU memory through CUDA IPC, several ranks per GPU allowed), staged (the CPU
    /// backend through the host), auto (nccl, or ipc where ranks share a GPU; the default). Any
    /// but auto needs --device cuda: the CPU device always runs the CPU backend.
    #[arg(long, value_enum, value_name = "BACKEND")]
    pub comm: Option<CommChoice>,

    /// Record every collective per rank (op, group, bytes, seq, start, end) into
    /// RUN_DIR/trace-rank{N}.jsonl.
    #[arg(long)]
    pub trace: bool,

    /// The CPU backend's all-reduce algorithm: ring (the default), tree, rhd (recursive
    /// halving-doubling), or auto (by message size and group size). NCCL picks its own.
    #[arg(long, value_enum, value_name = "ALGO")]
    pub algo: Option<AlgoFlag>,

    /// The α-β table (configs/alpha-beta/*.toml) whose thresholds, written by
    /// `bench-comm --fit`, `--algo auto` follows; without one, the cost model's defaults (for
    /// the `--link` when one is emulated).
    #[arg(long, value_name = "FILE", requires = "algo")]
    pub algo_table: Option<std::path::PathBuf>,

    /// Emulate a link on the CPU backend: every step of an op takes α + bytes/β on the wire (the
    /// thread that runs the op sleeps until then). `ALPHA_US,GBPS` (`20000,0.05`: 20 ms and
    /// 50 MB/s) or a link preset of the cost model (nvlink4, pcie4, ib-ndr, ...), then
    /// optionally the topology: `,switch` (the default: every pair one hop) or `,ring` (the
    /// ranks on a ring of links, a message d places away crossing min(d, p−d) of them).
    #[arg(long, value_name = "ALPHA_US,GBPS|PRESET[,TOPOLOGY]")]
    pub link: Option<String>,
}

impl LayoutArgs {
    /// These flags (given before the subcommand) with `after`'s (given after it).
    pub fn merge(&self, after: &LayoutArgs) -> Result<LayoutArgs, LayoutError> {
        Ok(LayoutArgs {
            dp: merged("--dp", &self.dp, &after.dp)?,
            tp: merged("--tp", &self.tp, &after.tp)?,
            pp: merged("--pp", &self.pp, &after.pp)?,
            ep: merged("--ep", &self.ep, &after.ep)?,
            cp: merged("--cp", &self.cp, &after.cp)?,
            nproc_per_node: merged(
                "--nproc-per-node",
                &self.nproc_per_node,
                &after.nproc_per_node,
            )?,
            nnodes: merged("--nnodes", &self.nnodes, &after.nnodes)?,
            node_rank: merged("--node-rank", &self.node_rank, &after.node_rank)?,
            master_addr: merged("--master-addr", &self.master_addr, &after.master_addr)?,
            master_port: merged("--master-port", &self.master_port, &after.master_port)?,
            comm_timeout: merged("--comm-timeout", &self.comm_timeout, &after.comm_timeout)?,
            comm: merged("--comm", &self.comm, &after.comm)?,
            trace: self.trace || after.trace,
            algo: merged("--algo", &self.algo, &after.algo)?,
            algo_table: match (&self.algo_table, &after.algo_table) {
                (_, Some(b)) => Some(b.clone()),
                (a, None) => a.clone(),
            },
            link: merged("--link", &self.link, &after.link)?,
        })
    }
}

/// `--link`: `ALPHA_US,GBPS` or the name of one of the cost model's link presets, either
/// followed by `,TOPOLOGY` (`switch`, the default, or `ring`).
fn parse_link(text: &str) -> Result<LinkEmulator, LayoutError> {
    let bad = |why: String| LayoutError::Link {
        given: text.to_string(),
        why,
    };
    let mut parts: Vec<&str> = text.split(',').map(str::trim).collect();
    let topology = match parts.last().map(|p| (p, Topology::parse(p))) {
        Some((_, Some(t))) if parts.len() > 1 => {
            parts.pop();
            t
        }
        _ => Topology::Switch,
    };
    let (alpha_us, gb_s) = match parts[..] {
        [a, b] => {
            let num = |s: &str| s.parse::<f64>().map_err(|e| bad(format!("{s:?}: {e}")));
            (num(a)?, num(b)?)
        }
        [name] => match Link::preset(name) {
            Some(l) => (l.model.alpha_s * 1e6, l.model.beta_bytes_per_s * 1e-9),
            None => {
                let names: Vec<_> = Link::PRESETS.iter().map(|l| l.name).collect();
                return Err(bad(format!("not a preset (one of {})", names.join(", "))));
            }
        },
        _ => {
            let names: Vec<_> = Topology::ALL.iter().map(|t| t.name()).collect();
            return Err(bad(format!(
                "expected ALPHA_US,GBPS or a preset, then optionally a topology (one of {})",
                names.join(", ")
            )));
        }
    };
    Ok(LinkEmulator::new(alpha_us, gb_s)
        .map_err(|e| bad(e.to_string()))?
        .on(topology))
}

impl LayoutArgs {
    /// Refuses a flag that acts only on CUDA GPUs when the run's `device` is another one, naming
    /// the flag and what it needs, rather than running without it: `--comm` other than `auto`
    /// (the CPU device always runs its collectives on the CPU backend).
    pub fn check_device(&self, device: DeviceKind) -> Result<(), LayoutError> {
        if let (Some(algo), DeviceKind::Cuda) = (self.algo, device) {
            if self.comm != Some(CommChoice::Staged) {
                return Err(LayoutError::NeedsCpu {
                    flag: format!("--algo {algo}"),
                    why: "it picks the CPU backend's all-reduce algorithm, and NCCL and CUDA IPC pick their own (see `bench-comm --nccl-debug`); with --comm staged it applies",
                });
            }
        }
        if let (Some(link), DeviceKind::Cuda) = (&self.link, device) {
            if self.comm != Some(CommChoice::Staged) {
                return Err(LayoutError::NeedsCpu {
                    flag: format!("--link {link}"),
                    why: "it emulates a link under the CPU backend's messages, and NCCL and CUDA IPC send over the real one; with --comm staged it applies",
                });
            }
        }
        match self.comm {
            Some(comm) if comm != CommChoice::Auto && device != DeviceKind::Cuda => {
                Err(LayoutError::NeedsCuda {
                    flag: format!("--comm {comm}"),
                    why: "it picks the collective backend of ranks on GPUs, and on the CPU device the collectives always run on the CPU backend (TCP)",
                })
            }
            _ => Ok(()),
        }
    }

    /// The layout of `parallel` (the resolved `[parallel]` table, these flags included) on this
    /// job's processes: the world size and whatever degree was left out. `launched_world` is
    /// `WORLD_SIZE` when this process was started by a launcher. Whether the numbers fit together
    /// is [`crate::resolve`]'s check.
    pub fn resolve(
        &self,
        parallel: &ParallelConfig,
        launched_world: Option<usize>,
    ) -> Result<Layout, LayoutError> {
        let nnodes = self.nnodes.unwrap_or(DEFAULT_NNODES);
        let comm_timeout = self.comm_timeout.unwrap_or(DEFAULT_COMM_TIMEOUT_S);
        for (what, v) in [
            ("--tp", Some(parallel.tp)),
            ("--pp", Some(parallel.pp)),
            ("--ep", Some(parallel.ep)),
            ("--cp", Some(parallel.cp)),
            ("--nnodes", Some(nnodes)),
            ("--dp", parallel.dp),
            ("--nproc-per-node", self.nproc_per_node),
        ] {
            match v {
                Some(0) => return Err(LayoutError::Zero { what }),
                // Bounded so that every product of degrees below fits a usize.
                Some(value) if value > MAX_WORLD => {
                    return Err(LayoutError::TooLarge { what, value })
                }
                _ => {}
            }
        }
        if !(comm_timeout.is_finite() && comm_timeout > 0.0 && comm_timeout <= MAX_COMM_TIMEOUT_S) {
            return Err(LayoutError::Timeout(comm_timeout));
        }
        // cp sits between tp and pp: for the world's arithmetic it widens tp.
        let (tp, pp) = (parallel.tp * parallel.cp, parallel.pp);
        let tp_named = match parallel.cp {
            1 => format!("tp({})", parallel.tp),
            cp => format!("cp({cp}) * tp({})", parallel.tp),
        };

        // The world size, and a description of where it came from for error messages.
        let (world, nproc, world_source) = match (launched_world, self.nproc_per_node) {
            (Some(w), _) => (
                w,
                self.nproc_per_node.unwrap_or(w / nnodes.max(1)),
                format!("WORLD_SIZE={w}"),
            ),
            (None, Some(n)) => {
                let w = n * nnodes;
                (w, n, format!("nproc-per-node {n} * nnodes {nnodes}"))
            }
            (None, None) => {
                let dp = parallel.dp.unwrap_or(1);
                let w = dp * tp * pp;
                if w % nnodes != 0 {
                    return Err(LayoutError::Uneven {
                        dp,
                        pp,
                        tp: tp_named.clone(),
                        world: w,
                        nnodes,
                        rem: w % nnodes,
                    });
                }
                (w, w / nnodes, format!("dp * pp * tp over {nnodes} node(s)"))
            }
        };

        if world > MAX_WORLD {
            return Err(LayoutError::WorldTooLarge {
                world,
                world_source: world_source.clone(),
            });
        }
        let dp = match parallel.dp {
            Some(dp) => dp,
            None => {
                if world % (tp * pp) != 0 {
                    return Err(LayoutError::NotDivisible {
                        world,
                        world_source,
                        tp: tp_named.clone(),
                        pp,
                        tp_pp: tp * pp,
                    });
                }
                world / (tp * pp)
            }
        };
        let launch = LaunchSpec {
            nproc_per_node: nproc,
            nnodes,
            node_rank: self.node_rank.unwrap_or(0),
            master_addr: self
                .master_addr
                .clone()
                .unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_string()),
            master_port: self.master_port,
        };
        if launched_world.is_none() {
            launch.validate()?;
        }
        Ok(Layout {
            dims: MeshDims {
                dp,
                pp,
                tp: parallel.tp,
                ep: parallel.ep,
                cp: parallel.cp,
            },
            world_size: world,
            world_source,
            launch,
            comm_timeout: Duration::from_secs_f64(comm_timeout),
            comm: self.comm.unwrap_or_default(),
            trace: self.trace,
            algo: self.algo.unwrap_or_default(),
            algo_table: self.algo_table.clone(),
            link: self.link.as_deref().map(parse_link).transpose()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse as cli;
    use super::*;

    /// The layout the flags resolve to (what is inferred; nothing checked against a model).
    fn layout(args: &[&str]) -> anyhow::Result<Layout> {
        let cli = cli(args);
        Ok(cli.layout.resolve(&cli.config()?.parallel, None)?)
    }

    /// The layout as a training run takes it: resolved, then its plan checked against the
    /// default model and batch ([`crate::resolve::resolve`]).
    fn checked(args: &[&str]) -> anyhow::Result<Layout> {
        Ok(crate::resolve::resolve(&cli(args), None)?.layout)
    }

    #[test]
    fn link_takes_numbers_or_a_preset_and_names_what_is_wrong() {
        let l = layout(&["--link", "20000,0.05"]).unwrap().link.expect("a link");
        assert_eq!(l.alpha, Duration::from_millis(20));
        assert_eq!(l.bytes_per_s, 0.05e9);
        let ib = layout(&["--link", "ib-ndr"]).unwrap().link.expect("a preset");
        assert!(ib.bytes_per_s > 1e10, "{ib:?}");
        assert!(layout(&[]).unwrap().link.is_none());
        let e = layout(&["--link", "fast"]).unwrap_err().to_string();
        assert!(e.contains("--link \"fast\"") && e.contains("nvlink4"), "{e}");
        let e = layout(&["--link", "5,0"]).unwrap_err().to_string();
        assert!(e.contains("bandwidth > 0 GB/s"), "{e}");
        let e = layout(&["--link", "5,x"]).unwrap_err().to_string();
        assert!(e.contains("ALPHA_US,GBPS"), "{e}");
        assert_eq!(l.topology, Topology::Switch);
        let r = layout(&["--link", "20,1,ring"]).unwrap().link.expect("a ring");
        assert_eq!((r.alpha, r.topology), (Duration::from_micros(20), Topology::Ring));
        let p = layout(&["--link", "pcie4,ring"]).unwrap().link.expect("a preset ring");
        assert_eq!((p.bytes_per_s, p.topology), (25e9, Topology::Ring));
        let e = layout(&["--link", "20,1,torus"]).unwrap_err().to_string();
        assert!(e.contains("switch, ring"), "{e}");
    }

    #[test]
    fn default_is_one_process() {
        let l = layout(&[]).unwrap();
        assert_eq!((l.dims.dp, l.dims.pp, l.dims.tp, l.dims.ep), (1, 1, 1, 1));
        assert_eq!((l.world_size, l.launch.nproc_per_node), (1, 1));
    }

    #[test]
    fn nproc_defaults_to_the_product() {
        let l = layout(&["--tp", "2", "--pp", "2"]).unwrap();
        assert_eq!(
            (l.dims.dp, l.world_size, l.launch.nproc_per_node),
            (1, 4, 4)
        );
        let l = layout(&["--dp", "2", "--tp", "2", "--pp", "2"]).unwrap();
        assert_eq!((l.world_size, l.launch.nproc_per_node), (8, 8));
        let l = layout(&[
            "--nnodes",
            "2",
            "--master-port",
            "29500",
            "--tp",
            "8",
            "--pp",
            "2",
        ])
        .unwrap();
        assert_eq!(
            (l.dims.dp, l.world_size, l.launch.nproc_per_node),
            (1, 16, 8)
        );
    }

    #[test]
    fn dp_is_inferred_from_the_world() {
        let l = layout(&["--nproc-per-node", "8", "--tp", "2"]).unwrap();
        assert_eq!((l.dims.dp, l.dims.pp, l.dims.tp), (4, 1, 2));
        let c = cli(&["--tp", "2"]);
        let l = c
            .layout
            .resolve(&c.config().unwrap().parallel, Some(6))
            .unwrap();
        assert_eq!(l.dims.dp, 3);
    }

    #[test]
    fn inconsistent_numbers_show_the_arithmetic() {
        let e = checked(&["--dp", "2", "--tp", "2", "--nproc-per-node", "3"])
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "dp(2) * pp(1) * tp(2) = 4 != world size 3 (nproc-per-node 3 * nnodes 1)"
        );
        let e = checked(&["--tp", "4", "--nproc-per-node", "6"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("world size 6") && e.contains("tp(4) * pp(1) = 4"),
            "{e}"
        );
        // The plan's check words it as the mesh's rule (`MeshDims::problems`).
        let e = checked(&["--dp", "3", "--ep", "2"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("ep(2) must divide dp(3)"), "{e}");
        let e = checked(&["--tp", "0"]).unwrap_err().to_string();
        assert!(e.contains("--tp must be at least 1"), "{e}");
        let e = checked(&["--dp", "3", "--nnodes", "2", "--master-port", "1"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 % 2 = 1"), "{e}");
    }

    #[test]
    fn out_of_range_numbers_are_refused_with_the_bound() {
        let e = layout(&["--tp", "4294967297"]).unwrap_err().to_string();
        assert_eq!(
            e,
            "--tp 4294967297 is above the largest supported world of 1048576 processes"
        );
        let e = layout(&["--dp", "1048576", "--tp", "1048576"])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("world size 1099511627776 (dp * pp * tp over 1 node(s))"),
            "{e}"
        );
        for t in ["1e300", "nan", "inf", "0"] {
            let e = layout(&["--comm-timeout", t]).unwrap_err().to_string();
            assert!(
                e.contains("--comm-timeout must be a positive number of seconds up to 2592000"),
                "{e}"
            );
        }
        let e = layout(&["--comm-timeout", "1e300"])
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("got 1e300"), "{e}");
    }
}
