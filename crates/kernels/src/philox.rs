//! Philox4x32-10, the counter-based generator of Salmon et al., "Parallel Random Numbers: As
//! Easy as 1, 2, 3" (SC 2011): random numbers as a pure function of a 64-bit key and a 128-bit
//! counter, with no state to carry from one draw to the next.
//!
//! ```text
//!   key (k0, k1) = the seed         counter (c0, c1, c2, c3) = what is being drawn
//!   10 rounds of:   (hi0, lo0) = M0 · c0        (hi1, lo1) = M1 · c2       (32 x 32 -> 64 bits)
//!                   c = (hi1 ^ c1 ^ k0,  lo1,  hi0 ^ c3 ^ k1,  lo0)
//!                   k += (W0, W1)                                           (Weyl key schedule)
//!   output: the four words of c, uniform and independent for distinct counters
//! ```
//!
//! A draw named by its coordinates (a training step, a row of the global batch, an element
//! index) is the same on every rank and after any restart, whichever process computes it and in
//! whatever order: this is what lets a data-parallel rank take its rows of a global batch without
//! replaying the draws of the rows before them. The same function runs in CUDA kernels (it is
//! integer multiplies and xors), so device and host agree bit for bit.

/// Multiplier of the first word pair.
const M0: u32 = 0xD251_1F53;
/// Multiplier of the second word pair.
const M1: u32 = 0xCD9E_8D57;
/// Weyl increments of the key (the golden ratio and √3 − 1, as 32-bit fractions).
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;
/// Rounds: 10, the variant that passes the TestU01 BigCrush battery with a margin.
const ROUNDS: usize = 10;

/// The four output words of Philox4x32-10 for `counter` under `key`.
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for round in 0..ROUNDS {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The key of a 64-bit seed (low word first).
pub fn key_of(seed: u64) -> [u32; 2] {
    [seed as u32, (seed >> 32) as u32]
}

/// Two 64-bit draws for `counter` under `seed`: the output words joined pairwise.
pub fn draw_u64x2(seed: u64, counter: [u32; 4]) -> [u64; 2] {
    let w = philox4x32(counter, key_of(seed));
    [
        u64::from(w[0]) | u64::from(w[1]) << 32,
        u64::from(w[2]) | u64::from(w[3]) << 32,
    ]
}

/// A uniform 64-bit draw mapped onto `0..n` by the high half of the 128-bit product `x · n`
/// (Lemire's multiply-shift): the bias of any value is below n / 2⁶⁴, far under what any count
/// here could resolve. `n` must be at least 1.
pub fn below(x: u64, n: u64) -> u64 {
    debug_assert!(n > 0);
    ((u128::from(x) * u128::from(n)) >> 64) as u64
}

/// A uniform 32-bit draw as a float in [0, 1): its top 24 bits over 2²⁴ (every value exact in
/// f32).
pub fn unit_f32(x: u32) -> f32 {
    (x >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The known-answer vectors Random123 publishes for Philox4x32-10 (counter, key, output).
    #[test]
    fn known_answers() {
        let cases = [
            (
                [0; 4],
                [0; 2],
                [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
            ),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (counter, key, want) in cases {
            assert_eq!(philox4x32(counter, key), want, "counter {counter:x?}");
        }
    }

    #[test]
    fn below_stays_in_range_and_reaches_both_ends() {
        assert_eq!(below(0, 10), 0);
        assert_eq!(below(u64::MAX, 10), 9);
        assert_eq!(below(u64::MAX, 1), 0);
        assert_eq!(unit_f32(0), 0.0);
        assert!(unit_f32(u32::MAX) < 1.0);
    }
}
