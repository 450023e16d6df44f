//! `--init-from PATH.safetensors`: start from GPT-2 weights in Hugging Face's layout (nanoGPT's
//! `init_from='gpt2'`).
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
//! file has more positions, as nanoGPT's `crop_block_size`). The padding rows of `wte` are zero,
//! so their logits are 0 until training moves them; no target ever names them. Every tensor of
//! the model must come from the file and every file tensor must be used: a missing or unknown
//! name, or a shape the model's config does not give, is refused naming it. The number of heads
//! cannot be read from the weights; the config must give the source model's (12 for GPT-2 124M).

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use mtrain_model::init::param_specs;
use mtrain_model::GptConfig;

/// Why a Hugging Face GPT-2 file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum HfLoadError {
    /// The file could not be read (names the operation and the path).
    #[error(transparent)]
    Io(#[from] crate::fsio::IoError),
    /// The file is not safetensors, or a tensor does not fit the model.
    #[error("{path}: {msg}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong, naming the tensor.
        msg: String,
    },
}

/// How a Hugging Face tensor becomes this model's.
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

/// The full fp32 weights of `cfg`'s model (this model's names and shapes, on the CPU) from the
/// Hugging Face GPT-2 file at `path`.
pub fn load(path: &Path, cfg: &GptConfig) -> Result<BTreeMap<String, Tensor>, HfLoadError> {
    let invalid = |msg: String| HfLoadError::Invalid {
        path: path.display().to_string(),
        msg,
    };
    if cfg.moe.is_some() {
        return Err(invalid(
            "GPT-2 has a dense MLP in every block; the model's config has experts (moe)".into(),
        ));
    }
    crate::fsio::regular_file(path)?;
    let file = candle_core::safetensors::load(path, &Device::Cpu)
        .map_err(|e| invalid(format!("not a readable safetensors file: {e}")))?;
    // Strip the `transformer.` prefix; drop the attention-mask buffers.
    let mut source: BTreeMap<String, Tensor> = BTreeMap::new();
    for (name, t) in file {
        let short = name
            .strip_prefix("transformer.")
            .unwrap_or(&name)
            .to_string();
        if short.ends_with(".attn.bias") || short.ends_with(".attn.masked_bias") {
            continue;
        }
        if source.insert(short.clone(), t).is_some() {
            return Err(invalid(format!(
                "`{short}` appears with and without `transformer.`"
            )));
        }
    }
    let head = source.remove("lm_head.weight");
    let mut weights = BTreeMap::new();
    for (name, shape, _) in param_specs(cfg) {
        let t = source.remove(&name).ok_or_else(|| {
            invalid(format!(
                "no tensor `{name}` (nor `transformer.{name}`): is this a GPT-2 with {} layers?",
                cfg.n_layer
            ))
        })?;
        let t = t
            .to_dtype(DType::F32)
            .map_err(|e| invalid(format!("`{name}`: {e}")))?;
        let converted = convert(&name, t, &shape).map_err(invalid)?;
        weights.insert(name, converted);
    }
    if let Some(extra) = source.keys().next() {
        return Err(invalid(format!(
            "tensor `{extra}` has no place in the model ({} layers, dense MLP): a larger GPT-2 than the config?",
            cfg.n_layer
        )));
    }
    if let Some(head) = head {
        // The head is tied to the embedding here; an untied head cannot be represented.
        let wte = &weights["wte.weight"];
        let rows = head.dim(0).unwrap_or(0);
        let same = head
            .to_dtype(DType::F32)
            .and_then(|h| {
                let ours = wte.narrow(0, 0, rows.min(wte.dim(0)?))?;
                (h - ours)?.abs()?.max_all()?.to_scalar::<f32>()
            })
            .map_err(|e| invalid(format!("`lm_head.weight`: {e}")))?;
        if same != 0.0 {
            return Err(invalid(format!(
                "`lm_head.weight` differs from `wte.weight` (max |difference| {same}); this model ties them"
            )));
        }
    }
    Ok(weights)
}

/// `t` (a Hugging Face tensor) in this model's layout `want`, or a message naming `name`.
fn convert(name: &str, t: Tensor, want: &[usize]) -> Result<Tensor, String> {
    let have = t.dims().to_vec();
    let wrong = |why: &str| format!("`{name}` has shape {have:?}, the model needs {want:?}{why}");
    let e = |e: candle_core::Error| format!("`{name}`: {e}");
    match conversion(name) {
        Conversion::Keep if have == want => Ok(t),
        Conversion::Transpose if have.len() == 2 && [have[1], have[0]] == want[..] => {
            t.t().and_then(|t| t.contiguous()).map_err(e)
        }
        Conversion::PadRows if have.len() == 2 && have[1] == want[1] && have[0] <= want[0] => {
            if have[0] == want[0] {
                return Ok(t);
            }
            let pad =
                Tensor::zeros((want[0] - have[0], want[1]), DType::F32, t.device()).map_err(e)?;
            Tensor::cat(&[&t, &pad], 0).map_err(e) // (V, C)
        }
        Conversion::PadRows if have.len() == 2 && have[0] > want[0] => Err(wrong(&format!(
            ": the file's vocabulary of {} ids does not fit model.vocab_size {}",
            have[0], want[0]
        ))),
        Conversion::CropRows if have.len() == 2 && have[1] == want[1] && have[0] >= want[0] => {
            t.narrow(0, 0, want[0]).map_err(e) // (T, C)
        }
        Conversion::Transpose => Err(wrong(" (transposed from Conv1D's (in, out))")),
        _ => Err(wrong("")),
    }
}

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

    #[test]
    fn a_vocabulary_larger_than_the_model_is_refused_with_both_sizes() {
        let t = Tensor::zeros((300, 8), DType::F32, &Device::Cpu).unwrap();
        let e = convert("wte.weight", t, &[256, 8]).unwrap_err();
        assert!(e.contains("300") && e.contains("256"), "{e}");
        let t = Tensor::zeros((8, 24), DType::F32, &Device::Cpu).unwrap();
        let e = convert("h.0.attn.c_attn.weight", t, &[24, 16]).unwrap_err();
        assert!(e.contains("[8, 24]") && e.contains("[24, 16]"), "{e}");
    }
}
