//! ZeRO-3's residency rule as data: for a pass over a chunk's segments, which units each step
//! frees, waits for and prefetches. The scheduler (`fsdp/scheduler.rs`) runs these moves with
//! real all-gathers; the cost model ([`crate::analysis::comm_cost`]) counts the same moves, so the two
//! cannot disagree on how often a unit is gathered.
//!
//! ```text
//!   unit i       the parameters segment i is the first (lowest) user of: where their
//!                gradient becomes final (the tied wte belongs to the embedding)
//!   needs[i]     the units segment i uses, ascending
//!
//!   reads[i]     the units segment i's backward reads: needs[i], or none for a segment
//!                whose backward reads no weight (the embedding's) unless it is recomputed
//!
//!   reshard after forward (the default; always under recompute):
//!   forward  i   free needs[i-1] \ needs[i] │ wait needs[i] │ prefetch needs[i+1]
//!   backward i   wait reads[i] │ prefetch reads[i-1]              (gathered a second time)
//!   after bwd i  free needs[i] \ reads[i-1]
//!
//!   kept from the forward to the backward (reshard_after_forward = false):
//!   forward  i   wait needs[i] │ prefetch needs[i+1]               (nothing freed)
//!   backward i   wait reads[i]                                     (resident: no gather)
//!   after bwd i  free needs[i] \ (reads[0] ∪ … ∪ reads[i-1])       (kept for a backward
//!                                                                   still to read it)
//! ```
//! A wait on a resident unit is free; it gathers only a unit an earlier pass released (a
//! pipeline's micro-batches interleave forwards and backwards).
//! A rank running several chunks numbers their segments (and units) one after the other and
//! applies the rule within each chunk's range; a unit used by two chunks (ZB-V's `wte` on rank
//! 0) is listed by [`shared_across_chunks`].

use std::collections::BTreeMap;
use std::ops::Range;

/// The units segment i uses, for every segment of a chunk: `uses[i]` are the parameter names
/// segment i uses, `owner` each name's unit ([`crate::toolbox::final_after_names`]).
pub fn needs(uses: &[Vec<String>], owner: &BTreeMap<String, usize>) -> Vec<Vec<usize>> {
    uses.iter()
        .map(|names| {
            let mut u: Vec<usize> = names.iter().filter_map(|n| owner.get(n).copied()).collect();
            u.sort_unstable();
            u.dedup();
            u
        })
        .collect()
}

/// The units each segment's backward reads ([`needs`] of the segments whose backward
/// `reads_params`, none for the others), or all of them when the backward recomputes the
/// forward.
pub fn backward_needs(needs: &[Vec<usize>], reads_params: &[bool], recompute: bool) -> Vec<Vec<usize>> {
    needs
        .iter()
        .zip(reads_params)
        .map(|(n, &reads)| match reads || recompute {
            true => n.clone(),
            false => Vec::new(),
        })
        .collect()
}

/// What happens to units around one segment's pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Moves {
    /// Units whose gathered weights are released first.
    pub free: Vec<usize>,
    /// Units that must be resident before the segment runs (gathered now if they are not).
    pub wait: Vec<usize>,
    /// Units whose gather starts now, to overlap the segment's compute.
    pub prefetch: Vec<usize>,
}

/// Before segment `i`'s forward: free the previous segment's units it does not use (with
/// `reshard`), wait for its own, prefetch the next segment's (with `prefetch`).
pub fn before_forward(needs: &[Vec<usize>], i: usize, prefetch: bool, reshard: bool) -> Moves {
    let free = match i {
        _ if !reshard => Vec::new(),
        0 => Vec::new(),
        _ => needs[i - 1]
            .iter()
            .copied()
            .filter(|u| !needs[i].contains(u))
            .collect(),
    };
    let prefetch = match prefetch && i + 1 < needs.len() {
        true => needs[i + 1].clone(),
        false => Vec::new(),
    };
    Moves {
        free,
        wait: needs[i].clone(),
        prefetch,
    }
}

/// Before segment `i`'s backward (and its recompute): wait for the units it reads (`reads`,
/// [`backward_needs`]); with `reshard` (the forward freed them) prefetch the previous
/// segment's (with `prefetch`).
pub fn before_backward(reads: &[Vec<usize>], i: usize, prefetch: bool, reshard: bool) -> Moves {
    let prefetch = match reshard && prefetch && i > 0 {
        true => reads[i - 1].clone(),
        false => Vec::new(),
    };
    Moves {
        free: Vec::new(),
        wait: reads[i].clone(),
        prefetch,
    }
}

/// After segment `i`'s backward: the units it used that the segment before it does not read
/// in its backward; without `reshard`, that no segment before it reads (they stay resident for
/// those backwards).
pub fn after_backward(needs: &[Vec<usize>], reads: &[Vec<usize>], i: usize, reshard: bool) -> Vec<usize> {
    let earlier = match reshard {
        true => i.saturating_sub(1)..i,
        false => 0..i,
    };
    needs[i]
        .iter()
        .copied()
        .filter(|u| !reads[earlier.clone()].iter().any(|n| n.contains(u)))
        .collect()
}

/// The units segments of more than one chunk use (`chunks[k]`: chunk k's range of `needs`),
/// each as (the chunk of its owner, segment `u`; every chunk using it, ascending).
pub fn shared_across_chunks(
    needs: &[Vec<usize>],
    chunks: &[Range<usize>],
) -> Vec<(usize, Vec<usize>)> {
    let chunk_of = |i: usize| chunks.iter().position(|c| c.contains(&i));
    let mut shared = Vec::new();
    for u in 0..needs.len() {
        let users = needs.iter().enumerate().filter(|(_, n)| n.contains(&u));
        let mut users: Vec<usize> = users.filter_map(|(i, _)| chunk_of(i)).collect();
        users.dedup();
        if let (true, Some(owner)) = (users.len() > 1, chunk_of(u)) {
            shared.push((owner, users));
        }
    }
    shared
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_keeps_the_tied_embedding_unit_resident() {
        // [embedding (wte, wpe), h.0, head (ln_f, wte)]: the head needs unit 0 too.
        let needs = vec![vec![0], vec![1], vec![0, 2]];
        assert_eq!(
            before_forward(&needs, 1, true, true),
            Moves {
                free: vec![0],
                wait: vec![1],
                prefetch: vec![0, 2]
            }
        );
        assert_eq!(before_forward(&needs, 2, false, true).free, vec![1]);
        assert_eq!(after_backward(&needs, &needs, 2, true), vec![0, 2]);
        assert_eq!(after_backward(&needs, &needs, 0, true), vec![0]);
        assert_eq!(
            before_backward(&needs, 0, true, true).prefetch,
            Vec::<usize>::new()
        );
        assert_eq!(before_backward(&needs, 2, true, true).prefetch, vec![1]);
        // The embedding's backward reads no weight: nothing is gathered again for it, unless
        // it is recomputed.
        let reads = backward_needs(&needs, &[false, true, true], false);
        assert_eq!(reads, vec![vec![], vec![1], vec![0, 2]]);
        assert!(before_backward(&reads, 1, true, true).prefetch.is_empty());
        assert!(before_backward(&reads, 0, true, true).wait.is_empty());
        assert_eq!(backward_needs(&needs, &[false, true, true], true), needs);
    }

    #[test]
    fn kept_weights_are_freed_once_after_their_last_backward() {
        // Without resharding the forward frees nothing and the backward prefetches nothing;
        // the head's backward keeps the embedding's unit (the tied wte) for a later backward
        // that reads it.
        let needs = vec![vec![0], vec![1], vec![0, 2]];
        assert!((0..3).all(|i| before_forward(&needs, i, true, false).free.is_empty()));
        assert!(before_backward(&needs, 2, true, false).prefetch.is_empty());
        assert_eq!(before_backward(&needs, 2, true, false).wait, vec![0, 2]);
        assert_eq!(after_backward(&needs, &needs, 2, false), vec![2]);
        assert_eq!(after_backward(&needs, &needs, 1, false), vec![1]);
        assert_eq!(after_backward(&needs, &needs, 0, false), vec![0]);
        // An embedding that reads no weight in its backward frees the tied unit at the head's.
        let reads = backward_needs(&needs, &[false, true, true], false);
        assert_eq!(after_backward(&needs, &reads, 2, false), vec![0, 2]);
    }

    #[test]
    fn zb_v_rank_0_shares_the_embedding_unit_between_its_chunks() {
        // Chunk 0 [embedding, h.0], chunk 1 [h.3, head]: the head uses the embedding's unit.
        let needs = vec![vec![0], vec![1], vec![2], vec![0, 3]];
        assert_eq!(
            shared_across_chunks(&needs, &[0..2, 2..4]),
            vec![(0, vec![0, 1])]
        );
        assert!(shared_across_chunks(&needs, std::slice::from_ref(&(0..4))).is_empty());
    }
}
