//! The reduction every transport performs, in one fixed order: accumulate in fp32, starting
//! from rank 0's value and adding ranks 1, 2, ... n-1 in turn, then round once to the dtype.
//! Every rank (one-shot) or the one owner of an element (two-shot) evaluates exactly this
//! expression, so all ranks hold bitwise identical results and tensor-parallel replicas never
//! drift apart.

use half::{bf16, f16};

use crate::dtype::DType;

/// The reduced value of one element given each rank's value in rank order.
pub fn reduce_in_rank_order(values: impl IntoIterator<Item = f32>) -> f32 {
    let mut values = values.into_iter();
    let first = values.next().expect("at least one rank");
    values.fold(first, |acc, v| acc + v)
}

/// Streams payload words from ranks 0, 1, ... into fp32 lanes, following
/// [`reduce_in_rank_order`] element by element.
pub struct Accumulator {
    dtype: DType,
    lanes: Vec<f32>,
}

impl Accumulator {
    pub fn new(dtype: DType) -> Accumulator {
        Accumulator {
            dtype,
            lanes: Vec::new(),
        }
    }

    /// Elements a payload word carries.
    pub fn elements_per_word(&self) -> usize {
        4 / self.dtype.size()
    }

    /// Starts a block of `words` payload words.
    pub fn reset(&mut self, words: usize) {
        self.lanes.clear();
        self.lanes.resize(words * self.elements_per_word(), 0.0);
    }

    /// Payload words in the current block.
    pub fn words(&self) -> usize {
        self.lanes.len() / self.elements_per_word()
    }

    /// Adds words `first..first + words.len()` of the block from the next rank; `first_rank`
    /// marks rank 0, whose values start the sums (so -0.0 from a single rank stays -0.0).
    pub fn add_words(&mut self, first: usize, words: &[u32], first_rank: bool) {
        let per = self.elements_per_word();
        let lanes = &mut self.lanes[first * per..(first + words.len()) * per];
        // One dispatch per block; the loops below are what the CPU spends its time in.
        match self.dtype {
            DType::F32 => combine(lanes, words.iter().map(|w| f32::from_bits(*w)), first_rank),
            DType::Bf16 => combine_pairs(lanes, words, first_rank, |w| {
                [f32::from_bits(w << 16), f32::from_bits(w & 0xffff_0000)]
            }),
            DType::F16 => combine_pairs(lanes, words, first_rank, |w| {
                [
                    f16::from_bits(w as u16).to_f32(),
                    f16::from_bits((w >> 16) as u16).to_f32(),
                ]
            }),
        }
    }

    /// The block's sums, one per element (including the padding lane of a partial last word).
    pub fn sums(&self) -> &[f32] {
        &self.lanes
    }

    /// Word `index` of the block rounded back to the dtype, as it travels in a line.
    pub fn word(&self, index: usize) -> u32 {
        match self.dtype {
            DType::F32 => self.lanes[index].to_bits(),
            DType::Bf16 => {
                let [a, b] = [self.lanes[2 * index], self.lanes[2 * index + 1]];
                u32::from(bf16::from_f32(a).to_bits())
                    | (u32::from(bf16::from_f32(b).to_bits()) << 16)
            }
            DType::F16 => {
                let [a, b] = [self.lanes[2 * index], self.lanes[2 * index + 1]];
                u32::from(f16::from_f32(a).to_bits())
                    | (u32::from(f16::from_f32(b).to_bits()) << 16)
            }
        }
    }

    /// Writes sums `0..count` of the block, rounded to the dtype, as elements `first..` of `out`.
    pub fn store(&self, out: &mut [u8], first: usize, count: usize) {
        let size = self.dtype.size();
        let out = &mut out[first * size..(first + count) * size];
        let sums = &self.lanes[..count];
        match self.dtype {
            DType::F32 => {
                for (o, s) in out.chunks_exact_mut(4).zip(sums) {
                    o.copy_from_slice(&s.to_le_bytes());
                }
            }
            DType::Bf16 => {
                for (o, s) in out.chunks_exact_mut(2).zip(sums) {
                    o.copy_from_slice(&bf16::from_f32(*s).to_bits().to_le_bytes());
                }
            }
            DType::F16 => {
                for (o, s) in out.chunks_exact_mut(2).zip(sums) {
                    o.copy_from_slice(&f16::from_f32(*s).to_bits().to_le_bytes());
                }
            }
        }
    }
}

#[inline(always)]
fn combine(lanes: &mut [f32], values: impl Iterator<Item = f32>, first_rank: bool) {
    if first_rank {
        for (lane, v) in lanes.iter_mut().zip(values) {
            *lane = v;
        }
    } else {
        for (lane, v) in lanes.iter_mut().zip(values) {
            *lane += v;
        }
    }
}

/// [`combine`] for words of two elements, as a plain indexed loop the compiler vectorises
/// (an iterator of pairs flattened with `flat_map` does not).
#[inline(always)]
fn combine_pairs(
    lanes: &mut [f32],
    words: &[u32],
    first_rank: bool,
    unpack: impl Fn(u32) -> [f32; 2],
) {
    for (pair, &w) in lanes.chunks_exact_mut(2).zip(words) {
        let [a, b] = unpack(w);
        if first_rank {
            pair[0] = a;
            pair[1] = b;
        } else {
            pair[0] += a;
            pair[1] += b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn order_is_left_to_right_from_rank_zero() {
        // (1e8 + 1) - 1e8 == 0 in fp32 but 1e8 + (1 - 1e8) == 1: the order is observable.
        assert_eq!(reduce_in_rank_order([1.0e8, 1.0, -1.0e8]), 0.0);
        assert_eq!(reduce_in_rank_order([1.0, -1.0e8, 1.0e8]), 0.0);
        assert_eq!(reduce_in_rank_order([-1.0e8, 1.0e8, 1.0]), 1.0);
        assert!(reduce_in_rank_order([-0.0]).is_sign_negative());
    }

    proptest! {
        #[test]
        fn accumulator_matches_the_definition(
            ranks in proptest::collection::vec(proptest::collection::vec(-1.0e4f32..1.0e4, 6), 1..9),
            d in 0usize..3,
        ) {
            let dtype = DType::ALL[d];
            let count = 6;
            // Each rank's values rounded to the dtype, as they would be stored.
            let encoded: Vec<Vec<u8>> = ranks.iter().map(|vals| {
                let mut b = vec![0u8; count * dtype.size()];
                for (i, v) in vals.iter().enumerate() { dtype.store_f32(&mut b, i, *v); }
                b
            }).collect();
            let words = (count * dtype.size()).div_ceil(4);
            let mut acc = Accumulator::new(dtype);
            acc.reset(words);
            for (r, bytes) in encoded.iter().enumerate() {
                let all: Vec<u32> = (0..words).map(|w| crate::protocol::line::word_at(bytes, w)).collect();
                // Two calls, to cover adding at an offset within the block.
                acc.add_words(0, &all[..2], r == 0);
                acc.add_words(2, &all[2..], r == 0);
            }
            for i in 0..count {
                let expected = reduce_in_rank_order(encoded.iter().map(|b| dtype.load_f32(b, i)));
                prop_assert_eq!(acc.sums()[i].to_bits(), expected.to_bits());
            }
            // Rounding words back, or storing elements, gives the dtype's rounding of each sum.
            let mut out = vec![0u8; count * dtype.size()];
            for w in 0..words { crate::protocol::line::put_word(&mut out, w, acc.word(w)); }
            let mut stored = vec![0u8; (count + 1) * dtype.size()];
            acc.store(&mut stored, 1, count);
            for i in 0..count {
                let mut one = [0u8; 4];
                dtype.store_f32(&mut one, 0, acc.sums()[i]);
                prop_assert_eq!(&out[i * dtype.size()..(i + 1) * dtype.size()], &one[..dtype.size()]);
                prop_assert_eq!(&stored[(i + 1) * dtype.size()..(i + 2) * dtype.size()], &one[..dtype.size()]);
            }
        }
    }
}
