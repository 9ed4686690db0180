//! The reduction order every transport follows: accumulate in fp32, starting from the first
//! term and adding the others in turn, then round once to the dtype. For one-shot, two-shot
//! and the staged forms the terms are the ranks' values in rank order; the islands and ring
//! algorithms order them as [`super::schedule`] says. Every rank (or the one owner of an
//! element) evaluates exactly this expression, so all ranks hold bitwise identical results and
//! tensor-parallel replicas never drift apart. The CPU backend's vectorised form is
//! `backend::cpu::reduce`; the kernels' is in `kernels/`.

/// The reduced value of one element given its terms in order (each rank's value, in rank
/// order, for one-shot).
pub fn reduce_in_rank_order(values: impl IntoIterator<Item = f32>) -> f32 {
    let mut values = values.into_iter();
    let first = values.next().expect("at least one rank");
    values.fold(first, |acc, v| acc + v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_left_to_right_from_rank_zero() {
        // (1e8 + 1) - 1e8 == 0 in fp32 but 1e8 + (1 - 1e8) == 1: the order is observable.
        assert_eq!(reduce_in_rank_order([1.0e8, 1.0, -1.0e8]), 0.0);
        assert_eq!(reduce_in_rank_order([1.0, -1.0e8, 1.0e8]), 0.0);
        assert_eq!(reduce_in_rank_order([-1.0e8, 1.0e8, 1.0]), 1.0);
        assert!(reduce_in_rank_order([-0.0]).is_sign_negative());
    }
}
