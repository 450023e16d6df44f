//! The rule for every number a user gives: checked where it is parsed, before anything is built
//! from it — finite, in range, and, for a size that becomes an allocation, allocatable.
//!
//! A refused number is reported with the option's name and the bound it broke, e.g.
//! `eps inf must be a finite number > 0` or `model.vocab_size 100000000000 is above the largest
//! supported 16777216`. Sizes are bounded twice: each dimension by a fixed limit that keeps the
//! size arithmetic (parameter counts, byte counts) from overflowing ([`model_shape`], checked for
//! every command), and, for a run that allocates, the bytes they add up to by this machine's
//! memory ([`model_size`], [`micro_batch`]), so a model too large to allocate is refused with its
//! size instead of ending in an allocation failure. `mtrain plan` allocates nothing and takes a
//! model of any size within the first bounds.

use mtrain_model::GptConfig;

/// Largest vocabulary, block size (positions) and per-micro-batch counts accepted (2^24).
pub const MAX_COUNT: usize = 1 << 24;
/// Largest embedding width accepted (2^17; GPT-3 175B is 12288 wide).
pub const MAX_WIDTH: usize = 1 << 17;
/// Largest number of layers, heads or experts accepted (2^12).
pub const MAX_DEPTH: usize = 1 << 12;

/// `name value` as a finite number > 0, else the message.
pub fn positive(name: &str, value: f64) -> Result<(), String> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(format!("{name} {value:?} must be a finite number > 0"))
    }
}

/// `name value` as a finite number >= 0, else the message.
pub fn non_negative(name: &str, value: f64) -> Result<(), String> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(format!("{name} {value:?} must be a finite number >= 0"))
    }
}

/// `name value` at most `max`, else the message.
pub fn at_most(name: &str, value: usize, max: usize) -> Result<(), String> {
    if value <= max {
        Ok(())
    } else {
        Err(format!(
            "{name} {value} is above the largest supported {max}"
        ))
    }
}

/// Bytes of memory on this machine (Linux `MemTotal`); `None` where it cannot be read, and
/// then nothing is refused for its size.
pub fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// `what` needs `bytes`: refused when that exceeds `memory` (the machine's, when known).
pub fn fits_in_memory(what: &str, bytes: u128, memory: Option<u64>) -> Result<(), String> {
    match memory {
        Some(mem) if bytes > mem as u128 => Err(format!(
            "{what} needs {} but this machine has {} of memory",
            human_bytes(bytes),
            human_bytes(mem as u128)
        )),
        _ => Ok(()),
    }
}

/// Refuse a model whose dimensions are out of range (the bounds above).
pub fn model_shape(model: &GptConfig) -> Result<(), String> {
    let field = |name: &str| format!("model.{name}");
    at_most(&field("vocab_size"), model.vocab_size, MAX_COUNT)?;
    at_most(&field("block_size"), model.block_size, MAX_COUNT)?;
    at_most(&field("n_embd"), model.n_embd, MAX_WIDTH)?;
    at_most(&field("n_layer"), model.n_layer, MAX_DEPTH)?;
    at_most(&field("n_head"), model.n_head, MAX_DEPTH)?;
    if let Some(moe) = &model.moe {
        at_most(&field("moe.n_experts"), moe.n_experts, MAX_DEPTH)?;
    }
    Ok(())
}

/// Refuse a model whose dimensions are out of range ([`model_shape`]) or whose fp32 weights (4
/// bytes per parameter, drawn in full on every rank at start) do not fit in this machine's
/// memory.
pub fn model_size(model: &GptConfig, memory: Option<u64>) -> Result<(), String> {
    model_shape(model)?;
    // Within these bounds the parameter count stays below 2^62: no overflow.
    let n = model.n_params() as u128;
    fits_in_memory(
        &format!("the model's fp32 weights ({n} parameters x 4 bytes)"),
        4 * n,
        memory,
    )
}

/// Refuse a micro-batch of `batch_size` sequences of `seq_len` tokens whose fp32 logits
/// (B x T x V x 4 bytes, the largest activation) do not fit in `memory`.
pub fn micro_batch(
    batch_size: usize,
    seq_len: usize,
    vocab_size: usize,
    memory: Option<u64>,
) -> Result<(), String> {
    at_most("batch_size", batch_size, MAX_COUNT)?;
    let bytes = batch_size as u128 * seq_len as u128 * vocab_size as u128 * 4;
    fits_in_memory(
        &format!("a micro-batch's logits (batch_size {batch_size} x seq_len {seq_len} x vocab {vocab_size} x 4 bytes)"),
        bytes,
        memory,
    )
}

/// `1.5 GiB`-style rendering of a byte count.
fn human_bytes(bytes: u128) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", units[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_floats_are_refused_with_the_name() {
        assert!(positive("lr", 1e-3).is_ok());
        for v in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = positive("eps", v).unwrap_err();
            assert!(
                e.starts_with(&format!("eps {v:?} ")) && e.contains("> 0"),
                "{e}"
            );
        }
        assert!(non_negative("grad_clip", 0.0).is_ok());
        let e = non_negative("grad_clip", f64::INFINITY).unwrap_err();
        assert_eq!(e, "grad_clip inf must be a finite number >= 0");
        // Large values are shown as written, not as 300 digits.
        let e = positive("lr", -1e300).unwrap_err();
        assert_eq!(e, "lr -1e300 must be a finite number > 0");
    }

    #[test]
    fn a_model_too_large_for_memory_is_refused_with_its_size() {
        let gib = Some(1u64 << 30);
        assert!(model_size(&GptConfig::tiny(), gib).is_ok());
        // gpt2-124m is 124M parameters, 0.46 GiB in fp32: fits 1 GiB, not 256 MiB.
        assert!(model_size(&GptConfig::gpt2_124m(), gib).is_ok());
        let e = model_size(&GptConfig::gpt2_124m(), Some(256 << 20)).unwrap_err();
        assert!(e.contains("fp32 weights") && e.contains("256.0 MiB"), "{e}");
        let huge = GptConfig {
            vocab_size: 100_000_000_000,
            ..GptConfig::tiny()
        };
        let e = model_size(&huge, None).unwrap_err();
        assert_eq!(
            e,
            "model.vocab_size 100000000000 is above the largest supported 16777216"
        );
        // The shape alone, as `mtrain plan` checks it: any size within the bounds.
        let big = GptConfig {
            n_layer: 80,
            n_head: 64,
            n_embd: 8192,
            ..GptConfig::gpt2_124m()
        };
        assert!(model_shape(&big).is_ok());
        assert!(model_size(&big, gib).unwrap_err().contains("fp32 weights"));
        assert_eq!(model_shape(&huge).unwrap_err(), e);
        let e = micro_batch(1 << 20, 1 << 10, 1 << 16, gib).unwrap_err();
        assert!(e.contains("logits") && e.contains("1.0 GiB"), "{e}");
    }
}
