//! The entry points on raw device addresses and stream handles, for callers that hold them
//! and have not moved to [`DeviceSpan`](super::DeviceSpan)s yet (the CLI's rank harness, the
//! Python binding): each wraps its arguments through the unsafe constructors of `span.rs`
//! (the one door) and takes the safe path. Not checked like spans (no GPU, length or overlap
//! checks: the caller's promise covers them). To be removed once no caller needs them.

use cudarc::driver::sys::CUstream;

use super::span::{borrowed_stream, Operands};
use super::CudaCommunicator;
use crate::algorithm::Algorithm;
use crate::communicator::Communicator;
use crate::dispatch::{Choice, Plan};
use crate::dtype::DType;
use crate::error::{Error, Result};

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

impl Communicator {
    /// [`Communicator::all_reduce`] on raw addresses, for callers not yet moved to spans (the
    /// CLI's rank harness); `capturing` is what the caller read of `stream`.
    ///
    /// # Safety
    /// As for [`CudaCommunicator::all_reduce_raw`].
    pub unsafe fn all_reduce_raw(
        &self,
        dtype: DType,
        input: Option<u64>,
        output: u64,
        count: usize,
        stream: CUstream,
        capturing: bool,
    ) -> Result<Plan> {
        let plan = self.plan(dtype, (count * dtype.size()) as u64, capturing)?;
        if let Some(why) = self.refusal(&plan) {
            return Err(Error::Unsupported(format!(
                "this call is planned for {why}"
            )));
        }
        // SAFETY: the caller's promise, passed on.
        unsafe { self.all_reduce_with(plan.choice, dtype, input, output, count, stream)? };
        Ok(plan)
    }

    /// [`Communicator::all_reduce_as`] on raw addresses, for callers not yet moved to spans
    /// (the CLI's rank harness, the Python binding).
    ///
    /// # Safety
    /// As for [`CudaCommunicator::all_reduce_raw`].
    pub unsafe fn all_reduce_with(
        &self,
        choice: Choice,
        dtype: DType,
        input: Option<u64>,
        output: u64,
        count: usize,
        stream: CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's promise covers the stream and both buffers.
        let (stream, operands) = unsafe {
            (
                borrowed_stream(self.cuda().context(), stream),
                Operands::from_raw(dtype, input.unwrap_or(output), output, count),
            )
        };
        let capture = self.capture(&stream)?;
        self.enqueue(choice, &operands, &stream, capture)
    }
}
