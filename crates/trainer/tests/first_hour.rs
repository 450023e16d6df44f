//! What a new user does first, through the real `mtrain` binary where it can be: prepare a text,
//! train on it, sample from the run; encode with an existing tokenizer.json; start from GPT-2
//! weights in Hugging Face's layout.
//!
//! - `prepare_train_sample_as_the_data_guide_says` (docs/data.md): `mtrain prepare --text T
//!   --vocab-size N --out D`, `mtrain --data D`, `mtrain sample --checkpoint RUN`, each exiting 0,
//!   the model taking the data's vocabulary padded to a multiple of 64; a vocabulary set too small
//!   is refused naming both sizes.
//! - `prepare_encodes_with_an_existing_tokenizer`: `--tokenizer FILE` gives the ids that file
//!   gives for the whole text, across the 1 MiB chunks `prepare` encodes in.
//! - `init_from_loads_the_hf_layout`: a small GPT-2 written in Hugging Face's layout (the
//!   `transformer.` names, Conv1D weights stored (in, out), a 250-id vocabulary, more positions
//!   than the model's context, the tied `lm_head`, the mask buffers) loads, and the model computes
//!   the logits of a GPT-2 forward written here directly from the Hugging Face tensors; the
//!   padded vocabulary's logits are 0. Then `mtrain --init-from` trains from it.

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;

use candle_core::{DType, Device, Tensor, D};
use mtrain_model::{Gpt, GptConfig};
use mtrain_trainer::tools::hf;
use mtrain_trainer::data::corpus;
use mtrain_trainer::tools::prepare::{self, PrepareArgs};

mod common;
use common::{run_mtrain, text};

fn meta_vocab(run_dir: &Path) -> u64 {
    let latest = std::fs::read_to_string(run_dir.join("latest")).expect("latest");
    let meta = run_dir.join(latest.trim()).join("meta.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(meta).expect("meta.json")).expect("json");
    v["config"]["model"]["vocab_size"]
        .as_u64()
        .unwrap_or_else(|| panic!("no model.vocab_size in {v}"))
}

#[test]
fn prepare_train_sample_as_the_data_guide_says() {
    let dir = tempfile::tempdir().expect("tmp");
    let corpus_txt = dir.path().join("corpus.txt");
    std::fs::write(&corpus_txt, corpus::generate(80_000, 5)).expect("write corpus");
    let data = dir.path().join("data");
    let (t, d) = (corpus_txt.display().to_string(), data.display().to_string());
    let o = run_mtrain(&["prepare", "--text", &t, "--vocab-size", "300", "--out", &d]);
    assert!(o.status.success(), "prepare: {}", text(&o));
    // Up to 300 ids (fewer if the text has fewer pairs to merge): the model takes 320.
    let out = text(&o);
    assert!(out.contains("takes vocab_size 320"), "{out}");
    let vocab: usize = out
        .split("vocab ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no vocabulary size in {out}"));
    assert!((257..=300).contains(&vocab), "{out}");

    let run = dir.path().join("run");
    let r = run.display().to_string();
    let small = ["--steps", "3", "--batch-size", "4", "--seq-len", "32"];
    let mut args = vec!["--data", &d, "--run-dir", &r];
    args.extend(small);
    let o = run_mtrain(&args);
    assert!(o.status.success(), "train: {}", text(&o));
    assert_eq!(meta_vocab(&run), 320);

    let o = run_mtrain(&[
        "sample",
        "--checkpoint",
        &r,
        "--prompt",
        "the ",
        "--max-new-tokens",
        "8",
    ]);
    assert!(o.status.success(), "sample: {}", text(&o));
    let sampled = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(sampled.starts_with("the "), "{sampled}");
    assert!(sampled.len() > "the ".len(), "{sampled}");

    // A vocabulary given explicitly stays, and one that cannot hold the data is refused.
    let bad = dir.path().join("bad");
    let b = bad.display().to_string();
    let mut args = vec![
        "--data",
        &d,
        "--run-dir",
        &b,
        "--set",
        "model.vocab_size=256",
    ];
    args.extend(small);
    let o = run_mtrain(&args);
    let msg = text(&o);
    assert!(!o.status.success(), "{msg}");
    assert!(
        msg.contains(&format!("vocabulary of {vocab} ids"))
            && msg.contains("model.vocab_size is 256"),
        "{msg}"
    );
    let mut args = vec![
        "--data",
        &d,
        "--run-dir",
        &b,
        "--set",
        "model.vocab_size=384",
    ];
    args.extend(small);
    let o = run_mtrain(&args);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(meta_vocab(&bad), 384);
}

/// Characters as tokens through the binary, as docs/data.md's shakespeare_char section runs it:
/// `prepare --chars` takes the text's sorted characters as the vocabulary, a run takes it
/// (padded to 64), and `sample` writes characters of the corpus; a prompt character outside the
/// vocabulary is refused by name.
#[test]
fn prepare_chars_train_sample() {
    let dir = tempfile::tempdir().expect("tmp");
    let shakespeare =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench/tinyshakespeare.txt");
    let full = std::fs::read_to_string(shakespeare).expect("tinyshakespeare.txt");
    let cut = full
        .char_indices()
        .nth(60_000)
        .map_or(full.len(), |(i, _)| i);
    let corpus_txt = dir.path().join("corpus.txt");
    std::fs::write(&corpus_txt, &full[..cut]).expect("write corpus");
    let mut chars: Vec<char> = full[..cut].chars().collect();
    chars.sort_unstable();
    chars.dedup();
    let data = dir.path().join("data");
    let (t, d) = (corpus_txt.display().to_string(), data.display().to_string());
    let o = run_mtrain(&["prepare", "--chars", "--text", &t, "--out", &d]);
    let out = text(&o);
    assert!(o.status.success(), "prepare: {out}");
    assert!(
        out.contains(&format!(
            "vocab {}, 54000 train + 6000 val tokens, 1.00 bytes/token",
            chars.len()
        )),
        "{out}"
    );
    assert!(data.join("chars.json").exists() && !data.join("tokenizer.json").exists());

    let run = dir.path().join("run");
    let r = run.display().to_string();
    let o = run_mtrain(&[
        "--data",
        &d,
        "--run-dir",
        &r,
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--eval-every",
        "3",
        "--eval-iters",
        "2",
    ]);
    let out = text(&o);
    assert!(o.status.success(), "train: {out}");
    assert!(
        out.contains("| eval train ") && out.contains(" | val "),
        "{out}"
    );
    assert_eq!(meta_vocab(&run) as usize, chars.len().div_ceil(64) * 64);

    let o = run_mtrain(&[
        "sample",
        "--checkpoint",
        &r,
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "40",
    ]);
    assert!(o.status.success(), "sample: {}", text(&o));
    let sampled = String::from_utf8_lossy(&o.stdout)
        .trim_end_matches('\n')
        .to_string();
    assert!(sampled.starts_with("ROMEO:"), "{sampled}");
    assert_eq!(sampled.chars().count(), "ROMEO:".len() + 40, "{sampled:?}");
    assert!(sampled.chars().all(|c| chars.contains(&c)), "{sampled:?}");
    let o = run_mtrain(&["sample", "--checkpoint", &r, "--prompt", "€"]);
    let msg = text(&o);
    assert!(
        !o.status.success() && msg.contains("'€' is not in the corpus's vocabulary"),
        "{msg}"
    );
}

#[test]
fn prepare_encodes_with_an_existing_tokenizer() {
    let dir = tempfile::tempdir().expect("tmp");
    let first = dir.path().join("first.txt");
    std::fs::write(&first, corpus::generate(40_000, 1)).expect("write");
    let trained = dir.path().join("trained");
    prepare::prepare(&PrepareArgs {
        chars: false,
        text: first,
        vocab_size: Some(290),
        tokenizer: None,
        out: trained.clone(),
        val_fraction: 0.1,
    })
    .expect("train a tokenizer");
    let tokenizer_json = trained.join("tokenizer.json");

    // Over 1 MiB of another text, so it is encoded in more than one chunk.
    let second = dir.path().join("second.txt");
    let body = corpus::generate(1_200_000, 2);
    std::fs::write(&second, &body).expect("write");
    let out = dir.path().join("encoded");
    let s = prepare::prepare(&PrepareArgs {
        chars: false,
        text: second,
        vocab_size: None,
        tokenizer: Some(tokenizer_json.clone()),
        out: out.clone(),
        val_fraction: 0.05,
    })
    .expect("encode with the existing tokenizer");
    let tok = tokenizers::Tokenizer::from_file(&tokenizer_json).expect("load");
    let whole = tok
        .encode(String::from_utf8(body).expect("utf8"), false)
        .expect("encode");
    assert_eq!(s.vocab_size, tok.get_vocab_size(true));
    assert_eq!(s.train_tokens + s.val_tokens, whole.get_ids().len());
    let ds =
        mtrain_trainer::data::Dataset::open(&mtrain_trainer::data::DataSource::Shards(out.clone()))
            .expect("open shards");
    assert_eq!(ds.vocab_size, s.vocab_size);
    let copied = std::fs::read_to_string(out.join("tokenizer.json")).expect("copied");
    let reloaded = tokenizers::Tokenizer::from_str(&copied).expect("parse copy");
    assert_eq!(reloaded.get_vocab_size(true), s.vocab_size);
    let line = "the lion chased the goats.\n";
    assert_eq!(
        reloaded.encode(line, false).unwrap().get_ids(),
        tok.encode(line, false).unwrap().get_ids()
    );

    // Training a vocabulary and using a given tokenizer exclude each other; a missing file is named.
    let o = run_mtrain(&[
        "prepare",
        "--text",
        "x.txt",
        "--tokenizer",
        "t.json",
        "--vocab-size",
        "300",
    ]);
    assert!(!o.status.success());
    let e = prepare::prepare(&PrepareArgs {
        chars: false,
        text: dir.path().join("second.txt"),
        vocab_size: None,
        tokenizer: Some(dir.path().join("missing.json")),
        out: dir.path().join("never"),
        val_fraction: 0.1,
    })
    .unwrap_err();
    assert!(e.to_string().contains("missing.json"), "{e}");
    assert!(!dir.path().join("never").exists());
}

/// The small GPT-2 of the Hugging Face test: 250 ids (the model pads to 256, so the built-in
/// byte corpus fits it), 20 positions (the model keeps 16).
const HF_VOCAB: usize = 250;
const HF_POSITIONS: usize = 20;

fn small_gpt2() -> GptConfig {
    GptConfig {
        vocab_size: 256,
        block_size: 16,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        moe: None,
    }
}

/// Random GPT-2 tensors in Hugging Face's layout and names.
fn hf_tensors(cfg: &GptConfig) -> HashMap<String, Tensor> {
    let c = cfg.n_embd;
    let dev = &Device::Cpu;
    let randn =
        |shape: &[usize], mean: f32| Tensor::randn(mean, 0.2f32, shape, dev).expect("randn");
    let mut t = HashMap::new();
    let wte = randn(&[HF_VOCAB, c], 0.0);
    t.insert("lm_head.weight".to_string(), wte.clone());
    t.insert("transformer.wte.weight".to_string(), wte);
    t.insert(
        "transformer.wpe.weight".into(),
        randn(&[HF_POSITIONS, c], 0.0),
    );
    for i in 0..cfg.n_layer {
        let h = format!("transformer.h.{i}");
        for (name, shape, mean) in [
            ("ln_1.weight", vec![c], 1.0),
            ("ln_1.bias", vec![c], 0.0),
            ("attn.c_attn.weight", vec![c, 3 * c], 0.0),
            ("attn.c_attn.bias", vec![3 * c], 0.0),
            ("attn.c_proj.weight", vec![c, c], 0.0),
            ("attn.c_proj.bias", vec![c], 0.0),
            ("ln_2.weight", vec![c], 1.0),
            ("ln_2.bias", vec![c], 0.0),
            ("mlp.c_fc.weight", vec![c, 4 * c], 0.0),
            ("mlp.c_fc.bias", vec![4 * c], 0.0),
            ("mlp.c_proj.weight", vec![4 * c, c], 0.0),
            ("mlp.c_proj.bias", vec![c], 0.0),
        ] {
            t.insert(format!("{h}.{name}"), randn(&shape, mean));
        }
        // The causal-mask buffer older exports carry.
        let mask = Tensor::ones((1, 1, HF_POSITIONS, HF_POSITIONS), DType::F32, dev).unwrap();
        t.insert(format!("{h}.attn.bias"), mask);
    }
    t.insert("transformer.ln_f.weight".into(), randn(&[c], 1.0));
    t.insert("transformer.ln_f.bias".into(), randn(&[c], 0.0));
    t
}

fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    let mean = x.mean_keepdim(D::Minus1).unwrap();
    let xc = x.broadcast_sub(&mean).unwrap();
    let var = xc.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let xn = xc
        .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
        .unwrap();
    xn.broadcast_mul(w).unwrap().broadcast_add(b).unwrap()
}

/// HF's Conv1D: x (B, T, in) @ w (in, out) + b.
fn conv1d(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    x.broadcast_matmul(w).unwrap().broadcast_add(b).unwrap()
}

/// GPT-2's forward as Hugging Face's `GPT2LMHeadModel` computes it, from its tensors: logits
/// (B, T, HF_VOCAB).
fn hf_forward(t: &HashMap<String, Tensor>, cfg: &GptConfig, idx: &Tensor) -> Tensor {
    let g = |n: &str| t.get(n).unwrap_or_else(|| panic!("{n}"));
    let (b, n) = idx.dims2().unwrap();
    let (c, nh) = (cfg.n_embd, cfg.n_head);
    let hd = c / nh;
    let tok = g("transformer.wte.weight")
        .index_select(&idx.flatten_all().unwrap(), 0)
        .unwrap()
        .reshape((b, n, c))
        .unwrap();
    let pos = g("transformer.wpe.weight").narrow(0, 0, n).unwrap();
    let mut x = tok.broadcast_add(&pos).unwrap(); // (B, T, C)
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..n).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(mask, (n, n), &Device::Cpu).unwrap();
    for i in 0..cfg.n_layer {
        let p = |s: &str| g(&format!("transformer.h.{i}.{s}"));
        let h = layer_norm(&x, p("ln_1.weight"), p("ln_1.bias"));
        let qkv = conv1d(&h, p("attn.c_attn.weight"), p("attn.c_attn.bias")); // (B, T, 3C)
        let heads = |k: usize| {
            qkv.narrow(2, k * c, c)
                .unwrap()
                .reshape((b, n, nh, hd))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap() // (B, H, T, D)
        };
        let (q, k, v) = (heads(0), heads(1), heads(2));
        let att = (q.matmul(&k.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
        let att = softmax_last_dim(&att.broadcast_add(&mask).unwrap());
        let y = att
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, n, c))
            .unwrap(); // (B, T, C)
        x = (x + conv1d(&y, p("attn.c_proj.weight"), p("attn.c_proj.bias"))).unwrap();
        let h = layer_norm(&x, p("ln_2.weight"), p("ln_2.bias"));
        let f = conv1d(&h, p("mlp.c_fc.weight"), p("mlp.c_fc.bias"))
            .gelu()
            .unwrap();
        x = (x + conv1d(&f, p("mlp.c_proj.weight"), p("mlp.c_proj.bias"))).unwrap();
    }
    let x = layer_norm(&x, g("transformer.ln_f.weight"), g("transformer.ln_f.bias"));
    x.broadcast_matmul(&g("lm_head.weight").t().unwrap())
        .unwrap() // (B, T, V_hf)
}

fn softmax_last_dim(x: &Tensor) -> Tensor {
    let max = x.max_keepdim(D::Minus1).unwrap();
    let e = x.broadcast_sub(&max).unwrap().exp().unwrap();
    let s = e.sum_keepdim(D::Minus1).unwrap();
    e.broadcast_div(&s).unwrap()
}

#[test]
fn init_from_loads_the_hf_layout() {
    let cfg = small_gpt2();
    let hf = hf_tensors(&cfg);
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("model.safetensors");
    candle_core::safetensors::save(&hf, &file).expect("write safetensors");

    let weights = hf::load(&file, &cfg).expect("load the HF layout");
    let model = Gpt::new(cfg.clone(), &weights, &Device::Cpu).expect("model");
    let ids: Vec<u32> = (0..2 * 12).map(|i| (i * 37 % HF_VOCAB) as u32).collect();
    let idx = Tensor::from_vec(ids, (2, 12), &Device::Cpu).unwrap(); // (B, T)
    let ours = model.logits(&idx).expect("logits"); // (B, T, 256)
    assert_eq!(ours.dims(), &[2, 12, 256]);
    let want = hf_forward(&hf, &cfg, &idx); // (B, T, 250)
    let diff = (ours.narrow(2, 0, HF_VOCAB).unwrap() - &want)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let scale = want
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    println!("max |logit difference| {diff:.3e} (logits up to {scale:.3})");
    assert!(scale > 0.1, "a degenerate test: logits up to {scale}");
    assert!(diff < 1e-4, "logits differ from the HF forward by {diff}");
    let pad = ours
        .narrow(2, HF_VOCAB, 256 - HF_VOCAB)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(pad, 0.0, "the padded vocabulary's logits");

    // What does not fit is refused by name.
    let mut missing = hf.clone();
    missing.remove("transformer.h.1.mlp.c_fc.bias");
    let path = dir.path().join("missing.safetensors");
    candle_core::safetensors::save(&missing, &path).unwrap();
    let e = hf::load(&path, &cfg).unwrap_err().to_string();
    assert!(
        e.contains("h.1.mlp.c_fc.bias") && e.contains("missing.safetensors"),
        "{e}"
    );
    let deeper = GptConfig {
        n_layer: 1,
        ..cfg.clone()
    };
    let e = hf::load(&file, &deeper).unwrap_err().to_string();
    assert!(e.contains("h.1."), "{e}");
    let narrow = GptConfig {
        vocab_size: 64,
        ..cfg.clone()
    };
    let e = hf::load(&file, &narrow).unwrap_err().to_string();
    assert!(e.contains("250") && e.contains("64"), "{e}");

    // Through the binary: one step at a learning rate of 1e-9 keeps the loaded weights.
    let run = dir.path().join("run");
    let (f, r) = (file.display().to_string(), run.display().to_string());
    let o = run_mtrain(&[
        "--init-from",
        &f,
        "--run-dir",
        &r,
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--lr",
        "1e-9",
        "--min-lr",
        "0",
        "--set",
        "model.vocab_size=256",
        "--set",
        "model.block_size=16",
        "--set",
        "model.n_layer=2",
        "--set",
        "model.n_head=2",
        "--set",
        "model.n_embd=16",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let latest = std::fs::read_to_string(run.join("latest")).unwrap();
    let saved =
        mtrain_trainer::checkpoint::load(&run.join(latest.trim()), &Device::Cpu).unwrap();
    let w = &saved.tensor("h.0.attn.c_attn.weight", &Device::Cpu).unwrap(); // (3C, C)
    let hf_w = hf["transformer.h.0.attn.c_attn.weight"].t().unwrap(); // (C, 3C) -> (3C, C)
    let d = (w - &hf_w)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(d < 1e-6, "the run did not start from the file: {d}");
}
