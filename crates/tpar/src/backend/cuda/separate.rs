//! The pieces of the fused op on their own, for benchmarks that time them apart (`tpar bench
//! --fused`): the unfused sequence (the allreduce of `x` into `y`, then the separate residual
//! add + RMSNorm kernel) and that norm kernel alone. Both take the same checked spans as
//! [`CudaCommunicator::fused_add_rms_norm`] and launch the same kernels it would.

use cudarc::driver::CudaStream;

use super::fused::{FusedSpans, NormInput};
use super::span::FusedOperands;
use super::CudaCommunicator;
use crate::algorithm::Algorithm;
use crate::error::Result;

impl CudaCommunicator {
    /// The unfused sequence with the fused op's results: the allreduce of `x` into `y` on
    /// tpar's `algorithm`, then the separate residual add + RMSNorm kernel reading `y`.
    pub fn unfused_add_rms_norm(
        &self,
        spans: FusedSpans<'_>,
        algorithm: Algorithm,
        stream: &CudaStream,
    ) -> Result<()> {
        let operands = FusedOperands::check(&spans, self.ctx.ordinal(), stream)?;
        // The spans live until this returns, after the work is queued.
        self.unfused_enqueue(&operands, algorithm, stream)
    }

    /// The separate residual add + RMSNorm kernel alone, reading the sum from `x` (as if an
    /// allreduce had run in place there) and writing `y` and the residual. `after_grid`: the
    /// blocks of the spinning kernel just before it on `stream` (`Some(0)` when none spins;
    /// `None` when unknown), which decides whether it may launch with PDL.
    pub fn add_rms_norm(
        &self,
        spans: FusedSpans<'_>,
        after_grid: Option<u32>,
        stream: &CudaStream,
    ) -> Result<()> {
        let operands = FusedOperands::check(&spans, self.ctx.ordinal(), stream)?;
        self.norm_enqueue(&operands, NormInput::X, after_grid, stream)
    }
}
