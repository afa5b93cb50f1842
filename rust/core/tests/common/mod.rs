//! Shared by the integration tests (each test file is its own crate and includes this module).
//! The hybrid tests' mixed model is in `hybrid.rs`, which only they include.

/// xorshift64*: a tiny deterministic generator, so randomised tests need no extra crate and
/// replay the same sequence on every machine.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform enough in `0..n` for tests.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}
