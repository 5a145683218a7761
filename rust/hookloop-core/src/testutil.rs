//! Helpers shared by the crate's tests.

/// A xorshift64 generator from `seed` (non-zero): fixed pseudo-random inputs that repeat
/// from run to run, for the tests that compare two ways of computing one thing.
pub fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}
