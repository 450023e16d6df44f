//! Trainer tests: they call the library directly, on CPU, with the tiny model and few steps.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::Device;
use mtrain_comm::{CpuBackend, CpuOptions, LaunchEnv, MeshDims};
use mtrain_model::GptConfig;
use mtrain_trainer::checkpoint::{self, CheckpointError};
use mtrain_trainer::config::{TrainArgs, TrainConfig};
use mtrain_trainer::data::{corpus, write_shard, DataLoader, DataSource, Dataset, Sampling};
use mtrain_trainer::memory::CountingAlloc;
use mtrain_trainer::tools::prepare::{self, PrepareArgs};
use mtrain_trainer::tools::sample::{self, SampleArgs};
use mtrain_trainer::train::{self, TrainSummary};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// The allocator's counters are process-wide, so tests run one at a time: the memory test's
/// phase-to-phase differences must not include another test's allocations.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

const ONE: MeshDims = MeshDims {
    dp: 1,
    pp: 1,
    tp: 1,
    ep: 1,
    cp: 1,
};

fn run(cfg: &TrainConfig) -> TrainSummary {
    let backend =
        CpuBackend::init(&LaunchEnv::single(), CpuOptions::default()).expect("single-rank backend");
    train::run(cfg, &backend, ONE).expect("training runs")
}

/// A short run of the tiny model in `dir`.
fn short(dir: &Path, steps: u64) -> TrainConfig {
    TrainConfig {
        steps,
        batch_size: 4,
        seq_len: 32,
        warmup_steps: 2,
        eval_every: 0,
        log_every: 0,
        run_dir: dir.to_path_buf(),
        ..TrainConfig::default()
    }
}

/// The default run (200 steps of tiny on the built-in corpus) must learn the grammar.
///
/// The corpus's entropy rate is 0.398 nats/byte and its unigram entropy 3.199 nats/byte (computed
/// exactly in `data::corpus`). A model that only learned byte frequencies sits at 3.2; one that
/// learned the word lists but not the structure (which word slot comes next, agreement, sums) is
/// far above 1.2 (measured: 1.22 at step 100 of this run, 0.85 at step 200). The bar, 1.0 nats (31% of the unigram entropy), needs the word-level structure.
/// The loss can never go below the entropy rate on held-out text: a value under 0.398 - 0.05 would
/// mean the validation data leaked or the loss is wrong.
#[test]
fn tiny_learns_the_builtin_corpus_and_samples() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    // The default run with half the default batch (8 x 64 tokens per step), to keep CI fast.
    let cfg = TrainConfig {
        batch_size: 8,
        run_dir: dir.path().to_path_buf(),
        log_every: 50,
        ..TrainConfig::default()
    };
    assert_eq!(cfg.steps, 200);
    let s = run(&cfg);
    let (last_step, val) = *s.val_losses.last().expect("evaluated at the end");
    assert_eq!(last_step, 199);
    let (rate, unigram) = (corpus::entropy_rate_nats(), corpus::unigram_entropy_nats());
    eprintln!(
        "val loss {val:.4} (entropy rate {rate:.3}, unigram {unigram:.3}); {:.0} tok/s",
        s.tokens_per_s
    );
    assert!(
        val < 1.0,
        "validation loss {val} is not below the 1.0 bar (unigram entropy {unigram:.3})"
    );
    assert!(
        val > rate - 0.05,
        "validation loss {val} is below the entropy rate {rate:.3}: impossible"
    );
    assert!(
        s.losses[0] > 5.0,
        "the first loss {} should be near ln(256) = 5.55",
        s.losses[0]
    );

    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    assert!(metrics.lines().count() >= 4 && metrics.contains("\"val_loss\""));

    // Sampling from the final checkpoint continues the grammar's vocabulary.
    let text = sample::sample(&SampleArgs {
        checkpoint: dir.path().to_path_buf(),
        prompt: "the red ".into(),
        max_new_tokens: 60,
        temperature: 0.0,
        top_k: 0,
        seed: 0,
        tokenizer: None,
        device: mtrain_trainer::config::DeviceKind::Cpu,
        no_kv_cache: false,
        profile_ops: false,
    })
    .unwrap()
    .text;
    eprintln!("sample: {text:?}");
    assert!(text.starts_with("the red ") && text.len() >= 60, "{text:?}");
    let continuation = &text["the red ".len()..];
    assert!(
        continuation.contains('\n') && continuation.contains("the "),
        "greedy continuation of a trained model should end lines and start new ones: {text:?}"
    );
}

/// Interrupting at step 6 and resuming gives bit-identical losses for steps 6..12, training and
/// evaluated (the batches at random offsets continue from the checkpoint's data position).
#[test]
fn resume_reproduces_the_uninterrupted_loss_series() {
    check_resume(0.0);
}

/// The same with dropout 0.1: the masks are keyed by the step, so the resumed run draws the
/// uninterrupted run's masks, bit for bit.
#[test]
fn resume_with_dropout_reproduces_the_uninterrupted_loss_series() {
    check_resume(0.1);
}

fn check_resume(dropout: f64) {
    let _serial = serial();
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let full = run(&TrainConfig {
        ckpt_every: 6,
        grad_accum: 2,
        eval_every: 4,
        eval_iters: 2,
        dropout,
        ..short(a.path(), 12)
    });
    let ckpt6 = a.path().join(checkpoint::step_dir_name(6));
    let resumed = run(&TrainConfig {
        ckpt_every: 6,
        grad_accum: 2,
        eval_every: 4,
        eval_iters: 2,
        dropout,
        resume: Some(ckpt6),
        ..short(b.path(), 12)
    });
    if dropout > 0.0 {
        let plain = tempfile::tempdir().unwrap();
        let without = run(&TrainConfig {
            grad_accum: 2,
            ..short(plain.path(), 12)
        });
        assert_ne!(
            without.losses, full.losses,
            "dropout {dropout} changed nothing"
        );
    }
    assert_eq!(resumed.start_step, 6);
    assert_eq!(
        resumed.losses,
        full.losses[6..].to_vec(),
        "loss series differ after resume"
    );
    let after = |v: &[(u64, f64)]| v.iter().copied().filter(|e| e.0 >= 6).collect::<Vec<_>>();
    assert_eq!(after(&resumed.val_losses), after(&full.val_losses));
    assert_eq!(
        after(&resumed.train_eval_losses),
        after(&full.train_eval_losses)
    );
    assert_eq!(
        resumed.val_losses.len(),
        2,
        "evaluated after steps 8 and 12"
    );
    let wa = checkpoint::load(&a.path().join(checkpoint::step_dir_name(12)), &Device::Cpu).unwrap();
    let wb = checkpoint::load(&b.path().join(checkpoint::step_dir_name(12)), &Device::Cpu).unwrap();
    let (wa, wb) = (wa.full_model(&Device::Cpu).unwrap(), wb.full_model(&Device::Cpu).unwrap());
    for (name, t) in &wa {
        let diff = (t - &wb[name])
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(diff, 0.0, "weights of {name} differ after resume");
    }
}

/// The analytic byte counts equal the bytes of the real tensors.
#[test]
fn analytic_parameter_bytes_equal_the_tensors() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let s = run(&short(dir.path(), 1));
    let ckpt = checkpoint::load(s.last_checkpoint.as_ref().unwrap(), &Device::Cpu).unwrap();
    let (model, optim) = (
        ckpt.full_model(&Device::Cpu).unwrap(),
        ckpt.full_optim(&Device::Cpu).unwrap(),
    );
    let bytes = |ts: &BTreeMap<String, candle_core::Tensor>| -> u64 {
        ts.values()
            .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum()
    };
    assert_eq!(s.layout.n_params, GptConfig::tiny().n_params() as u64);
    assert_eq!(s.layout.params(), bytes(&model));
    assert_eq!(
        s.layout.grads(),
        bytes(&model),
        "fp32 gradients, one per parameter"
    );
    assert_eq!(
        s.layout.optim(),
        bytes(&optim.m) + bytes(&optim.v)
    );
    assert_eq!(s.layout.total(), 16 * s.layout.n_params);
}

/// The memory report measures each phase with the counting allocator and writes JSON lines.
#[test]
fn memory_report_measures_phases() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let s = run(&TrainConfig {
        mem_report: true,
        ..short(dir.path(), 2)
    });
    let text = std::fs::read_to_string(dir.path().join("memory.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    let r = &lines[1];
    let at = |phase: &str| -> u64 {
        r["measured"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p[0] == phase)
            .unwrap()[1]
            .as_u64()
            .unwrap()
    };
    let peak = r["peak"].as_u64().unwrap();
    // Parameters and Adam state are alive during the whole step: at least 12 bytes per parameter.
    assert!(
        at("start") >= 12 * s.layout.n_params,
        "start {} < 12 * {}",
        at("start"),
        s.layout.n_params
    );
    // The forward keeps activations: memory grows from start to after_forward; peak bounds all.
    assert!(at("after_forward") > at("start"));
    for p in [
        "start",
        "after_forward",
        "after_backward",
        "after_optimizer",
    ] {
        assert!(peak >= at(p), "peak {peak} below {p} {}", at(p));
    }
    assert_eq!(r["analytic"]["params"].as_u64().unwrap(), s.layout.params());
}

/// A truncated or corrupted checkpoint is refused with a message naming the file, and the previous
/// checkpoint still loads and resumes.
#[test]
fn damaged_checkpoint_is_refused_and_the_previous_one_stays_usable() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    run(&TrainConfig {
        ckpt_every: 2,
        ..short(dir.path(), 4)
    });
    let step2 = dir.path().join(checkpoint::step_dir_name(2));
    let step4 = dir.path().join(checkpoint::step_dir_name(4));
    assert_eq!(checkpoint::latest(dir.path()).unwrap(), Some(step4.clone()));

    // Truncate the newest shard file: refused on opening, naming the file and its rank.
    let shard_file = step4.join("rank-00000.safetensors");
    let data = std::fs::read(&shard_file).unwrap();
    std::fs::write(&shard_file, &data[..data.len() / 2]).unwrap();
    let err = checkpoint::load(&step4, &Device::Cpu)
        .err()
        .expect("truncated checkpoint refused");
    let msg = err.to_string();
    assert!(
        matches!(err, CheckpointError::Corrupt { .. })
            && msg.contains("rank-00000.safetensors (written by rank 0)")
            && msg.contains("truncated"),
        "{msg}"
    );

    // Same length, one flipped byte in the last piece (an optimizer moment): its checksum
    // refuses it when read, naming the file, the rank and the piece.
    let mut o = data.clone();
    let k = o.len() - 3;
    o[k] ^= 0x40;
    std::fs::write(&shard_file, &o).unwrap();
    let c = checkpoint::load(&step4, &Device::Cpu).expect("sizes and manifest are intact");
    let msg = c.full_optim(&Device::Cpu).err().expect("corrupt piece refused").to_string();
    assert!(
        msg.contains("rank-00000.safetensors (written by rank 0)")
            && msg.contains("v of `")
            && msg.contains("checksum"),
        "{msg}"
    );
    c.full_model(&Device::Cpu).expect("the weights' pieces are intact");

    // The previous checkpoint is intact, is what `latest` resumption falls back to, and resumes.
    checkpoint::load(&step2, &Device::Cpu).unwrap();
    let mut skipped = Vec::new();
    let c =
        checkpoint::load_latest_valid(dir.path(), &Device::Cpu, |e| skipped.push(e.to_string()))
            .unwrap();
    assert_eq!((c.dir.clone(), c.meta.step, skipped.len()), (step2, 2, 1));
    assert!(skipped[0].contains("rank-00000.safetensors (written by rank 0) checksum"), "{skipped:?}");
    let resumed = run(&TrainConfig {
        resume: Some(PathBuf::from("latest")),
        ..short(dir.path(), 4)
    });
    assert_eq!((resumed.start_step, resumed.losses.len()), (2, 2));
}

/// A full-tensor checkpoint (format v2, what runs wrote before sharded checkpoints) still
/// resumes, through the same source interface, to the same losses as the sharded one.
#[test]
fn a_full_tensor_checkpoint_still_resumes() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let full = run(&TrainConfig {
        ckpt_every: 2,
        ..short(&dir.path().join("full"), 4)
    });
    let c = checkpoint::load(&dir.path().join("full").join(checkpoint::step_dir_name(2)), &Device::Cpu)
        .unwrap();
    let (model, optim) = (
        c.full_model(&Device::Cpu).unwrap(),
        c.full_optim(&Device::Cpu).unwrap(),
    );
    let data = checkpoint::CheckpointData {
        step: 2,
        config: &c.meta.config,
        data_position: c.meta.data_position,
        model: &model,
        optim: &optim,
    };
    let v2 = checkpoint::save_full(&dir.path().join("v2"), &data).unwrap();
    assert!(v2.join("model.safetensors").is_file());
    let back = checkpoint::load(&v2, &Device::Cpu).unwrap();
    assert_eq!(back.meta.format, checkpoint::FORMAT_FULL);
    let resumed = run(&TrainConfig {
        resume: Some(v2),
        ..short(&dir.path().join("resumed"), 4)
    });
    assert_eq!(resumed.start_step, 2);
    assert_eq!(resumed.losses, full.losses[2..], "losses after resuming the v2 checkpoint");
}

/// meta.json is covered by a checksum too: an edited step or data position, or a missing
/// meta.digest, is refused naming the file, before anything of the checkpoint is used.
#[test]
fn edited_checkpoint_metadata_is_refused() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let s = run(&short(dir.path(), 2));
    let ckpt = s.last_checkpoint.expect("a final checkpoint");
    let meta_file = ckpt.join("meta.json");
    let meta = std::fs::read_to_string(&meta_file).unwrap();
    checkpoint::load(&ckpt, &Device::Cpu).expect("the untouched checkpoint loads");
    for (from, to) in [
        ("\"step\": 2,", "\"step\": 1,"),
        ("\"data_position\": 2,", "\"data_position\": 9,"),
    ] {
        assert!(meta.contains(from), "{from} not in meta.json:\n{meta}");
        std::fs::write(&meta_file, meta.replace(from, to)).unwrap();
        let err = checkpoint::load(&ckpt, &Device::Cpu)
            .err()
            .expect("edited meta.json refused");
        let msg = err.to_string();
        assert!(
            matches!(err, CheckpointError::Corrupt { .. })
                && msg.contains("meta.json checksum")
                && msg.contains("edited"),
            "{from} -> {to}: {msg}"
        );
    }
    std::fs::write(&meta_file, &meta).unwrap();
    std::fs::remove_file(ckpt.join("meta.digest")).unwrap();
    let msg = checkpoint::load(&ckpt, &Device::Cpu)
        .err()
        .expect("unsealed meta.json refused")
        .to_string();
    assert!(msg.contains("meta.digest is missing"), "{msg}");
}

/// A checkpoint records its model; resuming it into a different architecture is refused naming
/// every key that differs, even where the tensor shapes agree (n_head 4 vs 8 at n_embd 64).
#[test]
fn resuming_into_a_different_architecture_is_refused_naming_the_keys() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let s = run(&short(dir.path(), 2));
    let other = GptConfig {
        n_head: 8,
        n_layer: 2,
        ..GptConfig::tiny()
    };
    let backend =
        CpuBackend::init(&LaunchEnv::single(), CpuOptions::default()).expect("single-rank backend");
    let err = train::run(
        &TrainConfig {
            model: mtrain_trainer::config::ModelSpec::Config(other),
            resume: s.last_checkpoint.clone(),
            ..short(dir.path(), 4)
        },
        &backend,
        ONE,
    )
    .err()
    .expect("a different architecture is refused");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("written for a different model")
            && msg.contains("n_head: 4 vs 8")
            && msg.contains("n_layer: 4 vs 2"),
        "{msg}"
    );
    // Same shapes, different heads: the shapes alone would have let it through.
    let heads = GptConfig {
        n_head: 8,
        ..GptConfig::tiny()
    };
    let c = checkpoint::load(s.last_checkpoint.as_ref().unwrap(), &Device::Cpu).unwrap();
    let err = c.check_model(&heads).unwrap_err().to_string();
    assert!(
        err.contains("n_head: 4 vs 8") && !err.contains("n_layer"),
        "{err}"
    );
    c.check_model(&GptConfig::tiny())
        .expect("the same model is accepted");
}

/// A checkpoint that cannot be written says which operation failed on which path.
#[test]
fn checkpoint_io_errors_name_the_operation_and_the_path() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let s = run(&short(dir.path(), 1));
    let c = checkpoint::load(s.last_checkpoint.as_ref().unwrap(), &Device::Cpu).unwrap();
    // The run directory's place is taken by a regular file.
    let blocked = dir.path().join("not-a-dir");
    std::fs::write(&blocked, b"x").unwrap();
    let msg = checkpoint::prepare_tmp(&blocked.join("run"), 1)
        .err()
        .expect("a sharded save fails")
        .to_string();
    assert!(
        msg.starts_with(&format!(
            "creating directory {}: ",
            blocked.join("run").display()
        )),
        "{msg}"
    );
    let (model, optim) = (
        c.full_model(&Device::Cpu).unwrap(),
        c.full_optim(&Device::Cpu).unwrap(),
    );
    let data = checkpoint::CheckpointData {
        step: 1,
        config: &c.meta.config,
        data_position: 1,
        model: &model,
        optim: &optim,
    };
    let msg = checkpoint::save_full(&blocked.join("run"), &data)
        .err()
        .expect("save fails")
        .to_string();
    assert!(
        msg.starts_with(&format!(
            "creating directory {}: ",
            blocked.join("run").display()
        )),
        "{msg}"
    );
}

/// Under epoch sampling, dp ranks with batch B together see exactly the rows one rank sees with
/// batch B·dp, every step, across an epoch boundary.
#[test]
fn epoch_sampling_slices_partition_the_global_batch() {
    let _serial = serial();
    let ds = Dataset::open(&DataSource::Builtin).unwrap();
    let (t, b, dp, seed) = (32, 2, 4, 7);
    let epochs = |l: DataLoader| l.with_sampling(Sampling::Epochs).unwrap();
    let mut one = epochs(DataLoader::new(ds.train.clone(), t, b * dp, 0, 1, seed).unwrap());
    let mut ranks: Vec<DataLoader> = (0..dp)
        .map(|r| epochs(DataLoader::new(ds.train.clone(), t, b, r, dp, seed).unwrap()))
        .collect();
    let per_epoch = one.batches_per_epoch();
    assert_eq!(per_epoch, ranks[0].batches_per_epoch());
    let start = per_epoch - 2; // cross into epoch 1
    one.set_position(start);
    ranks.iter_mut().for_each(|l| l.set_position(start));
    for _ in 0..4 {
        let global = one.next_batch();
        let mut inputs = Vec::new();
        let mut targets = Vec::new();
        for l in ranks.iter_mut() {
            let part = l.next_batch();
            assert_eq!(part.epoch, global.epoch);
            inputs.extend(part.inputs);
            targets.extend(part.targets);
        }
        assert_eq!(inputs, global.inputs);
        assert_eq!(targets, global.targets);
        assert_eq!(
            &global.inputs[1..t],
            &global.targets[..t - 1],
            "targets are inputs shifted by one"
        );
    }
    assert_eq!(one.epoch(), 1);
    // A new epoch reshuffles: the first batch of epoch 1 differs from that of epoch 0.
    let mut fresh = epochs(DataLoader::new(ds.train.clone(), t, b * dp, 0, 1, seed).unwrap());
    let e0 = fresh.next_batch();
    fresh.set_position(per_epoch);
    assert_ne!(e0.inputs, fresh.next_batch().inputs);
}

/// Under random offsets (the default), dp ranks with batch B draw exactly the rows one rank
/// draws with batch B·dp, for every micro-batch of every step, and one rank accumulating dp
/// times as many micro-batches of B rows draws them too, in the same order (parity's MoE
/// reference); the loader's position alone decides what comes next: a loader set to position k
/// continues the sequence of one that consumed k batches. Evaluation batches are their own draws
/// and move no position.
#[test]
fn random_offsets_give_every_layout_the_same_global_batch() {
    let _serial = serial();
    let ds = Dataset::open(&DataSource::Builtin).unwrap();
    let (t, b, dp, seed, accum) = (32, 2, 4, 7, 3);
    let loader = |rows, r, n| {
        DataLoader::new(ds.train.clone(), t, rows, r, n, seed)
            .unwrap()
            .with_grad_accum(accum)
            .unwrap()
    };
    let mut one = loader(b * dp, 0, 1);
    let mut ranks: Vec<DataLoader> = (0..dp).map(|r| loader(b, r, dp)).collect();
    let mut two: Vec<DataLoader> = (0..2).map(|r| loader(b * dp / 2, r, 2)).collect();
    let mut accumulating = DataLoader::new(ds.train.clone(), t, b, 0, 1, seed)
        .unwrap()
        .with_grad_accum(accum * dp)
        .unwrap();
    let mut seen = Vec::new();
    for step in 0..4u64 {
        for _ in 0..accum {
            let global = one.next_batch();
            let of = |ls: &mut Vec<DataLoader>| -> (Vec<u32>, Vec<u32>) {
                let parts: Vec<_> = ls.iter_mut().map(|l| l.next_batch()).collect();
                (
                    parts.iter().flat_map(|p| p.inputs.clone()).collect(),
                    parts.iter().flat_map(|p| p.targets.clone()).collect(),
                )
            };
            assert_eq!(
                of(&mut ranks),
                (global.inputs.clone(), global.targets.clone())
            );
            assert_eq!(
                of(&mut two),
                (global.inputs.clone(), global.targets.clone())
            );
            assert_eq!(&global.inputs[1..t], &global.targets[..t - 1]);
            let accumulated: Vec<u32> = (0..dp)
                .flat_map(|_| accumulating.next_batch().inputs)
                .collect();
            assert_eq!(accumulated, global.inputs, "accumulation, step {step}");
            seen.push(global.inputs);
        }
        let eval: Vec<u32> = ranks
            .iter()
            .flat_map(|l| l.eval_batch(step, 1).inputs)
            .collect();
        assert_eq!(
            eval,
            one.eval_batch(step, 1).inputs,
            "evaluation rows, step {step}"
        );
        assert!(!seen.contains(&eval), "evaluation drew a training batch");
    }
    // Every micro-batch of every step is a fresh draw.
    for (i, a) in seen.iter().enumerate() {
        assert!(seen[i + 1..].iter().all(|b| b != a), "batch {i} repeats");
    }
    let mut resumed = loader(b * dp, 0, 1);
    resumed.set_position(5);
    assert_eq!(resumed.next_batch().inputs, seen[5]);
    assert_eq!(one.position(), 4 * accum as u64);
}

/// The starts of random rows are uniform over the split: over two shards of 6000 and 2000
/// tokens (each token its own index, so a row's first input is its start) and rows of 17
/// tokens, 64 000 draws put each of 32 equal bins of the 7968 starts near 2000 draws. The bound:
/// Pearson's χ² over the bins (31 degrees of freedom, mean 31, σ = √62 ≈ 7.9) below 31 + 6σ =
/// 78, and the second shard's share within 5σ of its 1984/7968 (σ = 0.0017). No row crosses a
/// shard's end.
#[test]
fn random_offsets_are_uniform_over_the_shards() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u32> = (0..8000).collect();
    write_shard(dir.path(), "train_000", &ids[..6000], 8192).unwrap();
    write_shard(dir.path(), "train_001", &ids[6000..], 8192).unwrap();
    write_shard(dir.path(), "val_000", &ids[..100], 8192).unwrap();
    let ds = Dataset::open(&DataSource::Shards(dir.path().to_path_buf())).unwrap();
    let (t, b, steps) = (16usize, 64usize, 1000u64);
    let mut l = DataLoader::new(ds.train.clone(), t, b, 0, 1, 42).unwrap();
    let (n_bins, per_bin) = (32usize, 249usize); // 7968 starts = 5984 + 1984
    let mut bins = vec![0u64; n_bins];
    let mut in_second = 0u64;
    for _ in 0..steps {
        let batch = l.next_batch();
        for row in batch.inputs.chunks(t).zip(batch.targets.chunks(t)) {
            let start = row.0[0] as usize;
            assert_eq!(
                row.1[t - 1] as usize,
                start + t,
                "row at {start} is not contiguous"
            );
            let index = match start < 6000 {
                true => {
                    assert!(
                        start + t < 6000,
                        "row at {start} crosses the first shard's end"
                    );
                    start
                }
                false => {
                    in_second += 1;
                    start - 16
                }
            };
            bins[index / per_bin] += 1;
        }
    }
    let n = (steps as usize * b) as f64;
    let expect = n / n_bins as f64;
    let chi2: f64 = bins
        .iter()
        .map(|&c| (c as f64 - expect).powi(2) / expect)
        .sum();
    let bound = 31.0 + 6.0 * 62f64.sqrt();
    assert!(
        chi2 < bound,
        "χ² {chi2:.1} over 31 degrees of freedom is above {bound:.1}: {bins:?}"
    );
    let p = 1984.0 / 7968.0;
    let share = in_second as f64 / n;
    let sigma = (p * (1.0 - p) / n).sqrt();
    assert!(
        (share - p).abs() < 5.0 * sigma,
        "the second shard drew {share:.4} of the rows, expected {p:.4} ± {:.4}",
        5.0 * sigma
    );
    eprintln!("χ² {chi2:.1} (bound {bound:.1}), second shard {share:.4} (expected {p:.4})");
}

/// Shards written to disk are memory-mapped back identically and split the same way.
#[test]
fn token_shards_round_trip_and_split_like_memory() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = corpus::generate(20_000, 3)
        .into_iter()
        .take(20_000)
        .map(u32::from)
        .collect();
    write_shard(dir.path(), "train_000", &tokens[..15_000], 256).unwrap();
    write_shard(dir.path(), "train_001", &tokens[15_000..18_000], 256).unwrap();
    write_shard(dir.path(), "val_000", &tokens[18_000..], 256).unwrap();
    let ds = Dataset::open(&DataSource::Shards(dir.path().to_path_buf())).unwrap();
    assert_eq!(
        (ds.train.n_tokens(), ds.val.n_tokens(), ds.vocab_size),
        (18_000, 2_000, 256)
    );
    let mut one = DataLoader::new(ds.train.clone(), 16, 6, 0, 1, 1).unwrap();
    let mut r0 = DataLoader::new(ds.train.clone(), 16, 3, 0, 2, 1).unwrap();
    let mut r1 = DataLoader::new(ds.train.clone(), 16, 3, 1, 2, 1).unwrap();
    let g = one.next_batch();
    let both: Vec<u32> = [r0.next_batch().inputs, r1.next_batch().inputs].concat();
    assert_eq!(both, g.inputs);
    // Every row is a contiguous run of the original text.
    let text: Vec<u32> = tokens[..18_000].to_vec();
    for row in g.inputs.chunks(16) {
        assert!(text.windows(16).any(|w| w == row));
    }
    // A header that disagrees with the file is refused with both sizes.
    std::fs::write(dir.path().join("val_000.bin"), [0u8; 10]).unwrap();
    let msg = Dataset::open(&DataSource::Shards(dir.path().to_path_buf()))
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("2000 tokens") && msg.contains("10 bytes"),
        "{msg}"
    );
}

/// Unknown keys are refused by name, in the file's tables, in `--set`, and in the model table.
#[test]
fn config_rejects_unknown_keys_naming_them() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let args = |file: Option<PathBuf>, sets: &[&str]| TrainArgs {
        config: file,
        overrides: sets.iter().map(|s| s.to_string()).collect(),
        ..TrainArgs::default()
    };
    let err = args(Some(write("a.toml", "[train]\nstepz = 3\n")), &[])
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(err.contains("stepz"), "{err}");
    let err = args(Some(write("b.toml", "[model]\nvocab_size = 256\nblock_size = 64\nn_layer = 2\nn_head = 2\nn_embd = 32\nn_layr = 3\n")), &[])
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(err.contains("n_layr"), "{err}");
    let err = args(None, &["learning_rate=0.1"])
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(err.contains("learning_rate"), "{err}");
    let err = args(Some(write("c.toml", "[trian]\nsteps = 3\n")), &[])
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(err.contains("trian"), "{err}");

    // File, then flags, then --set; a preset expands into a table for `model.x` overrides.
    let file = write(
        "d.toml",
        "model = \"tiny\"\n[train]\nsteps = 7\nlr = 0.002\nmin_lr = 0.0001\n",
    );
    let cfg = TrainArgs {
        steps: Some(9),
        ..args(
            Some(file),
            &["model.n_layer=2", "warmup_steps=3", "data=\"builtin\""],
        )
    }
    .resolve()
    .unwrap();
    assert_eq!((cfg.steps, cfg.lr, cfg.warmup_steps), (9, 0.002, 3));
    assert_eq!(
        cfg.gpt_config().unwrap(),
        GptConfig {
            n_layer: 2,
            ..GptConfig::tiny()
        }
    );
    // Values that do not fit together are refused with the numbers.
    let err = args(None, &["seq_len=100"])
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("seq_len 100") && err.contains("block_size 64"),
        "{err}"
    );
}

/// `prepare` trains a byte-level BPE on a small text, and its shards train a model.
#[test]
fn prepare_writes_a_tokenizer_and_shards() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let text_path = dir.path().join("corpus.txt");
    let text = String::from_utf8(corpus::generate(60_000, 11)).unwrap();
    std::fs::write(&text_path, &text).unwrap();
    let out = dir.path().join("prepared");
    let s = prepare::prepare(&PrepareArgs {
        chars: false,
        text: text_path,
        vocab_size: Some(320),
        tokenizer: None,
        out: out.clone(),
        val_fraction: 0.1,
    })
    .unwrap();
    assert!(s.vocab_size <= 320 && s.vocab_size > 257, "{s:?}");
    // The grammar's few words compress well: several bytes per token.
    assert!(s.bytes_per_token > 2.0, "{s:?}");
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    let line = "the quick goats chase the lion.\n";
    let ids = prepare::encode(&tok, line).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), line);
    let ds = Dataset::open(&DataSource::Shards(out.clone())).unwrap();
    assert_eq!(
        (ds.train.n_tokens(), ds.val.n_tokens()),
        (s.train_tokens, s.val_tokens)
    );
    assert_eq!(ds.tokenizer, Some(out.join("tokenizer.json")));

    // A few steps on the shards with a model of the tokenizer's vocabulary.
    let run_dir = dir.path().join("run");
    let cfg = TrainArgs {
        data: Some(out.display().to_string()),
        overrides: vec![
            format!("model.vocab_size={}", s.vocab_size),
            "model.n_layer=1".into(),
        ],
        ..TrainArgs::default()
    }
    .resolve()
    .unwrap();
    let summary = run(&TrainConfig {
        eval_every: 3,
        eval_iters: 1,
        ..TrainConfig {
            data: cfg.data,
            model: cfg.model,
            ..short(&run_dir, 3)
        }
    });
    assert_eq!(summary.losses.len(), 3);
    let text = sample::sample(&SampleArgs {
        checkpoint: run_dir,
        prompt: "the ".into(),
        max_new_tokens: 5,
        temperature: 1.0,
        top_k: 0,
        seed: 1,
        tokenizer: None,
        device: mtrain_trainer::config::DeviceKind::Cpu,
        no_kv_cache: false,
        profile_ops: false,
    })
    .unwrap()
    .text;
    assert!(text.starts_with("the"), "{text:?}");
}

/// bf16 compute with fp32 master weights follows the fp32 run to bf16 accuracy, keeps fp32 weights
/// in its checkpoint, and reports the 2+2+4+8 byte layout.
#[test]
fn bf16_mixed_precision_tracks_fp32() {
    let _serial = serial();
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let f32_run = run(&short(a.path(), 20));
    let bf16_run = run(&TrainConfig {
        dtype: mtrain_trainer::config::DTypeKind::Bf16,
        ..short(b.path(), 20)
    });
    // Same weights rounded to bf16 (relative error 2^-8): the first losses agree to ~1%.
    let (l0, m0) = (f32_run.losses[0], bf16_run.losses[0]);
    assert!(
        (l0 - m0).abs() < 0.02 * l0,
        "step 0: fp32 {l0} vs bf16 {m0}"
    );
    // Both learn (mean of the last 5 losses far below ln 256) and stay within 10% of each other.
    let tail = |s: &TrainSummary| s.losses[15..].iter().sum::<f64>() / 5.0;
    let (l, m) = (tail(&f32_run), tail(&bf16_run));
    assert!(
        m < l0 - 1.5 && (l - m).abs() < 0.1 * l,
        "last 5 steps: fp32 {l} vs bf16 {m} (start {l0})"
    );
    let ckpt = checkpoint::load(bf16_run.last_checkpoint.as_ref().unwrap(), &Device::Cpu).unwrap();
    let sharded = match &ckpt.stored {
        checkpoint::Stored::Sharded(s) => s,
        checkpoint::Stored::Full { .. } => panic!("a run writes sharded checkpoints"),
    };
    assert_eq!(sharded.manifest().layout.precision, "bf16");
    // The stored weights are the fp32 masters: some are not bf16 values.
    let off_bf16 = ckpt.full_model(&Device::Cpu).unwrap().values().any(|t| {
        let round = t.to_dtype(candle_core::DType::BF16).unwrap();
        let back = round.to_dtype(candle_core::DType::F32).unwrap();
        (t - back).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap() > 0.0
    });
    assert!(off_bf16, "master weights are fp32");
    assert_eq!(bf16_run.layout.total(), 16 * bf16_run.layout.n_params);
    assert_eq!(bf16_run.layout.params(), 2 * bf16_run.layout.n_params);
}

/// A plan built in code is checked once, where the run's options are made, with the
/// arithmetic: the run never sees a plan its check refused.
#[test]
fn a_plan_built_in_code_is_refused_with_the_reason() {
    use mtrain_parallel::parallelize::ParallelPlan;
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = short(dir.path(), 1);
    let n_layer = cfg.gpt_config().expect("model").n_layer;
    let too_deep = ParallelPlan::new(MeshDims::new(1, n_layer + 1, 1, 1));
    let err = train::RunOptions::of_plan(&cfg, too_deep).expect_err("more stages than blocks");
    let msg = format!("{err:#}");
    assert!(
        msg.contains(&format!("pp {} > n_layer {n_layer}", n_layer + 1)),
        "{msg}"
    );
    let uneven = ParallelPlan {
        microbatches: 3,
        ..ParallelPlan::new(ONE)
    };
    let msg = format!(
        "{:#}",
        train::RunOptions::of_plan(&cfg, uneven).unwrap_err()
    );
    assert!(msg.contains("not divisible by microbatches 3"), "{msg}");
    let fits = train::RunOptions::of_plan(&cfg, ParallelPlan::new(ONE)).expect("one device");
    assert_eq!(fits.plan.precision, cfg.precision());
}
