//! What an MoE layer call reports about its routing, apart from the layer so that a tape can
//! carry it without importing the layer.

/// Routing statistics of one MoE layer call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoeStats {
    /// Tokens kept by each expert (after capacity drops).
    pub tokens_per_expert: Vec<usize>,
    /// (token, expert) choices dropped because the expert was full.
    pub dropped: usize,
}
