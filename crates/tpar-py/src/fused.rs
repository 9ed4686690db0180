//! The fused allreduce + residual add + RMSNorm for Python (issue 15): the one check of the
//! operands (what `fused_fit` answers and every fused call makes: one library, device and
//! dtype, `x` and `residual` of one shape `(..., hidden)`, `weight` of `(hidden,)`, then the
//! addresses and their aliasing), and the CPU path, which is the CPU backend's allreduce
//! followed by `tpar::norm`'s reference (the arithmetic the GPU kernels match bit for bit), so
//! that a machine with no GPU runs the op with the same semantics end to end.

use pyo3::prelude::*;

use tpar::norm;
use tpar::{Algorithm, CpuCommunicator};

use crate::arrays::{self, Array, Place, Refusal};

/// One call's operands as the Python package passes them (the library's [`FusedCall`]):
/// addresses of contiguous buffers of `dtype` (`weight`: `hidden` elements; the others
/// `tokens x hidden`; `residual_out: None` is in place on `residual`).
pub(crate) use tpar::backend::cuda::fused::FusedCall as Operands;

/// The checks the Python edge makes before either path runs (the CUDA path gets raw
/// addresses from torch, so they are checked here, not by spans).
pub(crate) trait OperandChecks {
    /// Bytes of one `tokens x hidden` operand.
    fn bytes(&self) -> Result<usize, String>;
    /// Shape, eps, null addresses and the aliasing rules (y may be x; residual_out may be
    /// residual; no output overlaps another operand otherwise). `Ok(false)`: nothing to do.
    fn check(&self) -> Result<bool, String>;
}

impl OperandChecks for Operands {
    fn bytes(&self) -> Result<usize, String> {
        self.tokens
            .checked_mul(self.hidden)
            .and_then(|e| e.checked_mul(self.dtype.size()))
            .filter(|b| *b <= isize::MAX as usize)
            .ok_or_else(|| {
                format!(
                    "fused_add_rms_norm: {} x {} elements is too many",
                    self.tokens, self.hidden
                )
            })
    }

    fn check(&self) -> Result<bool, String> {
        let bytes = self.bytes()? as u64;
        if !norm::validate(self.tokens, self.hidden, self.eps).map_err(|e| e.to_string())? {
            return Ok(false);
        }
        let residual_out = self.residual_out.unwrap_or(self.residual);
        if [self.x, self.residual, residual_out, self.weight, self.y].contains(&0) {
            return Err("fused_add_rms_norm: a null buffer address".to_owned());
        }
        let weight_bytes = (self.hidden * self.dtype.size()) as u64;
        let overlaps = |a: u64, a_len: u64, b: u64, b_len: u64| a < b + b_len && b < a + a_len;
        let rule = |bad: bool, text: &str| if bad { Err(text.to_owned()) } else { Ok(()) };
        rule(
            overlaps(self.y, bytes, self.residual, bytes)
                || overlaps(self.y, bytes, residual_out, bytes),
            "fused_add_rms_norm: out (y) overlaps residual; give y its own buffer (it may be x)",
        )?;
        rule(
            residual_out != self.residual && overlaps(residual_out, bytes, self.residual, bytes),
            "fused_add_rms_norm: residual_out partly overlaps residual; update residual in place or give a separate buffer",
        )?;
        rule(
            overlaps(residual_out, bytes, self.x, bytes),
            "fused_add_rms_norm: residual_out overlaps x; x is read by every rank's allreduce: keep them apart",
        )?;
        rule(
            overlaps(self.y, bytes, self.weight, weight_bytes)
                || overlaps(residual_out, bytes, self.weight, weight_bytes),
            "fused_add_rms_norm: an output overlaps weight; give the outputs their own buffers",
        )?;
        Ok(true)
    }
}

/// The fused op's arrays, read and fitted to each other.
pub(crate) struct FusedArrays {
    pub x: Array,
    pub residual: Array,
    pub weight: Array,
    pub place: Place,
    pub tokens: usize,
    pub hidden: usize,
}

/// Reads `x`, `residual` and `weight` and checks that they fit one fused call (the reason
/// codes are the ones engines log a decline by).
pub(crate) fn read_operands(
    x: &Bound<'_, PyAny>,
    residual: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
) -> PyResult<Result<FusedArrays, Refusal>> {
    let mut read = Vec::with_capacity(3);
    for (name, array) in [("x", x), ("residual", residual), ("weight", weight)] {
        match arrays::describe(array)? {
            Some(Ok(a)) => read.push(a),
            Some(Err(refusal)) => {
                return Ok(Err(Refusal {
                    reason: refusal.reason,
                    message: named(name, &refusal.message),
                }))
            }
            None => {
                return Ok(Err(Refusal {
                    reason: "kind",
                    message: format!(
                        "{name} is a {}: pass torch tensors or numpy arrays",
                        array.get_type().name()?
                    ),
                }))
            }
        }
    }
    let weight_array = read.pop().expect("three arrays");
    let residual_array = read.pop().expect("three arrays");
    let x_array = read.pop().expect("three arrays");
    let refuse = |reason, message: String| Ok(Err(Refusal { reason, message }));
    let type_name = |o: &Bound<'_, PyAny>| {
        o.get_type()
            .name()
            .map_or_else(|_| "?".to_owned(), |n| n.to_string())
    };
    for (name, a, object) in [
        ("residual", &residual_array, residual),
        ("weight", &weight_array, weight),
    ] {
        if a.library != x_array.library {
            return refuse(
                "kind",
                format!(
                    "{name} is a {} but x is a {}; pass one kind",
                    type_name(object),
                    type_name(x)
                ),
            );
        }
        if a.place != x_array.place {
            return refuse(
                "device",
                format!(
                    "{name} is on {} but x is on {}; they must be on the same device",
                    arrays::device_name(a.place),
                    arrays::device_name(x_array.place)
                ),
            );
        }
        if a.dtype != x_array.dtype {
            return refuse(
                "mixed",
                format!(
                    "{name} is {} but x is {}; all operands must have one dtype (e.g. not Gemma's fp32 gamma beside 16-bit activations)",
                    a.dtype, x_array.dtype
                ),
            );
        }
    }
    let shape: Vec<usize> = x.getattr("shape")?.extract()?;
    let Some(&hidden) = shape.last() else {
        return refuse(
            "shape",
            "x is a scalar; give it the shape (tokens, hidden)".to_owned(),
        );
    };
    if !arrays::same_shape(x, residual)? {
        return refuse(
            "shapes",
            format!(
                "residual has shape {} but x has {}; they must match",
                arrays::shape_text(residual),
                arrays::shape_text(x)
            ),
        );
    }
    let weight_shape: Vec<usize> = weight.getattr("shape")?.extract()?;
    if weight_shape != [hidden] {
        return refuse(
            "shapes",
            format!(
                "weight has shape {}; it must be ({hidden},), the hidden size of x",
                arrays::shape_text(weight)
            ),
        );
    }
    let tokens: usize = shape[..shape.len() - 1].iter().product();
    if hidden == 0 && tokens > 0 {
        return refuse(
            "shape",
            "x has a hidden size of 0; its last dimension is the hidden size".to_owned(),
        );
    }
    Ok(Ok(FusedArrays {
        place: x_array.place,
        x: x_array,
        residual: residual_array,
        weight: weight_array,
        tokens,
        hidden,
    }))
}

/// A refusal of one operand in its name: "tensor is not contiguous" of `residual` reads
/// "residual is not contiguous"; other messages get the name in front.
fn named(name: &str, message: &str) -> String {
    match message
        .strip_prefix("tensor ")
        .or_else(|| message.strip_prefix("array "))
    {
        Some(rest) => format!("{name} {rest}"),
        None => format!("{name}: {message}"),
    }
}

/// Copies `len` bytes from `address`.
///
/// # Safety
/// `address` points to `len` readable bytes.
unsafe fn read(address: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    // SAFETY: the caller's promise; `bytes` is a fresh allocation, so they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(address as *const u8, bytes.as_mut_ptr(), len) };
    bytes
}

/// The op on the CPU backend: every operand is copied in before anything is written, so `y`
/// may be `x` and `residual_out` may be `residual`.
///
/// # Safety
/// The addresses of `op` (checked by [`Operands::check`]) point to live host buffers of the
/// sizes it names, the outputs writable, none freed or written by anyone else during the call.
pub(crate) unsafe fn cpu(
    comm: &mut CpuCommunicator,
    op: &Operands,
    algorithm: Algorithm,
) -> tpar::Result<()> {
    let bytes = op.bytes().map_err(tpar::Error::InvalidArgument)?;
    // SAFETY: the caller's promise.
    let (mut sum, residual, weight) = unsafe {
        (
            read(op.x, bytes),
            read(op.residual, bytes),
            read(op.weight, op.hidden * op.dtype.size()),
        )
    };
    comm.all_reduce_bytes(op.dtype, None, &mut sum, algorithm)?;
    let (residual_out, y) =
        norm::add_rms_norm_reference(op.dtype, &sum, &residual, &weight, op.hidden, op.eps);
    // SAFETY: the caller's promise; the sources are this function's own vectors.
    unsafe {
        let target = op.residual_out.unwrap_or(op.residual) as *mut u8;
        std::ptr::copy_nonoverlapping(residual_out.as_ptr(), target, bytes);
        std::ptr::copy_nonoverlapping(y.as_ptr(), op.y as *mut u8, bytes);
    }
    Ok(())
}
