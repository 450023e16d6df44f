//! Single-device training speed of a GPT with and without the fused kernels.
//!
//! ```text
//! bench_gpu [--preset gpt2-124m] [--batch 16] [--seq 1024] [--steps 20] [--warmup 3]
//!           [--autograd] [--profile] [--data FILE]
//!           [--loss-steps N --loss-out FILE [--loss-warmup W]]
//!           [--ops] [--attn B,H,T,D[/B,H,T,D...]]
//! ```
//!
//! Each step is what the trainer does in bf16: the block-wise engine's forward and backward on a
//! bf16 compute copy, AdamW on fp32 master weights, the compute copy refreshed from them. Tokens
//! are the bytes of `--data` (a real text; the vocabulary stays the preset's), or pseudo-random
//! ids without it. Prints one JSON line, like scripts/bench/torch_gpt_ref.py, so the two can be
//! put side by side. `--autograd` differentiates every segment with candle's autograd (on the
//! same fused kernels) instead of the hand-written backward passes (`Backward::Autograd`).
//! `--profile` adds one step timed segment by segment (a device synchronise around each).
//! `--loss-steps N` trains N steps at lr 3e-4 (after `--loss-warmup W` steps of linear warmup,
//! default 20) and writes `step loss` lines to `--loss-out`.
//! `--ops` times the pieces of one block at the preset's sizes instead (attention, LayerNorm,
//! GELU forward and forward + backward, fused and plain candle; the whole block fused, under
//! autograd and through its tape; the block's matmuls), one JSON line.
//! `--attn` times the attention ops of the hand-written backward alone (`attention::forward`,
//! `attention::backward`) at each listed shape, one JSON line per shape with its TFLOP/s
//! (causal: forward 2·B·H·T²·D, backward 2.5 times that), to set beside PyTorch's SDPA
//! (scripts/bench/torch_attn_ref.py).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor};
use mtrain_kernels::plain;
use mtrain_model::optim::{AdamW, AdamWConfig, OptimItem};
use mtrain_model::{init_weights, Backward, Engine, Gpt, GptConfig, Grads, Hooks, Param, Segment};

struct Args {
    preset: String,
    batch: usize,
    seq: usize,
    steps: usize,
    warmup: usize,
    autograd: bool,
    profile: bool,
    data: Option<String>,
    loss_steps: usize,
    loss_warmup: usize,
    loss_out: String,
    ops: bool,
    attn: Vec<[usize; 4]>,
}

fn parse() -> std::result::Result<Args, String> {
    let mut a = Args {
        preset: "gpt2-124m".into(),
        batch: 16,
        seq: 1024,
        steps: 20,
        warmup: 3,
        autograd: false,
        profile: false,
        data: None,
        loss_steps: 0,
        loss_warmup: 20,
        loss_out: "loss.txt".into(),
        ops: false,
        attn: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().ok_or(format!("{k} needs a value"));
        let num = |s: String| {
            s.parse::<usize>()
                .map_err(|e| format!("bad number {s}: {e}"))
        };
        match k.as_str() {
            "--preset" => a.preset = val()?,
            "--batch" => a.batch = num(val()?)?,
            "--seq" => a.seq = num(val()?)?,
            "--steps" => a.steps = num(val()?)?,
            "--warmup" => a.warmup = num(val()?)?,
            "--autograd" => a.autograd = true,
            "--profile" => a.profile = true,
            "--data" => a.data = Some(val()?),
            "--loss-steps" => a.loss_steps = num(val()?)?,
            "--loss-warmup" => a.loss_warmup = num(val()?)?,
            "--loss-out" => a.loss_out = val()?,
            "--ops" => a.ops = true,
            "--attn" => {
                for shape in val()?.split('/') {
                    let dims = shape
                        .split(',')
                        .map(|x| num(x.to_string()))
                        .collect::<std::result::Result<Vec<_>, _>>()?;
                    let dims: [usize; 4] = dims
                        .try_into()
                        .map_err(|_| format!("--attn takes B,H,T,D shapes, got {shape}"))?;
                    a.attn.push(dims);
                }
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

/// Batches of (inputs, targets) from a token stream, walking it in order.
struct Batches {
    tokens: Vec<u32>,
    pos: usize,
}

impl Batches {
    fn new(path: Option<&str>, vocab: usize) -> std::io::Result<Self> {
        let tokens = match path {
            Some(p) => std::fs::read(p)?.into_iter().map(u32::from).collect(),
            None => (0..1u64 << 20)
                .map(|i| ((i * 2654435761) % vocab as u64) as u32)
                .collect(),
        };
        Ok(Self { tokens, pos: 0 })
    }

    fn next(&mut self, b: usize, t: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
        let (mut x, mut y) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for _ in 0..b {
            if self.pos + t + 1 > self.tokens.len() {
                self.pos = 0;
            }
            x.extend_from_slice(&self.tokens[self.pos..self.pos + t]);
            y.extend_from_slice(&self.tokens[self.pos + 1..self.pos + t + 1]);
            self.pos += t;
        }
        Ok((
            Tensor::from_vec(x, (b, t), dev)?,
            Tensor::from_vec(y, (b, t), dev)?,
        ))
    }
}

/// bf16 compute copy, fp32 master weights and AdamW, as the trainer's single-device path.
struct Trainer {
    model: Gpt,
    engine: Engine,
    params: Vec<Param>,
    master: Vec<Param>,
    optim: AdamW,
    grads: Grads,
}

impl Trainer {
    fn new(cfg: GptConfig, engine: Engine, dev: &Device) -> Result<Self> {
        let w = init_weights(&cfg, 0)?;
        let compute: BTreeMap<String, Tensor> = w
            .iter()
            .map(|(k, t)| Ok((k.clone(), t.to_dtype(DType::BF16)?)))
            .collect::<Result<_>>()?;
        let model = Gpt::new(cfg, &compute, dev)?;
        let params = model.params();
        let master = params
            .iter()
            .map(|p| Param::new(p.name(), w[p.name()].to_device(dev)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            model,
            engine,
            params,
            master,
            optim: AdamW::new(AdamWConfig::default()),
            grads: Grads::new(),
        })
    }

    /// One step; returns the loss as a device scalar (no host sync).
    fn step(&mut self, x: &Tensor, y: &Tensor, lr: f64, hooks: &mut dyn Hooks) -> Result<Tensor> {
        let segs: &[Arc<dyn Segment>] = &self.model.segments;
        let acts = self.engine.forward(segs, x, Some(y), hooks)?;
        let loss = acts.output.clone();
        self.engine
            .backward(segs, acts, None, 1.0, &mut self.grads, hooks)?;
        let items = self
            .master
            .iter()
            .map(|p| {
                let g = self.grads.get(p.name()).ok_or_else(|| {
                    candle_core::Error::Msg(format!("no gradient for {}", p.name()))
                })?;
                Ok(OptimItem {
                    name: p.name(),
                    param: p,
                    grad: g,
                    decay: p.shape().rank() >= 2,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let compute: Vec<&Param> = self.params.iter().collect();
        self.optim
            .step_with_copies(lr, 1.0, &items, Some(&compute))?;
        self.grads.clear();
        Ok(loss)
    }
}

/// Segment-by-segment wall time, with a device synchronise at every boundary.
struct Profile {
    dev: Device,
    t0: Instant,
    fwd: BTreeMap<String, f64>,
    bwd: BTreeMap<String, f64>,
}

fn kind(seg: &dyn Segment) -> String {
    let n = seg.name();
    if n.starts_with("h.") {
        "blocks".into()
    } else {
        n
    }
}

impl Hooks for Profile {
    fn pre_forward(&mut self, _: usize, _: &dyn Segment) -> Result<()> {
        self.dev.synchronize()?;
        self.t0 = Instant::now();
        Ok(())
    }
    fn post_forward(&mut self, _: usize, seg: &dyn Segment) -> Result<()> {
        self.dev.synchronize()?;
        *self.fwd.entry(kind(seg)).or_default() += self.t0.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }
    fn pre_backward(&mut self, _: usize, _: &dyn Segment) -> Result<()> {
        self.dev.synchronize()?;
        self.t0 = Instant::now();
        Ok(())
    }
    fn post_backward(&mut self, _: usize, seg: &dyn Segment, _: &mut Grads) -> Result<()> {
        self.dev.synchronize()?;
        *self.bwd.entry(kind(seg)).or_default() += self.t0.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }
}

/// Peak bytes of the CUDA default memory pool since the last reset (0 on CPU).
#[cfg(feature = "cuda")]
mod pool {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    use candle_core::Device;

    fn handle(dev: &Device) -> Option<sys::CUmemoryPool> {
        let Device::Cuda(c) = dev else { return None };
        let ctx = c.cuda_stream().context().clone();
        ctx.bind_to_thread().ok()?;
        // SAFETY: the device handle comes from a live context.
        unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }.ok()
    }

    pub fn peak(dev: &Device) -> u64 {
        let Some(p) = handle(dev) else { return 0 };
        let mut v: u64 = 0;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        // SAFETY: USED_MEM_HIGH is a cuuint64_t written into `v`.
        let _ = unsafe { sys::cuMemPoolGetAttribute(p, attr, &mut v as *mut u64 as *mut _) };
        v
    }

    pub fn reset(dev: &Device) {
        let Some(p) = handle(dev) else { return };
        let mut zero: u64 = 0;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        // SAFETY: writing 0 to USED_MEM_HIGH resets the high-water mark.
        let _ = unsafe { sys::cuMemPoolSetAttribute(p, attr, &mut zero as *mut u64 as *mut _) };
    }
}

#[cfg(not(feature = "cuda"))]
mod pool {
    pub fn peak(_: &candle_core::Device) -> u64 {
        0
    }
    pub fn reset(_: &candle_core::Device) {}
}

/// Mean wall time in ms of `f` over `reps` calls after two warm-up calls, synchronised.
fn time_ms(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 1e3 / reps as f64)
}

/// Forward, and forward + backward (seeded with ones), of `f` on fresh bf16 variables.
fn time_op(
    dev: &Device,
    shapes: &[&[usize]],
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<(f64, f64)> {
    let vars = shapes
        .iter()
        .map(|s| {
            candle_core::Var::from_tensor(&Tensor::randn(0f32, 1., *s, dev)?.to_dtype(DType::BF16)?)
        })
        .collect::<Result<Vec<_>>>()?;
    let xs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let fwd = time_ms(dev, 10, || f(&xs).map(|_| ()))?;
    let both = time_ms(dev, 10, || f(&xs)?.backward().map(|_| ()))?;
    Ok((fwd, both))
}

/// `--ops`: the pieces of one block at the preset's sizes, fused and plain.
fn ops(a: &Args, cfg: &GptConfig, dev: &Device) -> Result<()> {
    let (b, t, c, h) = (a.batch, a.seq, cfg.n_embd, cfg.n_head);
    let d = c / h;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = Vec::new();
    // One block of the preset, with its own weights (bf16), for the whole-block timings.
    let one = GptConfig {
        n_layer: 1,
        ..cfg.clone()
    };
    let w = init_weights(&one, 0)?;
    let compute: BTreeMap<String, Tensor> = w
        .iter()
        .map(|(k, t)| Ok((k.clone(), t.to_dtype(DType::BF16)?)))
        .collect::<Result<_>>()?;
    let model = Gpt::new(one, &compute, dev)?;
    let blk = model.segments[1].clone();
    for fused in [true, false] {
        let tag = if fused { "fused" } else { "plain" };
        // The ops of mtrain_kernels fuse on this device; plain:: are the candle versions.
        let attn = if fused {
            time_op(dev, &[&[3, b, h, t, d]], |x| {
                mtrain_kernels::causal_attention(&x[0], scale, None)
            })?
        } else {
            time_op(dev, &[&[b, h, t, d], &[b, h, t, d], &[b, h, t, d]], |x| {
                plain::causal_attention(&x[0], &x[1], &x[2], scale)
            })?
        };
        let ln = time_op(dev, &[&[b * t, c], &[c], &[c]], |x| {
            if fused {
                mtrain_kernels::layer_norm(&x[0], &x[1], &x[2], 1e-5)
            } else {
                plain::layer_norm(&x[0], &x[1], &x[2], 1e-5)
            }
        })?;
        let gelu = time_op(dev, &[&[b * t, 4 * c]], |x| {
            if fused {
                mtrain_kernels::gelu(&x[0])
            } else {
                plain::gelu(&x[0])
            }
        })?;
        // The glue between them: the q/k/v split into heads (the three parts summed so one
        // backward covers them), the attention output back to (B, T, C), bias and residual adds.
        let split = time_op(dev, &[&[b, t, 3 * c]], |x| {
            if fused {
                mtrain_kernels::split_heads(&x[0], 3, h)
            } else {
                let part = |i: usize| {
                    x[0].narrow(2, i * c, c)?
                        .reshape((b, t, h, d))?
                        .transpose(1, 2)?
                        .contiguous()
                };
                Tensor::stack(&[part(0)?, part(1)?, part(2)?], 0)
            }
        })?;
        let merge = time_op(dev, &[&[b, h, t, d]], |x| {
            if fused {
                mtrain_kernels::merge_heads(&x[0].unsqueeze(0)?)
            } else {
                x[0].transpose(1, 2)?.reshape((b, t, c))
            }
        })?;
        let bias = |w: usize| {
            time_op(dev, &[&[b * t, w], &[w]], |x| {
                if fused {
                    mtrain_kernels::bias_add(&x[0], &x[1])
                } else {
                    x[0].broadcast_add(&x[1])
                }
            })
        };
        let (bias3, bias4) = (bias(3 * c)?, bias(4 * c)?);
        let residual = time_op(dev, &[&[b, t, c], &[b, t, c]], |x| &x[0] + &x[1])?;
        for (name, (f, fb)) in [
            ("attention", attn),
            ("layer_norm", ln),
            ("gelu", gelu),
            ("qkv_split", split),
            ("attn_out_merge", merge),
            ("bias_add_3c", bias3),
            ("bias_add_4c", bias4),
            ("residual_add", residual),
        ] {
            out.push(format!(
                "\"{name}_{tag}_fwd\": {f:.3}, \"{name}_{tag}_fwd_bwd\": {fb:.3}"
            ));
        }
        if fused {
            // The block is built on the ops above, which fuse on this device.
            let (f, fb) = time_op(dev, &[&[b, t, c]], |x| Ok(blk.forward(&x[0], None)?.out))?;
            out.push(format!(
                "\"block_fused_fwd\": {f:.3}, \"block_fused_fwd_bwd\": {fb:.3}"
            ));
            // The same block through its hand-written backward (explicit::block_tape).
            let xb = Tensor::randn(0f32, 1., (b, t, c), dev)?.to_dtype(DType::BF16)?;
            let g = xb.ones_like()?;
            let taped = time_ms(dev, 10, || {
                let tape = blk.forward_taped(&xb, None)?.ok_or_else(|| {
                    candle_core::Error::Msg("the block has no hand-written backward here".into())
                })?;
                tape.backward(Some(&g), 1.0).map(|_| ())
            })?;
            out.push(format!("\"block_taped_fwd_bwd\": {taped:.3}"));
            // Host time to issue one block forward (no synchronise inside the loop): if it is
            // close to the synchronised time, the block is bound by candle's per-op host cost.
            let xb = Tensor::randn(0f32, 1., (b, t, c), dev)?.to_dtype(DType::BF16)?;
            dev.synchronize()?;
            let t0 = Instant::now();
            for _ in 0..10 {
                blk.forward(&xb, None)?;
            }
            let issue = t0.elapsed().as_secs_f64() * 1e3 / 10.0;
            dev.synchronize()?;
            out.push(format!("\"block_fused_fwd_issue_host\": {issue:.3}"));
        }
    }
    // The block's four matmuls, forward only: (N, C) x (C, 3C), (C, C), (C, 4C), (4C, C).
    let n = b * t;
    let r = |s: (usize, usize)| Tensor::randn(0f32, 1., s, dev)?.to_dtype(DType::BF16);
    let (x, x4) = (r((n, c))?, r((n, 4 * c))?);
    let ws = [r((c, 3 * c))?, r((c, c))?, r((c, 4 * c))?, r((4 * c, c))?];
    let mm = time_ms(dev, 10, || {
        for (i, w) in ws.iter().enumerate() {
            let inp = if i == 3 { &x4 } else { &x };
            inp.matmul(w)?;
        }
        Ok(())
    })?;
    out.push(format!("\"matmuls_fwd\": {mm:.3}"));
    println!(
        "{{\"ops_ms\": {{{}}}, \"batch\": {b}, \"seq\": {t}, \"n_embd\": {c}, \"n_head\": {h}}}",
        out.join(", ")
    );
    Ok(())
}

/// `--attn`: the hand-written path's attention forward and backward alone, per (B, H, T, D).
fn attn(shapes: &[[usize; 4]], dev: &Device) -> Result<()> {
    use mtrain_kernels::attention;
    for &[b, h, t, d] in shapes {
        let scale = 1.0 / (d as f64).sqrt();
        let r = |s: &[usize]| Tensor::randn(0f32, 1., s, dev)?.to_dtype(DType::BF16);
        let qkv = r(&[3, b, h, t, d])?;
        let dy = r(&[b, h, t, d])?;
        let (y, lse) = attention::forward(&qkv, scale, None)?;
        let fwd = time_ms(dev, 20, || {
            attention::forward(&qkv, scale, None).map(|_| ())
        })?;
        let bwd = time_ms(dev, 20, || {
            attention::backward(&qkv, &y, &dy, &lse, scale, None).map(|_| ())
        })?;
        let flops = 2.0 * (b * h * d) as f64 * (t * t) as f64; // causal: half of 4·B·H·T²·D
        println!(
            "{{\"impl\": \"mtrain\", \"attn\": [{b}, {h}, {t}, {d}], \"fwd_ms\": {fwd:.3}, \"bwd_ms\": {bwd:.3}, \"fwd_tflops\": {:.1}, \"bwd_tflops\": {:.1}}}",
            flops / fwd / 1e9,
            2.5 * flops / bwd / 1e9
        );
    }
    Ok(())
}

fn run(a: &Args) -> Result<()> {
    let dev = Device::cuda_if_available(0)?;
    let backward = match a.autograd {
        true => Backward::Autograd,
        false => Backward::default(),
    };
    mtrain_kernels::configure_device(&dev)?;
    let cfg = GptConfig::preset(&a.preset)
        .ok_or_else(|| candle_core::Error::Msg(format!("unknown preset {}", a.preset)))?;
    let mode = match a.autograd {
        true => "fused-autograd",
        false => "fused",
    };
    if a.ops {
        return ops(a, &cfg, &dev);
    }
    if !a.attn.is_empty() {
        return attn(&a.attn, &dev);
    }
    let mut data = Batches::new(a.data.as_deref(), cfg.vocab_size)?;
    let mut tr = Trainer::new(
        cfg.clone(),
        Engine::new(false).with_backward(backward),
        &dev,
    )?;
    let mut none = mtrain_model::NoHooks;

    if a.loss_steps > 0 {
        let mut lines = String::new();
        let mut pending = Vec::new();
        for s in 0..a.loss_steps {
            let (x, y) = data.next(a.batch, a.seq, &dev)?;
            // Linear warmup, then constant: without it, Adam's first steps at this small batch
            // spike the loss, and two runs that differ only in rounding part ways there.
            let lr = 3e-4 * ((s + 1) as f64 / a.loss_warmup.max(1) as f64).min(1.0);
            pending.push((s, tr.step(&x, &y, lr, &mut none)?));
            // Read the losses back 20 steps at a time, so the host rarely waits for the device.
            if pending.len() == 20 || s + 1 == a.loss_steps {
                for (i, l) in pending.drain(..) {
                    let l = l.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                    lines.push_str(&format!("{i} {l:.5}\n"));
                }
            }
        }
        std::fs::write(&a.loss_out, lines)?;
        println!(
            "{{\"impl\": \"mtrain\", \"mode\": \"{mode}\", \"loss_curve\": \"{}\", \"steps\": {}}}",
            a.loss_out, a.loss_steps
        );
        return Ok(());
    }

    for _ in 0..a.warmup {
        let (x, y) = data.next(a.batch, a.seq, &dev)?;
        tr.step(&x, &y, 3e-4, &mut none)?;
    }
    dev.synchronize()?;
    if a.profile {
        let (x, y) = data.next(a.batch, a.seq, &dev)?;
        let mut p = Profile {
            dev: dev.clone(),
            t0: Instant::now(),
            fwd: BTreeMap::new(),
            bwd: BTreeMap::new(),
        };
        let t = Instant::now();
        let segs: &[Arc<dyn Segment>] = &tr.model.segments;
        let engine = tr.engine;
        let acts = engine.forward(segs, &x, Some(&y), &mut p)?;
        engine.backward(segs, acts, None, 1.0, &mut tr.grads, &mut p)?;
        dev.synchronize()?;
        let fb = t.elapsed().as_secs_f64() * 1e3;
        tr.grads.clear();
        let t = Instant::now();
        tr.step(&x, &y, 3e-4, &mut none)?;
        dev.synchronize()?;
        let whole = t.elapsed().as_secs_f64() * 1e3;
        let fmt = |m: &BTreeMap<String, f64>| {
            m.iter()
                .map(|(k, v)| format!("\"{k}\": {v:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "{{\"profile\": \"{mode}\", \"forward_ms\": {{{}}}, \"backward_ms\": {{{}}}, \"fwd_bwd_ms\": {fb:.2}, \"step_ms\": {whole:.2}, \"optimizer_ms\": {:.2}}}",
            fmt(&p.fwd),
            fmt(&p.bwd),
            whole - fb
        );
    }
    pool::reset(&dev);
    let t = Instant::now();
    let mut loss = None;
    for _ in 0..a.steps {
        let (x, y) = data.next(a.batch, a.seq, &dev)?;
        loss = Some(tr.step(&x, &y, 3e-4, &mut none)?);
    }
    dev.synchronize()?;
    let dt = t.elapsed().as_secs_f64() / a.steps.max(1) as f64;
    let loss = match loss {
        Some(l) => l.to_dtype(DType::F64)?.to_scalar::<f64>()?,
        None => f64::NAN,
    };
    let tok = (a.batch * a.seq) as f64 / dt;
    let mfu = tok * cfg.flops_per_token(a.seq) / 989e12;
    println!(
        "{{\"impl\": \"mtrain\", \"mode\": \"{mode}\", \"preset\": \"{}\", \"batch\": {}, \"seq\": {}, \"dtype\": \"bf16\", \"tokens_per_s\": {}, \"mfu\": {mfu:.4}, \"peak_alloc_gib\": {:.3}, \"step_ms\": {:.2}, \"loss\": {loss:.4}}}",
        a.preset,
        a.batch,
        a.seq,
        tok.round(),
        pool::peak(&dev) as f64 / (1u64 << 30) as f64,
        dt * 1e3
    );
    Ok(())
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench_gpu: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        eprintln!("bench_gpu: {e}");
        std::process::exit(1);
    }
}
