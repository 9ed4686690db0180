//! Known inputs and expected sums prepared once per dtype, and the cross-rank tally of failed
//! checks. Bench, selftest and the fault-test command verify every call with these.

use super::Result;
use tpar::check::{fill_expected, fill_input};
use tpar::{Algorithm, CpuCommunicator, DType};

/// Two different inputs (seeds) and their expected sums, for calls of up to `max_count`
/// elements. Calls alternate between them, so a call that wrote nothing leaves the previous
/// call's result behind, which does not match.
pub struct KnownData {
    dtype: DType,
    inputs: [Vec<u8>; 2],
    expected: [Vec<u8>; 2],
}

impl KnownData {
    pub fn new(
        dtype: DType,
        rank: usize,
        world_size: usize,
        max_count: usize,
        seeds: [u64; 2],
    ) -> KnownData {
        let make = |fill: &dyn Fn(u64, &mut [u8]), seed: u64| {
            let mut buf = vec![0u8; max_count * dtype.size()];
            fill(seed, &mut buf);
            buf
        };
        let input = |seed: u64, buf: &mut [u8]| fill_input(dtype, seed, rank, buf);
        let expected = |seed: u64, buf: &mut [u8]| fill_expected(dtype, seed, world_size, buf);
        KnownData {
            dtype,
            inputs: seeds.map(|s| make(&input, s)),
            expected: seeds.map(|s| make(&expected, s)),
        }
    }

    pub fn input(&self, variant: usize, count: usize) -> &[u8] {
        &self.inputs[variant % 2][..count * self.dtype.size()]
    }

    pub fn expected(&self, variant: usize, count: usize) -> &[u8] {
        &self.expected[variant % 2][..count * self.dtype.size()]
    }
}

/// The sum over ranks of `local` (a count of failed checks); also lines the ranks up.
pub fn total_across_ranks(comm: &mut CpuCommunicator, local: u64) -> Result<u64> {
    // f32 holds whole numbers exactly up to 2^24, far more than any count of failures here.
    let mut value = [local as f32];
    comm.all_reduce_in_place(&mut value, Algorithm::OneShot)?;
    Ok(value[0] as u64)
}
