//! The one TOML merge every configuration goes through: a file's `[model]`, `[train]` and
//! `[parallel]` tables into one table, `--set KEY=VALUE` on any dotted key of it, and the
//! typed [`TrainConfig`] deserialized from the result (every unknown key refused by name).

use serde::Deserialize;

use super::{ConfigError, ModelSpec, TrainConfig};

/// Merge a config file's `[model]` / `[train]` / `[parallel]` tables (or a top-level
/// `model = "preset"`) into `table`.
pub(super) fn merge_file(
    table: &mut toml::Table,
    text: &str,
    context: &str,
) -> Result<(), ConfigError> {
    let parse = |message: String| ConfigError::Parse {
        context: context.to_string(),
        message,
    };
    let file: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| parse(e.to_string()))?;
    for (key, value) in file {
        match (key.as_str(), value) {
            ("model", v @ (toml::Value::Table(_) | toml::Value::String(_))) => {
                table.insert("model".into(), v);
            }
            ("train", toml::Value::Table(t)) => table.extend(t),
            ("parallel", v @ toml::Value::Table(_)) => {
                table.insert("parallel".into(), v);
            }
            ("model", _) | ("train", _) | ("parallel", _) => {
                return Err(parse(format!(
                    "`{key}` must be a table (or, for model, a preset name)"
                )))
            }
            (other, _) => {
                return Err(parse(format!(
                    "unknown top-level key `{other}`; expected [model], [train] and [parallel]"
                )))
            }
        }
    }
    Ok(())
}

/// Apply `key=value` (value parsed as TOML, else taken as a string). A dotted key reaches into
/// nested tables (`model.moe.n_experts=8`), creating a missing one; `model` given as a preset
/// name is expanded into its table first; `parallel.x` edits the layout table; a leading `train.` is optional. Keys that name no
/// field are refused by name when the table is deserialized.
pub(super) fn apply_override(table: &mut toml::Table, kv: &str) -> Result<(), ConfigError> {
    let parse = |message: String| ConfigError::Parse {
        context: format!("--set {kv}"),
        message,
    };
    let (key, raw) = kv
        .split_once('=')
        .ok_or_else(|| parse("expected KEY=VALUE".into()))?;
    let key = key.trim();
    let key = key.strip_prefix("train.").unwrap_or(key);
    let path: Vec<&str> = key.split('.').map(str::trim).collect();
    if path.iter().any(|k| k.is_empty()) {
        return Err(parse(format!("`{key}` has an empty key segment")));
    }
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.to_string())),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    set_path(table, &path, value, "").map_err(parse)
}

/// Set `path` (one key per nested table) in `table` to `value`; `above` is the dotted path of
/// `table` itself, for messages.
fn set_path(
    table: &mut toml::Table,
    path: &[&str],
    value: toml::Value,
    above: &str,
) -> Result<(), String> {
    let Some((&key, rest)) = path.split_first() else {
        return Ok(());
    };
    if rest.is_empty() {
        table.insert(key.to_string(), value);
        return Ok(());
    }
    let here = if above.is_empty() {
        key.to_string()
    } else {
        format!("{above}.{key}")
    };
    let mut inner = match table.remove(key) {
        None if here == "model" => expand_preset(&TrainConfig::default().model)?,
        None => toml::Table::new(),
        Some(toml::Value::Table(t)) => t,
        Some(toml::Value::String(name)) if here == "model" => {
            expand_preset(&ModelSpec::Preset(name))?
        }
        Some(other) => {
            return Err(format!(
                "`{here}` holds a {}, not a table, so it has no key `{}`",
                other.type_str(),
                rest.join(".")
            ))
        }
    };
    set_path(&mut inner, rest, value, &here)?;
    table.insert(key.to_string(), toml::Value::Table(inner));
    Ok(())
}

/// The `[model]` table a model spec stands for (a preset name resolved to its fields).
fn expand_preset(spec: &ModelSpec) -> Result<toml::Table, String> {
    let cfg = spec.resolve().map_err(|e| e.to_string())?;
    match toml::Value::try_from(cfg) {
        Ok(toml::Value::Table(t)) => Ok(t),
        Ok(_) | Err(_) => Err("cannot expand the model preset into a table".into()),
    }
}

/// `model.dropout`, the key nanoGPT's configs carry: a probability in [0, 1), moved out of the
/// model's table to the run's `dropout` (the model's shape does not depend on it); anything else
/// is refused with its value.
fn take_dropout(table: &mut toml::Table, context: &str) -> Result<(), ConfigError> {
    let Some(toml::Value::Table(model)) = table.get_mut("model") else {
        return Ok(());
    };
    let Some(value) = model.remove("dropout") else {
        return Ok(());
    };
    let p = match value {
        toml::Value::Float(p) => p,
        toml::Value::Integer(p) => p as f64,
        other => {
            return Err(ConfigError::Parse {
                context: context.to_string(),
                message: format!("model.dropout must be a number, got a {}", other.type_str()),
            })
        }
    };
    if !(0.0..1.0).contains(&p) {
        return Err(ConfigError::Invalid(format!(
            "model.dropout = {p} must be a probability in [0, 1)"
        )));
    }
    table.insert("dropout".into(), toml::Value::Float(p));
    Ok(())
}

/// Deserialize the merged table over the defaults.
pub(super) fn deserialize(
    mut table: toml::Table,
    context: &str,
) -> Result<TrainConfig, ConfigError> {
    take_dropout(&mut table, context)?;
    TrainConfig::deserialize(toml::Value::Table(table)).map_err(|e| ConfigError::Parse {
        context: context.to_string(),
        message: e.to_string(),
    })
}

/// Deserialize the merged table over the defaults and validate.
pub(super) fn finish(table: toml::Table, context: &str) -> Result<TrainConfig, ConfigError> {
    let cfg = deserialize(table, context)?;
    cfg.validate()?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::super::args::resolve_args as resolve;

    /// `--set` reaches every key: top-level, `model.*` (expanding a preset), `model.moe.*`.
    #[test]
    fn set_reaches_nested_keys() {
        let cfg = resolve(&[
            "--model",
            "moe-tiny",
            "--set",
            "model.moe.top_k=1",
            "--set",
            "model.moe.capacity_factor=2.0",
            "--set",
            "train.lr=1e-3",
        ])
        .unwrap();
        let model = cfg.gpt_config().unwrap();
        let moe = model.moe.as_ref().unwrap();
        assert_eq!((moe.top_k, moe.capacity_factor, moe.n_experts), (1, 2.0, 4));
        assert_eq!(cfg.lr, 1e-3);
        // A table created by --set must be complete: the missing fields are named.
        let e = resolve(&["--set", "model.moe.n_experts=8"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field"), "{e}");
        let e = format!(
            "{:#}",
            resolve(&["--model", "moe-tiny", "--set", "model.moe.bogus=1"]).unwrap_err()
        );
        assert!(e.contains("bogus"), "{e}");
        let e = format!(
            "{:#}",
            resolve(&["--lr", "0.1", "--set", "lr.x=1"]).unwrap_err()
        );
        assert!(e.contains("`lr` holds a float, not a table"), "{e}");
        let e = format!("{:#}", resolve(&["--set", "lr.x=1"]).unwrap_err());
        assert!(e.contains("invalid type: map") && e.contains("`lr`"), "{e}");
        let e = format!("{:#}", resolve(&["--set", "model..n_head=1"]).unwrap_err());
        assert!(e.contains("empty key segment"), "{e}");
    }

    /// `model.dropout` (as a file's key or through `--set`) becomes the run's `dropout` and
    /// leaves the model's shape alone; a value outside [0, 1) is refused, naming the key.
    #[test]
    fn dropout_is_taken_to_the_run_and_bad_values_refused() {
        for (set, p) in [("model.dropout=0", 0.0), ("model.dropout=0.2", 0.2)] {
            let cfg = resolve(&["--set", set]).unwrap();
            assert_eq!(
                cfg.gpt_config().unwrap(),
                mtrain_model::GptConfig::tiny(),
                "{set}"
            );
            assert_eq!(cfg.dropout, p, "{set}");
        }
        for bad in ["model.dropout=1.0", "model.dropout=-0.1"] {
            let e = format!("{:#}", resolve(&["--set", bad]).unwrap_err());
            assert!(e.contains("must be a probability in [0, 1)"), "{e}");
        }
        let e = format!(
            "{:#}",
            resolve(&["--set", "model.dropout=\"x\""]).unwrap_err()
        );
        assert!(e.contains("model.dropout must be a number"), "{e}");
        let text = "[model]\nvocab_size = 256\nblock_size = 64\nn_layer = 2\nn_head = 4\nn_embd = 64\ndropout = 0.1\n";
        let cfg = crate::config::TrainConfig::from_toml_str(text, "t.toml").unwrap();
        assert_eq!(cfg.gpt_config().unwrap().n_layer, 2);
        assert_eq!(cfg.dropout, 0.1);
    }
}
