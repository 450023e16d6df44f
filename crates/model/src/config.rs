//! Model hyper-parameters: [`GptConfig`] (nanoGPT's `GPTConfig`) and the optional [`MoeConfig`].
//!
//! Dimension legend used across the crate:
//! `B` batch, `T` sequence length (≤ `block_size`), `C` = `n_embd`, `H` = `n_head`,
//! `D` = `C / H` head size, `V` = `vocab_size`, `L` = `n_layer`, `E` = `n_experts`, `N` = `B·T` tokens.
//!
//! A configs/*.toml file holds these fields in a `[model]` table; unknown keys are rejected.

use serde::{Deserialize, Serialize};

/// Why a configuration cannot describe a model.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("n_embd {n_embd} is not divisible by n_head {n_head}")]
    HeadsDontDivide { n_embd: usize, n_head: usize },
    #[error("{field} must be at least 1, got {value}")]
    Zero { field: &'static str, value: usize },
    #[error("moe.top_k {top_k} must be 1 or 2 and at most n_experts {n_experts}")]
    TopK { top_k: usize, n_experts: usize },
    #[error("moe.{field} {value} must be a finite number {bound}")]
    BadFloat {
        field: &'static str,
        value: f64,
        bound: &'static str,
    },
}

/// Mixture-of-experts settings: every block's MLP becomes `n_experts` MLPs and a router.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    /// Number of expert MLPs per block (E).
    pub n_experts: usize,
    /// Experts each token is sent to (1 = Switch, 2 = GShard/Mixtral).
    pub top_k: usize,
    /// Slots per expert relative to an even split: capacity = ceil(top_k · N / E · capacity_factor).
    pub capacity_factor: f64,
    /// Weight of the load-balancing loss E · Σᵢ fᵢ · Pᵢ (Switch uses 0.01).
    pub aux_loss_coef: f64,
    /// Weight of the router z-loss mean(logsumexp(router logits)²) (ST-MoE uses 0.001; 0 disables).
    pub z_loss_coef: f64,
}

/// GPT hyper-parameters (GPT-2 / nanoGPT architecture: pre-LayerNorm, GELU MLP, tied LM head, biases on).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    /// Vocabulary size V (GPT-2's 50257 padded up to 50304, a multiple of 64).
    pub vocab_size: usize,
    /// Maximum sequence length T (size of the position embedding).
    pub block_size: usize,
    /// Number of transformer blocks L.
    pub n_layer: usize,
    /// Number of attention heads H.
    pub n_head: usize,
    /// Embedding width C; must be divisible by n_head.
    pub n_embd: usize,
    /// Replace every block's MLP with a mixture of experts when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
}

impl GptConfig {
    /// A model small enough for tests and the CPU demo: byte vocabulary, 4 layers, width 64.
    pub fn tiny() -> Self {
        Self {
            vocab_size: 256,
            block_size: 64,
            n_layer: 4,
            n_head: 4,
            n_embd: 64,
            moe: None,
        }
    }

    /// GPT-2 small (124M parameters).
    pub fn gpt2_124m() -> Self {
        Self {
            vocab_size: 50304,
            block_size: 1024,
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            moe: None,
        }
    }

    /// GPT-2 medium (350M parameters).
    pub fn gpt2_350m() -> Self {
        Self {
            vocab_size: 50304,
            block_size: 1024,
            n_layer: 24,
            n_head: 16,
            n_embd: 1024,
            moe: None,
        }
    }

    /// `tiny` with a 4-expert top-2 MoE in every block.
    pub fn moe_tiny() -> Self {
        Self {
            moe: Some(MoeConfig {
                n_experts: 4,
                top_k: 2,
                capacity_factor: 1.25,
                aux_loss_coef: 0.01,
                z_loss_coef: 0.001,
            }),
            ..Self::tiny()
        }
    }

    /// A preset by name: `tiny`, `gpt2-124m`, `gpt2-350m`, `moe-tiny` (`_` and `-` both accepted).
    pub fn preset(name: &str) -> Option<Self> {
        match name.replace('_', "-").as_str() {
            "tiny" => Some(Self::tiny()),
            "gpt2-124m" | "gpt2" => Some(Self::gpt2_124m()),
            "gpt2-350m" | "gpt2-medium" => Some(Self::gpt2_350m()),
            "moe-tiny" => Some(Self::moe_tiny()),
            _ => None,
        }
    }

    /// Names accepted by [`GptConfig::preset`].
    pub const PRESETS: [&'static str; 4] = ["tiny", "gpt2-124m", "gpt2-350m", "moe-tiny"];

    /// Checks that the numbers describe a buildable model.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("vocab_size", self.vocab_size),
            ("block_size", self.block_size),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero { field, value });
            }
        }
        if self.n_embd % self.n_head != 0 {
            return Err(ConfigError::HeadsDontDivide {
                n_embd: self.n_embd,
                n_head: self.n_head,
            });
        }
        if let Some(m) = &self.moe {
            if m.n_experts == 0 {
                return Err(ConfigError::Zero {
                    field: "moe.n_experts",
                    value: 0,
                });
            }
            if !(1..=2).contains(&m.top_k) || m.top_k > m.n_experts {
                return Err(ConfigError::TopK {
                    top_k: m.top_k,
                    n_experts: m.n_experts,
                });
            }
            if !(m.capacity_factor.is_finite() && m.capacity_factor > 0.0) {
                let (field, value) = ("capacity_factor", m.capacity_factor);
                return Err(ConfigError::BadFloat {
                    field,
                    value,
                    bound: "> 0",
                });
            }
            for (field, value) in [
                ("aux_loss_coef", m.aux_loss_coef),
                ("z_loss_coef", m.z_loss_coef),
            ] {
                if !(value.is_finite() && value >= 0.0) {
                    return Err(ConfigError::BadFloat {
                        field,
                        value,
                        bound: ">= 0",
                    });
                }
            }
        }
        Ok(())
    }

    /// Head size D = C / H.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Parameters in one transformer block (attention, LayerNorms and the MLP or the experts + router).
    pub fn n_params_per_block(&self) -> usize {
        let c = self.n_embd;
        let ln = 2 * c;
        let attn = 3 * c * c + 3 * c + c * c + c;
        let mlp = 4 * c * c + 4 * c + 4 * c * c + c;
        let ffn = match &self.moe {
            None => mlp,
            Some(m) => m.n_experts * mlp + m.n_experts * c,
        };
        2 * ln + attn + ffn
    }

    /// Total parameter count N; the LM head is tied to `wte` and counted once.
    pub fn n_params(&self) -> usize {
        let c = self.n_embd;
        self.vocab_size * c + self.block_size * c + self.n_layer * self.n_params_per_block() + 2 * c
    }

    /// Parameters one token actually passes through: all of them for a dense model; with MoE
    /// only `top_k` of the `n_experts` expert MLPs per block.
    pub fn n_active_params(&self) -> usize {
        let c = self.n_embd;
        let mlp = 8 * c * c + 5 * c;
        match &self.moe {
            None => self.n_params(),
            Some(m) => self.n_params() - self.n_layer * m.n_experts.saturating_sub(m.top_k) * mlp,
        }
    }

    /// Weights a token is multiplied by: every linear layer's (with MoE the `top_k` experts' and
    /// the router's) and the tied `wte` as the LM head. Biases, LayerNorm gains and the position
    /// table are added, not multiplied (0.7% of GPT-2 small's parameters; nanoGPT's MFU leaves
    /// the position table out too).
    pub fn n_matmul_params(&self) -> usize {
        let c = self.n_embd;
        let mlp = 8 * c * c;
        let ffn = match &self.moe {
            None => mlp,
            Some(m) => m.top_k * mlp + m.n_experts * c,
        };
        self.vocab_size * c + self.n_layer * (4 * c * c + ffn)
    }

    /// Training FLOPs per token for sequence length T: 6N, N = [`GptConfig::n_matmul_params`]
    /// (each weight's product forward, 2 FLOPs, and its two products backward, 4) plus 12·L·C·T
    /// for attention's two products per head (4·T·C forward, 8·T·C backward; the PaLM / nanoGPT
    /// MFU formula). The same closed forms `--profile-ops` counts its GEMMs and attention by.
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        6.0 * self.n_matmul_params() as f64
            + 12.0 * self.n_layer as f64 * self.n_embd as f64 * seq_len as f64
    }
}
