//! The CUDA backend: tpar's kernels (`crates/tpar/kernels/*.cu`) over buffers shared between
//! ranks, either ranks of one process (one communicator per rank, built together by
//! [`CudaCommunicator::new_local_group`]) or one rank per process (device buffers shared by
//! CUDA IPC, host-staged inboxes by POSIX shared memory, through the job's rendezvous:
//! [`CudaCommunicator::new`]).
//!
//! Calls are asynchronous on the caller's stream and capture into CUDA graphs: the epoch that
//! picks buffers and tags lives in device memory and is advanced by the kernels themselves, so
//! a replayed graph uses a fresh epoch every time. A kernel that waits past its deadline, or
//! sees a peer's header disagree with its own, writes the error word (host-mapped memory) and
//! exits; [`CudaCommunicator::check`] (called by every call and by `synchronize`) turns that
//! word into the same errors as the CPU backend.
//!
//! Files, one concern each: `driver` (the driver calls, in safe types), `nvrtc` (compiling
//! kernels, the disk cache), `kernels` (the sources, their ABI mirror and the kernel keys),
//! `loader` (modules and functions per GPU), `group` (building a group: buffers, exchange,
//! co-residency), `communicator` (the calls), `errors` (the kernels' error word), `span` (the
//! checked operands of the public API, and the one unsafe door for raw addresses),
//! `stream_order` (calls ordered across streams), `fused` (allreduce + residual add + RMSNorm),
//! `separate` (the fused op's pieces apart, for `tpar bench --fused`), `standalone` (kernels on
//! buffers of their own, for `tpar bench --anatomy`), `link_measurement` (link measurements),
//! `knobs` (the environment variables that override a launch default, for experiments).

pub mod communicator;
pub mod driver;
pub mod errors;
pub mod fused;
mod group;
pub mod kernels;
mod knobs;
pub mod link_measurement;
mod loader;
pub mod nvrtc;
mod separate;
pub mod span;
pub mod standalone;
pub mod stream_order;

pub use communicator::{CudaCommunicator, LaunchShape};
pub use group::{
    planned_architecture, planned_module_bytes, PLANNED_MODULE_BYTES, PLANNED_MODULE_BYTES_BY_ARCH,
};
pub use kernels::KernelId;
pub use span::{borrowed_stream, DeviceSpan, DeviceSpanMut, Span};

pub(crate) use group::{context, enable_peer_access};
pub(crate) use loader::{free_memory_taken_by, kernel_set, KernelSet};

use cudarc::driver::sys::CUstream;
use cudarc::driver::CudaContext;

use crate::error::{Error, Result};

/// A CUDA stream handle as the driver API takes it (`cudaStream_t` in the runtime API).
pub type CuStream = CUstream;

/// Whether the CUDA backend can run here: `Ok(device count)` or an error saying why not
/// (no driver, no GPU, no NVRTC), never a panic.
pub fn check_available() -> Result<usize> {
    if !driver::driver_present() {
        return Err(Error::Cuda(
            "no NVIDIA driver: libcuda.so.1 cannot be loaded".to_owned(),
        ));
    }
    let count = CudaContext::device_count().map_err(|e| {
        Error::Cuda(format!(
            "the driver is present but cuInit/cuDeviceGetCount failed: {e}"
        ))
    })?;
    if count <= 0 {
        return Err(Error::Cuda("the NVIDIA driver reports no GPU".to_owned()));
    }
    nvrtc::nvrtc_version()?;
    Ok(count as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_availability_check_explains_instead_of_panicking() {
        // On a machine without a driver this must be an error with a reason, not a panic.
        match check_available() {
            Ok(n) => assert!(n > 0),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
}
