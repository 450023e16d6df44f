//! The model a checkpoint was written for, compared key by key with the run's.
//!
//! Tensor shapes alone do not pin the architecture: a checkpoint of `n_head` 4 has the same
//! shapes as one of `n_head` 8 (the heads are a view of `c_attn`), and would load into it and
//! train a different model. So a resume compares the `[model]` settings recorded in meta.json
//! with the run's and refuses any difference, naming every key. The layout (dp, tp, pp, ...) is
//! not part of it: a checkpoint holds full tensors and is resharded for any layout.

use mtrain_model::GptConfig;

/// `key: checkpoint value vs run value` for every `[model]` key that differs (nested keys
/// dotted, e.g. `moe.n_experts`; `none` where one side lacks the key); empty when they agree.
pub fn differences(checkpoint: &GptConfig, run: &GptConfig) -> Vec<String> {
    let (a, b) = (flatten(checkpoint), flatten(run));
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "none".into());
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| format!("{k}: {} vs {}", show(a.get(k)), show(b.get(k))))
        .collect()
}

/// Every leaf of the config as `dotted.key -> value`.
fn flatten(cfg: &GptConfig) -> std::collections::BTreeMap<String, String> {
    fn walk(
        prefix: &str,
        table: &toml::Table,
        out: &mut std::collections::BTreeMap<String, String>,
    ) {
        for (k, v) in table {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                toml::Value::Table(t) => walk(&key, t, out),
                other => {
                    out.insert(key, other.to_string());
                }
            }
        }
    }
    let mut out = std::collections::BTreeMap::new();
    // A GptConfig is a table of numbers and an optional table of numbers: it always converts.
    if let Ok(toml::Value::Table(t)) = toml::Value::try_from(cfg) {
        walk("", &t, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_differing_key_is_named() {
        let tiny = GptConfig::tiny();
        assert!(differences(&tiny, &tiny).is_empty());
        let heads = GptConfig {
            n_head: 8,
            ..GptConfig::tiny()
        };
        assert_eq!(differences(&tiny, &heads), ["n_head: 4 vs 8"]);
        let d = differences(&GptConfig::moe_tiny(), &heads);
        assert!(d.contains(&"n_head: 4 vs 8".to_string()), "{d:?}");
        assert!(d.contains(&"moe.n_experts: 4 vs none".to_string()), "{d:?}");
        assert!(d.contains(&"moe.top_k: 2 vs none".to_string()), "{d:?}");
    }
}
