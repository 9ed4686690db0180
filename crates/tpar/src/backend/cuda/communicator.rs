//! [`CudaCommunicator`]: one rank's endpoint of a CUDA allreduce group (built in `group.rs`)
//! and its calls: checked operands in, one kernel launch per chunk on the caller's stream, the
//! launch shape (blocks, programmatic dependent launch) within the co-residency bound, and the
//! error word turned into tpar's errors at the next call.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};

use super::driver::{self, DeviceMemory, IpcMapping, MappedHostMemory, RegisteredSegment};
use super::errors::{self, HEADER_ISLANDS_ALL};
use super::kernels::{
    call_hash, IslandTables, KernelArgs, KernelId, FLAG_ISLANDS_ALL_UNITS, MAX_RANKS, THREADS,
};
use super::knobs::Knob;
use super::loader::KernelSet;
use super::span::{DeviceSpan, DeviceSpanMut, Operands};
use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::islands::{Islands, IslandsExchange};
use crate::protocol::header::CallHeader;
use crate::protocol::layout::{chunks, InboxLayout};
use crate::protocol::schedule::{self, units_for_bytes, UNIT_BYTES};

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
    /// The islands the islands algorithms reduce over (every rank agreed on them).
    pub(super) islands: Islands,
    /// The same as the kernels take them, built once: every launch's arguments carry them.
    pub(super) island_tables: IslandTables,
    /// Whether the islands' exchange goes through the host-staged inboxes (islands without
    /// peer access between them, or forced by `TPAR_ISLANDS_CROSS=host`), and why not where
    /// it cannot run: islands need peer access inside each island.
    pub(super) islands_path: std::result::Result<bool, String>,
    /// Which calls of the islands algorithm exchange all units (islands.cu), and whether
    /// TPAR_ISLANDS_EXCHANGE set it (else the model of the machine may: [`Self::model_islands_exchange`]).
    pub(super) islands_exchange: IslandsExchange,
    pub(super) islands_exchange_set: bool,
    /// Peers whose device memory this rank could not map (no peer access).
    pub(super) unreachable_peers: Vec<usize>,
    pub(super) peer_device_mappings: Vec<IpcMapping>,
    pub(super) peer_host_mappings: Vec<RegisteredSegment>,
    /// Ranks of other processes on this rank's GPU: without MPS the driver time-slices
    /// their contexts, so every call waits for each one's turn (milliseconds, not microseconds).
    pub(super) time_sliced_with: Vec<usize>,
    /// The group's GPUs in rank order (UUIDs, or ordinals for a group of one process) and
    /// the settings that shape its buffers: what an init self-test result depends on.
    pub(super) group_key: String,
    pub(super) status: Mutex<Status>,
    /// This rank's last kernel launch, packed ([`LaunchShape::pack`]; 0: none yet). See
    /// [`CudaCommunicator::same_grid_behind_last`] and [`CudaCommunicator::last_launch`].
    pub(super) last_launch: std::sync::atomic::AtomicU64,
}

/// How a kernel was launched: which kernel, blocks, threads per block, blocks per thread block
/// cluster, and whether with programmatic dependent launch (PDL: it may become resident while
/// the rank's previous kernel still runs). `tpar bench` prints the shape per row and writes the
/// kernel beside it in its JSON, so a figure says what it timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LaunchShape {
    /// The kernel, written in JSON as its `extern "C"` name ([`KernelId::name`]).
    #[serde(serialize_with = "kernel_by_name")]
    pub kernel: KernelId,
    pub grid: u32,
    pub block: u32,
    /// Blocks per thread block cluster: 1 where launched without clusters (the fused
    /// one-shot's cluster forms exchange a row's sums in shared memory, fused.rs).
    pub cluster: u32,
    pub pdl: bool,
}

impl LaunchShape {
    /// One word, for an atomic: grid in bits 0-31, block in 32-43, cluster in 44-49, the
    /// kernel's [`KernelId::index`] plus one in 50-62, PDL in 63 (a launch has at least one
    /// block, so a launch never packs to 0). Blocks hold at most 1024 threads, clusters at most
    /// 16 blocks and the kernels number [`KernelId::COUNT`], so no field is cut.
    fn pack(self) -> u64 {
        u64::from(self.grid)
            | u64::from(self.block & 0xfff) << 32
            | u64::from(self.cluster & 0x3f) << 44
            | ((self.kernel.index() as u64 + 1) & 0x1fff) << 50
            | u64::from(self.pdl) << 63
    }

    /// The launch `pack` made `word` from; None for 0 (no launch yet). Only `pack`'s words are
    /// stored, so their kernel field always names a kernel of the table.
    fn unpack(word: u64) -> Option<LaunchShape> {
        let kernel = ((word >> 50) as usize & 0x1fff).checked_sub(1)?;
        Some(LaunchShape {
            kernel: KernelId::ALL[kernel],
            grid: word as u32,
            block: (word >> 32) as u32 & 0xfff,
            cluster: (word >> 44) as u32 & 0x3f,
            pdl: word >> 63 == 1,
        })
    }
}

/// Serializes a launch's kernel as its `extern "C"` name, as the bench JSON schemas say.
fn kernel_by_name<S: serde::Serializer>(kernel: &KernelId, out: S) -> Result<S::Ok, S::Error> {
    out.serialize_str(kernel.name())
}

impl std::fmt::Display for LaunchShape {
    /// `8x64 pdl`, `16x512 c4 pdl`: blocks x threads, blocks per cluster where clustered, and
    /// PDL where taken (the kernel is in the JSON: its name would not fit a table's column).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.grid, self.block)?;
        if self.cluster > 1 {
            write!(f, " c{}", self.cluster)?;
        }
        if self.pdl {
            write!(f, " pdl")?;
        }
        Ok(())
    }
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
    /// Whether the last call was a fused one (its header counts rows, not elements).
    last_fused: bool,
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
            Algorithm::Islands => self.islands_path.clone().map(|_| ()),
            // The pull form reads the other islands' memory: it needs peer access between them.
            Algorithm::IslandsPull => match &self.islands_path {
                Ok(false) => Ok(()),
                Ok(true) => Err(format!(
                    "islands-pull reads the other islands' memory, which needs peer access between the islands of {}; islands exchanges through host memory there",
                    self.islands
                )),
                Err(why) => Err(why.clone()),
            },
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
        let error = errors::decode(
            word,
            self.rank,
            status.last_call,
            status.last_fused,
            self.timeout,
        );
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
        let kernel = KernelId::allreduce(algorithm, dtype)
            .expect("supports() refused kernel-less algorithms");
        let function = self.kernels.get(kernel);
        let header = self.next_call(count as u64, dtype, algorithm, false);
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
        let all_units = self.islands_all_units(algorithm, dtype, count);
        let header_code = u32::from(dtype.code()) | if all_units { HEADER_ISLANDS_ALL } else { 0 };
        for (index, elements) in chunks(count, self.launch_elements(algorithm, dtype)).enumerate() {
            let offset = (elements.start * dtype.size()) as u64;
            let args = self.kernel_args(
                algorithm,
                index,
                (input + offset, output + offset),
                elements.len() as u64,
                (header.count, header_code),
            );
            let threads = threads_needed(algorithm, elements.len() * dtype.size(), self.world_size);
            // Whole blocks for the pull kernels (they split their work by block and size
            // shared memory by TPAR_THREADS) and small two-shot calls; the squeeze per
            // algorithm; and the grid kept where PDL may not follow the last one.
            let min_block_threads = min_block_threads_for(algorithm, threads, self.world_size);
            let (grid, block, pdl) = spread_shape(
                threads,
                self.max_blocks,
                self.kernels.pdl,
                min_block_threads,
                pdl_squeeze(algorithm),
            );
            let pdl = self.same_grid_behind_last(kernel, grid, block, 1, pdl);
            // SAFETY: the argument block mirrors TparArgs; inboxes, state and error are ours
            // for the communicator's lifetime; input/output are checked operands. Every
            // allreduce kernel runs griddepcontrol.wait before touching memory (begin_epoch).
            unsafe { function.launch_ex(grid, block, stream.cu_stream(), &args, pdl)? };
        }
        Ok(())
    }

    /// Numbers the next call and remembers its header (what a mismatch or a timeout names).
    pub(crate) fn next_call(
        &self,
        count: u64,
        dtype: DType,
        algorithm: Algorithm,
        fused: bool,
    ) -> CallHeader {
        let mut status = self.status.lock().expect("status lock");
        status.last_fused = fused;
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

    /// Whether a call of `count` elements of `dtype` on `algorithm` runs the islands' exchange
    /// in its all-units form (islands.cu): the islands algorithm over two or more islands, a
    /// call that is one launch whose partials of every unit fit a slot, and the form the
    /// group's setting asks for ([`crate::islands::IslandsExchange`]).
    pub(crate) fn islands_all_units(
        &self,
        algorithm: Algorithm,
        dtype: DType,
        count: usize,
    ) -> bool {
        if algorithm != Algorithm::Islands || self.islands.count() < 2 {
            return false;
        }
        let bytes = count * dtype.size();
        let fits = units_for_bytes(bytes)
            <= schedule::partial_slot_units(dtype, self.layout.payload_lines / 2);
        fits && self.islands_exchange.all_units_at(bytes)
    }

    /// Which calls of the islands algorithm exchange all units.
    pub fn islands_exchange(&self) -> IslandsExchange {
        self.islands_exchange
    }

    /// The form the machine's model chose, unless TPAR_ISLANDS_EXCHANGE set one. Every rank
    /// must pass the same (a call whose ranks differ fails as a mismatch, naming it).
    pub fn model_islands_exchange(&mut self, exchange: IslandsExchange) {
        if !self.islands_exchange_set {
            self.islands_exchange = exchange;
        }
    }

    /// Elements of `dtype` one launch of `algorithm` carries: a chunk, fewer where the islands'
    /// f32 partials must fit a slot, up to n chunks for the ring ([`schedule::launch_units`]).
    pub(crate) fn launch_elements(&self, algorithm: Algorithm, dtype: DType) -> usize {
        let units = launch_units(algorithm, dtype, self.layout.payload_lines, &self.islands);
        units * UNIT_BYTES / dtype.size()
    }

    /// The argument block of one chunk of a call on `algorithm`: this rank's buffers and the
    /// inboxes the algorithm uses (host-staged: pinned host memory; else device memory; the
    /// islands' exchange through either), the islands, and the call's identity from the count
    /// of the whole call and its header code (the dtype, with the op's flags).
    pub(crate) fn kernel_args(
        &self,
        algorithm: Algorithm,
        chunk: usize,
        (input, output): (u64, u64),
        count: u64,
        (total_count, header_code): (u64, u32),
    ) -> KernelArgs {
        let inboxes = match algorithm {
            Algorithm::HostStaged => self.host_inboxes.expect("checked by supports"),
            _ => self.device_inboxes,
        };
        let through_host = matches!(
            (algorithm, &self.islands_path),
            (Algorithm::Islands | Algorithm::IslandsPull, Ok(true))
        );
        let (inboxes, recv_inboxes) = inboxes_by_pair(
            self.rank,
            &self.islands,
            inboxes,
            through_host.then(|| self.host_inboxes.expect("a host path implies host inboxes")),
        );
        KernelArgs {
            input,
            output,
            count,
            total_count,
            payload_lines: self.layout.payload_lines as u64,
            timeout_ns: self.timeout.as_nanos() as u64,
            state: self.own.state.ptr(),
            error: self.own.error.device_ptr(),
            inboxes,
            recv_inboxes,
            rank: self.rank as u32,
            world_size: self.world_size as u32,
            chunk: chunk as u32,
            algo: u32::from(algorithm.code()),
            call_hash: call_hash(total_count, header_code, algorithm, chunk as u32),
            // The header code says which form of the islands exchange the call takes.
            flags: if header_code & HEADER_ISLANDS_ALL != 0 {
                FLAG_ISLANDS_ALL_UNITS
            } else {
                0
            },
            islands: self.island_tables,
        }
    }

    /// How the islands algorithms' exchange between islands travels in this group (`true`:
    /// through the host-staged inboxes), or why they cannot run.
    pub fn islands_path(&self) -> std::result::Result<bool, String> {
        self.islands_path.clone()
    }

    /// The islands this communicator's islands algorithms reduce over.
    pub fn islands(&self) -> Islands {
        self.islands
    }

    /// Whether this rank's next kernel, `kernel` of `grid` blocks, may take the PDL it asks
    /// for, and remembers the launch for [`CudaCommunicator::last_launch`] (`block` threads,
    /// `cluster` blocks per cluster, 1 without). A kernel launched with PDL may become resident
    /// while this rank's previous kernel still spins (every tpar kernel lets its dependents
    /// launch once it has read the call counter); where ranks share a GPU, the two together
    /// must fit this rank's share of co-resident blocks, or a peer's spinning grid may never
    /// become resident and both wait until the deadline (seen on one H200 with 8 ranks: a PDL
    /// norm kernel behind a full-grid allreduce). So PDL is used only where the previous grid
    /// and this one fit;
    /// where they do not, the same grid runs without PDL (any grid may: it waits for the last
    /// kernel to end). Falling back to the full grid instead, as launches did before, left
    /// every later launch of a shape cut for PDL behind a full grid, without PDL for good: on
    /// one H200 two-shot at 8 ranks and 42 KiB, squeezed onto half the grid (see
    /// [`pdl_squeeze`]), stayed at 6.93 us after a one-shot launch of the full grid, against
    /// 6.38 (bench/results/2026-12-02-h200-s11, calls 1 and 2).
    pub(crate) fn same_grid_behind_last(
        &self,
        kernel: KernelId,
        grid: u32,
        block: u32,
        cluster: u32,
        pdl: bool,
    ) -> bool {
        let mut taken = false;
        // The closure always returns Some, so the update cannot fail.
        let _ = self.last_launch.fetch_update(
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
            |before| {
                let before_grid = LaunchShape::unpack(before).map_or(0, |l| l.grid);
                taken = pdl && pdl_fits_behind(before_grid, grid, self.max_blocks);
                let launch = LaunchShape {
                    kernel,
                    grid,
                    block,
                    cluster,
                    pdl: taken,
                };
                Some(launch.pack())
            },
        );
        taken
    }

    /// The shape of this rank's last kernel launch (None before its first): what `tpar bench`
    /// reports beside each figure.
    pub fn last_launch(&self) -> Option<LaunchShape> {
        LaunchShape::unpack(self.last_launch.load(std::sync::atomic::Ordering::Relaxed))
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
            recv_inboxes: [0; MAX_RANKS],
            rank: 0,
            world_size: 0,
            chunk: 0,
            algo: 0,
            call_hash: 0,
            flags: 0,
            islands: IslandTables::NONE,
        };
        let f = self.kernels.get(KernelId::Empty);
        // SAFETY: the empty kernel touches nothing.
        unsafe { f.launch(1, THREADS, stream.cu_stream(), &args) }
    }
}

/// Threads one launch of `algorithm` over `bytes` needs: a thread per unit (16-byte LL line)
/// for the push algorithms and islands-pull, a thread per 4-byte word for one-shot pull and
/// staged pull (plain data), a thread per unit of the largest ring chunk for the ring.
pub(crate) fn threads_needed(algorithm: Algorithm, bytes: usize, world_size: usize) -> u32 {
    let units = units_for_bytes(bytes);
    let threads = match algorithm {
        Algorithm::OneShotPull | Algorithm::StagedPull => 2 * units,
        Algorithm::Ring => units.div_ceil(world_size.max(1)),
        _ => units,
    };
    threads as u32
}

/// Units one launch of `algorithm` on `dtype` carries with slots of `payload_lines` 8-byte
/// lines (half as many units: 16-byte lines): [`schedule::launch_units`].
pub(crate) fn launch_units(
    algorithm: Algorithm,
    dtype: DType,
    payload_lines: usize,
    islands: &Islands,
) -> usize {
    schedule::launch_units(algorithm, islands, dtype, payload_lines / 2)
}

/// The inboxes of one launch, resolved per pair of ranks so that a kernel never tests where a
/// line travels: the inbox `rank` writes each rank's lines into, and its own inbox that each
/// rank's lines arrive in (`TparArgs::inboxes`, `recv_inboxes`). With `between_islands` (the
/// host inboxes, where the islands exchange through host memory) lines between islands travel
/// through those; every other line through `inboxes`.
pub(crate) fn inboxes_by_pair(
    rank: usize,
    islands: &Islands,
    inboxes: [u64; MAX_RANKS],
    between_islands: Option<[u64; MAX_RANKS]>,
) -> ([u64; MAX_RANKS], [u64; MAX_RANKS]) {
    let mut send = inboxes;
    let mut recv = [inboxes[rank]; MAX_RANKS];
    if let Some(host) = between_islands {
        let mine = islands.island_of(rank);
        for peer in (0..islands.world_size()).filter(|&p| islands.island_of(p) != mine) {
            send[peer] = host[peer];
            recv[peer] = host[rank];
        }
    }
    (send, recv)
}

/// Whether a grid of `grid` blocks launched with PDL behind one of `before` blocks fits a
/// rank's share of `max_blocks` co-resident blocks (both may be resident at once).
fn pdl_fits_behind(before: u32, grid: u32, max_blocks: u32) -> bool {
    before + grid <= max_blocks
}

/// Blocks and whether to use programmatic dependent launch for a launch of `threads` threads.
/// With PDL a rank's next kernel can be resident while this one spins, so with PDL a kernel
/// gets half the co-resident blocks. PDL is used where that half still gives every thread one
/// unit: where it would take two, the full grid without PDL was faster in every case measured
/// (`tpar bench --anatomy`, one H200, 2026-12-02, bench/results/2026-12-02-h200-s6-primitives
/// call2: 2 ranks at 256 KiB 3.70 us on 64 blocks against 3.88 on 32 with PDL; 8 ranks sharing
/// the GPU at 42 KiB 6.28 on 11 blocks against 7.81 on 8, at 256 KiB 21.10 against 28.91),
/// and where it does not, PDL was (2 ranks at 32 KiB 2.87 against 3.43; 8 ranks 5.03 against
/// 6.13).
pub(crate) fn launch_shape(threads: u32, max_blocks: u32, pdl_supported: bool) -> (u32, bool) {
    let blocks = threads.div_ceil(THREADS).max(1);
    let half = max_blocks / 2;
    let pdl = pdl_supported && half >= 1 && blocks <= half;
    (blocks.min(max_blocks), pdl)
}

/// The smallest block a launch of the push algorithms (one-shot, two-shot, host-staged,
/// staged, islands, ring) takes when it spreads its threads over more blocks, for
/// `world_size` ranks. A small call's one block of 512 threads made one SM issue every line
/// (at 8 ranks and 4 KiB, 512 threads each pushing 7 lines and polling 7); the same threads
/// in more, smaller blocks each get an SM's load and store paths to themselves. One H200,
/// ranks as streams, bf16, 2026-12-02 (bench/results/2026-12-02-h200-s10-spread, call 3),
/// one-shot at 4 KiB: 8 ranks 3.88 us on one block of 512, 3.41 on two of 256, 3.31 on four
/// of 128, 3.16 on eight of 64; 2 ranks 2.16 on one, 1.90 on two or four, 2.03 on eight.
/// So blocks of at least 128 threads up to 4 ranks and of 64 beyond; call 4 of the same run
/// held it at 3 and 4 ranks (one-shot 4 KiB 2.35 -> 2.20 and 2.61 -> 2.44 us; 64 or 256 within
/// 0.05 of 128). 5 to 7 ranks are not measured. Two-shot calls that one block holds keep it
/// from 3 ranks (`min_block_threads_for`).
/// `TPAR_MIN_BLOCK_THREADS` overrides it (a multiple of 32 up to 512; 512 launches whole
/// blocks, as before), for experiments.
pub fn min_block_threads(world_size: usize) -> u32 {
    static SET: Knob = Knob::with("TPAR_MIN_BLOCK_THREADS", |_, v| {
        v.map(|v| (v / 32 * 32).clamp(32, THREADS))
    });
    SET.get().unwrap_or(if world_size <= 4 { 128 } else { 64 })
}

/// The smallest block for a launch of `threads` threads of `algorithm` at `world_size` ranks:
/// whole blocks for the pull algorithms (their kernels split lines by block) and, from 3
/// ranks, for a two-shot call that one block holds; [`min_block_threads`] otherwise. One
/// H200, bf16, ranks as streams (bench/results/2026-12-02-h200-s11, call 1, against 1834fa2
/// in the same call), two-shot at 4 KiB on one block of 512 against spread: 3 ranks 3.41 ->
/// 3.29 us, 4 ranks 3.53 -> 3.37, 8 ranks 4.30 -> 4.20, but 2 ranks 2.99 -> 3.08; from 8 KiB
/// the rule does not apply and nothing moved.
pub(crate) fn min_block_threads_for(algorithm: Algorithm, threads: u32, world_size: usize) -> u32 {
    let one_block_two_shot =
        algorithm == Algorithm::TwoShot && threads <= THREADS && world_size > 2;
    if algorithm.is_pull() || one_block_two_shot {
        THREADS
    } else {
        min_block_threads(world_size)
    }
}

/// How many times the threads that half the grid holds a launch of `algorithm` may need and
/// still run on half the grid with PDL, each thread taking more than one unit (every kernel
/// loops over its units with the grid's stride); above it the launch takes the whole grid
/// without PDL. One H200, bf16, ranks as streams, the same binary at 1, 2 and 4, alternating
/// (bench/results/2026-12-02-h200-s11, call 1), the squeezed sizes against the whole grid:
/// - two-shot faster up to 3 units a thread: 8 ranks 42 / 64 / 96 KiB 6.93 / 6.99 / 7.44 ->
///   6.38 / 6.40 / 7.23 us; 2 ranks 256 KiB 4.51 -> 4.30 (512 KiB, two such launches, 8.97 ->
///   8.53); 4 ranks 128 KiB 5.39 -> 5.26; slower at 4 units (8 ranks 128 KiB 7.45 -> 8.09);
/// - host-staged (2 ranks) faster at 1.5 and 2 units: 192 / 256 KiB 33.8 / 43.6 -> 32.2 /
///   41.1 (no launch of more units was measured: 512 KiB is two launches of 256);
/// - staged (8 ranks) faster up to 2: 42 / 48 KiB 13.0 / 13.5 -> 12.2 / 12.7, 64 KiB even;
///   slower beyond (128 KiB 27.5 -> 30.3);
/// - one-shot slower just above the fit (8 ranks 42 KiB 5.85 -> 6.57, 2 ranks 192 KiB 3.06 ->
///   3.46) and islands slower everywhere (8 ranks 42 KiB 7.62 -> 10.4): they keep 1, as do the
///   ring (whose launches fit) and the pull algorithms (not measured).
///
/// Call 3 of the same run held these defaults against 1834fa2, alternating: two-shot 8 ranks
/// 42 / 64 / 96 KiB 6.92 / 6.97 / 7.43 -> 6.38 / 6.38 / 7.20, 2 ranks 512 KiB 8.91 -> 8.53;
/// host-staged 512 KiB 86.8 -> 82.3; staged 42 KiB 13.0 -> 12.2; nothing else moved by more
/// than noise. Across GPUs (a rank's share is the whole GPU) the squeeze applies only above
/// what half of it holds (264 KiB on an H200): not measured there.
///
/// `TPAR_PDL_SQUEEZE` (1 to 16) sets one factor for every algorithm, for experiments.
pub fn pdl_squeeze(algorithm: Algorithm) -> u32 {
    static SET: Knob = Knob::with("TPAR_PDL_SQUEEZE", |_, v| v.map(|v| v.clamp(1, 16)));
    SET.get().unwrap_or(match algorithm {
        Algorithm::TwoShot => 3,
        Algorithm::HostStaged => 2,
        Algorithm::Staged => 2,
        _ => 1,
    })
}

/// `threads` threads over at most `cap` blocks of at least `min_block_threads` (and at most
/// THREADS) threads, as many blocks as that allows: (blocks, threads per block).
pub fn spread_blocks(threads: u32, cap: u32, min_block_threads: u32) -> (u32, u32) {
    let cap = cap.max(1);
    let block = threads
        .div_ceil(cap)
        .next_multiple_of(32)
        .clamp(min_block_threads.min(THREADS), THREADS);
    (threads.div_ceil(block).clamp(1, cap), block)
}

/// Blocks, threads per block and PDL for a launch of `threads` threads that may spread over
/// smaller blocks (see [`min_block_threads`]). Every block counts as one SM's share of the
/// co-resident blocks whatever its size, so a rank never holds more SMs than
/// [`launch_shape`] lets it. With PDL (where half the blocks hold every thread, as
/// launch_shape) the threads spread over that half; without it the grid is launch_shape's,
/// whole blocks: one H200, 8 ranks, 42 KiB (too large for half the grid), one-shot took 5.97
/// us spread over 16 blocks against 5.82 on 11 whole ones
/// (bench/results/2026-12-02-h200-s10-spread, call 4), and auto runs one-shot there.
/// A launch of up to `squeeze` times what half the grid holds also runs there with PDL, on
/// whole blocks, its threads taking more than one unit each (see [`pdl_squeeze`]).
pub(crate) fn spread_shape(
    threads: u32,
    max_blocks: u32,
    pdl_supported: bool,
    min_block_threads: u32,
    squeeze: u32,
) -> (u32, u32, bool) {
    let half = max_blocks / 2;
    if pdl_supported && half >= 1 && threads <= squeeze.max(1) * half * THREADS {
        let (blocks, block) = spread_blocks(threads.min(half * THREADS), half, min_block_threads);
        return (blocks, block, true);
    }
    let (blocks, pdl) = launch_shape(threads, max_blocks, false);
    (blocks, THREADS, pdl)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_between_islands_travel_through_the_host_inboxes_only_where_asked() {
        let islands = Islands::from_sizes(&[4, 4]).unwrap();
        let device: [u64; MAX_RANKS] = std::array::from_fn(|r| 0x1000 * (r as u64 + 1));
        let host: [u64; MAX_RANKS] = std::array::from_fn(|r| 0x9000_0000 + 0x1000 * r as u64);
        // Device memory everywhere: every line through `inboxes`, read from this rank's own.
        let (send, recv) = inboxes_by_pair(1, &islands, device, None);
        assert_eq!(send, device);
        assert!(recv.iter().all(|&r| r == device[1]));
        // Through host memory between islands: rank 1 (island 0) writes ranks 4..8 through
        // their host inboxes and finds their lines in its own; its island stays on the device.
        let (send, recv) = inboxes_by_pair(1, &islands, device, Some(host));
        for peer in 0..8 {
            let other_island = peer >= 4;
            assert_eq!(
                send[peer],
                if other_island {
                    host[peer]
                } else {
                    device[peer]
                },
                "send {peer}"
            );
            assert_eq!(
                recv[peer],
                if other_island { host[1] } else { device[1] },
                "recv {peer}"
            );
        }
        // Rank 6 (island 1) sees the mirror image.
        let (send, recv) = inboxes_by_pair(6, &islands, device, Some(host));
        assert_eq!((send[2], recv[2]), (host[2], host[6]));
        assert_eq!((send[5], recv[5]), (device[5], device[6]));
    }

    #[test]
    fn the_first_use_probes_stand_at_one_shots_last_launch_with_pdl() {
        // The largest one-shot call whose launch keeps PDL (half of a rank's co-resident
        // blocks), in steps of 1 KiB: where the model's error jumps, so a probe must stand
        // there (dispatch::first_use::SIZES).
        let last_with_pdl = |max_blocks: u32| {
            (1..=4096usize)
                .map(|kib| kib << 10)
                .take_while(|&bytes| {
                    let threads = threads_needed(Algorithm::OneShot, bytes, 8);
                    let squeeze = pdl_squeeze(Algorithm::OneShot);
                    spread_shape(threads, max_blocks, true, min_block_threads(8), squeeze).2
                })
                .last()
                .unwrap() as u64
        };
        // 8 ranks sharing a GPU of 132 SMs (one block of 512 an SM): 16 blocks each; a GPU
        // per rank: the kernels' MAX_BLOCKS.
        for (max_blocks, expected) in [
            (16, 32 << 10),
            (super::super::kernels::MAX_BLOCKS, 128 << 10),
        ] {
            let bytes = last_with_pdl(max_blocks);
            assert_eq!(bytes, expected, "{max_blocks} blocks");
            assert!(
                crate::dispatch::first_use::SIZES.contains(&bytes),
                "no first-use probe at {bytes} bytes"
            );
        }
    }

    #[test]
    fn small_launches_spread_over_smaller_blocks_within_the_same_share_of_sms() {
        let four_k = threads_needed(Algorithm::OneShot, 4096, 8);
        // 8 ranks sharing an H200 (16 co-resident blocks each): 4 KiB on eight blocks of 64
        // with PDL (half of 16), not one of 512.
        assert_eq!(
            spread_shape(four_k, 16, true, min_block_threads(8), 1),
            (8, 64, true)
        );
        // 2 ranks (64 each): four blocks of 128.
        assert_eq!(
            spread_shape(four_k, 64, true, min_block_threads(2), 1),
            (4, 128, true)
        );
        // Blocks of THREADS at the least: launch_shape's grid, whatever the size.
        for bytes in [0, 4096, 32 << 10, 42 << 10, 256 << 10, 8 << 20] {
            let threads = threads_needed(Algorithm::OneShot, bytes, 8);
            for max_blocks in [1, 16, 64] {
                let (blocks, block, pdl) = spread_shape(threads, max_blocks, true, THREADS, 1);
                assert_eq!((blocks, pdl), launch_shape(threads, max_blocks, true));
                assert_eq!(block, THREADS);
            }
        }
        // 42 KiB at 8 ranks does not fit half the grid: no PDL, whole blocks.
        let mid = threads_needed(Algorithm::OneShot, 42 << 10, 8);
        assert_eq!(spread_shape(mid, 16, true, 64, 1), (11, 512, false));
        // Squeezed: half the grid (8 blocks of 512) with PDL, some threads taking two units.
        assert_eq!(spread_shape(mid, 16, true, 64, 2), (8, 512, true));
        assert_eq!(spread_shape(mid * 4, 16, true, 64, 2), (16, 512, false));
        // Without PDL support, whole blocks too.
        assert_eq!(spread_shape(four_k, 16, false, 64, 1), (1, 512, false));
        // Never more blocks than the share, and every thread has a unit to start with.
        for threads in [1, 31, 33, 512, 513, 4096, 5376, 40000, 1 << 20] {
            for max_blocks in [1, 2, 8, 16, 64] {
                for min in [32, 64, 128, 512] {
                    let (blocks, block, pdl) = spread_shape(threads, max_blocks, true, min, 1);
                    let cap = if pdl { max_blocks / 2 } else { max_blocks };
                    assert!(blocks >= 1 && blocks <= cap, "{threads} {max_blocks} {min}");
                    assert!(block % 32 == 0 && block >= min.min(THREADS) && block <= THREADS);
                    assert!(
                        blocks == cap || blocks * block >= threads,
                        "{threads} {max_blocks} {min}"
                    );
                }
            }
        }
    }

    #[test]
    fn two_shot_and_pull_keep_whole_blocks_where_spreading_measured_slower() {
        let at = |algorithm, bytes| {
            let threads = threads_needed(algorithm, bytes, 8);
            min_block_threads_for(algorithm, threads, 8)
        };
        assert_eq!(at(Algorithm::TwoShot, 4096), THREADS);
        let two_ranks = threads_needed(Algorithm::TwoShot, 4096, 2);
        assert_eq!(
            min_block_threads_for(Algorithm::TwoShot, two_ranks, 2),
            min_block_threads(2)
        );
        assert_eq!(at(Algorithm::TwoShot, 8192), min_block_threads(8));
        assert_eq!(at(Algorithm::OneShot, 4096), min_block_threads(8));
        assert_eq!(at(Algorithm::OneShotPull, 4096), THREADS);
        assert_eq!(at(Algorithm::IslandsPull, 1 << 20), THREADS);
    }

    #[test]
    fn only_the_algorithms_measured_faster_squeezed_run_on_half_the_grid() {
        if std::env::var_os("TPAR_PDL_SQUEEZE").is_some() {
            eprintln!("skipped: TPAR_PDL_SQUEEZE is set");
            return;
        }
        // 8 ranks sharing an H200 (16 blocks each), 64 KiB: twice what half the grid holds.
        let threads = threads_needed(Algorithm::TwoShot, 64 << 10, 8);
        let shape = |algorithm| spread_shape(threads, 16, true, 64, pdl_squeeze(algorithm));
        assert_eq!(shape(Algorithm::TwoShot), (8, THREADS, true));
        assert_eq!(shape(Algorithm::Staged), (8, THREADS, true));
        assert_eq!(shape(Algorithm::OneShot), (16, THREADS, false));
        assert_eq!(shape(Algorithm::Islands), (16, THREADS, false));
        // Two-shot at 128 KiB (four units a thread, measured slower): the whole grid.
        let big = threads_needed(Algorithm::TwoShot, 128 << 10, 8);
        assert_eq!(
            spread_shape(big, 16, true, 64, pdl_squeeze(Algorithm::TwoShot)),
            (16, THREADS, false)
        );
    }

    #[test]
    fn a_squeezed_launch_behind_a_full_grid_keeps_its_grid_so_the_next_takes_pdl() {
        // 8 ranks sharing an H200 (16 blocks each), 42 KiB: one-shot takes the full grid
        // without PDL, two-shot squeezes onto half of it with PDL.
        let max_blocks = 16;
        let full = spread_shape(
            threads_needed(Algorithm::OneShot, 42 << 10, 8),
            max_blocks,
            true,
            64,
            1,
        );
        let squeezed = spread_shape(
            threads_needed(Algorithm::TwoShot, 42 << 10, 8),
            max_blocks,
            true,
            64,
            2,
        );
        assert_eq!(
            (full.0, full.2, squeezed.0, squeezed.2),
            (11, false, 8, true)
        );
        let mut last = full.0;
        let mut pdl = Vec::new();
        for _ in 0..3 {
            pdl.push(squeezed.2 && pdl_fits_behind(last, squeezed.0, max_blocks));
            last = squeezed.0;
        }
        assert_eq!(pdl, [false, true, true]);
    }

    #[test]
    fn a_launch_shape_survives_its_packing() {
        assert_eq!(LaunchShape::unpack(0), None);
        let shape = |kernel: KernelId, grid, block, cluster, pdl| {
            let launch = LaunchShape {
                kernel,
                grid,
                block,
                cluster,
                pdl,
            };
            let back =
                LaunchShape::unpack(launch.pack()).expect("a launch packs to a non-zero word");
            assert_eq!(back, launch);
            back
        };
        // Every kernel of the table, so an index off by one shows.
        for kernel in KernelId::ALL {
            shape(kernel, 1, 32, 1, false);
        }
        shape(KernelId::OneShotPush(DType::Bf16), 8, 64, 1, true);
        shape(
            KernelId::FusedOneShotSmallClusters(DType::F16),
            64,
            512,
            2,
            false,
        );
        shape(KernelId::Empty, 16, 128, 16, true);
        shape(KernelId::Ring(DType::F32), u32::MAX, 1024, 8, true);
        let bf16 = KernelId::FusedOneShot(DType::Bf16);
        assert_eq!(shape(bf16, 8, 64, 1, true).to_string(), "8x64 pdl");
        assert_eq!(shape(bf16, 8, 64, 1, false).to_string(), "8x64");
        assert_eq!(shape(bf16, 16, 512, 4, true).to_string(), "16x512 c4 pdl");
        // The JSON names the kernel as the loader does.
        assert_eq!(
            serde_json::to_value(shape(bf16, 16, 512, 4, true)).unwrap()["kernel"],
            "tpar_fused_oneshot_bf16"
        );
    }

    #[test]
    fn pdl_only_where_half_the_grid_gives_every_thread_one_unit() {
        // 4 KiB: 512 units, one block.
        let four_k = threads_needed(Algorithm::OneShot, 4096, 2);
        assert_eq!(four_k, 512);
        assert_eq!(launch_shape(four_k, 32, true), (1, true));
        assert_eq!(threads_needed(Algorithm::TwoShot, 4096, 2), 512);
        // Pull reads words: twice the threads.
        assert_eq!(threads_needed(Algorithm::OneShotPull, 4096, 2), 1024);
        // The ring takes its largest chunk: 8 ranks, 4 KiB: 64 units.
        assert_eq!(threads_needed(Algorithm::Ring, 4096, 8), 64);
        // 32 KiB: 8 blocks, within half of 16.
        assert_eq!(
            launch_shape(threads_needed(Algorithm::OneShot, 32 << 10, 2), 16, true),
            (8, true)
        );
        // 256 KiB: 64 blocks, more than half of 64 co-resident: the full grid without PDL.
        let big = threads_needed(Algorithm::OneShot, 256 << 10, 2);
        assert_eq!(launch_shape(big, 64, true), (64, false));
        assert_eq!(launch_shape(big, 32, true), (32, false));
        assert_eq!(launch_shape(big, 128, true), (64, true));
        // 42 KiB at 8 ranks sharing a GPU (16 co-resident): 11 blocks without PDL, not 8 with.
        let mid = threads_needed(Algorithm::OneShot, 42 << 10, 8);
        assert_eq!(launch_shape(mid, 16, true), (11, false));
        // One co-resident block: no PDL, so no second grid waits beside it.
        assert_eq!(launch_shape(four_k, 1, true), (1, false));
    }

    #[test]
    fn partials_fit_their_slots() {
        let payload_lines = 65536; // a 256 KiB chunk
        let eight = Islands::single(8);
        assert_eq!(
            launch_units(Algorithm::OneShot, DType::Bf16, payload_lines, &eight),
            32768
        );
        // Ring: a chunk's bf16 partials take four lines a unit, and each of the n chunks has a
        // slot of its own: n x 16384 units (f32: n x 32768).
        assert_eq!(
            launch_units(Algorithm::Ring, DType::Bf16, payload_lines, &eight),
            8 * 16384
        );
        assert_eq!(
            launch_units(Algorithm::Ring, DType::F32, payload_lines, &eight),
            8 * 32768
        );
        let two = Islands::single(2);
        assert_eq!(
            launch_units(Algorithm::Ring, DType::Bf16, payload_lines, &two),
            32768
        );
        // Islands with an island of one: that member's range is the whole launch, its
        // partial twice a slot for 16-bit data: half a slot per launch; f32 fits.
        let lonely = Islands::parse("1+7", 8).unwrap();
        assert_eq!(
            launch_units(Algorithm::Islands, DType::Bf16, payload_lines, &lonely),
            16384
        );
        assert_eq!(
            launch_units(Algorithm::Islands, DType::F32, payload_lines, &lonely),
            32768
        );
        let halves = Islands::parse("4+4", 8).unwrap();
        assert_eq!(
            launch_units(Algorithm::Islands, DType::Bf16, payload_lines, &halves),
            32768
        );
        // An odd slot: the ring's largest chunk still fits a slot, as partials (four lines a
        // unit for 16-bit data, two for f32), and so as the all-gather's lines at the same
        // positions.
        for world in 2..=16 {
            // Slots of a chunk of at least Config::MIN_CHUNK_BYTES (16 lines).
            for lines in [16, 18, 22, 65534, 65538] {
                let islands = Islands::single(world);
                for (dtype, lines_a_unit) in [(DType::Bf16, 4), (DType::F32, 2)] {
                    let units = launch_units(Algorithm::Ring, dtype, lines, &islands);
                    assert!(
                        lines_a_unit * units.div_ceil(world) <= lines,
                        "{world} {lines} {dtype:?}: {units}"
                    );
                }
            }
        }
    }
}
