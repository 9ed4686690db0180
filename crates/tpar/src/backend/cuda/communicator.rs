//! [`CudaCommunicator`]: one rank's endpoint of a CUDA allreduce group (built in `group.rs`)
//! and its calls: checked operands in, one kernel launch per chunk on the caller's stream, the
//! launch shape (blocks, programmatic dependent launch) within the co-residency bound, and the
//! error word turned into tpar's errors at the next call.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};

use super::driver::{self, DeviceMemory, IpcMapping, MappedHostMemory, RegisteredSegment};
use super::errors;
use super::kernels::{KernelArgs, KernelId, MAX_RANKS, THREADS};
use super::loader::KernelSet;
use super::span::{DeviceSpan, DeviceSpanMut, Operands};
use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::protocol::header::CallHeader;
use crate::protocol::layout::{chunks, InboxLayout};
use crate::protocol::line::lines_for_bytes;

/// One rank's endpoint of a CUDA allreduce group.
pub struct CudaCommunicator {
    pub(super) rank: usize,
    pub(super) world_size: usize,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) kernels: Arc<KernelSet>,
    pub(super) layout: InboxLayout,
    pub(super) max_blocks: u32,
    pub(super) timeout: Duration,
    pub(super) own: Owned,
    /// Every rank's device inbox as this rank addresses it (own included).
    pub(super) device_inboxes: [u64; MAX_RANKS],
    /// Every rank's host-staged inbox as this rank's GPU addresses it.
    pub(super) host_inboxes: Option<[u64; MAX_RANKS]>,
    /// Device memory algorithms need every peer's device memory reachable (P2P or same GPU).
    pub(super) peer_access: std::result::Result<(), String>,
    pub(super) peer_device_mappings: Vec<IpcMapping>,
    pub(super) peer_host_mappings: Vec<RegisteredSegment>,
    /// Ranks of other processes on this rank's GPU: without MPS the driver time-slices
    /// their contexts, so every call waits for each one's turn (milliseconds, not microseconds).
    pub(super) time_sliced_with: Vec<usize>,
    /// The group's GPUs in rank order (UUIDs, or ordinals for a group of one process) and
    /// the settings that shape its buffers: what an init self-test result depends on.
    pub(super) group_key: String,
    pub(super) status: Mutex<Status>,
    /// Blocks of this rank's last kernel launch (see [`CudaCommunicator::launch_behind_last`]).
    pub(super) last_grid: std::sync::atomic::AtomicU32,
}

/// This rank's own allocations (made in `group.rs`).
pub(super) struct Owned {
    /// LL inbox, then the pull region (data buffers and block flags).
    pub(super) inbox: DeviceMemory,
    /// [epoch of the last chunk, blocks done], then the fused kernels' exchange lines.
    pub(super) state: DeviceMemory,
    pub(super) error: MappedHostMemory,
    pub(super) host_inbox: Option<RegisteredSegment>,
}

#[derive(Default)]
pub(super) struct Status {
    poisoned: Option<String>,
    last_call: Option<CallHeader>,
}

impl CudaCommunicator {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The group's GPUs in rank order and its buffer settings, as one string: groups with the
    /// same key run the same kernels over the same links.
    pub fn group_key(&self) -> &str {
        &self.group_key
    }

    /// Ranks of other processes that share this rank's GPU (time-sliced by the driver).
    pub fn time_sliced_with(&self) -> &[usize] {
        &self.time_sliced_with
    }

    /// Blocks per kernel launch (the co-residency bound).
    pub fn max_blocks(&self) -> u32 {
        self.max_blocks
    }

    /// The algorithms this communicator can run, with the reason for each it cannot.
    pub fn supports(&self, algorithm: Algorithm) -> std::result::Result<(), String> {
        match algorithm {
            Algorithm::HostStaged if self.host_inboxes.is_none() => {
                Err("host-staged inboxes were not built (Config::host_staged is off)".into())
            }
            Algorithm::HostStaged => Ok(()),
            _ if KernelId::allreduce(algorithm, DType::F32).is_none() => {
                Err(format!("the CUDA backend has no {algorithm} kernel"))
            }
            _ => self.peer_access.clone(),
        }
    }

    /// Panics where `algorithm` cannot run on this group: the dispatcher's eligibility, with
    /// this group's facts, decides before any launch, so reaching one is a bug.
    pub(crate) fn assert_supported(&self, algorithm: Algorithm) {
        if let Err(why) = self.supports(algorithm) {
            panic!("{algorithm} reached a launch on a group that cannot run it ({why}): the dispatcher's eligibility let it through");
        }
    }

    /// [`CudaCommunicator::supports`] as an error, for the entries that take an algorithm
    /// without the dispatcher (benchmarks, tests).
    pub(crate) fn refuse_unsupported(&self, algorithm: Algorithm) -> Result<()> {
        self.supports(algorithm)
            .map_err(|why| Error::Unsupported(format!("{algorithm} on this group: {why}")))
    }

    /// Whether this group built host-staged inboxes (an input of the dispatcher's eligibility).
    pub fn has_host_inboxes(&self) -> bool {
        self.host_inboxes.is_some()
    }

    /// Whether every peer's device memory was mapped when the group was built, or why not (an
    /// input of the dispatcher's eligibility).
    pub fn peer_access(&self) -> std::result::Result<(), &str> {
        self.peer_access
            .as_ref()
            .map(|_| ())
            .map_err(String::as_str)
    }

    /// Reports an error a kernel left in the error word (or an earlier one). Asynchronous
    /// errors surface here: at the next call, or at [`CudaCommunicator::synchronize`].
    pub fn check(&self) -> Result<()> {
        let mut status = self.status.lock().expect("status lock");
        if let Some(why) = &status.poisoned {
            return Err(Error::Poisoned(why.clone()));
        }
        let word = self.own.error.read_u64(0);
        if word == 0 {
            return Ok(());
        }
        let error = errors::decode(word, self.rank, status.last_call, self.timeout);
        status.poisoned = Some(error.to_string());
        Err(error)
    }

    /// Waits for `stream`, then reports any error the kernels left.
    pub fn synchronize(&self, stream: &CudaStream) -> Result<()> {
        stream
            .synchronize()
            .map_err(|e| Error::Cuda(format!("stream synchronise: {e}")))?;
        self.check()
    }

    /// Queues `output[i] = sum over ranks of input[i]` on `stream` with `algorithm`
    /// (`input: None`: in place on `output`). Returns once the work is queued; errors found by
    /// the kernels surface at the next [`CudaCommunicator::check`]. The spans must be on this
    /// rank's GPU, of one dtype and length; `stream` a stream of this rank's context (it may
    /// be capturing a graph).
    pub fn all_reduce(
        &self,
        input: Option<DeviceSpan<'_>>,
        output: DeviceSpanMut<'_>,
        algorithm: Algorithm,
        stream: &CudaStream,
    ) -> Result<()> {
        let operands = Operands::check(input.as_ref(), &output, self.ctx.ordinal(), stream)?;
        self.refuse_unsupported(algorithm)?;
        // The spans live to the end of this function: cudarc's buffers record the call's work
        // on their events when they are dropped, after it was queued.
        self.enqueue(&operands, algorithm, stream)
    }

    /// Queues the allreduce of checked `operands` on `algorithm`.
    pub(crate) fn enqueue(
        &self,
        operands: &Operands,
        algorithm: Algorithm,
        stream: &CudaStream,
    ) -> Result<()> {
        self.check()?;
        self.assert_supported(algorithm);
        driver::bind(&self.ctx)?;
        let dtype = operands.dtype();
        let count = operands.count();
        let function = self.kernels.get(
            KernelId::allreduce(algorithm, dtype)
                .expect("supports() refused kernel-less algorithms"),
        );
        let header = self.next_call(count as u64, dtype, algorithm);
        if self.world_size == 1 {
            // One rank: the sum is the input. In place there is nothing to do; otherwise a
            // copy (a memcpy node in a captured graph) is all the work there is.
            if !operands.in_place() && count > 0 {
                // SAFETY: checked operands are device memory of this GPU, `bytes()` long,
                // valid for the call's work on `stream`.
                unsafe {
                    driver::copy_device_addresses_async(
                        &self.ctx,
                        operands.output(),
                        operands.input(),
                        operands.bytes(),
                        stream,
                    )
                }?;
            }
            return Ok(());
        }
        let (input, output) = (operands.input(), operands.output());
        for (index, elements) in chunks(count, self.layout.chunk_elements(dtype)).enumerate() {
            let offset = (elements.start * dtype.size()) as u64;
            let lines = lines_for_bytes(elements.len() * dtype.size()) as u32;
            let args = self.kernel_args(
                algorithm,
                index,
                (input + offset, output + offset),
                elements.len() as u64,
                header.count,
            );
            let (grid, pdl) = self.launch_behind_last(|pdl_supported| {
                launch_shape(
                    algorithm,
                    lines,
                    self.layout.payload_lines,
                    self.max_blocks,
                    pdl_supported,
                )
            });
            // SAFETY: the argument block mirrors TparArgs; inboxes, state and error are ours
            // for the communicator's lifetime; input/output are checked operands. Every
            // allreduce kernel runs griddepcontrol.wait before touching memory (begin_epoch).
            unsafe { function.launch_ex(grid, THREADS, stream.cu_stream(), &args, pdl)? };
        }
        Ok(())
    }

    /// Numbers the next call and remembers its header (what a mismatch or a timeout names).
    pub(crate) fn next_call(&self, count: u64, dtype: DType, algorithm: Algorithm) -> CallHeader {
        let mut status = self.status.lock().expect("status lock");
        let seq = status.last_call.map_or(1, |c| c.seq.wrapping_add(1));
        let header = CallHeader {
            seq,
            count,
            dtype,
            algorithm,
            chunk: 0,
        };
        status.last_call = Some(header);
        header
    }

    /// The argument block of one chunk of a call on `algorithm`: this rank's buffers and the
    /// inboxes the algorithm uses (host-staged: pinned host memory; else device memory).
    pub(crate) fn kernel_args(
        &self,
        algorithm: Algorithm,
        chunk: usize,
        (input, output): (u64, u64),
        count: u64,
        total_count: u64,
    ) -> KernelArgs {
        KernelArgs {
            input,
            output,
            count,
            total_count,
            payload_lines: self.layout.payload_lines as u64,
            timeout_ns: self.timeout.as_nanos() as u64,
            state: self.own.state.ptr(),
            error: self.own.error.device_ptr(),
            inboxes: match algorithm {
                Algorithm::HostStaged => self.host_inboxes.expect("checked by supports"),
                _ => self.device_inboxes,
            },
            rank: self.rank as u32,
            world_size: self.world_size as u32,
            chunk: chunk as u32,
            algo: u32::from(algorithm.code()),
        }
    }

    /// The grid and PDL choice for this rank's next kernel, given `shape(pdl_supported)`, and
    /// remembers the grid. A kernel launched with PDL may become resident while this rank's
    /// previous kernel still spins (every tpar kernel lets its dependents launch once it has
    /// read the call counter); where ranks share a GPU, the two together must fit this rank's
    /// share of co-resident blocks, or a peer's spinning grid may never become resident and
    /// both wait until the deadline (seen on one H200 with 8 ranks: a PDL norm kernel behind a
    /// full-grid allreduce). So PDL is used only where the previous grid and this one fit.
    pub(crate) fn launch_behind_last(&self, shape: impl Fn(bool) -> (u32, bool)) -> (u32, bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let before = self.last_grid.load(Relaxed);
        let (mut grid, mut pdl) = shape(self.kernels.pdl);
        if pdl && before + grid > self.max_blocks {
            (grid, pdl) = shape(false);
        }
        self.last_grid.store(grid, Relaxed);
        (grid, pdl)
    }

    /// Launches the empty kernel with the allreduce's launch shape: the fixed cost floor.
    pub fn launch_empty(&self, stream: &CudaStream) -> Result<()> {
        driver::bind(&self.ctx)?;
        let args = KernelArgs {
            input: 0,
            output: 0,
            count: 0,
            total_count: 0,
            payload_lines: 0,
            timeout_ns: 0,
            state: 0,
            error: 0,
            inboxes: [0; MAX_RANKS],
            rank: 0,
            world_size: 0,
            chunk: 0,
            algo: 0,
        };
        let f = self.kernels.get(KernelId::Empty);
        // SAFETY: the empty kernel touches nothing.
        unsafe { f.launch(1, THREADS, stream.cu_stream(), &args) }
    }
}

/// Blocks and whether to use programmatic dependent launch for one chunk of `lines` 8-byte
/// lines. One-shot (and host-staged) carries two words per thread in 16-byte lines when the
/// slots are 16-byte aligned (`payload_lines` even), so it needs half the threads. With PDL a
/// rank's next kernel can be resident while this one spins, so with PDL a kernel gets half the
/// co-resident blocks. PDL is used where that half gives each thread at most twice its lines.
/// At 256 KiB on 2 ranks of one H200 (`tpar bench --anatomy`, 2026-12-01) the choice was close
/// and went either way with the build: 32 blocks with PDL 3.96 us against 64 without 6.08
/// (slow paths as calls), 4.05 against 3.78 (inlined, the default); 16 blocks with PDL lost
/// clearly to 32 without (7.5 against 5.8).
pub(crate) fn launch_shape(
    algorithm: Algorithm,
    lines: u32,
    payload_lines: usize,
    max_blocks: u32,
    pdl_supported: bool,
) -> (u32, bool) {
    let wide =
        matches!(algorithm, Algorithm::OneShot | Algorithm::HostStaged) && payload_lines % 2 == 0;
    let threads_needed = if wide { lines.div_ceil(2) } else { lines };
    let blocks = threads_needed.div_ceil(THREADS).max(1);
    let half = max_blocks / 2;
    let pdl = pdl_supported && half >= 1 && blocks <= 2 * half;
    (blocks.min(if pdl { half } else { max_blocks }), pdl)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pdl_where_half_the_grid_suffices_and_wide_lines_halve_the_threads() {
        // 4 KiB of bf16: 1024 lines, 512 wide lines: one block.
        assert_eq!(
            launch_shape(Algorithm::OneShot, 1024, 65536, 32, true),
            (1, true)
        );
        assert_eq!(
            launch_shape(Algorithm::TwoShot, 1024, 65536, 32, false),
            (2, false)
        );
        // An odd payload_lines keeps 8-byte lines.
        assert_eq!(
            launch_shape(Algorithm::OneShot, 1024, 65535, 32, false),
            (2, false)
        );
        // 32 KiB: 8 blocks, within half of 16.
        assert_eq!(
            launch_shape(Algorithm::OneShot, 8192, 65536, 16, true),
            (8, true)
        );
        // 256 KiB: 64 blocks; with 64 co-resident, 32 with PDL (two lines a thread); with
        // 32, 32 without PDL rather than 16 with it.
        assert_eq!(
            launch_shape(Algorithm::OneShot, 65536, 65536, 64, true),
            (32, true)
        );
        assert_eq!(
            launch_shape(Algorithm::OneShot, 65536, 65536, 32, true),
            (32, false)
        );
        assert_eq!(
            launch_shape(Algorithm::OneShot, 65536, 65536, 64, false),
            (64, false)
        );
        // One co-resident block: no PDL, so no second grid waits beside it.
        assert_eq!(
            launch_shape(Algorithm::HostStaged, 1024, 65536, 1, true),
            (1, false)
        );
    }
}
