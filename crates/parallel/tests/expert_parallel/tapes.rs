//! The expert-parallel MoE block's hand-written backward: against autograd through the same
//! block, the whole model through the tapes against one device (by [`super`]'s comparisons,
//! tolerances unchanged), and the collectives the tapes issue against autograd's.

use super::*;

use mtrain_model::Backward;

use crate::common::{det, rel};

/// rel ≤ 1e-5 in f32 for every gradient a tape returns.
const TAPE_TOL: f64 = 1e-5;

/// ‖got − want‖ / ‖want‖, or ‖got‖ where want is zero (an expert no token reached).
fn gap(got: &Tensor, want: &Tensor) -> f64 {
    let norm = |t: &Tensor| {
        t.sqr()
            .and_then(|t| t.sum_all())
            .and_then(|t| t.to_dtype(DType::F64))
            .and_then(|t| t.to_scalar::<f64>())
            .expect("norm")
            .sqrt()
    };
    match norm(want) {
        0.0 => norm(got),
        _ => rel(got, want),
    }
}

/// Each rank's first expert-parallel MoE block: its tape (which it must have) against
/// autograd through the same block, for this rank's own input and upstream gradient and
/// `loss_scale` 0.5 on the auxiliary loss: output, auxiliary loss, routing, every gradient
/// of this rank's parameters (router, its experts, attention, LayerNorms) and the input's.
/// Returns each rank's routing.
fn ep_block_tape_matches_autograd(ep: usize) -> Vec<MoeStats> {
    let cfg = tiny_moe();
    let w = init_weights(&cfg, 13).expect("weights");
    let results = run_local(ep, Duration::from_secs(60), |b| -> Res<MoeStats> {
        let g = b.world();
        let segs = build_segments(&cfg, &w, &g, false, &Device::Cpu).map_err(s)?;
        let block = segs[1].as_ref();
        let r = g.rank() as u64;
        let (x, dout) = (
            det(&[2, 16, cfg.n_embd], 40 + r),
            det(&[2, 16, cfg.n_embd], 50 + r),
        );
        let loss_scale = 0.5;
        let what = format!("ep {ep} rank {r}");
        // Autograd: the all-to-alls' backward runs inside `backward()`.
        let xv = Var::from_tensor(&x).map_err(s)?;
        let o = block.forward(xv.as_tensor(), None).map_err(s)?;
        let aux = o.aux_loss.clone().ok_or("no aux loss")?;
        let store = (&o.out * &dout)
            .and_then(|t| t.sum_all())
            .and_then(|t| t + (&aux * loss_scale)?)
            .and_then(|t| t.backward())
            .map_err(s)?;
        // The tape: the same all-to-alls in its forward, their conjugates in its backward.
        let tape = block
            .forward_taped(&x, None)
            .map_err(s)?
            .ok_or(format!("{what}: no tape"))?;
        let stats = tape.stats().ok_or("the tape reports no routing")?;
        if Some(&stats) != o.stats.as_ref() {
            return Err(format!("{what}: routing {stats:?} vs {:?}", o.stats));
        }
        let check = |name: &str, got: &Tensor, want: &Tensor| -> Res<f64> {
            let e = gap(got, want);
            match e <= TAPE_TOL {
                true => Ok(e),
                false => Err(format!("{what} {name}: rel {e:.3e} > {TAPE_TOL:.0e}")),
            }
        };
        check("output", tape.output(), &o.out)?;
        check("aux loss", tape.aux_loss().ok_or("no tape aux loss")?, &aux)?;
        let got = tape.backward(Some(&dout), loss_scale).map_err(s)?;
        let params = block.params();
        let mut names: Vec<&str> = got.params.iter().map(|(n, _)| n.as_str()).collect();
        names.sort();
        let mut want: Vec<&str> = params.iter().map(|p| p.name()).collect();
        want.sort();
        if names != want {
            return Err(format!("{what}: gradients {names:?}, parameters {want:?}"));
        }
        let mut worst = 0f64;
        for (name, gr) in &got.params {
            let p = params.iter().find(|p| p.name() == name).ok_or("param")?;
            let want = match store.get(&p.tensor()) {
                Some(t) => t.clone(),
                None => p.tensor().zeros_like().map_err(s)?,
            };
            worst = worst.max(check(name, gr, &want)?);
        }
        let dx = got.input.ok_or(format!("{what}: no input gradient"))?;
        let want_dx = store
            .get(xv.as_tensor())
            .ok_or("no autograd input gradient")?;
        worst = worst.max(check("input", &dx, want_dx)?);
        eprintln!("{what}: {stats:?}, worst gradient rel {worst:.1e}");
        Ok(stats)
    });
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("ep {ep} rank {r}: {e}")))
        .collect()
}

#[test]
fn tapes_ep_block_matches_autograd() {
    for ep in [2, 4] {
        let stats = ep_block_tape_matches_autograd(ep);
        assert!(
            stats.iter().any(|st| st.dropped > 0),
            "ep {ep}: the test should exercise capacity drops"
        );
    }
}

/// The engine through the tapes (`Backward::Tapes`, the all-to-alls' conjugates inside each
/// block's backward, the grad-ready hooks per segment) against the single-device autograd
/// reference, with the autograd runs' tolerances.
fn tapes() -> Engine {
    Engine::default().with_backward(Backward::Tapes)
}

#[test]
fn tapes_ep2_matches_one_device() {
    let cfg = tiny_moe();
    let w = init_weights(&cfg, 7).expect("weights");
    let reps = check_against_one_device(&cfg, &w, 2, 2, 10, tapes());
    assert!(
        reps.iter().any(|r| r.dropped > 0),
        "the test should exercise capacity drops"
    );
}

#[test]
fn tapes_dp4_ep2_matches_one_device() {
    let cfg = tiny_moe();
    let w = init_weights(&cfg, 9).expect("weights");
    check_against_one_device(&cfg, &w, 4, 2, 10, tapes());
}

/// Checkpointing recomputes each block's tape (its forward all-to-alls again) in the backward.
#[test]
fn tapes_ep2_with_checkpointing_matches_one_device() {
    let cfg = tiny_moe();
    let w = init_weights(&cfg, 12).expect("weights");
    check_against_one_device(
        &cfg,
        &w,
        2,
        2,
        5,
        Engine::new(true).with_backward(Backward::Tapes),
    );
}

#[test]
fn tapes_peer_with_zero_tokens_matches_one_device() {
    peer_with_zero_tokens(tapes());
}

/// The ep group's collectives in one forward and backward of the model at dp = ep = 2, as
/// (kind, bytes sent) in order: the tapes issue exactly what autograd issues (the counts,
/// dispatch and combine all-to-alls of each block forward, the conjugates in the backward).
#[test]
fn trace_ep_tapes_issue_the_collectives_of_autograd() {
    let cfg = tiny_moe();
    let w = init_weights(&cfg, 7).expect("weights");
    let traces = run_local(
        2,
        Duration::from_secs(60),
        |b| -> Res<Vec<Vec<(String, u64)>>> {
            let mesh = DeviceMesh::new(&b as &dyn Backend, MeshDims::new(2, 1, 1, 2)).map_err(s)?;
            let segs = build_segments(&cfg, &w, &mesh.ep, false, &Device::Cpu).map_err(s)?;
            let (idx, tgt) = batch(0, mesh.coords.dp, cfg.vocab_size);
            let tracer = mesh.ep.tracer();
            tracer.set_recording(true);
            [Backward::Autograd, Backward::Tapes]
                .into_iter()
                .map(|backward| {
                    tracer.clear();
                    let mut grads = Grads::new();
                    micro_step(
                        &segs,
                        &idx,
                        &tgt,
                        1.0,
                        &mut grads,
                        Engine::default().with_backward(backward),
                    )?;
                    Ok(tracer
                        .events()
                        .iter()
                        .map(|e| (format!("{:?}", e.op), e.bytes_sent))
                        .collect())
                })
                .collect()
        },
    );
    for (r, res) in traces.into_iter().enumerate() {
        let t = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        // Per block: counts, dispatch, combine forward; combine's and dispatch's conjugates.
        assert_eq!(
            t[0].len(),
            5 * cfg.n_layer,
            "rank {r}: autograd issued {:?}",
            t[0]
        );
        assert_eq!(t[1], t[0], "rank {r}: the tapes' collectives vs autograd's");
    }
}
