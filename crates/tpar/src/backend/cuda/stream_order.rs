//! Keeps one communicator's calls in the order they were issued on the host when they come
//! from several streams. tpar's kernels take their call number (epoch) from device memory and
//! every rank must run its calls in the same order, so two calls of one communicator running
//! concurrently on two streams could pair the wrong calls across ranks (issue 12, finding 5:
//! 88 of 100 results wrong). Each call records an event after its work; a call on another
//! stream first makes its stream wait on that event.
//!
//! Eager calls and captured calls are ordered separately, each with its own event: an eager
//! call waits for the previous eager call; a captured call waits for the previous call of the
//! same capture (an ordinary join inside the graph). A graph's calls run when it is replayed,
//! which the caller orders against eager calls by the stream it replays on (as for any work).
//!
//! Events are cudarc's; the capture id comes from [`driver::capture_info`]. No `unsafe` here.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUstreamCaptureStatus;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};

use super::driver;
use crate::error::{Error, Result};

fn failed(what: &str) -> impl FnOnce(DriverError) -> Error + '_ {
    move |e| {
        Error::Cuda(format!(
            "{what} failed ({e}) while ordering a call after the previous call on another stream"
        ))
    }
}

/// The last eager call's stream, and the last captured call's stream and capture id.
#[derive(Default)]
struct Last {
    eager: Option<usize>,
    captured: Option<(usize, u64)>,
}

/// One communicator's cross-stream ordering: an event recorded after every call (one for eager
/// calls, one for captured calls).
pub struct StreamOrder {
    ctx: Arc<CudaContext>,
    eager: CudaEvent,
    captured: CudaEvent,
    last: Mutex<Last>,
    /// The driver tells captures apart (`cuStreamGetCaptureInfo_v3`).
    with_ids: bool,
}

/// Drivers before 12.3 lack `cuStreamGetCaptureInfo_v3` (cudarc panics on a missing symbol).
const CAPTURE_INFO_V3: i32 = 12030;

/// The id of the capture `stream` is part of, or None when it is not capturing. On a driver
/// without capture ids, every capture counts as one (id 0).
fn capture_of(stream: &CudaStream, with_ids: bool) -> Result<Option<u64>> {
    let (status, id) = if with_ids {
        driver::capture_info(stream)?
    } else {
        let status = stream
            .capture_status()
            .map_err(|e| Error::Cuda(format!("cuStreamIsCapturing failed: {e}")))?;
        (status, 0)
    };
    Ok(match status {
        CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => None,
        CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Some(id),
        _ => return Err(Error::Cuda(
            "the stream's capture was invalidated by an earlier error; end it and capture again"
                .into(),
        )),
    })
}

impl StreamOrder {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<StreamOrder> {
        let event = || ctx.new_event(None).map_err(failed("cuEventCreate"));
        Ok(StreamOrder {
            ctx: ctx.clone(),
            eager: event()?,
            captured: event()?,
            last: Mutex::default(),
            with_ids: driver::driver_version().is_ok_and(|v| v >= CAPTURE_INFO_V3),
        })
    }

    /// Whether `stream` is capturing a graph, and which capture (see [`Capture`]): read once
    /// per call, by the call's first step, and passed to everything in it that depends on it.
    pub fn capture(&self, stream: &CudaStream) -> Result<Capture> {
        driver::bind(&self.ctx)?;
        capture_of(stream, self.with_ids).map(Capture)
    }

    /// Runs `enqueue` (which queues one call's work on `stream`, whose state is `capture`)
    /// after the previous call of the same kind (eager, or captured in the same capture),
    /// whatever stream that was on, and records the point after it for the next call. The lock
    /// keeps host order: two threads cannot interleave their waits and records.
    pub fn ordered<T>(
        &self,
        stream: &CudaStream,
        capture: Capture,
        enqueue: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if stream.context().ordinal() != self.ctx.ordinal() {
            return Err(Error::InvalidArgument(format!(
                "the stream belongs to GPU {} but this communicator's rank is on GPU {}; use a stream of the rank's GPU",
                stream.context().ordinal(),
                self.ctx.ordinal()
            )));
        }
        let mut last = self.last.lock().expect("stream order lock");
        let here = stream.cu_stream() as usize;
        let (event, wait) = match capture.0 {
            None => (&self.eager, last.eager.is_some_and(|s| s != here)),
            Some(id) => (
                &self.captured,
                last.captured.is_some_and(|(s, c)| c == id && s != here),
            ),
        };
        if wait {
            // The event was recorded by the previous call of this kind (in this capture, for
            // a captured call).
            stream.wait(event).map_err(failed("cuStreamWaitEvent"))?;
        }
        let result = enqueue()?;
        event.record(stream).map_err(failed("cuEventRecord"))?;
        match capture.0 {
            None => last.eager = Some(here),
            Some(id) => last.captured = Some((here, id)),
        }
        Ok(result)
    }
}

/// Whether a call's stream is capturing a CUDA graph, and which capture (None: eager).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capture(Option<u64>);

impl Capture {
    pub fn is_capturing(self) -> bool {
        self.0.is_some()
    }
}
