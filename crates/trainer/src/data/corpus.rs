//! The built-in corpus: a tiny stochastic grammar whose entropy is known exactly.
//!
//! Every line is drawn independently. With probability 1/2 it is a *fact* and otherwise a *sum*:
//!
//! ```text
//! fact:  "the {adj} {noun}[s] {verb}[s] the {noun}.\n"     e.g. "the red cats chase the duck.\n"
//!         number: singular or plural (1 bit) — the verb agrees with the subject across the adjective
//!         adj, noun, verb, object noun: 8 words each, uniform (3 bits each)        -> 13 bits
//! sum:   "{a}+{b}={a+b}.\n"                                e.g. "7+5=12.\n"
//!         a, b: digits 0..9, uniform; the result is determined by them             -> log2(100) bits
//! ```
//!
//! The line type is read off the first byte and every word is followed by a delimiter, so the bytes
//! determine the choices and the information per line is exactly the entropy of the choices:
//! `H_line = 1 + (13 + log2 100)/2 = 10.82 bits`. Lines are i.i.d., so by the renewal-reward theorem the
//! entropy rate of the byte stream is `H_line / E[line length] = 10.82 / 18.85 = 0.574 bits/byte =
//! 0.398 nats/byte` — the loss a perfect model reaches. A model that only knows byte frequencies (the
//! unigram entropy) pays `4.615 bits = 3.199 nats` per byte. Both numbers are computed from the tables
//! below by [`entropy_rate_nats`] and [`unigram_entropy_nats`]; a trained model must land in between,
//! and the closer to 0.398 the more of the grammar (word lists, agreement, addition) it has learned.
//!
//! Generation is deterministic (SplitMix64 from a seed), so the corpus needs no download and is the
//! same on every machine.

/// Adjectives of a fact line.
const ADJ: [&str; 8] = [
    "small", "big", "red", "old", "quick", "quiet", "happy", "green",
];
/// Nouns (subject and object); a plural subject appends "s".
const NOUN: [&str; 8] = [
    "cat", "dog", "bird", "frog", "horse", "goat", "duck", "lion",
];
/// Verb stems; a singular subject appends "s".
const VERB: [&str; 8] = [
    "see", "like", "follow", "chase", "help", "find", "hear", "call",
];

/// SplitMix64: a tiny, well-mixed 64-bit generator (Steele, Lea, Flood 2014). Its whole state is one
/// `u64`, which is what checkpoints save.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitMix64 {
    /// The generator's state.
    pub state: u64,
}

impl SplitMix64 {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform integer in `0..n` (`n > 0`), by rejection so it has no modulo bias.
    pub fn below(&mut self, n: u64) -> u64 {
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }
}

/// Append one line of the grammar to `out`.
fn push_line(rng: &mut SplitMix64, out: &mut Vec<u8>) {
    if rng.below(2) == 0 {
        let plural = rng.below(2) == 1;
        let adj = ADJ[rng.below(8) as usize];
        let noun = NOUN[rng.below(8) as usize];
        let verb = VERB[rng.below(8) as usize];
        let obj = NOUN[rng.below(8) as usize];
        let (ns, vs) = if plural { ("s", "") } else { ("", "s") };
        out.extend_from_slice(format!("the {adj} {noun}{ns} {verb}{vs} the {obj}.\n").as_bytes());
    } else {
        let a = rng.below(10);
        let b = rng.below(10);
        out.extend_from_slice(format!("{a}+{b}={}.\n", a + b).as_bytes());
    }
}

/// At least `n_bytes` bytes of the grammar (whole lines), generated from `seed`.
pub fn generate(n_bytes: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    let mut out = Vec::with_capacity(n_bytes + 64);
    while out.len() < n_bytes {
        push_line(&mut rng, &mut out);
    }
    out
}

/// Every line the grammar can produce with its probability (8 192 facts and 100 sums).
fn all_lines() -> Vec<(f64, String)> {
    let mut lines = Vec::new();
    let p_fact = 0.5 * 0.5 / 8f64.powi(4);
    for plural in [false, true] {
        let (ns, vs) = if plural { ("s", "") } else { ("", "s") };
        for adj in ADJ {
            for noun in NOUN {
                for verb in VERB {
                    for obj in NOUN {
                        lines.push((
                            p_fact,
                            format!("the {adj} {noun}{ns} {verb}{vs} the {obj}.\n"),
                        ));
                    }
                }
            }
        }
    }
    for a in 0..10 {
        for b in 0..10 {
            lines.push((0.5 / 100.0, format!("{a}+{b}={}.\n", a + b)));
        }
    }
    lines
}

/// Expected bytes per line, `E[L]`.
fn mean_line_len() -> f64 {
    all_lines().iter().map(|(p, s)| p * s.len() as f64).sum()
}

/// The entropy rate of the corpus in nats per byte: `H_line / E[L]` (0.398).
pub fn entropy_rate_nats() -> f64 {
    let h_line_bits = 1.0 + 0.5 * (1.0 + 4.0 * 3.0) + 0.5 * 100f64.log2();
    h_line_bits * std::f64::consts::LN_2 / mean_line_len()
}

/// The entropy of the stationary byte distribution in nats (3.199): the loss of the best model that
/// ignores context.
pub fn unigram_entropy_nats() -> f64 {
    let mut counts = [0f64; 256];
    for (p, s) in all_lines() {
        for b in s.bytes() {
            counts[b as usize] += p;
        }
    }
    let total: f64 = counts.iter().sum();
    -counts
        .iter()
        .filter(|&&c| c > 0.0)
        .map(|&c| (c / total) * (c / total).ln())
        .sum::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_entropies_match_the_tables() {
        assert!(
            (entropy_rate_nats() - 0.39794).abs() < 1e-4,
            "{}",
            entropy_rate_nats()
        );
        assert!(
            (unigram_entropy_nats() - 3.19905).abs() < 1e-4,
            "{}",
            unigram_entropy_nats()
        );
    }

    #[test]
    fn empirical_unigram_entropy_approaches_the_closed_form() {
        let text = generate(1 << 20, 7);
        let mut counts = [0f64; 256];
        for &b in &text {
            counts[b as usize] += 1.0;
        }
        let n = text.len() as f64;
        let h: f64 = -counts
            .iter()
            .filter(|&&c| c > 0.0)
            .map(|&c| c / n * (c / n).ln())
            .sum::<f64>();
        assert!((h - unigram_entropy_nats()).abs() < 0.01, "empirical {h}");
    }

    #[test]
    fn generation_is_deterministic() {
        assert_eq!(generate(4096, 3), generate(4096, 3));
        assert_ne!(generate(4096, 3), generate(4096, 4));
    }
}
