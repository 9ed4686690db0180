//! The fused allreduce + residual add + RMSNorm on the call path: the dispatcher decides the
//! allreduce as for a plain call of the same bytes, and the fused path for that choice
//! (`dispatch::decide_fused`: the fused kernel on one-shot, two-shot and host-staged, else the
//! allreduce followed by tpar's separate norm kernel, for NCCL, pull and rows the fused kernels
//! cannot take); the CUDA backend runs what was decided, ordered across streams like a plain
//! call. The kernels and their launch shapes are in `backend::cuda::fused`; the semantics in
//! `crate::norm`.

use cudarc::driver::CudaStream;

use super::Communicator;
use crate::algorithm::{Choice, Selection};
use crate::backend::cuda::fused::{FusedSpans, NormInput};
use crate::backend::cuda::span::FusedOperands;
use crate::backend::cuda::stream_order::Capture;
use crate::error::Result;

/// What a fused call ran: the choice of its allreduce and whether the fused kernel ran it
/// (the reason of either is [`Communicator::decide`]'s and [`Communicator::fused_decision`]'s,
/// asked for the same call).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedRun {
    pub allreduce: Choice,
    pub fused: bool,
}

impl Communicator {
    /// Decides and queues the fused allreduce + residual add + RMSNorm (semantics in
    /// [`crate::norm`]) on `stream`. The allreduce is decided as a plain call of the same
    /// bytes; on tpar's one-shot, two-shot and host-staged it runs fused, on NCCL and pull (or
    /// for rows above the fused kernels' hidden size) followed by tpar's separate norm kernel,
    /// with the same results. The spans are checked against this rank's GPU, `stream`, one
    /// dtype and the call's shape.
    pub fn fused_add_rms_norm(
        &self,
        spans: FusedSpans<'_>,
        stream: &CudaStream,
    ) -> Result<FusedRun> {
        self.fused_add_rms_norm_selected(Selection::Auto, spans, stream)
    }

    /// [`Communicator::fused_add_rms_norm`] with its allreduce decided for `selection` as a
    /// plain call's ([`Communicator::decide`]: a forced choice checked, a refusal returned
    /// before anything is queued).
    pub fn fused_add_rms_norm_selected(
        &self,
        selection: Selection,
        spans: FusedSpans<'_>,
        stream: &CudaStream,
    ) -> Result<FusedRun> {
        let (operands, capture, bytes) = self.fused_operands(&spans, stream)?;
        let dtype = operands.call().dtype;
        let choice = match &*self.decide(selection, dtype, bytes, capture.is_capturing()) {
            Ok(decision) => decision.choice,
            Err(refused) => return Err(refused.clone().into()),
        };
        self.fused_enqueue(choice, &operands, stream, capture, true)
    }

    /// [`Communicator::fused_add_rms_norm`] with its allreduce on `choice`, without asking
    /// the dispatcher for a choice (refused where this group cannot run it).
    pub fn fused_add_rms_norm_as(
        &self,
        choice: Choice,
        spans: FusedSpans<'_>,
        stream: &CudaStream,
    ) -> Result<FusedRun> {
        let (operands, capture, bytes) = self.fused_operands(&spans, stream)?;
        self.eligibility(choice, operands.call().dtype, bytes, capture.is_capturing())?;
        self.fused_enqueue(choice, &operands, stream, capture, false)
    }

    /// A fused call's operands checked against this rank's GPU and `stream`, `stream`'s
    /// capture state (read once) and the bytes of the call's allreduce.
    fn fused_operands(
        &self,
        spans: &FusedSpans<'_>,
        stream: &CudaStream,
    ) -> Result<(FusedOperands, Capture, u64)> {
        let operands = FusedOperands::check(spans, self.cuda().context().ordinal(), stream)?;
        let capture = self.capture(stream)?;
        let call = operands.call();
        let bytes = (call.elements() * call.dtype.size()) as u64;
        Ok((operands, capture, bytes))
    }

    /// Queues the fused op with its allreduce on `choice` and the path the dispatcher gives
    /// it, ordered like a plain call (a fused call takes the same epochs); `capture` is
    /// `stream`'s, read once. `faster`: the fused kernel only where it is also the faster path
    /// for the call's tokens (`norm::Prefer::Faster`); else wherever it can run (what
    /// `fused_add_rms_norm_as`'s callers, the self-tests and benchmarks, check and time).
    fn fused_enqueue(
        &self,
        choice: Choice,
        operands: &FusedOperands,
        stream: &CudaStream,
        capture: Capture,
        faster: bool,
    ) -> Result<FusedRun> {
        let cuda = self.cuda();
        let call = operands.call();
        let tokens = faster.then_some(call.tokens);
        let fused = self
            .fused_decision(choice, call.dtype, call.hidden, tokens)
            .fused;
        let run = FusedRun {
            allreduce: choice,
            fused,
        };
        match choice {
            Choice::Tpar(algorithm) => self.ordered(stream, capture, || {
                cuda.fused_enqueue(operands, algorithm, fused, stream)
            })?,
            Choice::Nccl => {
                if !call.validate()? {
                    return Ok(run);
                }
                self.enqueue(choice, &operands.allreduce(), stream, capture)?;
                cuda.norm_enqueue(operands, NormInput::Y, None, stream)?;
            }
        }
        Ok(run)
    }
}
