//! The CPU backend: tpar's algorithms over POSIX shared memory between the processes (or
//! threads) of one host, designed for CPUs: plain copies of the data, one flag per transfer in
//! its own cache line (coherent caches make a flag written after the data safe, so there are
//! no per-word tags), and a vectorised reduction in f32 (`reduce`). Every algorithm follows
//! its schedule in [`crate::protocol::schedule`] (push forms write into the peer's segment,
//! pull forms read from it) and sums in the order the schedule defines, so every rank gets the
//! same bits.
//!
//! Each rank owns one segment (layout in [`layout`]) that its peers map. Segments are created
//! 0600 under a name that carries the job token, stamped with a hash of the token, and
//! unlinked as soon as every rank has mapped every segment, so nothing stays in /dev/shm even
//! if a rank is killed later.

mod algorithms;
pub mod layout;
mod reduce;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::algorithm::{Algorithm, MAX_RANKS};
use crate::config::Config;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::islands::{Islands, IslandsExchange};
use crate::memory::MemoryFootprint;
use crate::protocol::header::CallHeader;
use crate::protocol::layout::chunks;
use crate::rendezvous::Rendezvous;
use crate::sys::{liveness, Liveness, SharedSegment};
pub use crate::wait::InterruptCheck;
use crate::wait::{SPIN_ALONE, SPIN_SHARED};
use layout::{CpuLayout, SEGMENT_HEADER_BYTES};

/// The stamp (six words) fits before the first buffer.
const _: () = assert!(SEGMENT_HEADER_BYTES >= 6 * 8);

const SEGMENT_MAGIC: u64 = 0x7470_6172_5f73_686d; // "tpar_shm"
/// 2: the CPU layout of [`layout`] (1 was the GPU's LL lines).
const SEGMENT_VERSION: u64 = 2;

pub use crate::rendezvous::segment_prefix;

/// FNV-1a: stamps a segment with its job without writing the token itself into it.
fn token_hash(token: &str) -> u64 {
    crate::hash::fnv1a(token.bytes())
}

#[derive(Serialize, Deserialize)]
struct SegmentRecord {
    segment: String,
    pid: u32,
    /// `/proc/self/ns/pid` of the rank: equal to this rank's, the pid names the same process.
    pid_namespace: Option<String>,
    slot_bytes: usize,
    /// The island partition this rank was given ([`Islands`]' text form).
    islands: String,
    /// Up to which round the islands' exchange takes its all-units form (TPAR_ISLANDS_EXCHANGE).
    islands_all_units_max_bytes: usize,
}

fn pid_namespace() -> Option<String> {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

/// The islands' exchange on the CPU backend without TPAR_ISLANDS_EXCHANGE: all units for calls
/// of up to 64 KiB. On the 2-core development VM, 2 ranks, that form was faster at 4 KiB in
/// every run and within the runs' spread from 16 KiB to 1 MiB
/// (bench/results/2026-12-02-vm-cpu-islands-forms); a CUDA launch of it carries up to 128 KiB
/// of 16-bit data.
const CPU_ISLANDS_EXCHANGE_MAX_BYTES: usize = 64 << 10;
const CPU_ISLANDS_EXCHANGE: IslandsExchange =
    IslandsExchange::all_units_up_to(CPU_ISLANDS_EXCHANGE_MAX_BYTES);

/// Bytes of /dev/shm each rank's segment takes in a communicator of `world_size` ranks with
/// `config` (for checking a job against the host before it starts).
pub fn segment_bytes(world_size: usize, config: &Config) -> usize {
    CpuLayout::new(world_size, config.cpu_chunk_bytes()).total_bytes()
}

/// The island partition of a CPU communicator: `Config::islands`, else `TPAR_ISLANDS`, else
/// one island. A `TPAR_ISLANDS` that does not describe this group (the variable is the whole
/// process's, and a process may also hold groups of other sizes) leaves one island and the
/// reason, which refuses the islands algorithms on this communicator (and nothing else).
fn resolve_islands(
    config: &Config,
    world_size: usize,
    from_env: Result<Option<Islands>>,
) -> Result<(Islands, Option<String>)> {
    if let Some(given) = config.islands {
        if given.world_size() != world_size {
            return Err(Error::InvalidArgument(format!(
                "islands {given} describe {} ranks, but this group has {world_size}",
                given.world_size()
            )));
        }
        return Ok((given, None));
    }
    Ok(match from_env {
        Ok(found) => (found.unwrap_or_else(|| Islands::single(world_size)), None),
        Err(e) => (Islands::single(world_size), Some(e.to_string())),
    })
}

/// One rank's endpoint of a CPU allreduce group.
pub struct CpuCommunicator {
    rank: usize,
    world_size: usize,
    layout: CpuLayout,
    islands: Islands,
    /// Every rank's segment, indexed by rank; `segments[rank]` is this rank's own.
    segments: Vec<SharedSegment>,
    /// Peers' process ids where this process can see them (same pid namespace).
    peer_pids: Vec<Option<u32>>,
    timeout: Duration,
    /// How long a wait spins before it yields: short when ranks outnumber cores.
    spin: Duration,
    /// Epoch of the last round; the next round uses `epoch + 1`.
    epoch: u64,
    seq: u32,
    /// Set by the first failed call: the ranks' epochs may no longer agree.
    poisoned: Option<String>,
    /// Asked while a wait is slow; true interrupts the call (and poisons the communicator).
    interrupt: Option<std::sync::Arc<InterruptCheck>>,
    /// Private f32 scratch of one slot (the islands' partials).
    scratch: Vec<u8>,
    /// Why the islands algorithms are refused here (a `TPAR_ISLANDS` of another group size).
    islands_refused: Option<String>,
    /// Which rounds of the islands algorithm exchange all units (protocol::schedule).
    islands_exchange: IslandsExchange,
}

impl CpuCommunicator {
    /// The algorithms this backend runs.
    pub const ALGORITHMS: [Algorithm; 8] = [
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::OneShotPull,
        Algorithm::Staged,
        Algorithm::StagedPull,
        Algorithm::Islands,
        Algorithm::IslandsPull,
        Algorithm::Ring,
    ];

    /// Joins the ranks of `rendezvous` in a new communicator. Every rank must call this, in
    /// the same order relative to its other communicators, with the same `config` (chunk size
    /// and islands; the timeout is each rank's own).
    pub fn new(rendezvous: &Rendezvous, config: Config) -> Result<CpuCommunicator> {
        // Taken before anything can fail on one rank alone, so that every rank's count of
        // communicators stays the same after a failed creation.
        let instance = rendezvous.next_instance();
        let chunk_bytes = config.cpu_chunk_bytes();
        if chunk_bytes < Config::MIN_CHUNK_BYTES {
            return Err(Error::InvalidArgument(format!(
                "chunk size {chunk_bytes} B is too small; use at least {} B",
                Config::MIN_CHUNK_BYTES
            )));
        }
        let rank = rendezvous.rank();
        let world_size = rendezvous.world_size();
        if world_size > MAX_RANKS {
            return Err(Error::Unsupported(crate::algorithm::too_many_ranks(
                &format!("world size {world_size}"),
            )));
        }
        let (islands, islands_refused) =
            resolve_islands(&config, world_size, Islands::from_env(world_size))?;
        let layout = CpuLayout::new(world_size, chunk_bytes);
        let islands_exchange = IslandsExchange::from_env()?.unwrap_or(CPU_ISLANDS_EXCHANGE);
        let token_stamp = token_hash(rendezvous.token());

        let name = rendezvous.shm_name(&format!("{instance}-r{rank}"));
        let own = SharedSegment::create(&name, layout.total_bytes())?;
        let stamp = |r: usize| {
            [
                SEGMENT_MAGIC,
                SEGMENT_VERSION,
                token_stamp,
                r as u64,
                world_size as u64,
                layout.slot_bytes as u64,
            ]
        };
        for (i, value) in stamp(rank).into_iter().enumerate() {
            own.word(8 * i)
                .store(value, std::sync::atomic::Ordering::Release);
        }

        let key = format!("cpu-{instance}");
        let my_namespace = pid_namespace();
        rendezvous.publish(
            &format!("{key}-segment"),
            &SegmentRecord {
                segment: name,
                pid: std::process::id(),
                pid_namespace: my_namespace.clone(),
                slot_bytes: layout.slot_bytes,
                islands: islands.to_string(),
                islands_all_units_max_bytes: islands_exchange.all_units_max_bytes(),
            },
        )?;
        let records: Vec<SegmentRecord> =
            rendezvous.gather(&format!("{key}-segment"), config.timeout)?;

        // Settings first, for every peer, before any segment is opened: a rank that finds a
        // disagreement returns and removes its segment, which a peer still opening segments
        // would otherwise report as missing instead of the disagreement.
        for (peer, record) in records.iter().enumerate() {
            if record.slot_bytes != layout.slot_bytes {
                return Err(Error::InvalidArgument(format!(
                    "rank {peer} uses chunks of {} B, this rank (rank {rank}) {} B; every rank must use the same Config::chunk_bytes",
                    record.slot_bytes, layout.slot_bytes
                )));
            }
            if record.islands != islands.to_string() {
                return Err(Error::InvalidArgument(format!(
                    "rank {peer} uses islands {}, this rank (rank {rank}) {islands}; every rank must use the same Config::islands (or {})",
                    record.islands,
                    crate::islands::ENV_ISLANDS
                )));
            }
            if record.islands_all_units_max_bytes != islands_exchange.all_units_max_bytes() {
                return Err(Error::InvalidArgument(format!(
                    "rank {peer} exchanges all units between islands up to {} B, this rank (rank {rank}) up to {} B; every rank must give the same {}",
                    record.islands_all_units_max_bytes,
                    islands_exchange.all_units_max_bytes(),
                    crate::islands::ENV_ISLANDS_EXCHANGE
                )));
            }
        }
        let mut segments = Vec::with_capacity(world_size);
        let mut own = Some(own);
        for (peer, record) in records.iter().enumerate() {
            let segment = if peer == rank {
                own.take().expect("own segment")
            } else {
                SharedSegment::open(&record.segment)?
            };
            let found: Vec<u64> = (0..6)
                .map(|i| {
                    segment
                        .word(8 * i)
                        .load(std::sync::atomic::Ordering::Acquire)
                })
                .collect();
            let expected = stamp(peer);
            if found[..3] != expected[..3] {
                return Err(Error::ForeignJob {
                    what: format!(
                        "shared memory {} presented as rank {peer}'s segment",
                        record.segment
                    ),
                });
            }
            if found != expected || segment.len_bytes() < layout.total_bytes() {
                return Err(Error::InvalidArgument(format!(
                    "rank {peer}'s segment {} does not match this job's layout",
                    record.segment
                )));
            }
            segments.push(segment);
        }
        // Whose process this rank can watch: a peer in the same pid namespace; where the
        // namespace cannot be read, a peer whose pid is alive now. This is decided before the
        // barrier below, while every peer is still waiting in it: after it, a peer may already
        // have returned and exited, and a check then (as before) left it unwatched, so that
        // its exit was reported only at the deadline, as "stuck".
        let peer_pids = records
            .iter()
            .map(|r| {
                let same_namespace = match (&r.pid_namespace, &my_namespace) {
                    (Some(theirs), Some(mine)) => theirs == mine,
                    _ => liveness(r.pid) == Liveness::Alive,
                };
                same_namespace.then_some(r.pid)
            })
            .collect();
        // Everyone has mapped everyone: the names can go, the mappings stay.
        rendezvous.barrier(&format!("{key}-mapped"), config.timeout)?;
        segments[rank].unlink();

        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(CpuCommunicator {
            rank,
            world_size,
            layout,
            islands,
            segments,
            peer_pids,
            timeout: config.timeout,
            spin: if world_size > cores {
                SPIN_SHARED
            } else {
                SPIN_ALONE
            },
            epoch: 0,
            seq: 0,
            poisoned: None,
            interrupt: None,
            scratch: vec![0u8; layout.slot_bytes],
            islands_refused,
            islands_exchange,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Sets the islands' exchange form (every rank the same, before any call), for tests that
    /// run both forms in one process without TPAR_ISLANDS_EXCHANGE.
    #[cfg(test)]
    pub(super) fn set_islands_exchange(&mut self, exchange: IslandsExchange) {
        self.islands_exchange = exchange;
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The island partition the islands algorithms reduce over.
    pub fn islands(&self) -> Islands {
        self.islands
    }

    /// Changes the per-wait deadline (all ranks should use the same).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Memory this communicator holds: its own segment, and its peers' segments mapped.
    pub fn memory_footprint(&self) -> MemoryFootprint {
        let own = self.segments[self.rank].len_bytes() as u64;
        let all: u64 = self.segments.iter().map(|s| s.len_bytes() as u64).sum();
        MemoryFootprint {
            shared_host_bytes: own,
            peer_mapped_bytes: all - own,
            ..MemoryFootprint::default()
        }
    }

    /// `output[i] = sum over ranks of input[i]`, identical on every rank.
    pub fn all_reduce<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        algorithm: Algorithm,
    ) -> Result<()> {
        if input.len() != output.len() {
            return Err(Error::InvalidArgument(format!(
                "input has {} elements but output has {}; they must be equal",
                input.len(),
                output.len()
            )));
        }
        self.all_reduce_bytes(
            T::DTYPE,
            Some(bytemuck::cast_slice(input)),
            bytemuck::cast_slice_mut(output),
            algorithm,
        )
    }

    /// `data[i] = sum over ranks of data[i]`, identical on every rank.
    pub fn all_reduce_in_place<T: Element>(
        &mut self,
        data: &mut [T],
        algorithm: Algorithm,
    ) -> Result<()> {
        self.all_reduce_bytes(T::DTYPE, None, bytemuck::cast_slice_mut(data), algorithm)
    }

    /// The untyped form: `input` (or `output` itself when `None`) holds little-endian elements
    /// of `dtype`. After any error the communicator refuses further calls.
    pub fn all_reduce_bytes(
        &mut self,
        dtype: DType,
        input: Option<&[u8]>,
        output: &mut [u8],
        algorithm: Algorithm,
    ) -> Result<()> {
        if let Some(why) = &self.poisoned {
            return Err(Error::Poisoned(why.clone()));
        }
        if output.len() % dtype.size() != 0 || input.is_some_and(|i| i.len() != output.len()) {
            return Err(Error::InvalidArgument(format!(
                "buffers of {} and {} bytes do not hold the same whole number of {dtype} elements",
                input.map_or(output.len(), <[u8]>::len),
                output.len()
            )));
        }
        if !Self::ALGORITHMS.contains(&algorithm) {
            return Err(Error::Unsupported(format!(
                "the CPU backend runs {}; {algorithm} is a GPU algorithm",
                Self::ALGORITHMS.map(Algorithm::name).join(", ")
            )));
        }
        if let Some(why) = self
            .islands_refused
            .as_ref()
            .filter(|_| matches!(algorithm, Algorithm::Islands | Algorithm::IslandsPull))
        {
            return Err(Error::InvalidArgument(format!(
                "{algorithm} needs this group's islands: {why}; set Config::islands for this group"
            )));
        }
        let result = self.run_call(dtype, input, output, algorithm);
        if let Err(e) = &result {
            self.poisoned = Some(e.to_string());
        }
        result
    }

    fn run_call(
        &mut self,
        dtype: DType,
        input: Option<&[u8]>,
        output: &mut [u8],
        algorithm: Algorithm,
    ) -> Result<()> {
        self.seq = self.seq.wrapping_add(1);
        let count = output.len() / dtype.size();
        let round_elements = self.layout.round_bytes(algorithm, dtype) / dtype.size();
        let all_units = algorithm == Algorithm::Islands
            && self.islands.count() > 1
            && self.islands_exchange.all_units_at(count * dtype.size());
        for (index, elements) in chunks(count, round_elements).enumerate() {
            self.epoch += 1;
            let header = CallHeader {
                seq: self.seq,
                count: count as u64,
                dtype,
                algorithm,
                chunk: index as u32,
            };
            let bytes = elements.start * dtype.size()..elements.end * dtype.size();
            let mut round = algorithms::Round {
                rank: self.rank,
                world_size: self.world_size,
                layout: self.layout,
                islands: &self.islands,
                segments: &mut self.segments,
                watch: crate::wait::Watch {
                    timeout: self.timeout,
                    peer_pids: &self.peer_pids,
                    interrupted: self.interrupt.as_deref(),
                    spin: self.spin,
                },
                epoch: self.epoch,
                header,
                scratch: &mut self.scratch,
                all_units,
            };
            let data = algorithms::Data {
                dtype,
                input: input.map(|i| &i[bytes.clone()]),
                out: &mut output[bytes],
            };
            round.run(data)?;
        }
        Ok(())
    }

    /// A check asked every ~50 ms while a call waits for a peer: when it says true the call
    /// fails with [`Error::Interrupted`] and the communicator is unusable afterwards (the
    /// ranks' epochs no longer agree). The Python package stops on Ctrl-C this way.
    pub fn set_interrupt(&mut self, check: Option<std::sync::Arc<InterruptCheck>>) {
        self.interrupt = check;
    }
}

impl std::fmt::Debug for CpuCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuCommunicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("layout", &self.layout)
            .field("islands", &self.islands)
            .field("epoch", &self.epoch)
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

#[cfg(test)]
mod tests;
