//! Device memory as tpar's public API takes it: a span (GPU, address, element count, dtype)
//! made once at the edge, then checked against the communicator and the call. Made safely from
//! cudarc's buffers (`CudaSlice`, `CudaView`, `CudaViewMut`, which guarantee a live allocation
//! of their length) or from tpar's own [`DeviceMemory`]; only the FFI edge, where a pointer
//! comes from another library (torch through PyO3), uses the one `unsafe fn from_raw`.
//!
//! The checked forms, `Operands` (an allreduce) and `FusedOperands` (the fused op), are
//! what the backends' launch paths take: made from spans, or at an FFI edge by their unsafe
//! constructors, so the launch paths themselves need no `unsafe` but the launch.
//!
//! A span made from a cudarc buffer for a stream also carries cudarc's event guard: the call's
//! stream waits for the buffer's earlier writes, and the guard records the call's work when the
//! span is dropped (after the call has queued it), so that cudarc frees or reuses the buffer
//! only after tpar's kernels are done with it. Those are cudarc's rules for its own calls too,
//! and the same care applies in graph capture: a wait on an event recorded before the capture
//! began does not belong in it (the driver may refuse it), so capture with cudarc's event
//! tracking off (`CudaContext::disable_event_tracking`), as for any cudarc work in a graph.
//!
//! Streams are cudarc's [`CudaStream`]: a stream owned by another library is wrapped with
//! [`borrowed_stream`] (unsafe: its owner keeps it alive).

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use super::driver::DeviceMemory;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::norm;

/// Where a span lives and what it holds; shared by the read-only and the writable span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Extent {
    device: usize,
    ptr: u64,
    count: usize,
    dtype: DType,
    /// The stream a cudarc buffer's events were taken for (None: no events to keep).
    stream: Option<usize>,
}

impl Extent {
    /// A cudarc buffer's extent, its events taken for `stream`.
    fn of_cudarc(device: usize, ptr: u64, count: usize, dtype: DType, stream: &CudaStream) -> Self {
        Extent {
            device,
            ptr,
            count,
            dtype,
            stream: Some(stream.cu_stream() as usize),
        }
    }

    /// Memory another library allocated: no events to keep.
    fn raw(device: usize, ptr: u64, count: usize, dtype: DType) -> Self {
        Extent {
            device,
            ptr,
            count,
            dtype,
            stream: None,
        }
    }

    fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }

    fn address_for(
        &self,
        which: &str,
        device: usize,
        stream: CallStream,
        dtype: DType,
        count: usize,
    ) -> Result<u64> {
        if stream.device != device {
            return Err(Error::InvalidArgument(format!(
                "the stream belongs to GPU {} but this communicator's rank is on GPU {device}; use a stream of the rank's GPU",
                stream.device
            )));
        }
        if self.device != device {
            return Err(Error::InvalidArgument(format!(
                "{which} is on GPU {} but this communicator's rank is on GPU {device}; pass memory of the rank's GPU",
                self.device
            )));
        }
        if self.stream.is_some_and(|s| s != stream.id) {
            return Err(Error::InvalidArgument(format!(
                "{which} was made for another stream than the call's; make it with the stream the call runs on"
            )));
        }
        if self.dtype != dtype || self.count != count {
            return Err(Error::InvalidArgument(format!(
                "{which} holds {} {} elements where the call needs {count} {}; pass a span of that length and dtype",
                self.count,
                self.dtype.name(),
                dtype.name()
            )));
        }
        Ok(self.ptr)
    }
}

/// `count` elements of `dtype` on GPU `device`, read by a call (an allreduce's input).
pub type DeviceSpan<'a> = Span<'a, Reads>;

/// `count` elements of `dtype` on GPU `device`, written by a call (an allreduce's output).
pub type DeviceSpanMut<'a> = Span<'a, Writes>;

/// A span of device memory that calls read ([`DeviceSpan`]) or write ([`DeviceSpanMut`]):
/// one type for both, so that what they share (the extent, cudarc's events, the accessors,
/// the raw constructor) is written once; only the cudarc constructors differ (a shared or an
/// exclusive borrow of the buffer).
pub struct Span<'a, A: Access> {
    extent: Extent,
    _events: Option<SyncOnDrop<'a>>,
    _memory: PhantomData<(&'a (), A)>,
}

/// What a call does with a span's memory: [`Reads`] or [`Writes`].
pub trait Access: sealed::Sealed {}

/// The access of a [`DeviceSpan`]: calls read its memory.
pub enum Reads {}

/// The access of a [`DeviceSpanMut`]: calls write its memory.
pub enum Writes {}

impl Access for Reads {}
impl Access for Writes {}

mod sealed {
    /// Only [`super::Reads`] and [`super::Writes`] are accesses.
    pub trait Sealed {}
    impl Sealed for super::Reads {}
    impl Sealed for super::Writes {}
}

impl<'a, A: Access> Span<'a, A> {
    fn new(extent: Extent, events: Option<SyncOnDrop<'a>>) -> Self {
        Span {
            extent,
            _events: events,
            _memory: PhantomData,
        }
    }

    /// A cudarc buffer's span: `count` elements on GPU `device`, its pointer and event guard
    /// as cudarc gave them for `stream`.
    fn of_cudarc<T: Element>(
        device: usize,
        count: usize,
        (ptr, events): (u64, SyncOnDrop<'a>),
        stream: &CudaStream,
    ) -> Self {
        let extent = Extent::of_cudarc(device, ptr, count, T::DTYPE, stream);
        Self::new(extent, Some(events))
    }

    /// A span of memory another library allocated.
    ///
    /// # Safety
    /// `ptr` is device memory on GPU `device` holding `count` elements of `dtype`, readable
    /// (for a [`DeviceSpanMut`] also writable, and used by nothing else) until the work of
    /// every call given this span has completed on its stream.
    pub unsafe fn from_raw(device: usize, ptr: u64, count: usize, dtype: DType) -> Self {
        Self::new(Extent::raw(device, ptr, count, dtype), None)
    }

    pub fn device(&self) -> usize {
        self.extent.device
    }

    pub fn count(&self) -> usize {
        self.extent.count
    }

    pub fn dtype(&self) -> DType {
        self.extent.dtype
    }
}

impl<'a> DeviceSpan<'a> {
    /// A cudarc buffer or view, read by work queued on `stream` (which first waits for the
    /// buffer's earlier writes).
    pub fn of<T: Element, S: DevicePtr<T>>(memory: &'a S, stream: &'a CudaStream) -> Self {
        let (device, count) = (memory.stream().context().ordinal(), memory.len());
        Self::of_cudarc::<T>(device, count, memory.device_ptr(stream), stream)
    }
}

impl<'a> DeviceSpanMut<'a> {
    /// A cudarc buffer or view, written by work queued on `stream` (which first waits for the
    /// buffer's earlier reads and writes).
    pub fn of<T: Element, S: DevicePtrMut<T>>(memory: &'a mut S, stream: &'a CudaStream) -> Self {
        let (device, count) = (memory.stream().context().ordinal(), memory.len());
        Self::of_cudarc::<T>(device, count, memory.device_ptr_mut(stream), stream)
    }
}

impl DeviceMemory {
    /// The first `count` elements of `dtype` of this allocation, to be read by a call.
    pub fn span(&self, dtype: DType, count: usize) -> Result<DeviceSpan<'_>> {
        Ok(Span::new(self.extent(dtype, count)?, None))
    }

    /// The first `count` elements of `dtype` of this allocation, to be written by a call.
    pub fn span_mut(&mut self, dtype: DType, count: usize) -> Result<DeviceSpanMut<'_>> {
        Ok(Span::new(self.extent(dtype, count)?, None))
    }

    fn extent(&self, dtype: DType, count: usize) -> Result<Extent> {
        let fits = count
            .checked_mul(dtype.size())
            .is_some_and(|bytes| bytes <= self.bytes());
        if !fits {
            return Err(Error::InvalidArgument(format!(
                "a span of {count} {} elements does not fit a device allocation of {} bytes; allocate more or pass fewer elements",
                dtype.name(),
                self.bytes()
            )));
        }
        Ok(Extent::raw(self.device(), self.ptr(), count, dtype))
    }
}

/// A stream owned by another library (torch's current stream, passed to Python as an
/// integer), wrapped for tpar's calls; dropping the wrapper leaves the stream alone.
///
/// # Safety
/// `stream` is a live stream of `ctx` (or null, the legacy default stream) and stays live
/// while the returned wrapper is used.
pub unsafe fn borrowed_stream(ctx: &Arc<CudaContext>, stream: CUstream) -> Arc<CudaStream> {
    // SAFETY: the caller's promise.
    unsafe { ctx.wrap_borrowed_stream(stream) }
}

/// The operands of one allreduce once checked: `count` elements of `dtype` read at `input`
/// and written at `output` (the same address in place), on the communicator's GPU and valid
/// for the call's stream. Made only by [`Operands::check`] (from spans) or from checked
/// [`FusedOperands`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Operands {
    dtype: DType,
    input: u64,
    output: u64,
    count: usize,
}

impl Operands {
    /// Checks `input` (None: in place on `output`) and `output` against each other, the
    /// communicator's GPU `device` and the call's `stream`.
    pub(crate) fn check(
        input: Option<&DeviceSpan<'_>>,
        output: &DeviceSpanMut<'_>,
        device: usize,
        stream: &CudaStream,
    ) -> Result<Operands> {
        let call_stream = CallStream {
            id: stream.cu_stream() as usize,
            device: stream.context().ordinal(),
        };
        check_extents(
            input.map(|i| &i.extent),
            &output.extent,
            device,
            call_stream,
        )
    }

    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    pub(crate) fn input(&self) -> u64 {
        self.input
    }

    pub(crate) fn output(&self) -> u64 {
        self.output
    }

    pub(crate) fn count(&self) -> usize {
        self.count
    }

    pub(crate) fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }

    pub(crate) fn in_place(&self) -> bool {
        self.input == self.output
    }
}

/// One fused call: `x`, `residual`, `weight` in; `residual_out` (`None`: in place on
/// `residual`) and `y` out; all device pointers of `dtype` on the rank's GPU.
#[derive(Clone, Copy, Debug)]
pub struct FusedCall {
    pub dtype: DType,
    pub tokens: usize,
    pub hidden: usize,
    pub x: u64,
    pub residual: u64,
    pub residual_out: Option<u64>,
    pub weight: u64,
    pub y: u64,
    pub eps: f32,
}

impl FusedCall {
    pub(crate) fn elements(&self) -> usize {
        self.tokens * self.hidden
    }

    /// Shape, eps and aliasing; `Ok(false)` when there is nothing to do.
    pub(crate) fn validate(&self) -> Result<bool> {
        if !norm::validate(self.tokens, self.hidden, self.eps)? {
            return Ok(false);
        }
        let bytes = (self.elements() * self.dtype.size()) as u64;
        let overlaps = |a: u64, b: u64| a < b + bytes && b < a + bytes;
        let residual_out = self.residual_out.unwrap_or(self.residual);
        if overlaps(self.y, self.residual) || overlaps(self.y, residual_out) {
            return Err(Error::InvalidArgument(
                "fused_add_rms_norm: y overlaps residual or residual_out; give y its own buffer (it may be x)"
                    .to_owned(),
            ));
        }
        if residual_out != self.residual && overlaps(residual_out, self.residual) {
            return Err(Error::InvalidArgument(
                "fused_add_rms_norm: residual_out partly overlaps residual; pass the same buffer (in place) or a separate one"
                    .to_owned(),
            ));
        }
        Ok(true)
    }
}

/// The fused op's `x` and `y`: separate (`y` written, `x` only read), or `y` written over `x`.
pub enum FusedInput<'a> {
    Separate {
        x: DeviceSpan<'a>,
        y: DeviceSpanMut<'a>,
    },
    YIntoX(DeviceSpanMut<'a>),
}

/// The fused op's residual: updated in place, or read and the sum written to `out`.
pub enum FusedResidual<'a> {
    InPlace(DeviceSpanMut<'a>),
    Separate {
        residual: DeviceSpan<'a>,
        out: DeviceSpanMut<'a>,
    },
}

/// One fused call's operands as spans (`tokens x hidden` elements each, `weight`: `hidden`,
/// all of one dtype on the rank's GPU): what the safe entry points take.
pub struct FusedSpans<'a> {
    pub input: FusedInput<'a>,
    pub residual: FusedResidual<'a>,
    pub weight: DeviceSpan<'a>,
    pub tokens: usize,
    pub hidden: usize,
    pub eps: f32,
}

/// One fused call's operands once checked: every address of the [`FusedCall`] is device memory
/// of the communicator's GPU holding what the call reads and writes, valid for the call's
/// stream. Made only by [`FusedOperands::check`], from spans (the FFI edge builds those with
/// `Span::from_raw`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedOperands {
    call: FusedCall,
}

impl FusedOperands {
    /// The call's addresses, every span checked against GPU `device`, `stream`, the call's
    /// dtype (x's) and its shape.
    pub(crate) fn check(
        spans: &FusedSpans<'_>,
        device: usize,
        stream: &CudaStream,
    ) -> Result<FusedOperands> {
        let dtype = match &spans.input {
            FusedInput::Separate { x, .. } => x.dtype(),
            FusedInput::YIntoX(x) => x.dtype(),
        };
        let elements = spans.tokens.checked_mul(spans.hidden).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "fused_add_rms_norm: {} tokens x {} hidden elements is too many",
                spans.tokens, spans.hidden
            ))
        })?;
        let at = |e: &Extent, which: &str, count: usize| {
            e.address_for(which, device, CallStream::of(stream), dtype, count)
        };
        let (x, y) = match &spans.input {
            FusedInput::Separate { x, y } => {
                (at(&x.extent, "x", elements)?, at(&y.extent, "y", elements)?)
            }
            FusedInput::YIntoX(x) => {
                let x = at(&x.extent, "x", elements)?;
                (x, x)
            }
        };
        let (residual, residual_out) = match &spans.residual {
            FusedResidual::InPlace(r) => (at(&r.extent, "residual", elements)?, None),
            FusedResidual::Separate { residual, out } => (
                at(&residual.extent, "residual", elements)?,
                Some(at(&out.extent, "residual_out", elements)?),
            ),
        };
        Ok(FusedOperands {
            call: FusedCall {
                dtype,
                tokens: spans.tokens,
                hidden: spans.hidden,
                x,
                residual,
                residual_out,
                weight: at(&spans.weight.extent, "weight", spans.hidden)?,
                y,
                eps: spans.eps,
            },
        })
    }

    pub(crate) fn call(&self) -> &FusedCall {
        &self.call
    }

    /// The operands of the fused op's allreduce: `x` summed into `y`.
    pub(crate) fn allreduce(&self) -> Operands {
        let c = &self.call;
        Operands {
            dtype: c.dtype,
            input: c.x,
            output: c.y,
            count: c.tokens * c.hidden,
        }
    }
}

/// The stream a call runs on, as the checks see it.
#[derive(Clone, Copy)]
struct CallStream {
    id: usize,
    device: usize,
}

impl CallStream {
    fn of(stream: &CudaStream) -> CallStream {
        CallStream {
            id: stream.cu_stream() as usize,
            device: stream.context().ordinal(),
        }
    }
}

fn check_extents(
    input: Option<&Extent>,
    out: &Extent,
    device: usize,
    stream: CallStream,
) -> Result<Operands> {
    let on_stream = |e: &Extent, which: &str| {
        match e.stream {
        Some(s) if s != stream.id => Err(Error::InvalidArgument(format!(
            "the {which} span was made for another stream than the call's; make it with the stream the call runs on"
        ))),
        _ => Ok(()),
    }
    };
    let on_device = |e: &Extent, which: &str| {
        if e.device == device {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "the {which} is on GPU {} but this communicator's rank is on GPU {device}; pass memory of the rank's GPU",
                e.device
            )))
        }
    };
    if stream.device != device {
        return Err(Error::InvalidArgument(format!(
            "the stream belongs to GPU {} but this communicator's rank is on GPU {device}; use a stream of the rank's GPU",
            stream.device
        )));
    }
    on_device(out, "output")?;
    on_stream(out, "output")?;
    let Some(inp) = input else {
        return Ok(Operands {
            dtype: out.dtype,
            input: out.ptr,
            output: out.ptr,
            count: out.count,
        });
    };
    on_device(inp, "input")?;
    on_stream(inp, "input")?;
    if inp.dtype != out.dtype {
        return Err(Error::InvalidArgument(format!(
            "the input holds {} and the output {}; give both the same dtype",
            inp.dtype.name(),
            out.dtype.name()
        )));
    }
    if inp.count != out.count {
        return Err(Error::InvalidArgument(format!(
            "the input holds {} elements and the output {}; give both the same length",
            inp.count, out.count
        )));
    }
    let overlap = inp.ptr < out.ptr + out.bytes() as u64 && out.ptr < inp.ptr + inp.bytes() as u64;
    if overlap && inp.ptr != out.ptr {
        return Err(Error::InvalidArgument(
            "the input and output overlap without being the same memory; pass one buffer (in place) or two separate ones".into(),
        ));
    }
    Ok(Operands {
        dtype: out.dtype,
        input: inp.ptr,
        output: out.ptr,
        count: out.count,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(device: usize, ptr: u64, count: usize, dtype: DType) -> Extent {
        Extent::raw(device, ptr, count, dtype)
    }

    const STREAM: CallStream = CallStream {
        id: 0x50,
        device: 1,
    };

    fn error(input: Option<&Extent>, output: &Extent) -> String {
        check_extents(input, output, 1, STREAM)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn spans_report_what_they_were_made_with() {
        // SAFETY: never dereferenced.
        let s = unsafe { DeviceSpan::from_raw(3, 0x1000, 7, DType::F16) };
        assert_eq!(
            (s.device(), s.extent.ptr, s.count(), s.dtype()),
            (3, 0x1000, 7, DType::F16)
        );
        // SAFETY: as above.
        let m = unsafe { DeviceSpanMut::from_raw(1, 0x2000, 9, DType::Bf16) };
        assert_eq!(
            (m.device(), m.extent.ptr, m.count(), m.dtype()),
            (1, 0x2000, 9, DType::Bf16)
        );
    }

    #[test]
    fn matching_operands_pass_and_in_place_reads_the_output() {
        let out = extent(1, 0x10_000, 100, DType::Bf16);
        let inp = extent(1, 0x20_000, 100, DType::Bf16);
        let ops = check_extents(Some(&inp), &out, 1, STREAM).unwrap();
        assert_eq!(
            (ops.dtype(), ops.input(), ops.output(), ops.count()),
            (DType::Bf16, 0x20_000, 0x10_000, 100)
        );
        assert!(!ops.in_place() && ops.bytes() == 200);
        let ops = check_extents(None, &out, 1, STREAM).unwrap();
        assert_eq!((ops.input(), ops.output()), (0x10_000, 0x10_000));
        assert!(ops.in_place());
        // The same memory as input and output is in place, not an overlap.
        assert!(check_extents(Some(&out), &out, 1, STREAM).is_ok());
    }

    #[test]
    fn mismatched_operands_are_named() {
        let out = extent(1, 0x10_000, 100, DType::Bf16);
        let short = extent(1, 0x20_000, 99, DType::Bf16);
        assert!(error(Some(&short), &out).contains("99 elements and the output 100"));
        let f32s = extent(1, 0x20_000, 100, DType::F32);
        assert!(error(Some(&f32s), &out).contains("f32 and the output bf16"));
        let elsewhere = extent(0, 0x20_000, 100, DType::Bf16);
        assert!(error(Some(&elsewhere), &out).contains("input is on GPU 0"));
        assert!(error(None, &extent(2, 0x10_000, 100, DType::Bf16)).contains("output is on GPU 2"));
        let partly = extent(1, 0x10_002, 100, DType::Bf16);
        assert!(error(Some(&partly), &out).contains("overlap"));
        let other_stream = Extent {
            stream: Some(0x60),
            ..out
        };
        assert!(error(None, &other_stream).contains("another stream"));
        let this_stream = Extent {
            stream: Some(STREAM.id),
            ..out
        };
        assert!(check_extents(None, &this_stream, 1, STREAM).is_ok());
        let on_gpu_0 = CallStream {
            id: 0x50,
            device: 0,
        };
        assert!(check_extents(None, &out, 1, on_gpu_0)
            .unwrap_err()
            .to_string()
            .contains("stream belongs to GPU 0"));
    }

    #[test]
    fn one_operand_is_checked_against_the_call() {
        let x = extent(1, 0x10_000, 64, DType::Bf16);
        assert_eq!(
            x.address_for("x", 1, STREAM, DType::Bf16, 64).unwrap(),
            0x10_000
        );
        let err = |e: Result<u64>| e.unwrap_err().to_string();
        assert!(err(x.address_for("weight", 1, STREAM, DType::Bf16, 8))
            .contains("weight holds 64 bf16 elements where the call needs 8 bf16"));
        assert!(err(x.address_for("x", 1, STREAM, DType::F32, 64)).contains("needs 64 f32"));
        assert!(err(x.address_for("x", 0, STREAM, DType::Bf16, 64)).contains("stream belongs"));
        let on_stream = Extent {
            stream: Some(0x60),
            ..x
        };
        assert!(err(on_stream.address_for("y", 1, STREAM, DType::Bf16, 64))
            .contains("y was made for another stream"));
        let elsewhere = Extent { device: 2, ..x };
        assert!(
            err(elsewhere.address_for("residual", 1, STREAM, DType::Bf16, 64))
                .contains("residual is on GPU 2")
        );
    }
}
