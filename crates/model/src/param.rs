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

use candle_core::{Result, Shape, Tensor, Var};

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
            Some(g) => *g = g.add(&grad)?,
            None => {
                self.map.insert(name.to_string(), grad);
            }
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
