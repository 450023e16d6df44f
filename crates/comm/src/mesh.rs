//! The device mesh: how the world's ranks are arranged as dp x pp x cp x tp, with expert
//! parallelism (ep) carved out of dp, and the process groups of each kind.
//!
//! tp is innermost, so the ranks of a tensor-parallel group are consecutive and share a node's
//! fast links; cp (context parallelism, the ring of sequence chunks) is next, as Megatron orders
//! them; then pp; dp is outermost:
//!
//! ```text
//! rank = ((dp_idx * pp + pp_idx) * cp + cp_idx) * tp + tp_idx
//! ep_idx = dp_idx % ep      (position inside the expert-parallel group)
//! edp_idx = dp_idx / ep     (position inside the expert-data-parallel group)
//! ```
//!
//! Groups: ranks that differ only in one coordinate form a group of that kind. `ep` splits each
//! dp group into blocks of `ep` consecutive dp indices (experts are sharded across a block);
//! `edp` links the ranks that hold the same experts (expert gradients are averaged over it);
//! `mp` is the model-parallel group of one dp index (all its pp x cp x tp ranks). `cp` is the
//! ring that K and V travel around; `dcp` joins dp and cp, the ranks that hold the same
//! parameters and see different tokens, over which gradients are averaged (Megatron's
//! data-parallel group with context parallelism). With cp = 1 it is the dp group.
//!
//! The 8-rank example `dp=2, pp=2, tp=2, ep=2`, as `mtrain plan` prints it (a unit test renders
//! these lines from the functions below, so the picture cannot drift):
//!
//! ```text
//! mesh dp=2 x pp=2 x tp=2 = 8 ranks, ep=2 (rank = (dp_idx * pp + pp_idx) * tp + tp_idx)
//!              tp=0 tp=1
//!   dp=0 pp=0:    0    1
//!   dp=0 pp=1:    2    3
//!   dp=1 pp=0:    4    5
//!   dp=1 pp=1:    6    7
//! tp groups:  [0, 1] [2, 3] [4, 5] [6, 7]
//! pp groups:  [0, 2] [1, 3] [4, 6] [5, 7]
//! dp groups:  [0, 4] [1, 5] [2, 6] [3, 7]
//! ep groups:  [0, 4] [1, 5] [2, 6] [3, 7]
//! edp groups: [0] [1] [2] [3] [4] [5] [6] [7]
//! mp groups:  [0, 1, 2, 3] [4, 5, 6, 7]
//! ```

use std::fmt::Write as _;

use crate::communicator::{Backend, Comm, CommError, Result};

/// The sizes of the mesh's dimensions. World size = dp * pp * cp * tp; ep divides dp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MeshDims {
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
    pub ep: usize,
    /// Context parallelism: ranks that split each sequence (1: none).
    pub cp: usize,
}

/// One rank's position in the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Coords {
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
    /// Position in the cp ring: which two chunks of each sequence this rank holds.
    pub cp: usize,
    /// `dp % ep`: which expert shard this rank holds.
    pub ep: usize,
    /// `dp / ep`: which replica of the expert shards this rank belongs to.
    pub edp: usize,
}

/// The kinds of process group a mesh has, in the order `DeviceMesh::new` creates them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupKind {
    Tp,
    Pp,
    Dp,
    Ep,
    Edp,
    Mp,
    Cp,
    Dcp,
}

impl GroupKind {
    pub const ALL: [GroupKind; 8] = [
        GroupKind::Tp,
        GroupKind::Pp,
        GroupKind::Dp,
        GroupKind::Ep,
        GroupKind::Edp,
        GroupKind::Mp,
        GroupKind::Cp,
        GroupKind::Dcp,
    ];

    /// The group's name, as used in errors and traces.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Tp => "tp",
            GroupKind::Pp => "pp",
            GroupKind::Dp => "dp",
            GroupKind::Ep => "ep",
            GroupKind::Edp => "edp",
            GroupKind::Mp => "mp",
            GroupKind::Cp => "cp",
            GroupKind::Dcp => "dcp",
        }
    }
}

impl MeshDims {
    /// Dimensions without context parallelism (cp = 1).
    pub fn new(dp: usize, pp: usize, tp: usize, ep: usize) -> Self {
        Self { dp, pp, tp, ep, cp: 1 }
    }

    /// The same dimensions with `cp` ranks splitting each sequence.
    pub fn with_cp(self, cp: usize) -> Self {
        Self { cp, ..self }
    }

    pub fn world_size(&self) -> usize {
        self.dp * self.pp * self.cp * self.tp
    }

    /// Every way these dimensions fail to make a mesh of `world_size` ranks, with the
    /// arithmetic; empty when they fit. The one statement of the rule: [`MeshDims::validate`]
    /// and the parallel plan's check both read it. A zero degree is reported alone (nothing
    /// else can be computed from it).
    pub fn problems(&self, world_size: usize) -> Vec<String> {
        let Self { dp, pp, tp, ep, cp } = *self;
        let zeros: Vec<String> = [("dp", dp), ("pp", pp), ("tp", tp), ("ep", ep), ("cp", cp)]
            .into_iter()
            .filter(|&(_, v)| v == 0)
            .map(|(name, _)| format!("{name} must be at least 1, got 0"))
            .collect();
        if !zeros.is_empty() {
            return zeros;
        }
        let mut why = Vec::new();
        if dp * pp * cp * tp != world_size {
            why.push(match cp {
                1 => format!(
                    "dp({dp}) * pp({pp}) * tp({tp}) = {} != world size {world_size}",
                    dp * pp * tp
                ),
                _ => format!(
                    "dp({dp}) * pp({pp}) * cp({cp}) * tp({tp}) = {} != world size {world_size}",
                    dp * pp * cp * tp
                ),
            });
        }
        if dp % ep != 0 {
            why.push(format!(
                "ep({ep}) must divide dp({dp}): expert parallelism is carved out of data parallelism, and {dp} % {ep} = {}",
                dp % ep
            ));
        }
        why
    }

    /// Check the dimensions against the world size ([`MeshDims::problems`], joined by `; `).
    pub fn validate(&self, world_size: usize) -> Result<()> {
        let why = self.problems(world_size);
        match why.is_empty() {
            true => Ok(()),
            false => Err(CommError::InvalidMesh(why.join("; "))),
        }
    }

    /// The global rank at these coordinates, on cp rank 0.
    pub fn rank_of(&self, dp_idx: usize, pp_idx: usize, tp_idx: usize) -> usize {
        self.rank_at(dp_idx, pp_idx, 0, tp_idx)
    }

    /// The global rank at these coordinates.
    pub fn rank_at(&self, dp_idx: usize, pp_idx: usize, cp_idx: usize, tp_idx: usize) -> usize {
        ((dp_idx * self.pp + pp_idx) * self.cp + cp_idx) * self.tp + tp_idx
    }

    /// The coordinates of a global rank.
    pub fn coords(&self, rank: usize) -> Coords {
        let tp = rank % self.tp;
        let cp = (rank / self.tp) % self.cp;
        let pp = (rank / (self.tp * self.cp)) % self.pp;
        let dp = rank / (self.tp * self.cp * self.pp);
        Coords {
            dp,
            pp,
            tp,
            cp,
            ep: dp % self.ep,
            edp: dp / self.ep,
        }
    }

    /// The ranks of the group of `kind` that contains `rank`, in increasing order.
    pub fn group_of(&self, kind: GroupKind, rank: usize) -> Vec<usize> {
        let c = self.coords(rank);
        let at = |d: usize, p: usize, x: usize, t: usize| self.rank_at(d, p, x, t);
        match kind {
            GroupKind::Tp => (0..self.tp).map(|t| at(c.dp, c.pp, c.cp, t)).collect(),
            GroupKind::Pp => (0..self.pp).map(|p| at(c.dp, p, c.cp, c.tp)).collect(),
            GroupKind::Dp => (0..self.dp).map(|d| at(d, c.pp, c.cp, c.tp)).collect(),
            GroupKind::Ep => (0..self.ep)
                .map(|e| at(c.edp * self.ep + e, c.pp, c.cp, c.tp))
                .collect(),
            GroupKind::Edp => (0..self.dp / self.ep)
                .map(|k| at(k * self.ep + c.ep, c.pp, c.cp, c.tp))
                .collect(),
            GroupKind::Mp => {
                let start = c.dp * self.pp * self.cp * self.tp;
                (start..start + self.pp * self.cp * self.tp).collect()
            }
            GroupKind::Cp => (0..self.cp).map(|x| at(c.dp, c.pp, x, c.tp)).collect(),
            GroupKind::Dcp => (0..self.dp)
                .flat_map(|d| (0..self.cp).map(move |x| (d, x)))
                .map(|(d, x)| at(d, c.pp, x, c.tp))
                .collect(),
        }
    }

    /// Every group of `kind`, ordered by their lowest rank.
    pub fn groups(&self, kind: GroupKind) -> Vec<Vec<usize>> {
        let mut out: Vec<Vec<usize>> = Vec::new();
        for r in 0..self.world_size() {
            let g = self.group_of(kind, r);
            if g[0] == r {
                out.push(g);
            }
        }
        out
    }

    /// The rank grid and every group, as printed by `mtrain plan` (the cp and dcp groups where
    /// cp > 1).
    pub fn render(&self) -> String {
        let mut s = String::new();
        let (dp, pp, cp, tp, ep) = (self.dp, self.pp, self.cp, self.tp, self.ep);
        let n = self.world_size();
        let _ = match cp {
            1 => writeln!(
                s,
                "mesh dp={dp} x pp={pp} x tp={tp} = {n} ranks, ep={ep} (rank = (dp_idx * pp + pp_idx) * tp + tp_idx)"
            ),
            _ => writeln!(
                s,
                "mesh dp={dp} x pp={pp} x cp={cp} x tp={tp} = {n} ranks, ep={ep} (rank = ((dp_idx * pp + pp_idx) * cp + cp_idx) * tp + tp_idx)"
            ),
        };
        let width = n.saturating_sub(1).to_string().len().max(4);
        let label = |d: usize, p: usize, x: usize| match cp {
            1 => format!("  dp={d} pp={p}:"),
            _ => format!("  dp={d} pp={p} cp={x}:"),
        };
        let label_width = label(dp - 1, pp - 1, cp - 1).len();
        let mut header = " ".repeat(label_width);
        for t in 0..tp {
            let _ = write!(header, " {:>width$}", format!("tp={t}"));
        }
        let _ = writeln!(s, "{header}");
        for d in 0..dp {
            for p in 0..pp {
                for x in 0..cp {
                    let mut row = format!("{:<label_width$}", label(d, p, x));
                    for t in 0..tp {
                        let _ = write!(row, " {:>width$}", self.rank_at(d, p, x, t));
                    }
                    let _ = writeln!(s, "{row}");
                }
            }
        }
        for kind in GroupKind::ALL {
            if cp == 1 && matches!(kind, GroupKind::Cp | GroupKind::Dcp) {
                continue;
            }
            let groups: Vec<String> = self.groups(kind).iter().map(|g| format!("{g:?}")).collect();
            let _ = writeln!(
                s,
                "{:<11} {}",
                format!("{} groups:", kind.name()),
                groups.join(" ")
            );
        }
        s
    }
}

/// This rank's process groups, one of each kind, created once and passed to whoever needs them.
#[derive(Clone)]
pub struct DeviceMesh {
    pub dims: MeshDims,
    pub coords: Coords,
    pub world: Comm,
    pub dp: Comm,
    pub pp: Comm,
    pub tp: Comm,
    pub ep: Comm,
    pub edp: Comm,
    pub mp: Comm,
    /// The ring of context parallelism (this rank alone when cp = 1).
    pub cp: Comm,
    /// dp × cp: the ranks gradients are averaged over (the dp group when cp = 1).
    pub dcp: Comm,
}

impl std::fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMesh")
            .field("dims", &self.dims)
            .field("coords", &self.coords)
            .finish()
    }
}

impl DeviceMesh {
    /// Create this rank's groups. Every rank creates its groups in the same order (tp, pp, dp,
    /// ep, edp, mp, cp, then dcp where cp > 1), so the group creations of all ranks line up.
    pub fn new(backend: &dyn Backend, dims: MeshDims) -> Result<DeviceMesh> {
        let world = backend.world();
        dims.validate(world.size())?;
        let rank = world.rank();
        let make = |kind: GroupKind| backend.new_group(&dims.group_of(kind, rank), kind.name());
        let tp = make(GroupKind::Tp)?;
        let pp = make(GroupKind::Pp)?;
        let dp = make(GroupKind::Dp)?;
        let ep = make(GroupKind::Ep)?;
        let edp = make(GroupKind::Edp)?;
        let mp = make(GroupKind::Mp)?;
        let cp = make(GroupKind::Cp)?;
        let dcp = match dims.cp {
            1 => dp.clone(),
            _ => make(GroupKind::Dcp)?,
        };
        Ok(DeviceMesh {
            dims,
            coords: dims.coords(rank),
            world,
            dp,
            pp,
            tp,
            ep,
            edp,
            mp,
            cp,
            dcp,
        })
    }

    /// This process's global rank.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// The group of one kind.
    pub fn group(&self, kind: GroupKind) -> &Comm {
        match kind {
            GroupKind::Tp => &self.tp,
            GroupKind::Pp => &self.pp,
            GroupKind::Dp => &self.dp,
            GroupKind::Ep => &self.ep,
            GroupKind::Edp => &self.edp,
            GroupKind::Mp => &self.mp,
            GroupKind::Cp => &self.cp,
            GroupKind::Dcp => &self.dcp,
        }
    }

    pub fn render(&self) -> String {
        self.dims.render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doc_example_is_what_render_prints() {
        let source = include_str!("mesh.rs");
        let doc: Vec<&str> = source
            .lines()
            .filter_map(|l| l.strip_prefix("//! "))
            .collect();
        let rendered = MeshDims::new(2, 2, 2, 2).render();
        let first = rendered.lines().next().unwrap_or_default();
        let at = doc
            .iter()
            .position(|l| *l == first)
            .expect("the doc comment shows the rendered example");
        for (i, line) in rendered.lines().enumerate() {
            assert_eq!(doc[at + i], line, "doc line {i} drifted from render()");
        }
    }

    #[test]
    fn coordinates_round_trip_and_groups_partition_the_world() {
        for (dp, pp, tp, ep) in [
            (2, 2, 2, 1),
            (4, 1, 2, 2),
            (3, 2, 1, 3),
            (1, 1, 1, 1),
            (4, 2, 1, 4),
        ] {
            let d = MeshDims::new(dp, pp, tp, ep);
            d.validate(d.world_size()).unwrap();
            for r in 0..d.world_size() {
                let c = d.coords(r);
                assert_eq!(d.rank_of(c.dp, c.pp, c.tp), r);
                assert_eq!(c.cp, 0);
                assert_eq!(c.edp * ep + c.ep, c.dp);
            }
            for kind in GroupKind::ALL {
                let mut seen: Vec<usize> = d.groups(kind).concat();
                seen.sort();
                assert_eq!(
                    seen,
                    (0..d.world_size()).collect::<Vec<_>>(),
                    "{kind:?} groups of {d:?}"
                );
                for r in 0..d.world_size() {
                    assert!(d.group_of(kind, r).contains(&r));
                }
            }
            // ep x edp tiles each dp group.
            assert_eq!(
                d.group_of(GroupKind::Ep, 0).len() * d.group_of(GroupKind::Edp, 0).len(),
                dp
            );
        }
    }

    /// With cp, tp stays innermost and cp comes next: a cp ring of tp = 2 strides by 2, and
    /// the dcp group holds every (dp, cp) pair of one (pp, tp).
    #[test]
    fn cp_sits_between_tp_and_pp() {
        let d = MeshDims::new(2, 2, 2, 1).with_cp(2); // 16 ranks
        d.validate(16).unwrap();
        for r in 0..16 {
            let c = d.coords(r);
            assert_eq!(d.rank_at(c.dp, c.pp, c.cp, c.tp), r);
        }
        assert_eq!(d.coords(2).cp, 1);
        assert_eq!(d.coords(4).pp, 1);
        assert_eq!(d.group_of(GroupKind::Cp, 0), vec![0, 2]);
        assert_eq!(d.group_of(GroupKind::Tp, 2), vec![2, 3]);
        assert_eq!(d.group_of(GroupKind::Pp, 0), vec![0, 4]);
        assert_eq!(d.group_of(GroupKind::Dp, 0), vec![0, 8]);
        assert_eq!(d.group_of(GroupKind::Dcp, 0), vec![0, 2, 8, 10]);
        assert_eq!(d.group_of(GroupKind::Mp, 9), (8..16).collect::<Vec<_>>());
        for kind in GroupKind::ALL {
            let mut seen: Vec<usize> = d.groups(kind).concat();
            seen.sort();
            assert_eq!(seen, (0..16).collect::<Vec<_>>(), "{kind:?}");
        }
        let text = d.render();
        assert!(text.contains("cp groups:  [0, 2] [1, 3]"), "{text}");
        assert!(text.contains("  dp=0 pp=1 cp=1:    6    7"), "{text}");
        let err = MeshDims::new(2, 1, 1, 1).with_cp(2).validate(2).unwrap_err().to_string();
        assert!(err.contains("dp(2) * pp(1) * cp(2) * tp(1) = 4 != world size 2"), "{err}");
    }

    #[test]
    fn validation_shows_the_arithmetic() {
        let err = MeshDims::new(2, 2, 2, 1)
            .validate(4)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("dp(2) * pp(2) * tp(2) = 8 != world size 4"),
            "{err}"
        );
        let err = MeshDims::new(4, 1, 1, 3)
            .validate(4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("ep(3) must divide dp(4)"), "{err}");
    }
}
