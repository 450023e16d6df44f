//! Hugging Face's GPT-2 layout, both ways: `--init-from` reads it ([`load`], nanoGPT's
//! `init_from='gpt2'`), `mtrain export --hf OUT` writes it ([`export`]) so that
//! `transformers.GPT2LMHeadModel.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)`
//! load a trained model.
//!
//! Hugging Face's `GPT2LMHeadModel` names tensors as this model does, under a `transformer.`
//! prefix (absent in files saved from `GPT2Model`, such as the hub's `gpt2/model.safetensors`),
//! with three differences:
//!
//! ```text
//!   HF name                                  HF shape       here                       shape
//!   transformer.wte.weight                   (50257, C)     wte.weight, zero rows      (V, C), V = 50304
//!                                                           appended up to the vocab
//!   transformer.h.N.attn.c_attn.weight       (C, 3C)        h.N.attn.c_attn.weight     (3C, C)   transposed:
//!   transformer.h.N.attn.c_proj.weight       (C, C)         h.N.attn.c_proj.weight     (C, C)    HF's Conv1D
//!   transformer.h.N.mlp.c_fc.weight          (C, 4C)        h.N.mlp.c_fc.weight        (4C, C)   keeps (in, out),
//!   transformer.h.N.mlp.c_proj.weight        (4C, C)        h.N.mlp.c_proj.weight      (C, 4C)   a Linear (out, in)
//!   lm_head.weight (optional)                (50257, C)     tied to wte: must equal it
//!   transformer.h.N.attn.bias, .masked_bias  causal-mask buffers, not parameters: skipped
//! ```
//!
//! Biases, LayerNorms and `wpe` keep their shapes (`wpe` is cut to `block_size` rows when the
//! file has more positions, as nanoGPT's `crop_block_size`). Both directions apply this one
//! table ([`conversion`]); the export writes the `transformer.` names, leaves `lm_head` to the
//! tie and drops the padding rows, so export then `--init-from` gives every exported tensor
//! back bit for bit, with the padding rows zero again.
//!
//! The architecture is GPT-2's in every other respect, which `config.json` states and the
//! loader checks when it reads a directory: GELU's tanh approximation (`gelu_new`), LayerNorm
//! eps 1e-5, an MLP of width 4C, the head tied to the embedding. Blocks with experts (MoE) have
//! no GPT-2 form: both directions refuse them.
//!
//! ```text
//!   hf.rs          the table above, the config keys
//!   hf/load.rs     --init-from: a model.safetensors, or a directory with its config.json
//!   hf/export.rs   mtrain export --hf: config.json, model.safetensors, the tokenizer
//! ```

mod export;
mod load;

pub use export::{export, ExportArgs, ExportSummary};
pub use load::{load, HfLoadError};

/// The weights' file in a Hugging Face model directory.
const MODEL_FILE: &str = "model.safetensors";
/// The GPT2Config's file in a Hugging Face model directory.
const CONFIG_FILE: &str = "config.json";
/// `activation_function` of this model's MLP (GELU, tanh approximation) in GPT2Config.
pub const ACTIVATION: &str = "gelu_new";
/// `layer_norm_epsilon` of every LayerNorm here.
pub const LAYER_NORM_EPS: f64 = 1e-5;

/// How a Hugging Face tensor becomes this model's (and back, the other way round).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Conversion {
    /// Same shape.
    Keep,
    /// Conv1D (in, out) to Linear (out, in).
    Transpose,
    /// Vocabulary rows padded with zeros up to the model's vocabulary.
    PadRows,
    /// Position rows cut to the model's context.
    CropRows,
}

/// The conversion of this model's tensor `name` (no `transformer.` prefix).
fn conversion(name: &str) -> Conversion {
    let conv1d = [
        ".attn.c_attn.weight",
        ".attn.c_proj.weight",
        ".mlp.c_fc.weight",
        ".mlp.c_proj.weight",
    ];
    match name {
        "wte.weight" => Conversion::PadRows,
        "wpe.weight" => Conversion::CropRows,
        n if conv1d.iter().any(|s| n.ends_with(s)) => Conversion::Transpose,
        _ => Conversion::Keep,
    }
}

/// Why a model with experts has no GPT-2 form (both directions say it).
const MOE_REFUSAL: &str = "GPT-2 has one dense MLP in every block, and this model's config has \
    experts (model.moe): its router and expert weights have no place in GPT2LMHeadModel";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv1d_weights_are_the_four_projection_matrices() {
        assert_eq!(conversion("h.3.attn.c_attn.weight"), Conversion::Transpose);
        assert_eq!(conversion("h.3.mlp.c_proj.weight"), Conversion::Transpose);
        assert_eq!(conversion("h.3.mlp.c_proj.bias"), Conversion::Keep);
        assert_eq!(conversion("h.3.ln_1.weight"), Conversion::Keep);
        assert_eq!(conversion("wte.weight"), Conversion::PadRows);
        assert_eq!(conversion("wpe.weight"), Conversion::CropRows);
    }
}
