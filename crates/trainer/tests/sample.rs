//! `mtrain sample` with and without the KV cache, through the binary: the same greedy tokens
//! (`--top-k 1`) from checkpoints of `configs/tiny.toml` (past its block_size, where the cached
//! path prefills the cropped window again) and of the shakespeare_char recipe's model shape
//! (`configs/shakespeare-char.toml` on `prepare --chars` data, docs/data.md), each trained a few
//! steps; each run prints its tokens/s.

use std::path::Path;

mod common;
use common::{run_mtrain, text};

fn config(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../configs")
        .join(name)
        .display()
        .to_string()
}

/// `mtrain sample --top-k 1` of the run `run` with and without the cache: the two texts.
fn both_ways(run: &str, prompt: &str, new_tokens: usize) -> (String, String) {
    let n = new_tokens.to_string();
    let args = [
        "sample",
        "--checkpoint",
        run,
        "--prompt",
        prompt,
        "--max-new-tokens",
        &n,
        "--top-k",
        "1",
    ];
    let mut texts = Vec::new();
    for (extra, what) in [(None, "KV cache"), (Some("--no-kv-cache"), "no KV cache")] {
        let mut a = args.to_vec();
        a.extend(extra);
        let o = run_mtrain(&a);
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "sample ({what}): {}", text(&o));
        assert!(
            stderr.contains(&format!("{n} tokens in ")) && stderr.contains(&format!("({what})")),
            "{stderr}"
        );
        texts.push(String::from_utf8_lossy(&o.stdout).into_owned());
    }
    let plain = texts.pop().unwrap_or_default();
    (texts.pop().unwrap_or_default(), plain)
}

#[test]
fn kv_cache_samples_the_same_tokens_from_the_tiny_config() {
    let dir = tempfile::tempdir().expect("tmp");
    let run = dir.path().join("run").display().to_string();
    let tiny = config("tiny.toml");
    let o = run_mtrain(&["--config", &tiny, "--run-dir", &run, "--steps", "40"]);
    assert!(o.status.success(), "train: {}", text(&o));
    // 4 + 100 tokens: past block_size 64.
    let (cached, plain) = both_ways(&run, "the ", 100);
    assert_eq!(cached, plain);
    assert_eq!(cached.trim_end_matches('\n').len(), 104, "{cached:?}");
    let distinct: std::collections::BTreeSet<char> = cached[4..].chars().collect();
    assert!(distinct.len() > 3, "a varied continuation: {cached:?}");
}

#[test]
fn kv_cache_samples_the_same_tokens_at_shakespeare_char_shape() {
    let dir = tempfile::tempdir().expect("tmp");
    let shakespeare =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench/tinyshakespeare.txt");
    let full = std::fs::read_to_string(shakespeare).expect("tinyshakespeare.txt");
    let cut = full
        .char_indices()
        .nth(60_000)
        .map_or(full.len(), |(i, _)| i);
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, &full[..cut]).expect("write corpus");
    let (t, d) = (
        corpus.display().to_string(),
        dir.path().join("data").display().to_string(),
    );
    let o = run_mtrain(&["prepare", "--chars", "--text", &t, "--out", &d]);
    assert!(o.status.success(), "prepare: {}", text(&o));
    let run = dir.path().join("run").display().to_string();
    // The recipe's model (6 layers, 6 heads, 384 wide, block 256), a few small steps.
    let recipe = config("shakespeare-char.toml");
    let o = run_mtrain(&[
        "--config",
        &recipe,
        "--data",
        &d,
        "--run-dir",
        &run,
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "64",
        "--eval-iters",
        "1",
    ]);
    assert!(o.status.success(), "train: {}", text(&o));
    let (cached, plain) = both_ways(&run, "ROMEO:", 40);
    assert_eq!(cached, plain);
    assert_eq!(
        cached.trim_end_matches('\n').chars().count(),
        46,
        "{cached:?}"
    );
}
