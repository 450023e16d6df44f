//! `--init-from PATH`: start from GPT-2 weights in Hugging Face's layout ([`super`]'s table).
//!
//! PATH is a `model.safetensors` file, or a directory holding one (what `save_pretrained` and
//! `mtrain export --hf` write), whose `config.json` is then checked against the model's config:
//! a different depth, width, number of heads, activation, LayerNorm eps or MLP width, an untied
//! head or a context shorter than `block_size` is refused naming the key and both values. Every
//! tensor of the model must come from the file and every file tensor must be used: a missing or
//! unknown name, or a shape the model's config does not give, is refused naming it. A bare file
//! does not tell the number of heads; the config must give the source model's (12 for GPT-2
//! 124M). The padding rows of `wte` are zero, so their logits are 0 until training moves them;
//! no target ever names them.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use mtrain_model::init::param_specs;
use mtrain_model::GptConfig;
use serde_json::Value;

use super::{
    conversion, Conversion, ACTIVATION, CONFIG_FILE, LAYER_NORM_EPS, MODEL_FILE, MOE_REFUSAL,
};

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

/// The full fp32 weights of `cfg`'s model (this model's names and shapes, on the CPU) from the
/// Hugging Face GPT-2 file at `path`, or from `path/model.safetensors` when `path` is a
/// directory (after checking `path/config.json`, when there is one, against `cfg`).
pub fn load(path: &Path, cfg: &GptConfig) -> Result<BTreeMap<String, Tensor>, HfLoadError> {
    let file_path = if path.is_dir() {
        let config = path.join(CONFIG_FILE);
        if config.exists() {
            check_config(&config, cfg)?;
        }
        path.join(MODEL_FILE)
    } else {
        path.to_path_buf()
    };
    let path = file_path.as_path();
    let invalid = |msg: String| HfLoadError::Invalid {
        path: path.display().to_string(),
        msg,
    };
    if cfg.moe.is_some() {
        return Err(invalid(MOE_REFUSAL.into()));
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

/// Refuse a GPT2Config (`config.json` at `path`) that describes another model than `cfg`,
/// naming every key that differs with both values.
fn check_config(path: &Path, cfg: &GptConfig) -> Result<(), HfLoadError> {
    let invalid = |msg: String| HfLoadError::Invalid {
        path: path.display().to_string(),
        msg,
    };
    let text = crate::fsio::read_to_string(path)?;
    let json: Value = serde_json::from_str(&text).map_err(|e| invalid(format!("not JSON: {e}")))?;
    let int = |key: &str| json.get(key).and_then(Value::as_u64).map(|v| v as usize);
    let mut problems = Vec::new();
    if let Some(t) = json.get("model_type").and_then(Value::as_str) {
        if t != "gpt2" {
            problems.push(format!("model_type is `{t}`, not `gpt2`"));
        }
    }
    for (key, ours, what) in [
        ("n_layer", cfg.n_layer, "model.n_layer"),
        ("n_head", cfg.n_head, "model.n_head"),
        ("n_embd", cfg.n_embd, "model.n_embd"),
    ] {
        match int(key) {
            Some(v) if v == ours => {}
            Some(v) => problems.push(format!("{key} is {v}, {what} is {ours}")),
            None => problems.push(format!("no integer `{key}`")),
        }
    }
    if let Some(v) = int("n_positions") {
        if v < cfg.block_size {
            problems.push(format!(
                "n_positions is {v}, shorter than model.block_size {}",
                cfg.block_size
            ));
        }
    }
    if let Some(v) = int("vocab_size") {
        if v > cfg.vocab_size {
            problems.push(format!(
                "vocab_size is {v}, larger than model.vocab_size {}",
                cfg.vocab_size
            ));
        }
    }
    if let Some(v) = int("n_inner") {
        if v != 4 * cfg.n_embd {
            problems.push(format!(
                "n_inner is {v}; this model's MLP is 4 * n_embd = {}",
                4 * cfg.n_embd
            ));
        }
    }
    if let Some(a) = json.get("activation_function").and_then(Value::as_str) {
        if a != ACTIVATION {
            problems.push(format!(
                "activation_function is `{a}`; this model's GELU is `{ACTIVATION}` (tanh approximation)"
            ));
        }
    }
    if let Some(eps) = json.get("layer_norm_epsilon").and_then(Value::as_f64) {
        if eps != LAYER_NORM_EPS {
            problems.push(format!(
                "layer_norm_epsilon is {eps}; this model's LayerNorms use {LAYER_NORM_EPS}"
            ));
        }
    }
    if json.get("tie_word_embeddings").and_then(Value::as_bool) == Some(false) {
        problems.push("tie_word_embeddings is false; this model ties its head to wte".into());
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(invalid(format!(
            "describes another model than the config's: {}",
            problems.join("; ")
        )))
    }
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
    fn a_vocabulary_larger_than_the_model_is_refused_with_both_sizes() {
        let t = Tensor::zeros((300, 8), DType::F32, &Device::Cpu).unwrap();
        let e = convert("wte.weight", t, &[256, 8]).unwrap_err();
        assert!(e.contains("300") && e.contains("256"), "{e}");
        let t = Tensor::zeros((8, 24), DType::F32, &Device::Cpu).unwrap();
        let e = convert("h.0.attn.c_attn.weight", t, &[24, 16]).unwrap_err();
        assert!(e.contains("[8, 24]") && e.contains("[24, 16]"), "{e}");
    }
}
