//! Transports that carry the [`crate::protocol`]. Each one implements the same algorithms with
//! the same line format and reduction order, so their results are interchangeable bit for bit.

pub mod cpu;
