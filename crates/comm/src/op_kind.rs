//! The kinds of collective: what an op header carries and a trace event records, below both
//! the communicator and the tracer so that neither imports the other for it.

use std::fmt;

/// The kind of a collective, as carried in every op header and trace event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    AllReduce,
    Reduce,
    Broadcast,
    AllGather,
    ReduceScatter,
    Scatter,
    Gather,
    AllToAll,
    Send,
    Recv,
    Barrier,
}

impl OpKind {
    /// Every kind, in a fixed order (backends encode an op as its index here).
    pub const ALL: [OpKind; 11] = [
        OpKind::AllReduce,
        OpKind::Reduce,
        OpKind::Broadcast,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::Scatter,
        OpKind::Gather,
        OpKind::AllToAll,
        OpKind::Send,
        OpKind::Recv,
        OpKind::Barrier,
    ];
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::Reduce => "reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Scatter => "scatter",
            OpKind::Gather => "gather",
            OpKind::AllToAll => "all_to_all",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Barrier => "barrier",
        };
        f.write_str(s)
    }
}
