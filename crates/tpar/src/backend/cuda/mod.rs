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

pub mod driver;
pub mod fused;
pub mod kernels;
pub mod link_probe;
pub mod nvrtc;
pub mod span;
pub mod stream_order;

pub use span::{borrowed_stream, DeviceSpan, DeviceSpanMut, Element};

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cudarc::driver::sys::{CUdevice_attribute, CUstream};

/// A CUDA stream handle as the driver API takes it (`cudaStream_t` in the runtime API).
pub type CuStream = CUstream;
use cudarc::driver::{CudaContext, CudaStream};
use serde::{Deserialize, Serialize};

use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::memory::MemoryFootprint;
use crate::protocol::header::CallHeader;
use crate::protocol::layout::{chunks, InboxLayout, BUFFERS};
use crate::protocol::line::lines_for_bytes;
use crate::rendezvous::{from_hex, to_hex, Rendezvous};
use crate::sys::SharedSegment;
use driver::{DeviceMemory, Function, IpcMapping, MappedHostMemory, Module, RegisteredSegment};
use kernels::{KernelArgs, FLAG_STRIDE_BYTES, MAX_BLOCKS, MAX_RANKS, THREADS};
use span::Operands;

/// Settings every rank of a CUDA communicator must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaConfig {
    /// Longest a kernel waits for a peer before it reports a timeout and exits.
    pub timeout: Duration,
    /// Payload bytes of one chunk (one kernel launch); larger calls launch several.
    pub chunk_bytes: usize,
    /// Also build pinned host-memory inboxes for the host-staged algorithm.
    pub host_staged: bool,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            timeout: Duration::from_secs(30),
            chunk_bytes: 256 << 10,
            host_staged: true,
        }
    }
}

/// Whether the CUDA backend can run here: `Ok(device count)` or an error saying why not
/// (no driver, no GPU, no NVRTC), never a panic.
pub fn probe() -> Result<usize> {
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

/// The kernels loaded into one device's primary context.
struct KernelSet {
    _modules: Vec<Module>,
    functions: HashMap<String, Function>,
    /// Blocks of `THREADS` threads of the most demanding kernel that fit on one SM.
    blocks_per_sm: u32,
    sm_count: u32,
    /// Drop in free device memory measured around loading the modules (code, constants,
    /// local-memory reservation): what the kernels cost this GPU's context, once per process.
    module_bytes: u64,
    /// Launch with programmatic dependent launch ([`driver::pdl_supported`]).
    pdl: bool,
}

/// An exclusive lock (flock) on a per-GPU file in the temporary directory, held while tpar
/// loads its kernels and allocates its buffers on that GPU, so that ranks of several
/// processes sharing a GPU do not allocate inside each other's measured windows. None when
/// the file cannot be opened or locked (then measurements may include a neighbour's bytes).
fn allocation_lock(device_uuid: &str) -> Option<std::fs::File> {
    let name: String = device_uuid
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let path = std::env::temp_dir().join(format!("tpar-gpu-{name}.lock"));
    let file = std::os::unix::fs::OpenOptionsExt::mode(
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true),
        0o600,
    )
    .open(path)
    .ok()?;
    crate::sys::lock_exclusive(&file).ok()?;
    Some(file)
}

/// Free device memory of the current context's GPU, or None where the driver cannot say.
fn free_device_memory(ctx: &Arc<CudaContext>) -> Option<u64> {
    ctx.bind_to_thread().ok()?;
    cudarc::driver::result::mem_get_info()
        .ok()
        .map(|(free, _)| free as u64)
}

/// Runs `work` and returns what it returned with the drop in `ctx`'s GPU's free memory around
/// it (0 where the driver cannot say): how tpar measures what loading kernels and NCCL take.
pub(crate) fn free_memory_taken_by<T>(
    ctx: &Arc<CudaContext>,
    work: impl FnOnce() -> T,
) -> (T, u64) {
    let before = free_device_memory(ctx);
    let value = work();
    let taken = match (before, free_device_memory(ctx)) {
        (Some(before), Some(after)) => before.saturating_sub(after),
        _ => 0,
    };
    (value, taken)
}

impl KernelSet {
    fn get(&self, name: &str) -> Function {
        self.functions[name]
    }
}

fn kernel_set(ctx: &Arc<CudaContext>) -> Result<Arc<KernelSet>> {
    static LOADED: OnceLock<Mutex<HashMap<usize, Arc<KernelSet>>>> = OnceLock::new();
    let mut loaded = LOADED
        .get_or_init(Default::default)
        .lock()
        .expect("kernel cache lock");
    if let Some(set) = loaded.get(&ctx.ordinal()) {
        return Ok(set.clone());
    }
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| Error::Cuda(format!("cannot read the compute capability: {e}")))?;
    if major < 8 {
        return Err(Error::Unsupported(format!(
            "GPU {} has compute capability {major}.{minor}; tpar's kernels need 8.0 (Ampere) or newer",
            ctx.ordinal()
        )));
    }
    let arch = (major * 10 + minor) as u32;
    // Compiled (or read from the disk cache) before measuring: only the load takes GPU memory.
    let cubins = kernels::SOURCES
        .iter()
        .map(|(file, source)| {
            nvrtc::cached_cubin(
                file,
                source,
                &[(kernels::HEADER_NAME, kernels::HEADER_SOURCE)],
                arch,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    // The window holds the function lookups too. On one H200 (2026-12-01) it measured 2.0 MiB
    // with them inside and 0 with the module loads alone: with lazy module loading, the
    // driver's default, a kernel's code likely reaches the GPU when its function is fetched.
    let (loaded_modules, module_bytes) = free_memory_taken_by(ctx, || -> Result<_> {
        let mut modules = Vec::new();
        let mut functions = HashMap::new();
        let mut blocks_per_sm = u32::MAX;
        for ((_, source), cubin) in kernels::SOURCES.iter().zip(cubins) {
            let module = Module::load(ctx, &cubin)?;
            for name in kernel_names(source) {
                let f = module.function(&name)?;
                if name != kernels::EMPTY_KERNEL.1 && !name.starts_with(kernels::PROBE_PREFIX) {
                    blocks_per_sm = blocks_per_sm.min(f.max_blocks_per_sm(THREADS)?);
                }
                functions.insert(name, f);
            }
            modules.push(module);
        }
        Ok((modules, functions, blocks_per_sm))
    });
    let (modules, functions, blocks_per_sm) = loaded_modules?;
    let sm_count = driver::attribute(
        ctx,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )? as u32;
    let set = Arc::new(KernelSet {
        _modules: modules,
        functions,
        blocks_per_sm,
        sm_count,
        module_bytes,
        pdl: driver::pdl_supported(ctx),
    });
    loaded.insert(ctx.ordinal(), set.clone());
    Ok(set)
}

/// How every kernel in the `.cu` files begins its line (the loader finds them by it).
const KERNEL_DECLARATION: &str = "extern \"C\" __global__";

/// The `extern "C" __global__` function names in a source file: on each such line, the first
/// word after the return type and any `__launch_bounds__(...)`, up to its parameter list
/// (whatever the argument struct is called).
fn kernel_names(source: &str) -> Vec<String> {
    source
        .lines()
        .filter_map(|l| l.strip_prefix(KERNEL_DECLARATION))
        .filter_map(|rest| {
            rest.split_whitespace()
                .filter(|word| *word != "void" && !word.starts_with("__launch_bounds__"))
                .map(|word| word.split('(').next().unwrap_or(word).to_owned())
                .next()
        })
        .collect()
}

/// The ranks whose (process id, GPU UUID) shows them on `rank`'s GPU in another process.
fn other_processes_on_my_gpu(rank: usize, ranks: &[(u32, &str)]) -> Vec<usize> {
    let (pid, gpu) = ranks[rank];
    (0..ranks.len())
        .filter(|&r| ranks[r].1 == gpu && ranks[r].0 != pid)
        .collect()
}

/// Blocks per rank such that every spinning block of every rank on the busiest GPU is
/// resident at once (`capacity` = SMs x blocks per SM on each GPU).
fn co_resident_blocks(capacity_and_sharers: impl IntoIterator<Item = (u32, u32)>) -> Result<u32> {
    let mut blocks = MAX_BLOCKS;
    for (capacity, sharers) in capacity_and_sharers {
        let fit = capacity / sharers.max(1);
        if fit == 0 {
            return Err(Error::Unsupported(format!(
                "{sharers} ranks share a GPU that holds only {capacity} resident blocks of tpar's kernels; use fewer ranks per GPU"
            )));
        }
        blocks = blocks.min(fit);
    }
    // TPAR_MAX_BLOCKS lowers the cap, for tuning experiments.
    let cap = std::env::var("TPAR_MAX_BLOCKS")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|v| *v >= 1)
        .unwrap_or(MAX_BLOCKS);
    Ok(blocks.min(cap).min(MAX_BLOCKS))
}

/// This rank's own allocations.
struct Owned {
    /// LL inbox, then the pull region (data buffers and block flags).
    inbox: DeviceMemory,
    /// [epoch of the last chunk, blocks done].
    state: DeviceMemory,
    error: MappedHostMemory,
    host_inbox: Option<RegisteredSegment>,
}

/// The device state (epoch, blocks done) and the host-mapped error word of one rank.
const STATE_BYTES: usize = 16;
const ERROR_WORD_BYTES: usize = 4096;

fn device_inbox_bytes(layout: &InboxLayout) -> usize {
    layout.total_bytes()
        + BUFFERS * layout.payload_lines * 4
        + MAX_BLOCKS as usize * FLAG_STRIDE_BYTES
}

impl Owned {
    fn allocate(
        ctx: &Arc<CudaContext>,
        layout: &InboxLayout,
        host_segment: Option<String>,
    ) -> Result<Owned> {
        let host_inbox = match host_segment {
            Some(name) => Some(RegisteredSegment::register(
                ctx,
                SharedSegment::create(&name, layout.total_bytes())?,
            )?),
            None => None,
        };
        Ok(Owned {
            inbox: DeviceMemory::zeroed(ctx, device_inbox_bytes(layout))?,
            state: DeviceMemory::zeroed(ctx, STATE_BYTES)?,
            error: MappedHostMemory::zeroed(ctx, ERROR_WORD_BYTES)?,
            host_inbox,
        })
    }
}

#[derive(Serialize, Deserialize)]
struct CudaRecord {
    pid: u32,
    device_uuid: String,
    /// SMs x resident blocks per SM of tpar's kernels on this rank's GPU.
    capacity: u32,
    payload_lines: usize,
    inbox_ptr: u64,
    inbox_ipc: String,
    host_segment: Option<String>,
}

/// What `cuMemAlloc` takes from free device memory for an allocation: whole 2 MiB pages.
/// Counted this way the footprint matches the drop in free memory; counted by the bytes asked
/// for it fell 2.2 MiB short at one rank and 5.5 MiB at two (one H200, 2026-12-01:
/// `scripts/gpu-check.sh engine-comm`, a 3.8 MiB inbox and a 16-byte state word took 4 + 2 MiB).
/// For the small state word this is an upper bound (the driver may share its page).
const DEVICE_PAGE_BYTES: usize = 2 << 20;

/// What loading tpar's kernels took from free device memory, once per process and GPU (one
/// H200, every kernel file, 2026-12-01: 2.0 MiB in each footprint check of
/// `scripts/gpu-check.sh engine-comm`): the planned figure before anything is loaded.
pub const PLANNED_MODULE_BYTES: u64 = 2 << 20;

fn reserved_device_bytes(bytes: usize) -> u64 {
    bytes.max(1).next_multiple_of(DEVICE_PAGE_BYTES) as u64
}

/// One rank's endpoint of a CUDA allreduce group.
pub struct CudaCommunicator {
    rank: usize,
    world_size: usize,
    ctx: Arc<CudaContext>,
    kernels: Arc<KernelSet>,
    layout: InboxLayout,
    max_blocks: u32,
    timeout: Duration,
    own: Owned,
    /// Every rank's device inbox as this rank addresses it (own included).
    device_inboxes: [u64; MAX_RANKS],
    /// Every rank's host-staged inbox as this rank's GPU addresses it.
    host_inboxes: Option<[u64; MAX_RANKS]>,
    /// Device memory algorithms need every peer's device memory reachable (P2P or same GPU).
    peer_access: std::result::Result<(), String>,
    peer_device_mappings: Vec<IpcMapping>,
    peer_host_mappings: Vec<RegisteredSegment>,
    /// Ranks of other processes on this rank's GPU: without MPS the driver time-slices
    /// their contexts, so every call waits for each one's turn (milliseconds, not microseconds).
    time_sliced_with: Vec<usize>,
    /// The group's GPUs in rank order (UUIDs, or ordinals for a group of one process) and
    /// the settings that shape its buffers: what an init self-test result depends on.
    group_key: String,
    status: Mutex<Status>,
    /// Blocks of this rank's last kernel launch (see [`CudaCommunicator::launch_behind_last`]).
    last_grid: std::sync::atomic::AtomicU32,
}

#[derive(Default)]
struct Status {
    poisoned: Option<String>,
    last_call: Option<CallHeader>,
}

fn context(device: usize) -> Result<Arc<CudaContext>> {
    probe()?;
    CudaContext::new(device).map_err(|e| Error::Cuda(format!("cannot open GPU {device}: {e}")))
}

fn check_world(world_size: usize) -> Result<()> {
    if world_size == 0 || world_size > MAX_RANKS {
        return Err(Error::Unsupported(format!(
            "world size {world_size}: the CUDA backend supports 1 to {MAX_RANKS} ranks"
        )));
    }
    Ok(())
}

impl CudaCommunicator {
    /// All `devices.len()` ranks of a group in this process (rank r on GPU `devices[r]`),
    /// sharing buffers by pointer. Several ranks may share a GPU.
    pub fn new_local_group(devices: &[usize], config: CudaConfig) -> Result<Vec<CudaCommunicator>> {
        let world_size = devices.len();
        check_world(world_size)?;
        let layout = InboxLayout::new(world_size, config.chunk_bytes);
        let token = crate::rendezvous::random_token()?;
        let contexts: Vec<Arc<CudaContext>> =
            devices.iter().map(|d| context(*d)).collect::<Result<_>>()?;
        let sets: Vec<Arc<KernelSet>> = contexts.iter().map(kernel_set).collect::<Result<_>>()?;

        let mut sharers: HashMap<usize, u32> = HashMap::new();
        for d in devices {
            *sharers.entry(*d).or_default() += 1;
        }
        let max_blocks = co_resident_blocks(
            devices
                .iter()
                .zip(&sets)
                .map(|(d, s)| (s.sm_count * s.blocks_per_sm, sharers[d])),
        )?;
        let peer_access = enable_peer_access(&contexts);

        let mut owned = Vec::with_capacity(world_size);
        for (rank, ctx) in contexts.iter().enumerate() {
            let host = config.host_staged.then(|| {
                format!(
                    "/{}local-r{rank}",
                    crate::backend::cpu::segment_prefix(&token)
                )
            });
            let mut mine = Owned::allocate(ctx, &layout, host)?;
            if let Some(h) = mine.host_inbox.as_mut() {
                h.segment_mut().unlink(); // this process holds the only mapping it needs
            }
            owned.push(mine);
        }
        let mut device_inboxes = [0u64; MAX_RANKS];
        let mut host_inboxes = [0u64; MAX_RANKS];
        for (rank, o) in owned.iter().enumerate() {
            device_inboxes[rank] = o.inbox.ptr();
            host_inboxes[rank] = o
                .host_inbox
                .as_ref()
                .map_or(0, RegisteredSegment::device_ptr);
        }
        Ok(owned
            .into_iter()
            .enumerate()
            .map(|(rank, own)| CudaCommunicator {
                rank,
                world_size,
                ctx: contexts[rank].clone(),
                kernels: sets[rank].clone(),
                layout,
                max_blocks,
                timeout: config.timeout,
                own,
                device_inboxes,
                host_inboxes: config.host_staged.then_some(host_inboxes),
                peer_access: peer_access.clone(),
                peer_device_mappings: Vec::new(),
                peer_host_mappings: Vec::new(),
                time_sliced_with: Vec::new(),
                group_key: format!("local {devices:?} {config:?}"),
                status: Mutex::default(),
                last_grid: std::sync::atomic::AtomicU32::new(0),
            })
            .collect())
    }

    /// This process's rank of the job behind `rendezvous`, on GPU `device`; peers in other
    /// processes are reached through CUDA IPC (device memory) and shared memory (host-staged).
    pub fn new(
        rendezvous: &Rendezvous,
        device: usize,
        config: CudaConfig,
    ) -> Result<CudaCommunicator> {
        // Taken before anything can fail on one rank alone, so that every rank's count of
        // communicators stays the same after a failed creation.
        let instance = rendezvous.next_instance();
        let rank = rendezvous.rank();
        let world_size = rendezvous.world_size();
        check_world(world_size)?;
        let layout = InboxLayout::new(world_size, config.chunk_bytes);
        let ctx = context(device)?;
        // Ranks of other processes on this GPU load and allocate one at a time, so that the
        // free-memory drop measured around the module load is this process's alone.
        let gpu_lock = allocation_lock(&driver::device_uuid(&ctx)?);
        let set = kernel_set(&ctx)?;
        let host = config
            .host_staged
            .then(|| rendezvous.shm_name(&format!("cuda-{instance}-r{rank}")));
        let mut own = Owned::allocate(&ctx, &layout, host.clone())?;
        drop(gpu_lock);
        let key = format!("cuda-{instance}");
        rendezvous.publish(
            &format!("{key}-buffers"),
            &CudaRecord {
                pid: std::process::id(),
                device_uuid: driver::device_uuid(&ctx)?,
                capacity: set.sm_count * set.blocks_per_sm,
                payload_lines: layout.payload_lines,
                inbox_ptr: own.inbox.ptr(),
                inbox_ipc: to_hex(&own.inbox.ipc_handle()?),
                host_segment: host,
            },
        )?;
        let records: Vec<CudaRecord> =
            rendezvous.gather(&format!("{key}-buffers"), config.timeout)?;
        let mut sharers: HashMap<&str, u32> = HashMap::new();
        for r in &records {
            *sharers.entry(r.device_uuid.as_str()).or_default() += 1;
            if r.payload_lines != layout.payload_lines
                || r.host_segment.is_some() != config.host_staged
            {
                return Err(Error::InvalidArgument(
                    "ranks were created with different CudaConfig (chunk size or host-staged); every rank must pass the same".into(),
                ));
            }
        }
        let max_blocks = co_resident_blocks(
            records
                .iter()
                .map(|r| (r.capacity, sharers[r.device_uuid.as_str()])),
        )?;

        let mut device_inboxes = [0u64; MAX_RANKS];
        let mut host_inboxes = [0u64; MAX_RANKS];
        let mut peer_device_mappings = Vec::new();
        let mut peer_host_mappings = Vec::new();
        // GPUs without peer access cannot map each other's memory: then only host-staged (and
        // NCCL) can run, which every rank must know alike (see the exchange below).
        let mut peer_access: std::result::Result<(), String> = Ok(());
        for (peer, record) in records.iter().enumerate() {
            device_inboxes[peer] = if peer == rank || record.pid == std::process::id() {
                record.inbox_ptr
            } else {
                let handle = from_hex::<64>(&record.inbox_ipc).ok_or_else(|| {
                    Error::InvalidArgument(format!("rank {peer} sent a malformed IPC handle"))
                })?;
                match IpcMapping::open(&ctx, &handle) {
                    Ok(mapping) => {
                        let ptr = mapping.ptr();
                        peer_device_mappings.push(mapping);
                        ptr
                    }
                    Err(e) => {
                        if peer_access.is_ok() {
                            peer_access = Err(format!("rank {rank} cannot map rank {peer}'s device memory through CUDA IPC ({e}): no peer access between their GPUs; host-staged runs without it"));
                        }
                        0
                    }
                }
            };
            host_inboxes[peer] = match (&record.host_segment, peer == rank) {
                (_, true) => own
                    .host_inbox
                    .as_ref()
                    .map_or(0, RegisteredSegment::device_ptr),
                (Some(name), false) => {
                    let registered = RegisteredSegment::register(&ctx, SharedSegment::open(name)?)?;
                    let ptr = registered.device_ptr();
                    peer_host_mappings.push(registered);
                    ptr
                }
                (None, false) => 0,
            };
        }
        // Also the barrier after which the segments may be unlinked.
        rendezvous.publish(&format!("{key}-mapped"), &peer_access.as_ref().err())?;
        let everyone: Vec<Option<String>> =
            rendezvous.gather(&format!("{key}-mapped"), config.timeout)?;
        if let Some(why) = everyone.into_iter().flatten().next() {
            peer_access = Err(why);
        }
        if let Some(h) = own.host_inbox.as_mut() {
            h.segment_mut().unlink();
        }
        Ok(CudaCommunicator {
            rank,
            world_size,
            ctx,
            kernels: set,
            layout,
            max_blocks,
            timeout: config.timeout,
            own,
            device_inboxes,
            host_inboxes: config.host_staged.then_some(host_inboxes),
            peer_access,
            peer_device_mappings,
            peer_host_mappings,
            group_key: format!(
                "{:?} {config:?}",
                records
                    .iter()
                    .map(|r| r.device_uuid.as_str())
                    .collect::<Vec<_>>()
            ),
            time_sliced_with: other_processes_on_my_gpu(
                rank,
                &records
                    .iter()
                    .map(|r| (r.pid, r.device_uuid.as_str()))
                    .collect::<Vec<_>>(),
            ),
            status: Mutex::default(),
            last_grid: std::sync::atomic::AtomicU32::new(0),
        })
    }

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
                Err("host-staged inboxes were not built (CudaConfig::host_staged is off)".into())
            }
            Algorithm::HostStaged => Ok(()),
            _ => self.peer_access.clone(),
        }
    }

    /// What a rank of a `world_size` group with `config` will allocate, before creating it
    /// (so that an engine can subtract it from its KV-cache budget first).
    pub fn planned_footprint(world_size: usize, config: &CudaConfig) -> MemoryFootprint {
        let layout = InboxLayout::new(world_size, config.chunk_bytes);
        let host = if config.host_staged {
            layout.total_bytes() as u64
        } else {
            0
        };
        let buffers =
            reserved_device_bytes(device_inbox_bytes(&layout)) + reserved_device_bytes(STATE_BYTES);
        MemoryFootprint {
            device_bytes: buffers + PLANNED_MODULE_BYTES,
            pinned_host_bytes: ERROR_WORD_BYTES as u64,
            shared_host_bytes: host,
            peer_mapped_bytes: 0,
            device_buffer_bytes: buffers,
            module_bytes: PLANNED_MODULE_BYTES,
            ..MemoryFootprint::default()
        }
    }

    /// Every byte this rank allocated, by kind.
    pub fn memory_footprint(&self) -> MemoryFootprint {
        let host_inbox = self
            .own
            .host_inbox
            .as_ref()
            .map_or(0, |h| h.segment().len_bytes() as u64);
        let buffers = reserved_device_bytes(self.own.inbox.bytes())
            + reserved_device_bytes(self.own.state.bytes());
        MemoryFootprint {
            device_bytes: buffers + self.kernels.module_bytes,
            device_buffer_bytes: buffers,
            module_bytes: self.kernels.module_bytes,
            nccl_bytes: 0,
            nccl_estimated: false,
            pinned_host_bytes: self.own.error.bytes() as u64,
            shared_host_bytes: host_inbox,
            peer_mapped_bytes: self.peer_device_mappings.len() as u64
                * device_inbox_bytes(&self.layout) as u64
                + self
                    .peer_host_mappings
                    .iter()
                    .map(|h| h.segment().len_bytes() as u64)
                    .sum::<u64>(),
        }
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
        let error = self.decode_error(word, status.last_call);
        status.poisoned = Some(error.to_string());
        Err(error)
    }

    fn decode_error(&self, word: u64, last_call: Option<CallHeader>) -> Error {
        let code = word & 0xff;
        let peer = ((word >> 8) & 0xff) as usize;
        let phase = kernels::phase_name((word >> 16) & 0xff);
        let field = (word >> 24) & 0xff;
        let detail = (word >> 32) as u32;
        match code {
            kernels::ERR_TIMEOUT => Error::PeerTimeout {
                peer,
                phase: format!("{phase}, in a kernel"),
                waited: self.timeout,
            },
            kernels::ERR_MISMATCH => Error::CallMismatch {
                seq: last_call.map_or(0, |c| c.seq),
                rank: self.rank,
                mine: last_call.map_or_else(|| "another call".to_owned(), |c| c.describe()),
                peer,
                theirs: match field {
                    2 => format!("{detail} elements (low 32 bits of its count)"),
                    4 => format!(
                        "dtype {} with algorithm {}{}",
                        DType::from_code(detail as u8).map_or("?", DType::name),
                        Algorithm::from_code((detail >> 8) as u8).map_or("?", Algorithm::name),
                        fused::header_note(detail)
                    ),
                    5 => format!("chunk {detail}"),
                    _ => format!("header word {field} = {detail:#x}"),
                },
            },
            _ => Error::Cuda(format!(
                "the kernel reported an unknown error word {word:#x}"
            )),
        }
    }

    /// Waits for `stream`, then reports any error the kernels left.
    pub fn synchronize(&self, stream: &cudarc::driver::CudaStream) -> Result<()> {
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
        // The spans live to the end of this function: cudarc's buffers record the call's work
        // on their events when they are dropped, after it was queued.
        self.enqueue(&operands, algorithm, stream)
    }

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
                span::borrowed_stream(&self.ctx, stream),
                Operands::from_raw(dtype, input.unwrap_or(output), output, count),
            )
        };
        self.enqueue(&operands, algorithm, &stream)
    }

    /// Queues the allreduce of checked `operands` on `algorithm`.
    pub(crate) fn enqueue(
        &self,
        operands: &Operands,
        algorithm: Algorithm,
        stream: &CudaStream,
    ) -> Result<()> {
        self.check()?;
        self.supports(algorithm)
            .map_err(|why| Error::Unsupported(format!("{algorithm} on this group: {why}")))?;
        driver::bind(&self.ctx)?;
        let dtype = operands.dtype();
        let count = operands.count();
        let function = self.kernels.get(&kernels::kernel_for(algorithm, dtype).1);
        let header = self.next_call(count as u64, dtype, algorithm);
        if self.world_size == 1 {
            // One rank: the sum is the input. In place there is nothing to do; otherwise a
            // copy (a memcpy node in a captured graph) is all the work there is.
            if !operands.in_place() && count > 0 {
                driver::copy_operands_async(&self.ctx, operands, stream)?;
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
    pub fn launch_empty(&self, stream: &cudarc::driver::CudaStream) -> Result<()> {
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
        let f = self.kernels.get(kernels::EMPTY_KERNEL.1);
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
fn launch_shape(
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

/// Enables peer access between every pair of distinct GPUs in `contexts`; the error says
/// which pair cannot (then only host-staged can run).
fn enable_peer_access(contexts: &[Arc<CudaContext>]) -> std::result::Result<(), String> {
    use cudarc::driver::sys;
    for a in contexts {
        for b in contexts {
            if a.ordinal() == b.ordinal() {
                continue;
            }
            let mut can = 0;
            // SAFETY: queries two valid devices.
            let rc = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) };
            if rc != sys::CUresult::CUDA_SUCCESS || can == 0 {
                return Err(format!(
                    "GPU {} cannot access GPU {} (no P2P); use host-staged",
                    a.ordinal(),
                    b.ordinal()
                ));
            }
            driver::bind(a).map_err(|e| e.to_string())?;
            // SAFETY: enables access from a's context to b's.
            let rc = unsafe { sys::cuCtxEnablePeerAccess(b.cu_ctx(), 0) };
            if rc != sys::CUresult::CUDA_SUCCESS
                && rc != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            {
                return Err(format!(
                    "enabling P2P from GPU {} to GPU {} failed: {rc:?}",
                    a.ordinal(),
                    b.ordinal()
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_planned_footprint_grows_with_the_world_size() {
        let config = CudaConfig::default();
        let two = CudaCommunicator::planned_footprint(2, &config);
        let eight = CudaCommunicator::planned_footprint(8, &config);
        assert!(eight.device_bytes > two.device_bytes);
        // 3 buffers x (8 slots + gather) x 64K lines x 8 B, plus headers and the pull region.
        assert!(eight.device_bytes > 3 * 9 * (256 << 10) * 2);
        let off = CudaCommunicator::planned_footprint(
            8,
            &CudaConfig {
                host_staged: false,
                ..config
            },
        );
        assert_eq!(off.shared_host_bytes, 0);
    }

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

    #[test]
    fn co_residency_divides_the_gpu_among_its_ranks() {
        // 132 SMs x 2 blocks, 8 ranks on it: 33 each; 2 ranks: 132, capped at 64.
        assert_eq!(co_resident_blocks([(264, 8)]).unwrap(), 33);
        assert_eq!(co_resident_blocks([(264, 2)]).unwrap(), MAX_BLOCKS);
        assert_eq!(co_resident_blocks([(264, 8), (40, 4)]).unwrap(), 10);
        assert!(co_resident_blocks([(4, 8)]).is_err());
    }

    #[test]
    fn ranks_of_other_processes_on_the_same_gpu_are_found() {
        let ranks = [(10, "gpu-a"), (11, "gpu-a"), (12, "gpu-b"), (10, "gpu-a")];
        assert_eq!(other_processes_on_my_gpu(0, &ranks), vec![1]);
        assert_eq!(other_processes_on_my_gpu(1, &ranks), vec![0, 3]);
        assert!(other_processes_on_my_gpu(2, &ranks).is_empty());
    }

    #[test]
    fn kernel_names_are_found_in_sources() {
        let names = kernel_names(kernels::SOURCES[0].1);
        assert!(
            names.contains(&"tpar_oneshot_push_bf16".to_owned()),
            "{names:?}"
        );
        assert_eq!(names.len(), 3);
    }

    #[test]
    fn every_kernel_file_yields_plain_function_names() {
        // Each file's names must be C identifiers that the module lookup can find: a parse
        // that returned a brace or a fragment of a parameter list failed every load on a GPU.
        let mut all = Vec::new();
        for (file, source) in kernels::SOURCES {
            let declared = source
                .lines()
                .filter(|l| l.starts_with(KERNEL_DECLARATION))
                .count();
            let names = kernel_names(source);
            assert_eq!(names.len(), declared, "{file}: {names:?}");
            for name in &names {
                assert!(
                    name.starts_with("tpar_")
                        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                    "{file}: {name:?}"
                );
            }
            all.extend(names);
        }
        assert!(all.contains(&"tpar_probe_copy".to_owned()), "{all:?}");
        assert!(all.contains(&"tpar_probe_pingpong".to_owned()), "{all:?}");
        assert!(all.contains(&kernels::EMPTY_KERNEL.1.to_owned()), "{all:?}");
    }

    #[test]
    fn probe_explains_instead_of_panicking() {
        // On a machine without a driver this must be an error with a reason, not a panic.
        match probe() {
            Ok(n) => assert!(n > 0),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
}
