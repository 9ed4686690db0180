//! The fused allreduce + residual add + RMSNorm on the call path: the dispatcher decides the
//! allreduce as for a plain call of the same bytes, then the CUDA backend runs it fused
//! (one-shot, two-shot, host-staged) or as the allreduce followed by tpar's separate norm
//! kernel (NCCL, pull, rows the fused kernels cannot take), ordered across streams like a
//! plain call. The kernels and their launch shapes are in `backend::cuda::fused`; the
//! semantics and the plan in `crate::norm`.

use cudarc::driver::CudaStream;

use super::Communicator;
use crate::algorithm::{Choice, Selection};
use crate::backend::cuda::fused::{FusedSpans, NormInput};
use crate::backend::cuda::span::FusedOperands;
use crate::backend::cuda::stream_order::Capture;
use crate::dispatch::Decision;
use crate::error::Result;
use crate::norm::FusedDecision;

/// What a fused call ran: the dispatcher's plan for its allreduce and the fused path.
#[derive(Clone, Debug)]
pub struct FusedRun {
    pub allreduce: Decision,
    pub path: FusedDecision,
}

impl Communicator {
    /// Plans and queues the fused allreduce + residual add + RMSNorm (semantics in
    /// [`crate::norm`]) on `stream`. The allreduce is planned as a plain call of the same
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
    /// plain call's ([`Communicator::decide`]: a forced choice checked, a refusal raised before
    /// anything is queued).
    pub fn fused_add_rms_norm_selected(
        &self,
        selection: Selection,
        spans: FusedSpans<'_>,
        stream: &CudaStream,
    ) -> Result<FusedRun> {
        let operands = FusedOperands::check(&spans, self.cuda().context().ordinal(), stream)?;
        let capture = self.capture(stream)?;
        let call = operands.call();
        let bytes = (call.elements() * call.dtype.size()) as u64;
        let allreduce = self.decide(selection, call.dtype, bytes, capture.is_capturing())?;
        let path = self.fused_enqueue(allreduce.choice, &operands, stream, capture, true)?;
        Ok(FusedRun { allreduce, path })
    }

    /// [`Communicator::fused_add_rms_norm`] with its allreduce on `choice`, without asking
    /// the dispatcher, and the fused kernel wherever it can run (not only where it is the
    /// faster path: the self-tests check it).
    pub fn fused_add_rms_norm_as(
        &self,
        choice: Choice,
        spans: FusedSpans<'_>,
        stream: &CudaStream,
    ) -> Result<FusedDecision> {
        let operands = FusedOperands::check(&spans, self.cuda().context().ordinal(), stream)?;
        let capture = self.capture(stream)?;
        self.fused_enqueue(choice, &operands, stream, capture, false)
    }

    /// Queues the fused op with its allreduce on `choice`, ordered like a plain call (a fused
    /// call takes the same epochs); `capture` is `stream`'s, read once. `faster`: the fused
    /// kernel only where it is the faster path for the call's tokens (`norm::Prefer`).
    fn fused_enqueue(
        &self,
        choice: Choice,
        operands: &FusedOperands,
        stream: &CudaStream,
        capture: Capture,
        faster: bool,
    ) -> Result<FusedDecision> {
        let cuda = self.cuda();
        let call = operands.call();
        match choice {
            Choice::Tpar(algorithm) => self.ordered(stream, capture, || {
                cuda.fused_enqueue(operands, algorithm, stream, faster)
            }),
            Choice::Nccl => {
                let plan = cuda.fused_plan(None, call.dtype, call.hidden, Some(call.tokens));
                if !call.validate()? {
                    return Ok(plan);
                }
                self.enqueue(choice, &operands.allreduce(), stream, capture)?;
                cuda.norm_enqueue(operands, NormInput::Y, None, stream)?;
                Ok(plan)
            }
        }
    }
}
