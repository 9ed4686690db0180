//! The CUDA communicator's entry point on raw device addresses and a stream handle, for
//! callers that hold them and have not moved to [`DeviceSpan`](super::DeviceSpan)s yet (the
//! CLI's rank harness, the fused path): it wraps its arguments through the unsafe
//! constructors of `span.rs` (the one door) and takes the safe path. Not checked like spans
//! (no GPU, length or overlap checks: the caller's promise covers them). To be removed once
//! no caller needs it; `tpar::Communicator`'s raw entry points do the same in its file.

use cudarc::driver::sys::CUstream;

use super::span::{borrowed_stream, Operands};
use super::CudaCommunicator;
use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::error::Result;

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
}
