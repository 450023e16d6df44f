//! Config, init, layers and MoE routing checked against closed forms and hand computations.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Result, Tensor};
use mtrain_model::config::{GptConfig, MoeConfig};
use mtrain_model::gpt::Gpt;
use mtrain_model::init::{init_tensor, init_weights, param_specs};
use mtrain_model::layers::{DenseLinear, FeedForward, Mlp};
use mtrain_model::moe::{self, Assignment, MoeLayer};
use mtrain_model::param::{Grads, Param};

fn workspace_file(rel: &str) -> String {
    format!("{}/../../{rel}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn n_params_matches_gpt2_and_tensor_sizes() -> Result<()> {
    // GPT-2 small with the original 50257 vocabulary has 124,439,808 parameters (tied head).
    let gpt2 = GptConfig {
        vocab_size: 50257,
        ..GptConfig::gpt2_124m()
    };
    assert_eq!(gpt2.n_params(), 124_439_808);
    for cfg in [
        GptConfig::tiny(),
        GptConfig::moe_tiny(),
        GptConfig {
            n_layer: 1,
            ..GptConfig::tiny()
        },
    ] {
        let w = init_weights(&cfg, 0)?;
        let total: usize = w.values().map(|t| t.elem_count()).sum();
        assert_eq!(cfg.n_params(), total, "{cfg:?}");
        // Parameter bytes (fp32) equal the tensors' bytes.
        let bytes: usize = w
            .values()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        assert_eq!(cfg.n_params() * 4, bytes);
    }
    Ok(())
}

#[test]
fn flops_per_token_formula() {
    let cfg = GptConfig::tiny();
    // The multiplied weights: wte (the head) and each block's 12·C² of linear weights.
    let matmul = 256 * 64 + 4 * 12 * 64 * 64;
    assert_eq!(cfg.n_matmul_params(), matmul);
    // Every parameter but the biases, LayerNorms and the position table.
    let added = 64 * 64 + 4 * (4 * 64 + 3 * 64 + 64 + 4 * 64 + 64) + 2 * 64;
    assert_eq!(cfg.n_params() - added, matmul);
    let expected = 6.0 * matmul as f64 + 12.0 * 4.0 * 64.0 * 32.0;
    assert_eq!(cfg.flops_per_token(32), expected);
    // MoE: only top_k of n_experts MLPs count as active per token.
    let moe = GptConfig::moe_tiny();
    let mlp = 8 * 64 * 64 + 5 * 64;
    assert_eq!(moe.n_active_params(), moe.n_params() - 4 * 2 * mlp);
    assert_eq!(moe.n_matmul_params(), 256 * 64 + 4 * (4 * 64 * 64 + 2 * 8 * 64 * 64 + 4 * 64));
}

#[test]
fn validate_names_the_bad_numbers() {
    let bad = GptConfig {
        n_embd: 100,
        n_head: 3,
        ..GptConfig::tiny()
    };
    assert_eq!(
        bad.validate().map_err(|e| e.to_string()),
        Err("n_embd 100 is not divisible by n_head 3".to_string())
    );
    let mut moe = GptConfig::moe_tiny();
    if let Some(m) = moe.moe.as_mut() {
        m.top_k = 3;
    }
    let msg = moe
        .validate()
        .map_err(|e| e.to_string())
        .err()
        .unwrap_or_default();
    assert!(
        msg.contains("top_k 3") && msg.contains("n_experts 4"),
        "{msg}"
    );
    let zero = GptConfig {
        n_layer: 0,
        ..GptConfig::tiny()
    };
    assert!(zero.validate().is_err());
    for name in GptConfig::PRESETS {
        let cfg = GptConfig::preset(name).expect("preset exists");
        assert!(cfg.validate().is_ok(), "{name}");
    }
    assert!(GptConfig::preset("gpt5").is_none());
}

#[derive(serde::Deserialize)]
#[allow(dead_code)]
struct ModelTable {
    model: GptConfig,
}

#[test]
fn config_files_match_presets_and_reject_unknown_keys() {
    for (file, preset) in [
        ("tiny", "tiny"),
        ("gpt2-124m", "gpt2-124m"),
        ("gpt2-350m", "gpt2-350m"),
        ("moe-tiny", "moe-tiny"),
    ] {
        let text = std::fs::read_to_string(workspace_file(&format!("configs/{file}.toml")))
            .expect("config file");
        // Other tables ([train]) may follow; only [model] is read here.
        let value: toml::Value = toml::from_str(&text).expect("valid toml");
        let model = value.get("model").expect("[model] table").clone();
        let cfg: GptConfig = model.try_into().expect("model table parses");
        assert_eq!(Some(cfg), GptConfig::preset(preset), "{file}");
    }
    let bad = "[model]\nvocab_size = 256\nblock_size = 64\nn_layer = 2\nn_head = 4\nn_embd = 64\ndropout = 0.1\n";
    let err = toml::from_str::<ModelTable>(bad)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("dropout"), "{err}");
}

#[test]
fn init_is_layout_independent() -> Result<()> {
    let cfg = GptConfig::tiny();
    let a = init_weights(&cfg, 7)?;
    // Create the tensors in reverse order, one at a time: same numbers.
    let mut specs = param_specs(&cfg);
    specs.reverse();
    for (name, shape, kind) in specs {
        let t = init_tensor(7, &name, &shape, kind)?;
        let diff = (&a[&name] - &t)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "{name}");
    }
    // A deeper model shares every tensor whose rule does not depend on depth.
    let deep = init_weights(
        &GptConfig {
            n_layer: 6,
            ..cfg.clone()
        },
        7,
    )?;
    for name in [
        "wte.weight",
        "h.1.attn.c_attn.weight",
        "h.3.mlp.c_fc.weight",
    ] {
        let diff = (&a[name] - &deep[name])?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "{name}");
    }
    // Different seeds and different names give different tensors.
    let b = init_weights(&cfg, 8)?;
    assert_ne!(
        a["wte.weight"].to_vec2::<f32>()?,
        b["wte.weight"].to_vec2::<f32>()?
    );
    assert_ne!(
        a["h.0.mlp.c_fc.weight"].to_vec2::<f32>()?,
        a["h.1.mlp.c_fc.weight"].to_vec2::<f32>()?
    );
    Ok(())
}

fn mean_std(t: &Tensor) -> Result<(f64, f64)> {
    let v = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    Ok((mean, var.sqrt()))
}

#[test]
fn init_statistics_follow_nanogpt() -> Result<()> {
    let cfg = GptConfig::tiny(); // 4 layers: residual std 0.02 / sqrt(8)
    let w = init_weights(&cfg, 1)?;
    // 16384 samples: the sample std is within 3% of the true std with overwhelming probability.
    for (name, std) in [
        ("h.0.mlp.c_fc.weight", 0.02),
        ("h.0.mlp.c_proj.weight", 0.02 / 8f64.sqrt()),
        ("wte.weight", 0.02),
    ] {
        let (m, s) = mean_std(&w[name])?;
        assert!((s / std - 1.0).abs() < 0.03, "{name}: std {s} vs {std}");
        assert!(
            m.abs() < 4.0 * std / (w[name].elem_count() as f64).sqrt(),
            "{name}: mean {m}"
        );
    }
    assert_eq!(w["h.2.ln_1.weight"].to_vec1::<f32>()?, vec![1.0; 64]);
    assert_eq!(w["h.2.attn.c_attn.bias"].to_vec1::<f32>()?, vec![0.0; 192]);
    Ok(())
}

#[test]
fn param_slot_is_shared_and_swappable() -> Result<()> {
    let p = Param::new("w", Tensor::ones((2, 3), DType::F32, &Device::Cpu)?)?;
    let q = p.clone();
    q.set(&Tensor::full(2f32, (2, 3), &Device::Cpu)?)?;
    assert_eq!(p.tensor().sum_all()?.to_scalar::<f32>()?, 12.0);
    p.replace(Tensor::zeros(0, DType::F32, &Device::Cpu)?)?;
    assert_eq!(q.elem_count(), 0);
    assert_eq!(q.shape().dims(), &[0]);
    let mut g = Grads::new();
    g.accumulate("a", Tensor::new(&[3f32, 4.0], &Device::Cpu)?)?;
    g.accumulate("a", Tensor::new(&[3f32, 4.0], &Device::Cpu)?)?;
    g.insert("b", Tensor::new(&[1f32], &Device::Cpu)?);
    assert_eq!(g.sq_norm()?, 36.0 + 64.0 + 1.0);
    assert_eq!(g.names(), vec!["a".to_string(), "b".to_string()]);
    Ok(())
}

fn probs(rows: &[[f64; 3]]) -> Result<Tensor> {
    let flat: Vec<f64> = rows.iter().flatten().copied().collect();
    Tensor::from_vec(flat, (rows.len(), 3), &Device::Cpu)
}

#[test]
fn routing_capacity_and_drops_by_hand() -> Result<()> {
    // Top-1, 6 tokens, 3 experts, factor 1: capacity 2. Expert 0 is wanted by tokens 0, 1, 2, 4.
    let p = probs(&[
        [0.6, 0.3, 0.1],
        [0.5, 0.4, 0.1],
        [0.7, 0.2, 0.1],
        [0.2, 0.5, 0.3],
        [0.4, 0.3, 0.3],
        [0.1, 0.2, 0.7],
    ])?;
    let plan = moe::route(&p, 1, 1.0)?;
    assert_eq!(plan.capacity, 2);
    assert_eq!(plan.tokens_of(0), vec![0, 1]);
    assert_eq!(plan.tokens_of(1), vec![3]);
    assert_eq!(plan.tokens_of(2), vec![5]);
    assert_eq!(plan.dropped, 2);
    assert_eq!(plan.stats().tokens_per_expert, vec![2, 1, 1]);
    assert_eq!(plan.first_choice_counts, vec![4, 1, 1]);

    // Top-2, 4 tokens, factor 1: capacity ceil(8/3) = 3. All first choices go before any second
    // choice: token 3 loses its first choice (expert 0 full) but keeps its second.
    let p = probs(&[
        [0.5, 0.3, 0.2],
        [0.6, 0.1, 0.3],
        [0.4, 0.35, 0.25],
        [0.7, 0.2, 0.1],
    ])?;
    let plan = moe::route(&p, 2, 1.0)?;
    assert_eq!(plan.capacity, 3);
    let a = |token, choice| Assignment { token, choice };
    assert_eq!(plan.assignments[0], vec![a(0, 0), a(1, 0), a(2, 0)]);
    assert_eq!(plan.assignments[1], vec![a(0, 1), a(2, 1), a(3, 1)]);
    assert_eq!(plan.assignments[2], vec![a(1, 1)]);
    assert_eq!(plan.dropped, 1);

    // Ties go to the lower expert index.
    let plan = moe::route(&probs(&[[0.25, 0.25, 0.5]])?, 2, 4.0)?;
    assert_eq!(plan.choices[0], vec![2, 0]);
    assert_eq!(moe::capacity(10, 4, 2, 1.25), 7); // ceil(2*10/4*1.25) = ceil(6.25)
    Ok(())
}

#[test]
fn aux_losses_by_hand() -> Result<()> {
    let p = probs(&[
        [0.5, 0.3, 0.2],
        [0.6, 0.1, 0.3],
        [0.4, 0.35, 0.25],
        [0.7, 0.2, 0.1],
    ])?;
    let plan = moe::route(&p, 2, 1.0)?;
    // Every first choice is expert 0: f = (1, 0, 0); P_0 = (0.5 + 0.6 + 0.4 + 0.7) / 4 = 0.55.
    let lb = moe::load_balancing_loss(&p, &plan)?.to_scalar::<f64>()?;
    assert!((lb - 3.0 * 0.55).abs() < 1e-12, "{lb}");
    // Uniform routing gives exactly 1.
    let u = probs(&[[1.0 / 3.0; 3]; 3])?;
    let plan_u = moe::route(&u, 1, 1.0)?;
    // Ties send every token to expert 0, so f = (1, 0, 0) and P = 1/3: loss = 3 · 1/3 = 1.
    let lb_u = moe::load_balancing_loss(&u, &plan_u)?.to_scalar::<f64>()?;
    assert!((lb_u - 1.0).abs() < 1e-12, "{lb_u}");
    // z-loss: rows (0, 0) and (1, 1, ...) have logsumexp ln 2 and 1 + ln 2.
    let logits = Tensor::new(&[[0f64, 0.0], [1.0, 1.0]], &Device::Cpu)?;
    let z = moe::z_loss(&logits)?.to_scalar::<f64>()?;
    let l2 = 2f64.ln();
    assert!(
        (z - (l2 * l2 + (1.0 + l2).powi(2)) / 2.0).abs() < 1e-12,
        "{z}"
    );
    Ok(())
}

/// The MoE layer's output equals Σ over kept choices of gate · expert(x) computed token by token.
#[test]
fn moe_layer_matches_per_token_sum() -> Result<()> {
    let (c, e, n) = (8usize, 4usize, 12usize);
    let cfg = MoeConfig {
        n_experts: e,
        top_k: 2,
        capacity_factor: 1.0,
        aux_loss_coef: 0.0,
        z_loss_coef: 0.0,
    };
    let mut weights = BTreeMap::new();
    let mut experts = Vec::new();
    for i in 0..e {
        let w = |name: &str, shape: &[usize]| -> Result<Param> {
            Param::new(
                format!("e{i}.{name}"),
                init_tensor(
                    3,
                    &format!("e{i}.{name}"),
                    shape,
                    mtrain_model::init::InitKind::Normal { std: 0.5 },
                )?,
            )
        };
        let fc = DenseLinear::new(w("fc.w", &[4 * c, c])?, Some(w("fc.b", &[4 * c])?));
        let proj = DenseLinear::new(w("proj.w", &[c, 4 * c])?, Some(w("proj.b", &[c])?));
        experts.push(Mlp::new(Box::new(fc), Box::new(proj)));
    }
    let router = Param::new(
        "router",
        init_tensor(
            3,
            "router",
            &[e, c],
            mtrain_model::init::InitKind::Normal { std: 1.0 },
        )?,
    )?;
    weights.insert(
        "x",
        init_tensor(
            4,
            "x",
            &[n, c],
            mtrain_model::init::InitKind::Normal { std: 1.0 },
        )?,
    );
    let x = &weights["x"];
    let layer = MoeLayer::new(router.clone(), experts, cfg);
    let out = layer.forward(x)?;
    let (_, p) = moe::router_probs(x, &router.tensor())?;
    let plan = moe::route(&p, 2, 1.0)?;
    assert!(
        plan.dropped > 0,
        "the case is meant to drop something: {plan:?}"
    );
    assert_eq!(out.stats.as_ref().map(|s| s.dropped), Some(plan.dropped));
    let pv = p.to_vec2::<f32>()?;
    let got = out.out.to_vec2::<f32>()?;
    for t in 0..n {
        let xt = x.narrow(0, t, 1)?;
        let mut want = vec![0f32; c];
        for (ei, asg) in plan.assignments.iter().enumerate() {
            if asg.iter().any(|a| a.token == t) {
                let y = layer.experts[ei].apply(&xt)?.squeeze(0)?.to_vec1::<f32>()?;
                for k in 0..c {
                    want[k] += pv[t][ei] * y[k];
                }
            }
        }
        for k in 0..c {
            assert!(
                (got[t][k] - want[k]).abs() < 1e-5,
                "token {t} dim {k}: {} vs {}",
                got[t][k],
                want[k]
            );
        }
    }
    Ok(())
}

#[test]
fn gpt_shapes_and_greedy_generation() -> Result<()> {
    let cfg = GptConfig {
        n_layer: 2,
        block_size: 16,
        ..GptConfig::tiny()
    };
    let gpt = Gpt::new(cfg.clone(), &init_weights(&cfg, 0)?, &Device::Cpu)?;
    let names: Vec<String> = gpt.params().iter().map(|p| p.name().to_string()).collect();
    assert_eq!(names.first().map(String::as_str), Some("wte.weight"));
    assert_eq!(names.last().map(String::as_str), Some("ln_f.bias"));
    assert_eq!(names.len(), 2 + 2 * 12 + 2);
    let idx = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu)?;
    assert_eq!(gpt.logits(&idx)?.dims(), &[2, 3, 256]);
    // An untrained model: loss near ln(V) (targets differ from the inputs, whose tied embedding
    // would otherwise favour them).
    let targets = Tensor::new(&[[7u32, 8, 9], [10, 11, 12]], &Device::Cpu)?;
    let loss = gpt.forward_loss(&idx, &targets)?.loss.to_scalar::<f32>()?;
    assert!((loss - 256f32.ln()).abs() < 0.1, "{loss}");
    let mut rng = rand::rngs::mock::StepRng::new(0, 1);
    let a = gpt.generate(&idx, 20, 0.0, None, &mut rng)?;
    let b = gpt.generate(&idx, 20, 0.0, None, &mut rng)?;
    assert_eq!(a.dims(), &[2, 23]);
    assert_eq!(a.to_vec2::<u32>()?, b.to_vec2::<u32>()?);
    let s = gpt.generate(
        &idx,
        5,
        1.0,
        Some(10),
        &mut rand::rngs::mock::StepRng::new(1, 7),
    )?;
    assert!(s.flatten_all()?.to_vec1::<u32>()?.iter().all(|&t| t < 256));
    // Too long a prompt for the embedding is an error naming the numbers.
    let long = Tensor::zeros((1, 17), DType::U32, &Device::Cpu)?;
    let msg = gpt
        .logits(&long)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(msg.contains("17") && msg.contains("16"), "{msg}");
    Ok(())
}
