//! A small seeded random generator (PCG-XSH-RR 64/32) so runs are reproducible bit for bit and
//! the generator's position can be saved in a checkpoint as two integers, and the process-wide
//! seed ([`set_global_seed`]) that Accelerate-style `set_seed` sets.
//!
//! The engine keeps no hidden generator state: every generator it uses is made from one seed
//! (parameter initialisation on stream 1, each epoch's data order on stream `0x5a4d` with
//! `seed + epoch`). [`global_seed`] is the seed a [`TrainConfig`](super::trainer::TrainConfig)
//! starts from, so setting it once seeds all of them.

use std::sync::atomic::{AtomicU64, Ordering};

/// The seed used when nobody set one (the reference PyTorch script's).
pub const DEFAULT_SEED: u64 = 42;

static GLOBAL_SEED: AtomicU64 = AtomicU64::new(DEFAULT_SEED);

/// Set this process's seed for every generator the engine makes from now on: the default
/// [`TrainConfig`](super::trainer::TrainConfig) takes it (initialisation and data order). On a
/// job, prefer [`set_seed`](crate::set_seed), which also checks that every rank passed the same one.
pub fn set_global_seed(seed: u64) {
    GLOBAL_SEED.store(seed, Ordering::Relaxed);
}

/// The seed set by [`set_global_seed`], or [`DEFAULT_SEED`].
pub fn global_seed() -> u64 {
    GLOBAL_SEED.load(Ordering::Relaxed)
}

/// PCG32 generator: 64-bit state, 32-bit output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    state: u64,
    inc: u64,
}

const MUL: u64 = 6364136223846793005;

impl Rng {
    /// A generator for `seed` on stream `stream` (different streams give independent sequences,
    /// e.g. one for initialisation and one per epoch's shuffle).
    pub fn new(seed: u64, stream: u64) -> Rng {
        let mut r = Rng {
            state: 0,
            inc: (stream << 1) | 1,
        };
        r.next_u32();
        r.state = r.state.wrapping_add(seed);
        r.next_u32();
        r
    }

    /// Rebuild a generator from a saved position ([`Rng::position`]).
    pub fn from_position(state: u64, inc: u64) -> Rng {
        Rng {
            state,
            inc: inc | 1,
        }
    }

    /// The generator's position, to save and restore with [`Rng::from_position`].
    pub fn position(&self) -> (u64, u64) {
        (self.state, self.inc)
    }

    /// Next 32 random bits.
    pub fn next_u32(&mut self) -> u32 {
        let old = self.state;
        self.state = old.wrapping_mul(MUL).wrapping_add(self.inc);
        let xorshifted = (((old >> 18) ^ old) >> 27) as u32;
        let rot = (old >> 59) as u32;
        xorshifted.rotate_right(rot)
    }

    /// Uniform in `[0, 1)` with 24 bits of precision (exactly representable in f32).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.next_f32()
    }

    /// Uniform integer in `[0, n)` without modulo bias (Lemire's method); `n` must be > 0.
    pub fn below(&mut self, n: u32) -> u32 {
        let mut m = self.next_u32() as u64 * n as u64;
        if (m as u32) < n {
            let t = n.wrapping_neg() % n;
            while (m as u32) < t {
                m = self.next_u32() as u64 * n as u64;
            }
        }
        (m >> 32) as u32
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u32 + 1) as usize;
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn reproducible_and_restorable() {
        let mut a = Rng::new(42, 7);
        let mut b = Rng::new(42, 7);
        let _ = a.next_u32();
        let _ = b.next_u32();
        let (s, i) = a.position();
        let mut c = Rng::from_position(s, i);
        for _ in 0..100 {
            let x = a.next_u32();
            assert_eq!(x, b.next_u32());
            assert_eq!(x, c.next_u32());
        }
        assert_ne!(Rng::new(42, 1).next_u32(), Rng::new(43, 1).next_u32());
        let mut r = Rng::new(1, 1);
        for _ in 0..1000 {
            let f = r.uniform(-2.0, 3.0);
            assert!((-2.0..3.0).contains(&f));
            assert!(r.below(10) < 10);
        }
    }
}
