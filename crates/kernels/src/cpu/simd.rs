//! The CPU loops' element-wise spans, each compiled twice: for x86-64's baseline (SSE2, 4 lanes)
//! and for AVX2 + FMA (8 lanes), the second chosen at run time on a CPU that has them, as the
//! gemm crate chooses its kernels; GELU's two spans, whose polynomial and division fill the
//! vector units, a third time for AVX-512F (16 lanes). The compiler contracts no `a·b + c` into
//! an FMA on its own, so every build does the same arithmetic per element: the same bits on any
//! x86-64 (a test compares them). Sums over a row are not here: they stay one add after
//! another, in order.

use std::sync::atomic::{AtomicU8, Ordering};

use super::{exp, tanh, GELU_A, GELU_K};

/// Which build runs: 0 not yet known, 1 the baseline, 2 AVX2 + FMA.
static LEVEL: AtomicU8 = AtomicU8::new(0);

/// Whether the AVX2 + FMA build runs (detected once).
fn avx2_fma() -> bool {
    match LEVEL.load(Ordering::Relaxed) {
        0 => {
            #[cfg(target_arch = "x86_64")]
            let has = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            #[cfg(not(target_arch = "x86_64"))]
            let has = false;
            LEVEL.store(if has { 2 } else { 1 }, Ordering::Relaxed);
            has
        }
        level => level == 2,
    }
}

/// Whether the AVX-512F build of the wide spans runs (detected once; never under the baseline).
fn avx512() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    #[cfg(target_arch = "x86_64")]
    let has = *HAS.get_or_init(|| is_x86_feature_detected!("avx512f"));
    #[cfg(not(target_arch = "x86_64"))]
    let has = false;
    has && avx2_fma()
}

/// Runs the baseline build from now on (`true`) or the one the CPU supports (`false`).
#[cfg(test)]
pub(super) fn force_baseline(on: bool) {
    LEVEL.store(if on { 1 } else { 0 }, Ordering::Relaxed);
}

/// `fn name(args) { body }`, its body compiled for the baseline and for AVX2 + FMA; with
/// `wide:` first also for AVX-512F (16 lanes), for the spans whose arithmetic (GELU's
/// polynomial and division) fills the vector units.
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) $body:block) => {
        simd_fn! { @build false; $(#[$m])* $vis fn $name($($a: $t),*) $body }
    };
    (wide: $(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) $body:block) => {
        simd_fn! { @build true; $(#[$m])* $vis fn $name($($a: $t),*) $body }
    };
    (@build $wide:literal; $(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),*) $body:block) => {
        $(#[$m])*
        $vis fn $name($($a: $t),*) {
            #[inline(always)]
            fn body($($a: $t),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn lanes16($($a: $t),*) {
                    body($($a),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($a: $t),*) {
                    body($($a),*)
                }
                if $wide && avx512() {
                    // SAFETY: the CPU has AVX-512F, AVX2 and FMA (checked at run time).
                    return unsafe { lanes16($($a),*) };
                }
                if avx2_fma() {
                    // SAFETY: the CPU has AVX2 and FMA (checked at run time).
                    return unsafe { avx2($($a),*) };
                }
            }
            body($($a),*)
        }
    };
}

simd_fn! {
    wide:
    /// y = GELU(x), element by element.
    pub(super) fn gelu(x: &[f32], y: &mut [f32]) {
        for (y, &x) in y.iter_mut().zip(x) {
            *y = 0.5 * x * (1.0 + tanh(GELU_K * (x + GELU_A * x * x * x)));
        }
    }
}

simd_fn! {
    wide:
    /// dx = dy · GELU'(x), element by element.
    pub(super) fn gelu_backward(x: &[f32], dy: &[f32], dx: &mut [f32]) {
        for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
            let th = tanh(GELU_K * (x + GELU_A * x * x * x));
            let d = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * GELU_K * (1.0 + 3.0 * GELU_A * x * x);
            *dx = dy * d;
        }
    }
}

simd_fn! {
    /// out = e^(s − shift) · scale, element by element.
    pub(super) fn exp_shifted(s: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
        for (o, &s) in out.iter_mut().zip(s) {
            *o = exp(s - shift) * scale;
        }
    }
}

simd_fn! {
    /// x = e^(x − shift) · scale, element by element: [`exp_shifted`] over its own input.
    pub(super) fn exp_shifted_in_place(x: &mut [f32], shift: f32, scale: f32) {
        x.iter_mut().for_each(|x| *x = exp(*x - shift) * scale);
    }
}

simd_fn! {
    /// x *= k, element by element.
    pub(super) fn scale(x: &mut [f32], k: f32) {
        x.iter_mut().for_each(|v| *v *= k);
    }
}
