//! Hugging Face both ways, and the real torchrun, checked against the real Python packages.
//!
//! - `export_then_init_from_gives_the_weights_back_bit_for_bit` (no Python): `mtrain export
//!   --hf` then `--init-from`'s loader, for the byte corpus (nothing dropped) and a BPE vocabulary
//!   of 300 padded to 320 (the padding rows come back zero); a model with experts is refused.
//! - `transformers_computes_mtrains_logits_for_a_tp2_pp2_run`: a model trained 3 steps under
//!   tp 2 × pp 2, exported; `GPT2LMHeadModel.from_pretrained` gives the logits mtrain's forward
//!   gives on the same tokens (f32, max |difference| ≤ 1e-5 · max |logit|).
//! - `init_from_reads_a_gpt2_saved_by_transformers`: `save_pretrained` of a random GPT2Config;
//!   the loaded model's logits are transformers' (same bound), and `mtrain --init-from DIR`
//!   trains from it; a config.json of another model is refused naming the key.
//! - `greedy_decoding_is_transformers_generate`: a model trained on `prepare`d BPE data,
//!   exported; 50 greedy tokens from transformers' `generate(do_sample=False)` are the tokens of
//!   mtrain's generate at top-k 1, and the text is `mtrain sample --top-k 1`'s.
//! - `torchrun_runs_the_job_the_launcher_runs`: `torchrun --standalone --nproc-per-node 2
//!   --no-python mtrain --dp 2` trains, and its losses and final weights are bit for bit those of
//!   `mtrain --dp 2` (mtrain's own launcher) on the same job.
//!
//! The Python side (`tests/hf_side.py`) runs in the virtual environment `.ci/run` builds from
//! `.ci/hf-requirements.txt` and exports as `MTRAIN_HF_VENV`. Without it these tests fail under
//! CI (`CI` set) and say they are skipped elsewhere.
//!
//! No test here hangs: a command still running after five minutes, or mtrain's generate in the
//! test's own process, fails the test with the stacks of its threads (`common`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use candle_core::{DType, Device, Tensor};
use mtrain_model::{Gpt, GptConfig};
use mtrain_trainer::checkpoint;
use mtrain_trainer::data::corpus;
use mtrain_trainer::tools::hf;

mod common;
use common::{clean_env, losses, mtrain, text, MTRAIN};

const HF_SIDE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/hf_side.py");
/// The bound on max |logit difference| / max |logit| between transformers and mtrain (f32).
const LOGITS_REL: f32 = 1e-5;

/// The model every test trains: 2 layers, 4 heads, width 32, context 64.
const MODEL: [&str; 8] = [
    "--set",
    "model.n_layer=2",
    "--set",
    "model.n_head=4",
    "--set",
    "model.n_embd=32",
    "--set",
    "model.block_size=64",
];

/// Run `cmd`, failing the test with its output unless it succeeds.
fn run_ok(mut cmd: Command, what: &str) -> Output {
    let out = common::output(&mut cmd);
    assert!(out.status.success(), "{what} failed:\n{}", text(&out));
    out
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// The test environment's directory, or `None` (skip) outside CI when there is none; under CI
/// its absence fails the test.
fn venv() -> Option<PathBuf> {
    let why = match std::env::var_os("MTRAIN_HF_VENV") {
        Some(v) if Path::new(&v).join("bin/python").is_file() => return Some(v.into()),
        Some(v) => format!(
            "MTRAIN_HF_VENV={} has no bin/python",
            Path::new(&v).display()
        ),
        None => "MTRAIN_HF_VENV is not set".to_string(),
    };
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    assert!(
        !ci,
        "{why}: under CI the Hugging Face tests must run (.ci/run builds the environment)"
    );
    eprintln!(
        "SKIPPED: {why} (a virtual environment with .ci/hf-requirements.txt installed, as .ci/run builds)"
    );
    None
}

/// `hf_side.py COMMAND ARGS` in the environment `venv`, offline.
fn hf_side(venv: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(venv.join("bin/python"));
    cmd.arg(HF_SIDE)
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env("TOKENIZERS_PARALLELISM", "false")
        .stdin(Stdio::null());
    run_ok(cmd, &format!("hf_side.py {}", args[0]))
}

/// Train `steps` steps of [`MODEL`] on `data` (None: the built-in corpus) into `run`, with the
/// layout flags `layout`.
fn train(run: &Path, data: Option<&Path>, steps: usize, layout: &[&str]) {
    let steps = steps.to_string();
    let run = s(run);
    let mut args: Vec<String> = layout.iter().map(|a| a.to_string()).collect();
    args.extend(
        [
            "--steps",
            &steps,
            "--batch-size",
            "4",
            "--seq-len",
            "64",
            "--eval-every",
            "0",
            "--log-every",
            "10",
            "--lr",
            "3e-3",
            "--run-dir",
            &run,
        ]
        .map(String::from),
    );
    args.extend(MODEL.map(String::from));
    if let Some(d) = data {
        args.extend(["--data".to_string(), s(d)]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_ok(mtrain(&args), &format!("mtrain {}", args.join(" ")));
}

/// `mtrain prepare` of a generated corpus with a BPE vocabulary of `vocab` into `dir`/data.
fn prepare(dir: &Path, vocab: usize) -> PathBuf {
    let corpus_txt = dir.join("corpus.txt");
    std::fs::write(&corpus_txt, corpus::generate(60_000, 3)).expect("write the corpus");
    let data = dir.join("data");
    let vocab = vocab.to_string();
    run_ok(
        mtrain(&[
            "prepare",
            "--text",
            &s(&corpus_txt),
            "--vocab-size",
            &vocab,
            "--out",
            &s(&data),
        ]),
        "mtrain prepare",
    );
    data
}

/// `mtrain export --hf out --checkpoint run`.
fn export(run: &Path, out: &Path) -> String {
    let o = run_ok(
        mtrain(&["export", "--hf", &s(out), "--checkpoint", &s(run)]),
        "mtrain export",
    );
    text(&o)
}

/// The newest checkpoint of `run` and its model config.
fn newest(run: &Path) -> (checkpoint::Checkpoint, GptConfig) {
    let dir = checkpoint::resolve(run).expect("a checkpoint");
    let ckpt = checkpoint::load(&dir, &Device::Cpu).expect("load the checkpoint");
    let cfg = ckpt.meta.config.gpt_config().expect("its model");
    (ckpt, cfg)
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Bit patterns of a tensor's f32 values.
fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// (B, T) token ids below `vocab`, spread over the vocabulary.
fn some_ids(b: usize, t: usize, vocab: usize) -> Vec<Vec<u32>> {
    (0..b)
        .map(|r| {
            (0..t)
                .map(|i| ((r * 131 + i * 37 + 5) % vocab) as u32)
                .collect()
        })
        .collect()
}

/// mtrain's logits for `ids` from `weights` next to transformers' for the model in `dir`:
/// asserts the bound on the first `vocab` columns, returns (max |difference|, max |logit|).
fn compare_logits(
    venv: &Path,
    dir: &Path,
    cfg: &GptConfig,
    weights: &BTreeMap<String, Tensor>,
    ids: &[Vec<u32>],
    vocab: usize,
) -> (f32, f32) {
    let (b, t) = (ids.len(), ids[0].len());
    let flat: Vec<u32> = ids.concat();
    let idx = Tensor::from_vec(flat, (b, t), &Device::Cpu).unwrap(); // (B, T)
    let model = Gpt::new(cfg.clone(), weights, &Device::Cpu).expect("the model");
    let ours = model.logits(&idx).unwrap(); // (B, T, V padded)
    let out = dir.join("hf-logits.safetensors");
    let ids_json = serde_json::to_string(ids).unwrap();
    hf_side(venv, &["logits", &s(dir), &ids_json, &s(&out)]);
    let theirs = candle_core::safetensors::load(&out, &Device::Cpu).unwrap()["logits"].clone(); // (B, T, vocab)
    assert_eq!(theirs.dims(), &[b, t, vocab], "transformers' logits");
    let diff = max_abs(&(ours.narrow(2, 0, vocab).unwrap() - &theirs).unwrap());
    let scale = max_abs(&theirs);
    println!(
        "max |logit difference| {diff:.3e}, logits up to {scale:.3}, ratio {:.3e}",
        diff / scale
    );
    assert!(scale > 0.1, "a degenerate comparison: logits up to {scale}");
    assert!(
        diff <= LOGITS_REL * scale,
        "transformers' logits differ from mtrain's by {diff:.3e} (bound {LOGITS_REL} x {scale:.3})"
    );
    (diff, scale)
}

#[test]
fn export_then_init_from_gives_the_weights_back_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let bpe = prepare(dir.path(), 300);
    for (name, data, dropped) in [("bytes", None, 0), ("bpe", Some(bpe.as_path()), 20)] {
        let run = dir.path().join(format!("run-{name}"));
        train(&run, data, 2, &[]);
        let out = dir.path().join(format!("hf-{name}"));
        let said = export(&run, &out);
        let (ckpt, cfg) = newest(&run);
        if dropped > 0 {
            assert!(said.contains(&format!("{dropped} padding rows")), "{said}");
        }
        let back = hf::load(&out, &cfg).expect("--init-from reads the export");
        let model = ckpt.full_model(&Device::Cpu).unwrap();
        assert_eq!(
            back.keys().collect::<Vec<_>>(),
            model.keys().collect::<Vec<_>>()
        );
        for (k, t) in &model {
            let (want, got) = (bits(t), bits(&back[k]));
            if k == "wte.weight" && dropped > 0 {
                let kept = (cfg.vocab_size - dropped) * cfg.n_embd;
                assert_eq!(got[..kept], want[..kept], "{name}: `{k}`'s exported rows");
                assert!(
                    got[kept..].iter().all(|&b| b == 0),
                    "{name}: the padding rows are zero"
                );
                assert!(
                    want[kept..].iter().any(|&b| b != 0),
                    "{name}: training moved the padding rows"
                );
            } else {
                assert_eq!(
                    got, want,
                    "{name}: `{k}` is not bit for bit the checkpoint's"
                );
            }
        }
    }

    // A model with experts has no GPT-2 form: the export says so and writes nothing.
    let run = dir.path().join("run-moe");
    let args = [
        "--model",
        "moe-tiny",
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--eval-every",
        "0",
        "--run-dir",
        &s(&run),
    ];
    run_ok(mtrain(&args), "mtrain --model moe-tiny");
    let out = dir.path().join("hf-moe");
    let o = common::output(&mut mtrain(&[
        "export",
        "--hf",
        &s(&out),
        "--checkpoint",
        &s(&run),
    ]));
    let said = text(&o);
    assert!(!o.status.success(), "{said}");
    assert!(
        said.contains("experts") && said.contains("GPT2LMHeadModel"),
        "{said}"
    );
    assert!(!out.exists(), "a refused export wrote {}", out.display());
}

#[test]
fn transformers_computes_mtrains_logits_for_a_tp2_pp2_run() {
    let Some(venv) = venv() else { return };
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    train(&run, None, 3, &["--tp", "2", "--pp", "2"]);
    let out = dir.path().join("hf");
    export(&run, &out);
    let (ckpt, cfg) = newest(&run);
    assert_eq!(ckpt.meta.step, 3);
    let model = ckpt.full_model(&Device::Cpu).unwrap();
    compare_logits(&venv, &out, &cfg, &model, &some_ids(2, 64, 256), 256);
}

#[test]
fn init_from_reads_a_gpt2_saved_by_transformers() {
    let Some(venv) = venv() else { return };
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("saved");
    let config =
        r#"{"vocab_size": 300, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4}"#;
    hf_side(&venv, &["save-random", &s(&saved), config]);
    assert!(saved.join("model.safetensors").is_file() && saved.join("config.json").is_file());
    let cfg = GptConfig {
        vocab_size: 320,
        block_size: 64,
        n_layer: 2,
        n_head: 4,
        n_embd: 32,
        moe: None,
    };
    let weights = hf::load(&saved, &cfg).expect("load what save_pretrained wrote");
    compare_logits(&venv, &saved, &cfg, &weights, &some_ids(2, 64, 300), 300);

    // Through the binary: trains from it (BPE data of vocabulary 300 fits).
    let data = prepare(dir.path(), 300);
    let run = dir.path().join("run");
    let mut args = vec![
        "--init-from".to_string(),
        s(&saved),
        "--data".into(),
        s(&data),
        "--steps".into(),
        "2".into(),
        "--batch-size".into(),
        "2".into(),
        "--seq-len".into(),
        "32".into(),
        "--eval-every".into(),
        "0".into(),
        "--run-dir".into(),
        s(&run),
    ];
    args.extend(MODEL.map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = run_ok(mtrain(&args), "mtrain --init-from");
    assert!(
        text(&o).contains("initial weights from a Hugging Face GPT-2 file"),
        "{}",
        text(&o)
    );

    // The directory's config.json is checked: another number of heads is refused by name.
    let other = GptConfig { n_head: 2, ..cfg };
    let e = hf::load(&saved, &other).unwrap_err().to_string();
    assert!(
        e.contains("n_head is 4, model.n_head is 2") && e.contains("config.json"),
        "{e}"
    );
}

#[test]
fn greedy_decoding_is_transformers_generate() {
    let Some(venv) = venv() else { return };
    let dir = tempfile::tempdir().unwrap();
    let data = prepare(dir.path(), 300);
    let run = dir.path().join("run");
    train(&run, Some(&data), 150, &[]);
    let out = dir.path().join("hf");
    export(&run, &out);
    assert!(out.join("tokenizer.json").is_file());
    let prompt = "the ";
    let n = 50;

    let o = hf_side(&venv, &["generate", &s(&out), prompt, &n.to_string()]);
    let line = String::from_utf8_lossy(&o.stdout);
    let theirs: serde_json::Value = serde_json::from_str(line.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: {line}"));
    let ids = |k: &str| -> Vec<u32> {
        theirs[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let (prompt_ids, their_ids) = (ids("prompt_ids"), ids("ids"));

    // The same tokens from mtrain's generate at top-k 1 (what `mtrain sample --top-k 1` runs).
    let (ckpt, cfg) = newest(&run);
    let tok = tokenizers::Tokenizer::from_file(data.join("tokenizer.json")).unwrap();
    let our_prompt = tok.encode(prompt, false).unwrap().get_ids().to_vec();
    assert_eq!(
        prompt_ids, our_prompt,
        "AutoTokenizer encodes the prompt as mtrain does"
    );
    let guard = common::watchdog("mtrain's generate, in the test's process");
    let weights = ckpt.full_model(&Device::Cpu).unwrap();
    let model = Gpt::new(cfg, &weights, &Device::Cpu).unwrap();
    let idx = Tensor::from_vec(our_prompt.clone(), (1, our_prompt.len()), &Device::Cpu).unwrap();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(0);
    let ours: Vec<u32> = model
        .generate(&idx, n, 0.8, Some(1), &mut rng)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1()
        .unwrap();
    drop(guard);
    assert_eq!(ours.len(), our_prompt.len() + n);
    let distinct: std::collections::BTreeSet<_> = ours[our_prompt.len()..].iter().collect();
    println!(
        "{n} greedy tokens, {} distinct: {:?}",
        distinct.len(),
        &ours[our_prompt.len()..]
    );
    assert!(distinct.len() >= 5, "a degenerate continuation: {ours:?}");
    assert_eq!(
        ours, their_ids,
        "mtrain's greedy tokens vs transformers' generate(do_sample=False)"
    );

    // And the command line's text is transformers' decoded text.
    let o = run_ok(
        mtrain(&[
            "sample",
            "--checkpoint",
            &s(&run),
            "--prompt",
            prompt,
            "--max-new-tokens",
            &n.to_string(),
            "--top-k",
            "1",
        ]),
        "mtrain sample",
    );
    let sampled = String::from_utf8_lossy(&o.stdout);
    let sampled = sampled.strip_suffix('\n').unwrap_or(&sampled);
    assert_eq!(
        sampled,
        theirs["text"].as_str().unwrap(),
        "mtrain sample --top-k 1 vs transformers"
    );
}

#[test]
fn torchrun_runs_the_job_the_launcher_runs() {
    let Some(venv) = venv() else { return };
    let dir = tempfile::tempdir().unwrap();
    let job = |run: &Path| -> Vec<String> {
        let mut a: Vec<String> = [
            "--dp",
            "2",
            "--steps",
            "4",
            "--batch-size",
            "4",
            "--seq-len",
            "32",
            "--eval-every",
            "0",
            "--log-every",
            "1",
            "--run-dir",
        ]
        .map(String::from)
        .to_vec();
        a.push(s(run));
        a.extend(MODEL.map(String::from));
        a
    };
    let by_launcher = dir.path().join("launcher");
    run_ok(
        mtrain(
            &job(&by_launcher)
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        ),
        "mtrain --dp 2",
    );

    let by_torchrun = dir.path().join("torchrun");
    let mut cmd = Command::new(venv.join("bin/torchrun"));
    cmd.args([
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-python",
        MTRAIN,
    ])
    .args(job(&by_torchrun));
    clean_env(&mut cmd);
    // torchrun --standalone serves its own store on a free port P of its choosing, and mtrain's
    // store takes P + 1 by the MASTER_PORT rule (unit-tested in comm's env.rs); P + 1 can be any
    // socket's ephemeral port while the other tests of this file run, so the test names a port
    // it found free instead, through the documented override.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    cmd.env("MTRAIN_STORE_PORT", free.local_addr().unwrap().port().to_string());
    drop(free);
    let o = run_ok(
        cmd,
        "torchrun --standalone --nproc-per-node 2 --no-python mtrain --dp 2",
    );
    let log = text(&o);
    assert!(log.contains("step 4/4 | loss "), "{log}");

    let loss_bits = |run: &Path| -> Vec<u64> {
        losses(run).into_iter().map(|(_, l)| l.to_bits()).collect()
    };
    let (ours, theirs) = (loss_bits(&by_launcher), loss_bits(&by_torchrun));
    assert_eq!(ours.len(), 4);
    assert_eq!(
        ours, theirs,
        "the losses under torchrun and under mtrain's launcher"
    );
    let (a, _) = newest(&by_launcher);
    let (b, _) = newest(&by_torchrun);
    let (a, b) = (a.full_model(&Device::Cpu).unwrap(), b.full_model(&Device::Cpu).unwrap());
    for (k, t) in &a {
        assert_eq!(bits(t), bits(&b[k]), "`{k}` after the torchrun job");
    }
}
