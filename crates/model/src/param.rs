//! Named parameters and gradients keyed by name.
//!
//! A [`Param`] is a name plus a shared, swappable `Var` slot:
//!
//! ```text
//!   Param { name: "h.0.attn.c_attn.weight", slot: Arc<RwLock<Var>> }
//!        layers hold clones ──┘        └── FSDP swaps a gathered Var in / a placeholder out
//! ```
//!
//! Every layer that uses a weight holds a clone of the same `Param`, so replacing the `Var` in the
//! slot is seen by every user at once (the tied `wte` weight is one `Param` shared by the embedding
//! and the head). [`Grads`] stores one gradient per parameter name; a weight used twice gets the
//! sum of both contributions through [`Grads::accumulate`].

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use candle_core::{CpuStorage, InplaceOp2, Layout, Result, Shape, Tensor, Var};

/// A named trainable tensor in a shared, swappable slot.
#[derive(Clone)]
pub struct Param {
    name: Arc<str>,
    slot: Arc<RwLock<Var>>,
}

impl std::fmt::Debug for Param {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Param({}, {:?})", self.name, self.shape())
    }
}

impl Param {
    /// Wraps `tensor` (copied into a fresh `Var`) under `name`.
    pub fn new(name: impl Into<String>, tensor: Tensor) -> Result<Param> {
        let var = Var::from_tensor(&tensor.detach())?;
        Ok(Param {
            name: Arc::from(name.into()),
            slot: Arc::new(RwLock::new(var)),
        })
    }

    /// Wraps `var` under `name` as it is, without copying it (a fresh `Var` nothing else
    /// holds, such as one made from values just read).
    pub fn from_var(name: impl Into<String>, var: Var) -> Param {
        Param {
            name: Arc::from(name.into()),
            slot: Arc::new(RwLock::new(var)),
        }
    }

    /// The parameter's name (GPT-2 naming, e.g. `h.3.mlp.c_fc.weight`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The `Var` currently in the slot.
    pub fn var(&self) -> Var {
        // A poisoned lock only means another thread panicked while holding it; the Var inside is
        // still a valid tensor handle, so keep going.
        match self.slot.read() {
            Ok(v) => v.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The current value as a tensor tracked by autograd (gradients are reported for it).
    pub fn tensor(&self) -> Tensor {
        self.var().as_tensor().clone()
    }

    /// Swaps a new `Var` (any shape) into the slot; users see it from their next forward on.
    pub fn replace(&self, tensor: Tensor) -> Result<()> {
        let var = Var::from_tensor(&tensor.detach())?;
        match self.slot.write() {
            Ok(mut v) => *v = var,
            Err(poisoned) => *poisoned.into_inner() = var,
        }
        Ok(())
    }

    /// Overwrites the value in place (same shape); tensors already recorded keep pointing at it.
    pub fn set(&self, tensor: &Tensor) -> Result<()> {
        self.var().set(tensor)
    }

    /// Shape of the current value.
    pub fn shape(&self) -> Shape {
        self.var().shape().clone()
    }

    /// Number of elements of the current value.
    pub fn elem_count(&self) -> usize {
        self.var().elem_count()
    }
}

/// Gradients by parameter name.
#[derive(Clone, Debug, Default)]
pub struct Grads {
    map: BTreeMap<String, Tensor>,
}

impl Grads {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `grad` to the gradient stored under `name` (or stores it if there is none).
    pub fn accumulate(&mut self, name: &str, grad: Tensor) -> Result<()> {
        let grad = grad.detach();
        match self.map.get_mut(name) {
            Some(g) => *g = accumulated(g, &grad, || g.add(&grad))?,
            None => {
                self.map.insert(name.to_string(), grad);
            }
        }
        Ok(())
    }

    /// [`Grads::accumulate`] for a gradient nothing else reads (a tape's fresh result): on the
    /// CPU, when it owns its whole f32 buffer, it takes the stored gradient's values in place
    /// (`grad += stored`, the same bits as `stored + grad`), so two copies are alive at the sum
    /// rather than three (the tied `wte`: the head's gradient, the embedding's and their sum
    /// would be three tables of V × C). A clone of `grad` kept elsewhere would see the sum.
    pub fn accumulate_fresh(&mut self, name: &str, grad: Tensor) -> Result<()> {
        match self.map.get_mut(name) {
            Some(g) if g.shape() == grad.shape() => {
                *g = accumulated(g, &grad, || match grad.inplace_op2(g, &AddInPlace) {
                    Ok(()) => Ok(grad.detach()),
                    Err(_) => g.add(&grad.detach()),
                })?
            }
            _ => self.accumulate(name, grad)?,
        }
        Ok(())
    }

    /// The gradient stored under `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.map.get(name)
    }

    /// Stores `grad` under `name`, returning the previous one.
    pub fn insert(&mut self, name: impl Into<String>, grad: Tensor) -> Option<Tensor> {
        self.map.insert(name.into(), grad)
    }

    /// Removes and returns the gradient stored under `name`.
    pub fn remove(&mut self, name: &str) -> Option<Tensor> {
        self.map.remove(name)
    }

    /// `(name, gradient)` pairs in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Tensor)> {
        self.map.iter()
    }

    /// Parameter names with a gradient, in name order.
    pub fn names(&self) -> Vec<String> {
        self.map.keys().cloned().collect()
    }

    /// Drops every gradient.
    pub fn clear(&mut self) {
        self.map.clear()
    }

    /// Number of stored gradients.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no gradient is stored.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Σ g² over every stored gradient, accumulated in f64 (the square of the global norm), with
    /// one read-back for all of them ([`mtrain_kernels::reduce::sq_sum_f64_all`]).
    pub fn sq_norm(&self) -> Result<f64> {
        mtrain_kernels::reduce::sq_sum_f64_all(self.map.values())
    }
}

/// `f`, the sum of a gradient `g` and a new contribution `grad`, as the profiler's row
/// `grad accumulate` (one add per element, both read, one written).
fn accumulated<R>(g: &Tensor, grad: &Tensor, f: impl FnOnce() -> Result<R>) -> Result<R> {
    use mtrain_kernels::profile;
    profile::op(grad.device(), f, |_| {
        let per = profile::per_element("grad accumulate");
        let cost = profile::Cost::elementwise(per, grad, &[g, grad], &[grad]);
        ("grad accumulate".into(), cost)
    })
}

/// `dst += src` on CPU f32 tensors, where `dst` is a contiguous tensor owning its whole buffer
/// (a fresh gradient, no view of a larger one) and `src` is contiguous; refused otherwise, and on
/// other devices, so the caller adds out of place.
struct AddInPlace;

impl InplaceOp2 for AddInPlace {
    fn name(&self) -> &'static str {
        "gradient add in place"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<()> {
        let (CpuStorage::F32(dst), CpuStorage::F32(src)) = (s1, s2) else {
            candle_core::bail!("gradient add in place: f32 only");
        };
        let (Some((0, end)), Some((lo, hi))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("gradient add in place: contiguous tensors only");
        };
        if end != dst.len() || hi - lo != end {
            candle_core::bail!("gradient add in place: the gradient does not own its buffer");
        }
        for (d, s) in dst.iter_mut().zip(&src[lo..hi]) {
            *d += *s;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn accumulating_in_place_gives_the_sum_and_leaves_views_alone() -> Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::new(&[0.1f32, -2.5, 3.0e-8, 7.0], &dev)?;
        let b = Tensor::new(&[0.2f32, 1.25, -1.0e-8, 1.0e7], &dev)?;
        let mut grads = Grads::new();
        let want = a.add(&b)?.to_vec1::<f32>()?;
        grads.accumulate_fresh("w", a)?;
        grads.accumulate_fresh("w", b)?; // in place into b's buffer
        assert_eq!(grads.get("w").unwrap().to_vec1::<f32>()?, want);

        // A view of a larger buffer is added out of place: the buffer keeps its values.
        let big = Tensor::new(&[1f32, 2., 3., 4., 5., 6.], &dev)?;
        let view = big.narrow(0, 2, 4)?;
        grads.accumulate_fresh("w", view)?;
        assert_eq!(big.to_vec1::<f32>()?, vec![1., 2., 3., 4., 5., 6.]);
        let want: Vec<f32> = want.iter().zip([3f32, 4., 5., 6.]).map(|(x, y)| x + y).collect();
        assert_eq!(grads.get("w").unwrap().to_vec1::<f32>()?, want);
        Ok(())
    }
}
