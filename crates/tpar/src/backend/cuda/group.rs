//! How a CUDA group is built, once for both kinds of group: every rank opens its GPU, loads
//! the kernels and allocates its buffers (a [`Member`]), publishes a record of them (within one
//! process by hand, across processes through the rendezvous), and joins: peers' inboxes
//! addressed or mapped (CUDA IPC, shared-memory segments), the co-residency bound of the
//! busiest GPU, peer access. Also what a group allocates, planned and measured.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use serde::{Deserialize, Serialize};

use super::check_available;
use super::communicator::{CudaCommunicator, Owned};
use super::driver::{self, DeviceMemory, IpcMapping, MappedHostMemory, RegisteredSegment};
use super::kernels::{
    IslandTables, FLAG_STRIDE_BYTES, MAX_BLOCKS, MAX_RANKS, PULL_PHASES, STATE_BYTES,
};
use super::knobs::Knob;
use super::loader::{kernel_set, KernelSet};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::islands::{Islands, IslandsExchange};
use crate::memory::MemoryFootprint;
use crate::protocol::layout::{InboxLayout, BUFFERS};
use crate::protocol::schedule::UNIT_BYTES;
use crate::rendezvous::{from_hex, to_hex, Rendezvous};
use crate::sys::SharedSegment;

pub(crate) fn context(device: usize) -> Result<Arc<CudaContext>> {
    check_available()?;
    CudaContext::new(device).map_err(|e| Error::Cuda(format!("cannot open GPU {device}: {e}")))
}

fn check_world(world_size: usize, config: &Config) -> Result<()> {
    if world_size == 0 || world_size > MAX_RANKS {
        return Err(Error::Unsupported(format!(
            "world size {world_size}: the CUDA backend supports 1 to {MAX_RANKS} ranks"
        )));
    }
    let chunk = config.cuda_chunk_bytes();
    if !(Config::MIN_CHUNK_BYTES..=Config::MAX_CHUNK_BYTES).contains(&chunk) {
        return Err(Error::InvalidArgument(format!(
            "chunk_bytes {chunk}: the CUDA backend takes {} bytes to 1 GiB (the default is {} KiB)",
            Config::MIN_CHUNK_BYTES,
            Config::CUDA_CHUNK_BYTES >> 10
        )));
    }
    Ok(())
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

/// The ranks whose (process id, GPU UUID) shows them on `rank`'s GPU in another process.
fn other_processes_on_my_gpu(rank: usize, ranks: &[(u32, &str)]) -> Vec<usize> {
    let (pid, gpu) = ranks[rank];
    (0..ranks.len())
        .filter(|&r| ranks[r].1 == gpu && ranks[r].0 != pid)
        .collect()
}

/// Refuses a rendezvous group in which two ranks are threads of one process on one GPU. They
/// share one CUDA context, where allocating, zeroing, uploading and freeing synchronise the
/// whole context: a rank doing so waits for its peer's kernel, which spins waiting for that
/// rank (on one H200, 2026-12-01, two Python threads timed out in the init self-test after the
/// deadline, and a buffer freed under the peer's kernel faulted the context). Every rank sees
/// the same records, so every rank refuses alike.
fn refuse_threads_sharing_a_gpu(ranks: &[(u32, &str)]) -> Result<()> {
    for (a, &(pid, gpu)) in ranks.iter().enumerate() {
        if let Some(b) = (a + 1..ranks.len()).find(|&b| ranks[b] == (pid, gpu)) {
            return Err(Error::Unsupported(format!(
                "ranks {a} and {b} are threads of one process (pid {pid}) on one GPU: they would share a CUDA context, whose synchronising calls deadlock against a peer's waiting kernel; run one process per rank (torchrun, multiprocessing), give each thread its own GPU, or, in Rust, build the ranks of one process with CudaCommunicator::new_local_group"
            )));
        }
    }
    Ok(())
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
    static CAP: Knob = Knob::with("TPAR_MAX_BLOCKS", |_, v| v.filter(|v| *v >= 1));
    let cap = CAP.get().unwrap_or(MAX_BLOCKS);
    Ok(blocks.min(cap).min(MAX_BLOCKS))
}

/// The host-mapped error word of one rank.
const ERROR_WORD_BYTES: usize = 4096;

/// The inbox layout of a CUDA group: slots of whole 16-byte LL lines (the chunk rounded up to
/// [`UNIT_BYTES`]), so that every line of every slot is 16-byte aligned.
pub(crate) fn cuda_layout(world_size: usize, config: &Config) -> InboxLayout {
    InboxLayout::new(
        world_size,
        config.cuda_chunk_bytes().next_multiple_of(UNIT_BYTES),
    )
}

/// The LL inbox, then the pull algorithms' region: a plain buffer per epoch and a flag per
/// buffer, phase and block (layout.cuh).
fn device_inbox_bytes(layout: &InboxLayout) -> usize {
    layout.total_bytes()
        + BUFFERS * layout.payload_lines * 4
        + BUFFERS * PULL_PHASES * MAX_BLOCKS as usize * FLAG_STRIDE_BYTES
}

/// The variable that says how the islands' exchange travels: `auto` (the default: through
/// peer access where the islands have it, else through the host-staged inboxes), `host`
/// (always through the host: what a machine without P2P between its islands does, to check
/// on one that has it) or `p2p`.
pub const ENV_ISLANDS_CROSS: &str = "TPAR_ISLANDS_CROSS";

/// How the islands' exchange should travel, as [`ENV_ISLANDS_CROSS`] says: `Some(true)`
/// through the host, `Some(false)` over peer access, `None` whichever the machine allows.
fn islands_cross_setting() -> Result<Option<bool>> {
    match std::env::var(ENV_ISLANDS_CROSS)
        .ok()
        .as_deref()
        .map(str::trim)
    {
        None | Some("") | Some("auto") => Ok(None),
        Some("host") => Ok(Some(true)),
        Some("p2p") => Ok(Some(false)),
        Some(other) => Err(Error::InvalidArgument(format!(
            "{ENV_ISLANDS_CROSS}={other}: expected auto, host or p2p"
        ))),
    }
}

/// The islands a group of `world_size` ranks was given: [`Config::islands`], else
/// `TPAR_ISLANDS`; `None`: the machine decides ([`machine_islands`]).
fn given_islands(world_size: usize, config: &Config) -> Result<Option<Islands>> {
    let islands = match config.islands {
        Some(islands) => Some(islands),
        None => Islands::from_env(world_size)?,
    };
    if let Some(islands) = islands.filter(|i| i.world_size() != world_size) {
        return Err(Error::InvalidArgument(format!(
            "the islands {islands} describe {} ranks, the group has {world_size}",
            islands.world_size()
        )));
    }
    Ok(islands)
}

/// This machine as NVML and sysfs describe it, read once per process (a machine's GPUs and
/// PCIe tree do not change under a running process); `None` where it cannot be read.
fn this_machine() -> Option<&'static crate::topology::Topology> {
    static MACHINE: std::sync::OnceLock<Option<crate::topology::Topology>> =
        std::sync::OnceLock::new();
    MACHINE
        .get_or_init(|| crate::topology::Topology::detect().ok())
        .as_ref()
}

/// The islands of the ranks whose records these are, from where their GPUs sit in this
/// machine's PCIe tree (switches, root complexes, sockets, P2P: `Topology::islands_for_gpus`);
/// one island where the machine cannot be read or a GPU is not found in it. Every rank reads
/// the same machine and the same records, so every rank finds the same islands.
fn machine_islands(records: &[CudaRecord]) -> Islands {
    let n = records.len();
    let normalised = |uuid: &str| {
        uuid.trim_start_matches("GPU-")
            .replace('-', "")
            .to_ascii_lowercase()
    };
    this_machine()
        .and_then(|machine| {
            let gpu_of_rank: Option<Vec<usize>> = records
                .iter()
                .map(|r| {
                    machine
                        .gpus
                        .iter()
                        .position(|g| normalised(&g.uuid) == r.device_uuid)
                })
                .collect();
            machine.islands_for_gpus(&gpu_of_rank?)
        })
        .unwrap_or_else(|| Islands::single(n))
}

/// How the islands algorithms' exchange between islands travels (`Ok(true)`: through the
/// host-staged inboxes), or why they cannot run: they need peer access between the members of
/// each island; between islands they use it where every pair has it and `forced` does not say
/// otherwise, else the host-staged inboxes.
fn islands_path(
    islands: &Islands,
    unreachable: impl Fn(usize, usize) -> bool,
    host_inboxes: bool,
    forced: Option<bool>,
) -> std::result::Result<bool, String> {
    let n = islands.world_size();
    let pairs = || (0..n).flat_map(|a| (a + 1..n).map(move |b| (a, b)));
    if let Some((a, b)) =
        pairs().find(|&(a, b)| islands.island_of(a) == islands.island_of(b) && unreachable(a, b))
    {
        return Err(format!(
            "ranks {a} and {b} share island {} of {islands} but have no peer access to each other's memory",
            islands.island_of(a)
        ));
    }
    let across_reachable = pairs().all(|(a, b)| !unreachable(a, b));
    let host = match forced {
        Some(host) => host,
        None => !across_reachable,
    };
    if host && !host_inboxes {
        return Err(
            "the exchange between islands needs the host-staged inboxes (Config::host_staged is off)"
                .into(),
        );
    }
    if !host && !across_reachable {
        return Err(format!(
            "{ENV_ISLANDS_CROSS}=p2p, but some islands of {islands} have no peer access between them"
        ));
    }
    Ok(host)
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

#[derive(Clone, Serialize, Deserialize)]
struct CudaRecord {
    pid: u32,
    device_uuid: String,
    /// SMs x resident blocks per SM of tpar's kernels on this rank's GPU.
    capacity: u32,
    payload_lines: usize,
    inbox_ptr: u64,
    /// The IPC handle of the inbox, for peers in other processes (None within one process).
    inbox_ipc: Option<String>,
    host_segment: Option<String>,
    /// The host-staged inbox as GPUs address it: valid in this process only.
    host_inbox_ptr: u64,
    /// The islands this rank was given (or "the machine's") and how it would send between them
    /// ([`ENV_ISLANDS_CROSS`]): every rank must agree.
    islands: String,
    islands_cross: Option<bool>,
}

/// What `cuMemAlloc` takes from free device memory for an allocation: whole 2 MiB pages.
/// Counted this way the footprint matches the drop in free memory; counted by the bytes asked
/// for it fell 2.2 MiB short at one rank and 5.5 MiB at two (one H200, 2026-12-01:
/// `scripts/gpu-check.sh engine-comm`, a 3.8 MiB inbox and a 16-byte state word took 4 + 2 MiB;
/// the state has grown to 64 KiB since, still one page). For the small state this is an upper
/// bound (the driver may share its page).
const DEVICE_PAGE_BYTES: usize = 2 << 20;

/// What loading tpar's kernels takes from free device memory, once per process and GPU, by
/// architecture (compute capability x 10, every one of `kernels::ARCHITECTURES`): the kernel
/// files' CUBINs (NVRTC 13.0) in whole 2 MiB pages. One H100 (sm_90), every kernel file of
/// cd689f2, 2026-12-06: loading took 6.0 MiB in four of the five footprint checks of
/// `scripts/gpu-check.sh engines` and 4.0 MiB in the fifth, where torch's NCCL was created
/// first (bench/results/2026-12-06-s16 call 3, footprint.txt), for 4.6 MiB of CUBINs; the
/// other architectures are planned from their CUBINs the same way, not measured. With the fused
/// one-shot's cluster forms (2026-12-07) the CUBINs are 6.0 MiB on sm_90 and 10.7 and 10.9 MiB on
/// sm_100 and sm_120, not yet measured loaded. The test that compiles every kernel for every
/// architecture (kernels.rs) fails where an entry is not its CUBINs'
/// `reserved_device_bytes`, so the plan follows the kernels.
pub const PLANNED_MODULE_BYTES_BY_ARCH: [(u32, u64); 6] = [
    (80, 6 << 20),
    (86, 6 << 20),
    (89, 6 << 20),
    (90, 6 << 20),
    (100, 12 << 20),
    (120, 12 << 20),
];

/// The kernels' planned bytes where the GPU is not known yet (`planned_footprint`: `tpar plan
/// memory`, `tpar doctor`, an engine before it creates a communicator): the largest entry of
/// [`PLANNED_MODULE_BYTES_BY_ARCH`], so that a plan is never below what loading takes.
pub const PLANNED_MODULE_BYTES: u64 = {
    let mut largest = 0;
    let mut i = 0;
    while i < PLANNED_MODULE_BYTES_BY_ARCH.len() {
        if PLANNED_MODULE_BYTES_BY_ARCH[i].1 > largest {
            largest = PLANNED_MODULE_BYTES_BY_ARCH[i].1;
        }
        i += 1;
    }
    largest
};

/// The architecture (compute capability x 10) of `capability` ("9.0", as the topology and
/// NVML write it: one digit after the point), where it is one of
/// [`PLANNED_MODULE_BYTES_BY_ARCH`]'s.
pub fn planned_architecture(capability: &str) -> Option<u32> {
    let (major, minor) = capability.trim().split_once('.')?;
    if minor.len() != 1 {
        return None;
    }
    let arch = major.parse::<u32>().ok()? * 10 + minor.parse::<u32>().ok()?;
    PLANNED_MODULE_BYTES_BY_ARCH
        .iter()
        .any(|(a, _)| *a == arch)
        .then_some(arch)
}

/// The kernels' planned bytes on GPUs of compute capability `capability` ("9.0"): its entry of
/// [`PLANNED_MODULE_BYTES_BY_ARCH`], or [`PLANNED_MODULE_BYTES`] where it is not known or not an
/// architecture tpar builds for ([`planned_architecture`]).
pub fn planned_module_bytes(capability: Option<&str>) -> u64 {
    let arch = capability.and_then(planned_architecture);
    PLANNED_MODULE_BYTES_BY_ARCH
        .iter()
        .find(|(a, _)| Some(*a) == arch)
        .map_or(PLANNED_MODULE_BYTES, |(_, bytes)| *bytes)
}

/// `bytes` as the driver takes them from free device memory: in whole [`DEVICE_PAGE_BYTES`]
/// pages.
pub(super) fn reserved_device_bytes(bytes: usize) -> u64 {
    bytes.max(1).next_multiple_of(DEVICE_PAGE_BYTES) as u64
}

/// One rank's part of a group before it meets its peers: its GPU, kernels and buffers.
struct Member {
    ctx: Arc<CudaContext>,
    kernels: Arc<KernelSet>,
    own: Owned,
}

impl Member {
    /// Opens GPU `device`, loads the kernels and allocates the rank's buffers (host-staged
    /// inbox in the shared-memory segment `host_segment`, if any).
    fn create(device: usize, layout: &InboxLayout, host_segment: Option<String>) -> Result<Member> {
        let ctx = context(device)?;
        // Ranks of other processes on this GPU load and allocate one at a time, so that the
        // free-memory drop measured around the module load is this process's alone.
        let gpu_lock = allocation_lock(&driver::device_uuid(&ctx)?);
        let kernels = kernel_set(&ctx)?;
        let own = Owned::allocate(&ctx, layout, host_segment)?;
        drop(gpu_lock);
        Ok(Member { ctx, kernels, own })
    }

    /// What peers need to know of this rank; `ipc`: peers in other processes will map it.
    fn record(&self, layout: &InboxLayout, ipc: bool, config: &Config) -> Result<CudaRecord> {
        let host = self.own.host_inbox.as_ref();
        Ok(CudaRecord {
            islands: given_islands(layout.world_size, config)?
                .map_or_else(|| "the machine's".to_owned(), |i| i.to_string()),
            islands_cross: islands_cross_setting()?,
            pid: std::process::id(),
            device_uuid: driver::device_uuid(&self.ctx)?,
            capacity: self.kernels.sm_count * self.kernels.blocks_per_sm,
            payload_lines: layout.payload_lines,
            inbox_ptr: self.own.inbox.ptr(),
            inbox_ipc: if ipc {
                Some(to_hex(&self.own.inbox.ipc_handle()?))
            } else {
                None
            },
            host_segment: host.map(|h| h.segment().name().to_owned()),
            host_inbox_ptr: host.map_or(0, RegisteredSegment::device_ptr),
        })
    }

    /// Rank `rank` of the group whose ranks sent `records` (in rank order, this one's
    /// included): peers' inboxes addressed (directly within this process, else mapped from
    /// their IPC handle and shared-memory segment), the launch bound that keeps every rank on
    /// a shared GPU resident, and the GPUs shared with other processes. Device memory that
    /// cannot be mapped leaves `peer_access` saying why (then only host-staged runs).
    fn join(
        self,
        rank: usize,
        records: &[CudaRecord],
        config: &Config,
        group_key: String,
    ) -> Result<CudaCommunicator> {
        let Member { ctx, kernels, own } = self;
        let layout = cuda_layout(records.len(), config);
        let islands = match given_islands(records.len(), config)? {
            Some(islands) => islands,
            None => machine_islands(records),
        };
        if let Some((peer, r)) = records.iter().enumerate().find(|(_, r)| {
            (&r.islands, r.islands_cross) != (&records[rank].islands, records[rank].islands_cross)
        }) {
            return Err(Error::InvalidArgument(format!(
                "rank {peer} was given the islands {} ({ENV_ISLANDS_CROSS} {:?}), rank {rank} {} ({:?}); every rank must give the same (Config::islands, TPAR_ISLANDS, {ENV_ISLANDS_CROSS})",
                r.islands, r.islands_cross, records[rank].islands, records[rank].islands_cross
            )));
        }
        let mut sharers: HashMap<&str, u32> = HashMap::new();
        for r in records {
            *sharers.entry(r.device_uuid.as_str()).or_default() += 1;
            if r.payload_lines != layout.payload_lines
                || r.host_segment.is_some() != config.host_staged
            {
                return Err(Error::InvalidArgument(
                    "ranks were created with different Config (chunk_bytes or host_staged); every rank must pass the same".into(),
                ));
            }
        }
        let max_blocks = co_resident_blocks(
            records
                .iter()
                .map(|r| (r.capacity, sharers[r.device_uuid.as_str()])),
        )?;
        let pid = std::process::id();
        let mut device_inboxes = [0u64; MAX_RANKS];
        let mut host_inboxes = [0u64; MAX_RANKS];
        let mut peer_device_mappings = Vec::new();
        let mut peer_host_mappings = Vec::new();
        let mut peer_access: std::result::Result<(), String> = Ok(());
        let mut unreachable = Vec::new();
        for (peer, record) in records.iter().enumerate() {
            let in_process = peer == rank || record.pid == pid;
            device_inboxes[peer] = match (&record.inbox_ipc, in_process) {
                (_, true) => record.inbox_ptr,
                (None, false) => {
                    return Err(Error::InvalidArgument(format!(
                        "rank {peer} is in another process but sent no IPC handle"
                    )))
                }
                (Some(hex), false) => {
                    let handle = from_hex::<64>(hex).ok_or_else(|| {
                        Error::InvalidArgument(format!("rank {peer} sent a malformed IPC handle"))
                    })?;
                    match IpcMapping::open(&ctx, &handle) {
                        Ok(mapping) => {
                            let ptr = mapping.ptr();
                            peer_device_mappings.push(mapping);
                            ptr
                        }
                        Err(e) => {
                            unreachable.push(peer);
                            if peer_access.is_ok() {
                                peer_access = Err(format!("rank {rank} cannot map rank {peer}'s device memory through CUDA IPC ({e}): no peer access between their GPUs; host-staged runs without it"));
                            }
                            0
                        }
                    }
                }
            };
            // A local group's segments are registered portable by this process and live as
            // long as the group: every GPU addresses them alike. A rank of a rendezvous group
            // maps each peer's segment itself, so that it outlives that peer's communicator.
            let direct = peer == rank || record.inbox_ipc.is_none();
            host_inboxes[peer] = match (&record.host_segment, direct) {
                (_, true) => record.host_inbox_ptr,
                (Some(name), false) => {
                    let registered = RegisteredSegment::register(&ctx, SharedSegment::open(name)?)?;
                    let ptr = registered.device_ptr();
                    peer_host_mappings.push(registered);
                    ptr
                }
                (None, false) => 0,
            };
        }
        let exchange = IslandsExchange::from_env()?;
        Ok(CudaCommunicator {
            rank,
            world_size: records.len(),
            ctx,
            kernels,
            layout,
            max_blocks,
            timeout: config.timeout,
            own,
            device_inboxes,
            host_inboxes: config.host_staged.then_some(host_inboxes),
            islands_exchange: exchange.unwrap_or(IslandsExchange::UNMODELLED),
            islands_exchange_set: exchange.is_some(),
            islands_path: islands_path(
                &islands,
                |a, b| {
                    (a == rank && unreachable.contains(&b))
                        || (b == rank && unreachable.contains(&a))
                },
                config.host_staged,
                records[rank].islands_cross,
            ),
            island_tables: IslandTables::from(&islands),
            islands,
            unreachable_peers: unreachable,
            peer_access,
            peer_device_mappings,
            peer_host_mappings,
            time_sliced_with: other_processes_on_my_gpu(
                rank,
                &records
                    .iter()
                    .map(|r| (r.pid, r.device_uuid.as_str()))
                    .collect::<Vec<_>>(),
            ),
            group_key,
            status: Mutex::default(),
            last_launch: std::sync::atomic::AtomicU64::new(0),
        })
    }
}

/// The group's GPUs in rank order and its settings: groups with the same key run the same
/// kernels over the same links (`prefix` tells the transports apart). The chunk is the one in
/// use, so a default and the same size given explicitly make one key.
fn group_key(prefix: &str, records: &[CudaRecord], config: &Config) -> String {
    let gpus: Vec<&str> = records.iter().map(|r| r.device_uuid.as_str()).collect();
    let settings = Config {
        chunk_bytes: Some(config.cuda_chunk_bytes()),
        ..*config
    };
    format!("{prefix}{gpus:?} {settings:?}")
}

impl CudaCommunicator {
    /// All `devices.len()` ranks of a group in this process (rank r on GPU `devices[r]`),
    /// sharing buffers by pointer. Several ranks may share a GPU.
    pub fn new_local_group(devices: &[usize], config: Config) -> Result<Vec<CudaCommunicator>> {
        let world_size = devices.len();
        check_world(world_size, &config)?;
        let layout = cuda_layout(world_size, &config);
        let token = crate::rendezvous::random_token()?;
        let mut members = Vec::with_capacity(world_size);
        for (rank, device) in devices.iter().enumerate() {
            let host = config.host_staged.then(|| {
                format!(
                    "/{}local-r{rank}",
                    crate::backend::cpu::segment_prefix(&token)
                )
            });
            let mut member = Member::create(*device, &layout, host)?;
            members.push(member.record(&layout, false, &config).map(|record| {
                if let Some(h) = member.own.host_inbox.as_mut() {
                    h.segment_mut().unlink(); // this process holds the only mapping it needs
                }
                (member, record)
            })?);
        }
        let contexts: Vec<Arc<CudaContext>> = members.iter().map(|(m, _)| m.ctx.clone()).collect();
        let peer_access = enable_peer_access(&contexts);
        let unreachable = |a: usize, b: usize| {
            contexts[a].ordinal() != contexts[b].ordinal()
                && !driver::can_access_peer(&contexts[a], &contexts[b]).unwrap_or(false)
        };
        let records: Vec<CudaRecord> = members.iter().map(|(_, r)| r.clone()).collect();
        let key = group_key("local ", &records, &config);
        members
            .into_iter()
            .enumerate()
            .map(|(rank, (member, _))| {
                let mut comm = member.join(rank, &records, &config, key.clone())?;
                comm.peer_access = peer_access.clone();
                comm.islands_path = islands_path(
                    &comm.islands,
                    unreachable,
                    config.host_staged,
                    records[rank].islands_cross,
                );
                Ok(comm)
            })
            .collect()
    }

    /// This process's rank of the job behind `rendezvous`, on GPU `device`; peers in other
    /// processes are reached through CUDA IPC (device memory) and shared memory (host-staged).
    pub fn new(rendezvous: &Rendezvous, device: usize, config: Config) -> Result<CudaCommunicator> {
        // Taken before anything can fail on one rank alone, so that every rank's count of
        // communicators stays the same after a failed creation.
        let instance = rendezvous.next_instance();
        let rank = rendezvous.rank();
        check_world(rendezvous.world_size(), &config)?;
        let layout = cuda_layout(rendezvous.world_size(), &config);
        let host = config
            .host_staged
            .then(|| rendezvous.shm_name(&format!("cuda-{instance}-r{rank}")));
        let member = Member::create(device, &layout, host)?;
        let key = format!("cuda-{instance}");
        rendezvous.publish(
            &format!("{key}-buffers"),
            &member.record(&layout, true, &config)?,
        )?;
        let records: Vec<CudaRecord> =
            rendezvous.gather(&format!("{key}-buffers"), config.timeout)?;
        refuse_threads_sharing_a_gpu(
            &records
                .iter()
                .map(|r| (r.pid, r.device_uuid.as_str()))
                .collect::<Vec<_>>(),
        )?;
        let mut comm = member.join(rank, &records, &config, group_key("", &records, &config))?;
        // GPUs without peer access cannot map each other's memory: then only host-staged (and
        // NCCL) can run, which every rank must know alike. Also the barrier after which the
        // segments may be unlinked.
        // Each rank also says which peers' memory it could not map, so that every rank
        // decides the islands' path from the same pairs.
        let unreachable_here: Vec<usize> = comm.unreachable_peers.clone();
        rendezvous.publish(
            &format!("{key}-mapped"),
            &(comm.peer_access.as_ref().err(), &unreachable_here),
        )?;
        let everyone: Vec<(Option<String>, Vec<usize>)> =
            rendezvous.gather(&format!("{key}-mapped"), config.timeout)?;
        if let Some(why) = everyone.iter().find_map(|(why, _)| why.clone()) {
            comm.peer_access = Err(why);
        }
        comm.islands_path = islands_path(
            &comm.islands,
            |a, b| everyone[a].1.contains(&b) || everyone[b].1.contains(&a),
            config.host_staged,
            records[rank].islands_cross,
        );
        if let Some(h) = comm.own.host_inbox.as_mut() {
            h.segment_mut().unlink();
        }
        Ok(comm)
    }

    /// What a rank of a `world_size` group with `config` will allocate, before creating it
    /// (so that an engine can subtract it from its KV-cache budget first), on a GPU not known
    /// yet (the kernels at [`PLANNED_MODULE_BYTES`]).
    pub fn planned_footprint(world_size: usize, config: &Config) -> MemoryFootprint {
        Self::planned_footprint_on(world_size, config, None)
    }

    /// [`CudaCommunicator::planned_footprint`] on GPUs of compute capability `capability`
    /// ("9.0"; None: not known), whose kernels take [`planned_module_bytes`].
    pub fn planned_footprint_on(
        world_size: usize,
        config: &Config,
        capability: Option<&str>,
    ) -> MemoryFootprint {
        let module_bytes = planned_module_bytes(capability);
        let layout = cuda_layout(world_size, config);
        let host = if config.host_staged {
            layout.total_bytes() as u64
        } else {
            0
        };
        let buffers =
            reserved_device_bytes(device_inbox_bytes(&layout)) + reserved_device_bytes(STATE_BYTES);
        MemoryFootprint {
            device_bytes: buffers + module_bytes,
            pinned_host_bytes: ERROR_WORD_BYTES as u64,
            shared_host_bytes: host,
            peer_mapped_bytes: 0,
            device_buffer_bytes: buffers,
            module_bytes,
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
}

/// Enables peer access between every pair of distinct GPUs in `contexts`; the error says
/// which pair cannot (then only host-staged can run).
pub(crate) fn enable_peer_access(contexts: &[Arc<CudaContext>]) -> std::result::Result<(), String> {
    for a in contexts {
        for b in contexts {
            if a.ordinal() == b.ordinal() {
                continue;
            }
            if !driver::can_access_peer(a, b).unwrap_or(false) {
                return Err(format!(
                    "GPU {} cannot access GPU {} (no P2P); use host-staged",
                    a.ordinal(),
                    b.ordinal()
                ));
            }
            driver::enable_peer_access(a, b).map_err(|e| {
                format!(
                    "enabling P2P from GPU {} to GPU {} failed: {e}",
                    a.ordinal(),
                    b.ordinal()
                )
            })?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_whose_launch_units_would_not_fit_32_bits_is_refused_with_the_range() {
        let with_chunk = |bytes| Config {
            chunk_bytes: Some(bytes),
            ..Config::default()
        };
        assert!(check_world(8, &Config::default()).is_ok());
        assert!(check_world(8, &with_chunk(Config::MAX_CHUNK_BYTES)).is_ok());
        for bytes in [Config::MAX_CHUNK_BYTES + 1, 8 << 30, 16] {
            let e = check_world(8, &with_chunk(bytes)).unwrap_err().to_string();
            assert!(
                e.contains(&format!("chunk_bytes {bytes}")) && e.contains("1 GiB"),
                "{e}"
            );
        }
        assert!(check_world(MAX_RANKS + 1, &Config::default()).is_err());
    }

    #[test]
    fn threads_of_one_process_on_one_gpu_are_refused_and_every_other_placement_is_not() {
        // Processes sharing a GPU, and threads on different GPUs, have contexts of their own.
        assert!(refuse_threads_sharing_a_gpu(&[(1, "GPU-a"), (2, "GPU-a"), (1, "GPU-b")]).is_ok());
        let err = refuse_threads_sharing_a_gpu(&[(1, "GPU-a"), (2, "GPU-a"), (2, "GPU-a")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("ranks 1 and 2 are threads of one process (pid 2) on one GPU"),
            "{err}"
        );
        assert!(err.contains("one process per rank"), "{err}");
    }

    #[test]
    fn the_planned_footprint_grows_with_the_world_size() {
        let config = Config::default();
        let two = CudaCommunicator::planned_footprint(2, &config);
        let eight = CudaCommunicator::planned_footprint(8, &config);
        assert!(eight.device_bytes > two.device_bytes);
        // 3 buffers x (8 slots + gather) x 64K lines x 8 B, plus headers and the pull region.
        assert!(eight.device_bytes > 3 * 9 * (256 << 10) * 2);
        let off = CudaCommunicator::planned_footprint(
            8,
            &Config {
                host_staged: false,
                ..config
            },
        );
        assert_eq!(off.shared_host_bytes, 0);
    }

    #[test]
    fn the_planned_kernels_follow_the_gpus_architecture() {
        assert_eq!(planned_module_bytes(Some("9.0")), 6 << 20);
        assert_eq!(planned_module_bytes(Some("12.0")), 12 << 20);
        assert_eq!(planned_module_bytes(Some(" 8.9 ")), 6 << 20);
        // Not known, not parsed, or not an architecture tpar builds for: the largest.
        for capability in [None, Some("7.5"), Some("nine"), Some("9"), Some("")] {
            assert_eq!(planned_module_bytes(capability), PLANNED_MODULE_BYTES);
        }
        assert_eq!(PLANNED_MODULE_BYTES, 12 << 20);
        let config = Config::default();
        let h100 = CudaCommunicator::planned_footprint_on(8, &config, Some("9.0"));
        let unknown = CudaCommunicator::planned_footprint(8, &config);
        assert_eq!(h100.module_bytes, 6 << 20);
        assert_eq!(unknown.device_bytes - h100.device_bytes, 6 << 20);
        assert_eq!(unknown.device_buffer_bytes, h100.device_buffer_bytes);
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
}
