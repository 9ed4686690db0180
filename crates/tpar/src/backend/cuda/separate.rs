//! The CUDA communicator's entry points on raw device addresses and a stream handle, for
//! callers that hold them and have not moved to [`DeviceSpan`](super::DeviceSpan)s yet (the
//! CLI's rank harness and fused bench): each wraps its arguments through the unsafe
//! constructors of `span.rs` (the one door) and takes the safe path. Not checked like spans
//! (no GPU, length or overlap checks: the caller's promise covers them). To be removed once
//! no caller needs them; `tpar::Communicator`'s raw entry points do the same in its files.

use cudarc::driver::sys::CUstream;

use super::fused::{FusedCall, NormInput};
use super::span::{borrowed_stream, FusedOperands, Operands};
use super::CudaCommunicator;
use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::error::Result;
use crate::norm::FusedPlan;

impl CudaCommunicator {
    /// [`CudaCommunicator::all_reduce`] on raw addresses, for callers that have not moved to
    /// spans yet (the CLI's rank harness until it does); not checked like spans.
    ///
    /// # Safety
    /// `input` (if any) and `output` must be device pointers on this rank's GPU to `count`
    /// elements of `dtype` that stay valid until the work on `stream` has completed, and
    /// `stream` a live stream of this rank's context (it may be capturing a graph).
    pub unsafe fn all_reduce_raw(
        &self,
        dtype: DType,
        input: Option<u64>,
        output: u64,
        count: usize,
        algorithm: Algorithm,
        stream: CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's promise covers the stream and both buffers.
        let (stream, operands) = unsafe {
            (
                borrowed_stream(&self.ctx, stream),
                Operands::from_raw(dtype, input.unwrap_or(output), output, count),
            )
        };
        self.enqueue(&operands, algorithm, &stream)
    }

    /// [`CudaCommunicator::fused_add_rms_norm`] on raw addresses (the CLI's fused bench).
    ///
    /// # Safety
    /// Every pointer of `call` must be device memory on this rank's GPU holding
    /// `tokens x hidden` elements (`weight`: `hidden`) that stays valid until the work on
    /// `stream` has completed; `stream` a live stream of this rank's context (it may be
    /// capturing).
    pub unsafe fn fused_add_rms_norm_raw(
        &self,
        call: &FusedCall,
        algorithm: Algorithm,
        stream: CUstream,
    ) -> Result<FusedPlan> {
        // SAFETY: the caller's promise covers the stream and every address of `call`.
        let (stream, operands) = unsafe {
            (
                borrowed_stream(&self.ctx, stream),
                FusedOperands::assume(*call),
            )
        };
        self.fused_enqueue(&operands, algorithm, &stream)
    }

    /// The unfused sequence (allreduce of `x` into `y`, then the separate norm kernel) on raw
    /// addresses (the CLI's fused bench).
    ///
    /// # Safety
    /// As for [`CudaCommunicator::fused_add_rms_norm_raw`].
    pub unsafe fn unfused_add_rms_norm_raw(
        &self,
        call: &FusedCall,
        algorithm: Algorithm,
        stream: CUstream,
    ) -> Result<()> {
        // SAFETY: as above.
        let (stream, operands) = unsafe {
            (
                borrowed_stream(&self.ctx, stream),
                FusedOperands::assume(*call),
            )
        };
        self.unfused_enqueue(&operands, algorithm, &stream)
    }

    /// The separate residual add + RMSNorm kernel alone, reading the rounded allreduce output
    /// at `sum` (`call.y`, or any buffer of the call's shape). `after_grid`: the blocks of the
    /// spinning kernel just before it on `stream` (`Some(0)` when none spins; `None` when
    /// unknown), which decides whether it may launch with PDL.
    ///
    /// # Safety
    /// As for [`CudaCommunicator::fused_add_rms_norm_raw`], and `sum` too.
    pub unsafe fn launch_add_rms_norm(
        &self,
        call: &FusedCall,
        sum: u64,
        after_grid: Option<u32>,
        stream: CUstream,
    ) -> Result<()> {
        // The norm kernel never reads x: `sum` takes its place.
        // SAFETY: as above.
        let (stream, operands) = unsafe {
            (
                borrowed_stream(&self.ctx, stream),
                FusedOperands::assume(FusedCall { x: sum, ..*call }),
            )
        };
        self.norm_enqueue(&operands, NormInput::X, after_grid, &stream)
    }
}
