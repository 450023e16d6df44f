//! Gradient buckets: which parameters travel together, and the hook that launches each bucket's
//! all-reduce the moment the backward has made all of its gradients final.
//!
//! ```text
//!   model order:     wte wpe | h.0.* | h.1.* | ln_f        (wte is also used by the head)
//!   final after:     emb emb | h.0   | h.1   | head
//!   bucket order:    [ln_f, h.1.* …] [… h.0.*] [wpe, wte]   reverse, grouped by when they are final
//! ```

use candle_core::{DType, Tensor};
use mtrain_comm::{Comm, ReduceOp, Work};
use mtrain_model::{Grads, HookResult, Hooks, Param, Segment};
use std::collections::BTreeMap;

/// A group of parameters whose gradients travel in one flat all-reduce.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    /// Indices into the model's parameter list, in the order they sit in the flat buffer.
    pub params: Vec<usize>,
    /// Elements in the flat buffer.
    pub numel: usize,
    /// The bucket is complete once segment `ready_after`'s backward has finished.
    pub ready_after: usize,
}

/// Packs parameters into buckets in the order their gradients become final: segments from last
/// to first, inside a segment from its last parameter to its first. A bucket is closed once it
/// reaches its cap (the first one's cap is `first_cap`), so a parameter is never split.
pub fn assign_buckets(
    params: &[Param],
    final_after: &BTreeMap<String, usize>,
    first_cap: usize,
    cap: usize,
) -> Vec<Bucket> {
    let sizes: Vec<ParamSize> = params
        .iter()
        .map(|p| ParamSize {
            name: p.name(),
            numel: p.elem_count(),
            bytes: p.elem_count() * p.var().dtype().size_in_bytes(),
        })
        .collect();
    assign_bucket_sizes(&sizes, final_after, first_cap, cap)
}

/// What [`assign_buckets`] needs of a parameter: its name, elements and bytes (the cost model
/// packs the same buckets from the plan's placement, without tensors).
#[derive(Debug, Clone, Copy)]
pub struct ParamSize<'a> {
    pub name: &'a str,
    pub numel: usize,
    pub bytes: usize,
}

/// [`assign_buckets`] over sizes: the one packing rule.
pub fn assign_bucket_sizes(
    params: &[ParamSize],
    final_after: &BTreeMap<String, usize>,
    first_cap: usize,
    cap: usize,
) -> Vec<Bucket> {
    let ready = |k: usize| final_after.get(params[k].name).copied().unwrap_or(0);
    let mut order: Vec<usize> = (0..params.len()).rev().collect();
    // Stable: keeps reverse model order inside a segment.
    order.sort_by_key(|&k| std::cmp::Reverse(ready(k)));
    let mut buckets = Vec::new();
    let mut cur = Bucket {
        params: Vec::new(),
        numel: 0,
        ready_after: usize::MAX,
    };
    let mut cur_bytes = 0usize;
    for k in order {
        let p = &params[k];
        cur.params.push(k);
        cur.numel += p.numel;
        cur.ready_after = cur.ready_after.min(ready(k));
        cur_bytes += p.bytes;
        let limit = if buckets.is_empty() { first_cap } else { cap };
        if cur_bytes >= limit {
            buckets.push(std::mem::replace(
                &mut cur,
                Bucket {
                    params: Vec::new(),
                    numel: 0,
                    ready_after: usize::MAX,
                },
            ));
            cur_bytes = 0;
        }
    }
    if !cur.params.is_empty() {
        buckets.push(cur);
    }
    buckets
}

/// Concatenates the gradients of `params[ids]` into one flat tensor (zeros for a missing one).
pub(crate) fn flatten_grads(
    params: &[Param],
    ids: &[usize],
    grads: &Grads,
) -> candle_core::Result<Tensor> {
    let mut parts = Vec::with_capacity(ids.len());
    for &k in ids {
        let p = &params[k];
        parts.push(match grads.get(p.name()) {
            Some(g) => g.flatten_all()?,
            None => Tensor::zeros(p.elem_count(), p.var().dtype(), p.var().device())?,
        });
    }
    Tensor::cat(&parts, 0) // (numel,)
}

/// The hook that launches bucket all-reduces as the backward makes them complete.
pub(crate) struct BucketLauncher<'a> {
    comm: &'a Comm,
    params: &'a [Param],
    buckets: &'a [Bucket],
    /// Next bucket to launch; buckets go out strictly in this order.
    next: usize,
    /// Launched all-reduces, in bucket order.
    pending: Vec<Work>,
    /// Bytes handed to those all-reduces.
    bytes: u64,
    /// The dtype buckets are reduced in (f32 under mixed precision unless bf16 is asked for).
    reduce_dtype: DType,
}

impl<'a> BucketLauncher<'a> {
    pub(crate) fn new(
        comm: &'a Comm,
        params: &'a [Param],
        buckets: &'a [Bucket],
        reduce_dtype: DType,
    ) -> Self {
        Self {
            reduce_dtype,
            comm,
            params,
            buckets,
            next: 0,
            pending: Vec::new(),
            bytes: 0,
        }
    }

    fn launch_next(&mut self, grads: &Grads) -> candle_core::Result<()> {
        let b = &self.buckets[self.next];
        let flat = flatten_grads(self.params, &b.params, grads)?.to_dtype(self.reduce_dtype)?; // (numel,)
        self.pending
            .push(self.comm.all_reduce_async(&flat, ReduceOp::Avg));
        self.bytes += (flat.elem_count() * flat.dtype().size_in_bytes()) as u64;
        self.next += 1;
        Ok(())
    }

    /// Launches the buckets not launched yet (none after a full model's backward) and hands
    /// over the pending all-reduces, in bucket order, with their total bytes.
    pub(crate) fn finish(mut self, grads: &Grads) -> candle_core::Result<(Vec<Work>, u64)> {
        while self.next < self.buckets.len() {
            self.launch_next(grads)?;
        }
        Ok((self.pending, self.bytes))
    }
}

/// Waits for the launched buckets in order and writes each average back into `grads`, calling
/// `after_wait` after each (the op timer's collection); the wait time is added to `exposed_s`.
pub(crate) fn write_back(
    params: &[Param],
    buckets: &[Bucket],
    pending: Vec<Work>,
    grads: &mut Grads,
    exposed_s: &mut f64,
    after_wait: &mut dyn FnMut(),
) -> super::Result<()> {
    for (b, work) in buckets.iter().zip(pending) {
        let flat = crate::toolbox::timed_wait(work, exposed_s)?; // (numel,)
        after_wait();
        let mut off = 0;
        for &k in &b.params {
            let p = &params[k];
            let n = p.elem_count();
            grads.insert(p.name(), flat.narrow(0, off, n)?.reshape(p.shape())?);
            off += n;
        }
    }
    Ok(())
}

impl Hooks for BucketLauncher<'_> {
    fn post_backward(&mut self, i: usize, _seg: &dyn Segment, grads: &mut Grads) -> HookResult {
        // Segments finish in reverse; bucket b is complete once segment `ready_after` is done.
        while self.next < self.buckets.len() && self.buckets[self.next].ready_after >= i {
            self.launch_next(grads)?;
        }
        Ok(())
    }
}
