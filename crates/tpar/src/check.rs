//! Known inputs and their exact expected sums. Self-tests and benchmarks fill each rank's
//! input from (seed, rank, index) and compare the result with the sum every rank can compute
//! on its own, in the protocol's fixed order: a match is bitwise, not within a tolerance.
//! Values are never zero (a sum of zeros proves nothing) and vary with the seed, so a stale
//! result from an earlier call does not pass for a new one.

use crate::dtype::DType;
use crate::protocol::reduce::reduce_in_rank_order;

/// The value rank `rank` contributes at `index` for `seed`: a non-zero multiple of 1/64 in
/// [-8, 8], so sums of up to hundreds of ranks stay well inside every dtype's range.
pub fn input_value(seed: u64, rank: usize, index: usize) -> f32 {
    let h = splitmix64(seed ^ ((rank as u64) << 40) ^ (index as u64).wrapping_mul(0x9e37_79b9));
    let v = (h % 1024) as i32 - 512; // -512..=511
    let v = if v == 0 { 1 } else { v };
    v as f32 / 64.0
}

/// Fills `out` (elements of `dtype`) with rank `rank`'s input for `seed`.
pub fn fill_input(dtype: DType, seed: u64, rank: usize, out: &mut [u8]) {
    for i in 0..out.len() / dtype.size() {
        dtype.store_f32(out, i, input_value(seed, rank, i));
    }
}

/// Writes into `out` the sum over `world_size` ranks of their inputs for `seed`, as the
/// protocol computes it: each input rounded to `dtype`, summed in fp32 in rank order, rounded.
pub fn fill_expected(dtype: DType, seed: u64, world_size: usize, out: &mut [u8]) {
    let mut one = [0u8; 4];
    for i in 0..out.len() / dtype.size() {
        let sum = reduce_in_rank_order((0..world_size).map(|rank| {
            dtype.store_f32(&mut one, 0, input_value(seed, rank, i));
            dtype.load_f32(&one, 0)
        }));
        dtype.store_f32(out, i, sum);
    }
}

/// The largest difference from [`fill_expected`]'s sum that a correct allreduce may show when
/// it adds the same inputs in another order and rounds every partial sum to `dtype` (NCCL's
/// rings and trees do): `world_size` roundings, each at most half an ulp of a partial sum,
/// and no partial sum above `world_size` x 8 (the largest input).
pub fn unordered_sum_error_bound(dtype: DType, world_size: usize) -> f32 {
    let unit_roundoff = match dtype {
        DType::F32 => 2f32.powi(-24),
        DType::F16 => 2f32.powi(-11),
        DType::Bf16 => 2f32.powi(-8),
    };
    let n = world_size.max(1) as f32;
    n * unit_roundoff * 8.0 * n
}

/// The first element where `got` and `expected` differ bitwise: (index, got, expected).
pub fn first_mismatch(dtype: DType, got: &[u8], expected: &[u8]) -> Option<(usize, f32, f32)> {
    let size = dtype.size();
    got.chunks_exact(size)
        .zip(expected.chunks_exact(size))
        .position(|(g, e)| g != e)
        .map(|i| (i, dtype.load_f32(got, i), dtype.load_f32(expected, i)))
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    #[test]
    fn another_summation_order_stays_within_the_bound() {
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            for n in 2..=8usize {
                let bound = unordered_sum_error_bound(dtype, n);
                let mut expected = vec![0u8; 4096 * dtype.size()];
                fill_expected(dtype, 7, n, &mut expected);
                let mut worst = 0f32;
                let mut one = [0u8; 4];
                let round = |x: f32, one: &mut [u8; 4]| {
                    dtype.store_f32(one, 0, x);
                    dtype.load_f32(one, 0)
                };
                for i in 0..4096 {
                    // Reverse rank order, rounding every partial sum: a ring's worst case.
                    let mut acc = round(input_value(7, n - 1, i), &mut one);
                    for r in (0..n - 1).rev() {
                        acc = round(acc + round(input_value(7, r, i), &mut one), &mut one);
                    }
                    worst = worst.max((acc - dtype.load_f32(&expected, i)).abs());
                }
                assert!(worst <= bound, "{dtype:?} n={n}: {worst} > {bound}");
                if dtype == DType::Bf16 && n >= 4 {
                    assert!(worst > 0.0, "the orders should differ somewhere for bf16");
                }
            }
        }
    }

    use super::*;

    #[test]
    fn inputs_are_non_zero_and_depend_on_seed_and_rank() {
        let mut differs_by_seed = 0;
        let mut differs_by_rank = 0;
        for i in 0..1000 {
            let v = input_value(1, 0, i);
            assert!(v != 0.0 && v.abs() <= 8.0);
            differs_by_seed += usize::from(v != input_value(2, 0, i));
            differs_by_rank += usize::from(v != input_value(1, 1, i));
        }
        assert!(differs_by_seed > 900 && differs_by_rank > 900);
    }

    #[test]
    fn expected_is_the_sum_of_the_inputs() {
        for dtype in DType::ALL {
            let n = 37;
            let mut exp = vec![0u8; n * dtype.size()];
            fill_expected(dtype, 5, 3, &mut exp);
            let inputs: Vec<Vec<u8>> = (0..3)
                .map(|r| {
                    let mut b = vec![0u8; n * dtype.size()];
                    fill_input(dtype, 5, r, &mut b);
                    b
                })
                .collect();
            for i in 0..n {
                let direct: f32 = inputs.iter().map(|b| dtype.load_f32(b, i)).sum();
                // Multiples of 1/64 below 24 add exactly in every dtype's accumulator.
                assert_eq!(dtype.load_f32(&exp, i), {
                    let mut one = [0u8; 4];
                    dtype.store_f32(&mut one, 0, direct);
                    dtype.load_f32(&one, 0)
                });
            }
            let mut wrong = exp.clone();
            wrong[dtype.size()] ^= 0x40;
            assert_eq!(first_mismatch(dtype, &wrong, &exp).map(|m| m.0), Some(1));
            assert_eq!(first_mismatch(dtype, &exp, &exp), None);
        }
    }
}
