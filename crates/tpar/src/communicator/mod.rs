//! One allreduce call for every message: the dispatcher picks tpar's algorithm or NCCL for
//! each call (forced by `TPAR_ALGO`, else the tuning table measured on this machine, else the
//! built-in rules) and the call goes there. This is what an engine holds per rank.
//!
//! One path per call: check the operands, decide once (the dispatcher's [`Decided`] for the
//! call's size, dtype, selection and capture state, cached: refusals too, typed), enqueue.
//! Whether a choice can run is the dispatcher's question alone: this group's facts (its
//! backend's kernels, host-staged inboxes, measured peer access, the state of its NCCL) are
//! inputs of every request ([`GroupFacts`]); the backend asserts them at launch.

pub mod first_use;
mod fused;
pub use fused::FusedRun;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaStream;

use crate::algorithm::Algorithm;
use crate::backend::cuda::kernels::{self, KernelId};
use crate::backend::cuda::link_measurement::LinkMeasurements;
use crate::backend::cuda::span::Operands;
use crate::backend::cuda::stream_order::{Capture, StreamOrder};
use crate::backend::cuda::{CudaCommunicator, DeviceSpan, DeviceSpanMut};
pub use crate::backend::nccl::BorrowedNccl;
use crate::backend::nccl::{Nccl, NcclCommunicator};
use crate::config::Config;
use crate::dispatch::{
    decide, eligibility, Choice, Decision, Findings, GroupFacts, NcclAvailability, NoDecision,
    Request, TuningTable,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::memory::MemoryFootprint;
use crate::rendezvous::Rendezvous;
use crate::topology::Topology;

pub use crate::algorithm::{Selection, ENV_ALGO};

/// `TPAR_INIT_SELFTEST=0` skips the numerical self-test of [`Communicator::join`].
pub const ENV_INIT_SELFTEST: &str = "TPAR_INIT_SELFTEST";

/// The choice `TPAR_ALGO` (given as `value`) forces, if any; an unknown name is an error, not
/// ignored. A shorthand of [`Selection::parse_from`] for callers that read the variable
/// themselves.
pub fn forced_choice(value: Option<&str>) -> Result<Option<Choice>> {
    Selection::parse_from(ENV_ALGO, value).map(Selection::forced)
}

/// Which NCCL communicator serves the calls the dispatcher gives to NCCL (large messages,
/// anything tpar's kernels do not cover).
///
/// Defaults: the Rust [`Communicator::join`] (the `tpar` tool, benchmarks) uses [`NcclMode::Own`];
/// the Python package, which engines call, defaults to [`NcclMode::None`], because an engine
/// already holds NCCL communicators for its groups and a second one costs about 0.5 GiB per
/// GPU per group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NcclMode {
    /// tpar creates its own NCCL communicator, lazily at the first call planned for NCCL
    /// (logged; every rank reaches it at the same call), and counts it in the footprint.
    Own,
    /// tpar's kernels only: a call the dispatcher would give to NCCL is refused with an error,
    /// and [`Communicator::decision`] says so beforehand.
    None,
    /// An existing `ncclComm_t` of the same ranks (see [`NcclCommunicator::borrow`]): the
    /// fallback costs no memory. tpar never destroys it.
    Borrowed(BorrowedNccl),
}

impl std::str::FromStr for NcclMode {
    type Err = Error;

    /// `own` or `none` (a borrowed communicator is given as a handle, not a name).
    fn from_str(s: &str) -> Result<NcclMode> {
        match s {
            "own" => Ok(NcclMode::Own),
            "none" => Ok(NcclMode::None),
            other => Err(Error::InvalidArgument(format!(
                "nccl={other:?}: use \"own\" (tpar creates its own NCCL communicator when a call needs it), \"none\" (tpar's kernels only) or an existing NCCL communicator to borrow"
            ))),
        }
    }
}

/// Where this communicator's NCCL stands (what the dispatcher sees of it:
/// [`NcclSlot::availability`]).
enum NcclSlot {
    /// Created (own or borrowed): in `Communicator::nccl_ready`.
    Ready,
    /// `own`: created at the first call planned for NCCL, through this rendezvous.
    Lazy {
        rendezvous: Rendezvous,
        instance: String,
        timeout: std::time::Duration,
    },
    /// `none`: refused by the user's choice.
    Refused,
    /// Cannot exist here (no library, ranks sharing a GPU): never planned.
    Unavailable(String),
}

impl NcclSlot {
    fn availability(&self) -> NcclAvailability {
        match self {
            NcclSlot::Ready => NcclAvailability::Ready,
            NcclSlot::Lazy { .. } => NcclAvailability::AtFirstCall,
            NcclSlot::Refused => NcclAvailability::NotHeld,
            NcclSlot::Unavailable(why) => NcclAvailability::Unavailable(why.clone()),
        }
    }
}

/// The sentence asking for NCCL of a communicator created with nccl=none gets.
const NCCL_NONE: &str = "this communicator was created with nccl=none (tpar's kernels only): create it with nccl=\"own\" or with your NCCL communicator to borrow";

/// The dispatcher's answer for one call, as the call path caches it: the decision, or why the
/// call gets none (typed: forced and unable to run, planned for an NCCL this group does not
/// hold, nothing can run).
pub type Decided = std::result::Result<Decision, NoDecision>;

/// What a call's decision depends on besides the machine and the group, which every rank
/// shares: what the caller selected, the dtype, the size and whether the stream captures.
type DecisionKey = (Selection, DType, u64, bool);

/// One rank's allreduce: tpar's CUDA communicator, NCCL for the same ranks where it could be
/// created, and the dispatcher between them.
pub struct Communicator {
    cuda: CudaCommunicator,
    nccl: Mutex<NcclSlot>,
    /// The NCCL communicator once created (or borrowed), for `&self` calls without the lock.
    nccl_ready: OnceLock<NcclCommunicator>,
    /// Drop in free device memory measured around creating our own NCCL communicator.
    nccl_bytes: std::sync::atomic::AtomicU64,
    /// The machine, as the dispatcher sees it.
    topology: Topology,
    /// What `TPAR_ALGO` selects for every call that does not force its own choice.
    selection: Selection,
    tuning: HashMap<DType, TuningTable>,
    /// What checks and measurements found on this machine (link bandwidths kept by `tpar
    /// doctor`, paths that failed the self-test of `join`): failed paths are never planned.
    findings: Findings,
    /// What this group was built with, as the dispatcher's input; its `nccl` follows the
    /// slot (updated under the slot's lock).
    group: Mutex<GroupFacts>,
    /// Orders calls issued from several streams as they were issued on the host.
    order: StreamOrder,
    /// Decisions already made, refusals included: the dispatcher's answer depends only on
    /// these keys (and the group, whose changes clear it), and an engine asks the same few
    /// sizes over and over, on its hot path.
    decisions: Mutex<HashMap<DecisionKey, Arc<Decided>>>,
    /// What creating this group found that its user should hear about (also logged):
    /// paths vetoed by the init self-test, ranks time-sliced on a shared GPU.
    warnings: Vec<String>,
}

/// Distinct (dtype, size, capturing) plans kept before the cache starts over.
const DECISION_CACHE_ENTRIES: usize = 4096;

impl Communicator {
    /// Puts the backends of one rank behind one call. `nccl` is the NCCL communicator for the
    /// same ranks, or why there is none (then NCCL is never planned). Reads `TPAR_ALGO` and
    /// the tuning tables for this machine and world size.
    pub fn new(
        cuda: CudaCommunicator,
        nccl: std::result::Result<NcclCommunicator, String>,
        topology: Topology,
    ) -> Result<Communicator> {
        let ready = OnceLock::new();
        let slot = match nccl {
            Ok(n) => {
                let _ = ready.set(n);
                NcclSlot::Ready
            }
            Err(why) => NcclSlot::Unavailable(why),
        };
        Self::with_slot(cuda, slot, ready, topology)
    }

    fn with_slot(
        mut cuda: CudaCommunicator,
        slot: NcclSlot,
        nccl_ready: OnceLock<NcclCommunicator>,
        topology: Topology,
    ) -> Result<Communicator> {
        let selection = Selection::from_env()?;
        // The islands exchange's form from the topology alone (no measured findings, which
        // may differ between ranks), so that every rank chooses the same.
        let all_units = crate::dispatch::fabric::Fabric::new(&topology, cuda.world_size(), None)
            .islands_all_units_max_bytes(DType::Bf16);
        cuda.model_islands_exchange(crate::islands::IslandsExchange::all_units_up_to(all_units));
        let findings = LinkMeasurements::load(&LinkMeasurements::path(&topology))
            .map(|m| m.to_findings())
            .unwrap_or_default();
        // What this group cannot run (no kernel, no peer access between its GPUs, no host
        // inboxes, no NCCL) is never planned: the dispatcher falls back and says why, and
        // refuses it when forced.
        let group = GroupFacts {
            kernels: Algorithm::ALL
                .into_iter()
                .filter(|&a| KernelId::allreduce(a, DType::F32).is_some())
                .collect(),
            host_staged: cuda.has_host_inboxes(),
            peer_access: cuda.peer_access().map_err(str::to_owned),
            islands: cuda.islands_path(),
            payload_lines: cuda.payload_lines(),
            nccl: slot.availability(),
        };
        let this_build = kernels::build_id();
        let mut tuning: HashMap<DType, TuningTable> = HashMap::new();
        let mut ignored: Vec<String> = Vec::new();
        for d in DType::ALL {
            let (read, passed_over) =
                TuningTable::read_for(&topology, cuda.world_size(), d, &this_build);
            // A `tpar tune` table of another build no longer decides: say so, or a user who
            // tuned would take the first-use measurement's (or the model's) choices for the
            // table's.
            if let Some(t) = TuningTable::stale_tune_table(read.as_ref(), passed_over.as_ref()) {
                ignored.push(format!(
                    "the tuning table {} is not read: it timed other kernels ({}) than this build's ({this_build}); run `tpar tune` again",
                    t.kept_at().display(),
                    if t.kernels.is_empty() { "unnamed" } else { t.kernels.as_str() }
                ));
            }
            if let Some(t) = read {
                tuning.insert(d, t);
            }
        }
        let order = StreamOrder::new(cuda.context())?;
        let mut comm = Communicator {
            order,
            cuda,
            nccl: Mutex::new(slot),
            nccl_ready,
            nccl_bytes: Default::default(),
            topology,
            selection,
            tuning,
            findings,
            group: Mutex::new(group),
            decisions: Mutex::default(),
            warnings: Vec::new(),
        };
        for warning in ignored {
            comm.warn_once(warning);
        }
        Ok(comm)
    }

    /// Logs `warning` once per process (a job that makes many communicators, as selftest
    /// makes one per row, would otherwise repeat it for every one); each communicator keeps it
    /// ([`Communicator::warnings`]).
    fn warn_once(&mut self, warning: String) {
        static WARNED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
        let mut warned = WARNED.lock().unwrap_or_else(|p| p.into_inner());
        if !warned.contains(&warning) {
            log::warn!("{warning}");
            warned.push(warning.clone());
        }
        self.warnings.push(warning);
    }

    /// This process's rank of the job behind `rendezvous`, on GPU `device`, with its own NCCL
    /// communicator created when a call first needs it ([`NcclMode::Own`]; see
    /// [`Communicator::join_with`]). Every rank of the job must call this together.
    pub fn join(rendezvous: &Rendezvous, device: usize, config: Config) -> Result<Communicator> {
        Self::join_with(rendezvous, device, config, NcclMode::Own)
    }

    /// This process's rank of the group behind `rendezvous` (the job, or a subgroup from
    /// [`Rendezvous::subgroup`]), on GPU `device`: tpar's CUDA communicator and, as `nccl`
    /// says, NCCL behind the same call. Every rank of the group must call this together, and
    /// create its communicators in the same order. A borrowed NCCL communicator carries its
    /// owner's promise from [`BorrowedNccl::new`].
    pub fn join_with(
        rendezvous: &Rendezvous,
        device: usize,
        config: Config,
        nccl: NcclMode,
    ) -> Result<Communicator> {
        // Names for the parts that meet through the rendezvous, taken before anything can fail
        // on one rank alone (every rank's count of communicators must stay in step).
        let nccl_instance = rendezvous.next_instance();
        let selftest_instance = rendezvous.next_instance();
        let gpus = crate::backend::cuda::check_available()?;
        let cuda = CudaCommunicator::new(rendezvous, device, config)?;
        let ready = OnceLock::new();
        // Every rank decides the same way (same machine, same library, same mode), so either
        // all take part in NCCL's initialisation at the same call or none does.
        let slot = match nccl {
            NcclMode::None => NcclSlot::Refused,
            NcclMode::Borrowed(comm) => {
                crate::backend::cuda::driver::bind(cuda.context())?;
                let n = NcclCommunicator::borrow(comm, rendezvous.rank(), rendezvous.world_size())?;
                let _ = ready.set(n);
                NcclSlot::Ready
            }
            NcclMode::Own => match Nccl::load() {
                Err(e) => NcclSlot::Unavailable(e.to_string()),
                Ok(_) if rendezvous.world_size() > gpus => NcclSlot::Unavailable(format!(
                    "NCCL needs one GPU per rank: {} ranks on {gpus} GPU(s)",
                    rendezvous.world_size()
                )),
                Ok(_) => NcclSlot::Lazy {
                    rendezvous: rendezvous.clone(),
                    instance: nccl_instance,
                    timeout: config.timeout,
                },
            },
        };
        let gpus_seen = Topology::detect_or_unknown(gpus);
        let mut comm = Communicator::with_slot(cuda, slot, ready, gpus_seen)?;
        let sharing = comm.cuda.time_sliced_with();
        if !sharing.is_empty() {
            let warning = format!(
                "rank {} shares GPU {device} with rank(s) {} of other processes: the driver time-slices their contexts, so every allreduce waits for each one's turn (milliseconds, not microseconds); results are right, timings are not a machine's. Give each rank its own GPU, or run the ranks as threads of one process",
                comm.cuda.rank(),
                sharing.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
            );
            comm.warn_once(warning);
        }
        if std::env::var(ENV_INIT_SELFTEST).map_or(true, |v| v != "0") {
            comm.init_selftest(rendezvous, &selftest_instance, config.timeout)?;
        }
        // Where no table was measured on this machine: time the model's closest candidates
        // (first_use.rs; TPAR_FIRST_USE=0 turns it off).
        comm.first_use(rendezvous, &selftest_instance, config.timeout);
        Ok(comm)
    }

    /// The NCCL communicator behind this one: created now if `nccl=own` left it for the first
    /// call that needs it (collective: every rank must reach this at the same call, as they
    /// do when the dispatcher plans NCCL for a call), or why there is none.
    pub fn nccl(&self) -> std::result::Result<&NcclCommunicator, String> {
        if let Some(n) = self.nccl_ready.get() {
            return Ok(n);
        }
        let mut slot = self.nccl.lock().expect("nccl slot");
        match &*slot {
            NcclSlot::Ready => {}
            NcclSlot::Refused => return Err(NCCL_NONE.to_owned()),
            NcclSlot::Unavailable(why) => return Err(why.clone()),
            NcclSlot::Lazy {
                rendezvous,
                instance,
                timeout,
            } => {
                let created = self.create_own_nccl(rendezvous, instance, *timeout);
                let failed = match created {
                    Ok(n) => {
                        let _ = self.nccl_ready.set(n);
                        *slot = NcclSlot::Ready;
                        None
                    }
                    Err(e) => {
                        let why = format!("creating tpar's own NCCL communicator failed: {e}");
                        *slot = NcclSlot::Unavailable(why.clone());
                        Some(why)
                    }
                };
                // The dispatcher sees the new state from the next decision on.
                self.group.lock().expect("group facts").nccl = slot.availability();
                self.decisions.lock().expect("decision cache").clear();
                if let Some(why) = failed {
                    return Err(why);
                }
            }
        }
        self.nccl_ready
            .get()
            .ok_or_else(|| "NCCL communicator missing".to_owned())
    }

    /// Creates tpar's own NCCL communicator (nccl=own), measuring the free device memory it
    /// takes with nothing else of tpar's allocating meanwhile.
    fn create_own_nccl(
        &self,
        rendezvous: &Rendezvous,
        instance: &str,
        timeout: std::time::Duration,
    ) -> Result<NcclCommunicator> {
        let ctx = self.cuda.context();
        crate::backend::cuda::driver::bind(ctx)?;
        let started = std::time::Instant::now();
        let (nccl, taken) = crate::backend::cuda::free_memory_taken_by(ctx, || {
            NcclCommunicator::new_named(rendezvous, instance, timeout)
        });
        let nccl = nccl?;
        self.nccl_bytes
            .store(taken, std::sync::atomic::Ordering::Relaxed);
        log::info!(
            "rank {}: created tpar's own NCCL communicator ({} ranks) for the first call planned for NCCL, in {:.2?}; it took {} of device memory (nccl=own; pass nccl=none or borrow an existing NCCL communicator to avoid it)",
            self.cuda.rank(),
            self.cuda.world_size(),
            started.elapsed(),
            crate::memory::human_bytes(taken)
        );
        Ok(nccl)
    }

    /// Creates tpar's own NCCL communicator now (nccl=own) instead of at the first call that
    /// needs it, e.g. before CUDA-graph capture; collective. An error says why there is none.
    pub fn ensure_nccl(&self) -> Result<()> {
        self.nccl().map(|_| ()).map_err(Error::Unsupported)
    }

    /// How many NCCL communicators tpar created itself for this communicator (0 or 1).
    pub fn own_nccl_created(&self) -> usize {
        usize::from(
            self.nccl_ready
                .get()
                .is_some_and(NcclCommunicator::is_owned),
        )
    }

    /// The numerical self-test of `join`: every tpar algorithm this group can run reduces
    /// known values (one chunk and several) and every element is checked on every rank, which
    /// also exercises the real IPC writes and reads between the processes. A path with a
    /// wrong element on any rank is never planned, on every rank alike (they exchange their
    /// findings), and the reason is logged. A path whose kernels time out leaves the group
    /// unusable: that is returned as the error.
    fn init_selftest(
        &mut self,
        rendezvous: &Rendezvous,
        instance: &str,
        timeout: std::time::Duration,
    ) -> Result<()> {
        // A group over the same GPUs with the same settings already passed (or failed) the
        // test in this process: reuse its findings when every rank has them, so that an
        // engine's many groups pay for the test once.
        let cache_key = self.cuda.group_key().to_owned();
        let cached = selftest_cache()
            .lock()
            .expect("self-test cache")
            .get(&cache_key)
            .cloned();
        let cache_round = format!("selftest-{instance}-cached");
        rendezvous.publish(&cache_round, &cached.is_some())?;
        let everyone_cached = rendezvous
            .gather::<bool>(&cache_round, timeout)?
            .into_iter()
            .all(|c| c);
        let vetoed = match cached.filter(|_| everyone_cached) {
            Some(vetoed) => {
                log::info!(
                    "init self-test on rank {}: reused this process's result for the same GPUs and settings",
                    self.cuda.rank()
                );
                vetoed
            }
            None => {
                let vetoed = self.run_selftest(rendezvous, instance, timeout)?;
                selftest_cache()
                    .lock()
                    .expect("self-test cache")
                    .insert(cache_key, vetoed.clone());
                vetoed
            }
        };
        for (choice, why) in vetoed {
            let warning = format!("{choice} failed the init self-test and will not be used: {why}");
            log::warn!("{warning}");
            self.warnings.push(warning);
            self.findings.failed.push((choice, why));
        }
        self.decisions.lock().expect("decision cache").clear();
        Ok(())
    }

    /// The self-test itself; returns the paths that failed on any rank.
    fn run_selftest(
        &mut self,
        rendezvous: &Rendezvous,
        instance: &str,
        timeout: std::time::Duration,
    ) -> Result<Vec<(Choice, String)>> {
        let spec = crate::verify::INIT_CHECK;
        let rank = self.cuda.rank();
        let stream = self
            .cuda
            .context()
            .new_stream()
            .map_err(|e| Error::Cuda(format!("init self-test: cannot create a stream: {e}")))?;
        let target = crate::verify::BackendRank {
            cuda: &self.cuda,
            stream: &stream,
        };
        let mut failures: Vec<(String, String)> = Vec::new();
        let mut checked: Vec<&str> = Vec::new();
        for algorithm in Algorithm::ALL {
            // What this group can run (its kernels, inboxes, peer access): the self-test
            // checks exactly those.
            if self
                .eligibility(Choice::Tpar(algorithm), spec.dtype, 0, false)
                .is_err()
            {
                continue;
            }
            checked.push(algorithm.name());
            let findings = crate::verify::check(&target, algorithm, &spec).map_err(|e| {
                Error::Cuda(format!("init self-test of {algorithm} on rank {rank}: {e}"))
            })?;
            // One finding per path; every rank made every call (they are collective).
            if let Some(f) = findings.first() {
                failures.push((
                    algorithm.name().to_owned(),
                    format!(
                        "the init self-test on rank {rank}, {} {} elements: element {} was {}, expected {}",
                        f.count, spec.dtype, f.index, f.got, f.want
                    ),
                ));
            }
        }
        let key = format!("selftest-{instance}");
        rendezvous.publish(&key, &failures)?;
        let everyone: Vec<Vec<(String, String)>> = rendezvous.gather(&key, timeout)?;
        let vetoed = merge_findings(everyone)?;
        if vetoed.is_empty() {
            log::info!(
                "init self-test on rank {rank}: {} correct on every rank ({} bf16 elements, every element checked)",
                checked.join(", "),
                spec.counts
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(" and ")
            );
        }
        Ok(vetoed)
    }

    /// What creating this group found that its user should hear about, one sentence each
    /// (paths the init self-test vetoed, a GPU time-sliced between processes); also logged.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    pub fn cuda(&self) -> &CudaCommunicator {
        &self.cuda
    }

    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// What a call of `bytes` of `dtype` will run, and why (or why nothing can): the
    /// dispatcher's decision, or the choice `TPAR_ALGO` forces; a refusal as an error.
    pub fn decision(&self, dtype: DType, bytes: u64, capturing: bool) -> Result<Decision> {
        match &*self.decide(Selection::Auto, dtype, bytes, capturing) {
            Ok(decision) => Ok(decision.clone()),
            Err(refused) => Err(refused.clone().into()),
        }
    }

    /// The one decision of a call, cached, for `selection` ([`Selection::Auto`]: what
    /// `TPAR_ALGO` selects, else the dispatcher's choice; a forced choice of the call wins over
    /// `TPAR_ALGO` and is verified, never substituted), `bytes` of `dtype`, captured or not:
    /// the decision, or the typed refusal (a forced choice that cannot run here, a call
    /// planned for NCCL on a communicator created with nccl=none, nothing that can run).
    pub fn decide(
        &self,
        selection: Selection,
        dtype: DType,
        bytes: u64,
        capturing: bool,
    ) -> Arc<Decided> {
        let selection = match selection {
            Selection::Auto => self.selection,
            forced => forced,
        };
        let key = (selection, dtype, bytes, capturing);
        if let Some(decided) = self.decisions.lock().expect("decision cache").get(&key) {
            return decided.clone();
        }
        let decided = Arc::new(self.with_request(dtype, bytes, capturing, |req| {
            decide(&Request {
                forced: selection.forced(),
                ..*req
            })
        }));
        let mut decisions = self.decisions.lock().expect("decision cache");
        if decisions.len() >= DECISION_CACHE_ENTRIES {
            decisions.clear();
        }
        decisions.insert(key, decided.clone());
        decided
    }

    /// Whether this group can run `choice` for a call of `bytes` of `dtype` (the dispatcher's
    /// eligibility with this group's facts and this machine's topology, without the
    /// findings: benchmarks and self-tests run paths a check vetoed), or the typed refusal.
    pub fn eligibility(
        &self,
        choice: Choice,
        dtype: DType,
        bytes: u64,
        capturing: bool,
    ) -> std::result::Result<(), crate::dispatch::Refusal> {
        self.with_request(dtype, bytes, capturing, |req| {
            eligibility(
                &Request {
                    findings: None,
                    ..*req
                },
                choice,
            )
        })
    }

    /// The dispatcher's request for a call of this communicator (nothing forced).
    fn with_request<T>(
        &self,
        dtype: DType,
        bytes: u64,
        capturing: bool,
        ask: impl FnOnce(&Request) -> T,
    ) -> T {
        let group = self.group.lock().expect("group facts");
        ask(&Request {
            topology: &self.topology,
            findings: Some(&self.findings),
            tuning: self.tuning.get(&dtype),
            world_size: self.cuda.world_size(),
            dtype,
            bytes,
            capturing,
            forced: None,
            group: Some(&group),
        })
    }

    /// The path of a fused call whose allreduce runs on `choice`, for rows of `hidden`
    /// elements of `dtype` on this group (the dispatcher's `decide_fused`): with `tokens`, the
    /// faster of the two paths where both can run (`tpar tune`'s table for this machine, else
    /// the built-in rule: `norm::Prefer::Faster`); without, the fused kernel wherever it can
    /// run.
    pub fn fused_decision(
        &self,
        choice: Choice,
        dtype: DType,
        hidden: usize,
        tokens: Option<usize>,
    ) -> crate::norm::FusedDecision {
        let world_size = self.cuda.world_size();
        let measured =
            tokens.and_then(|_| crate::backend::machine::fused_table(world_size, dtype, hidden));
        let prefer = match tokens {
            None => crate::norm::Prefer::Fused,
            Some(tokens) => crate::norm::Prefer::Faster {
                world_size,
                tokens,
                measured: measured.as_deref(),
            },
        };
        crate::dispatch::decide_fused(choice, dtype, hidden, self.cuda.payload_lines(), prefer)
    }

    /// Whether tpar's own NCCL communicator is still to be created by the first call planned
    /// for NCCL (which cannot happen inside CUDA-graph capture).
    pub fn nccl_pending(&self) -> bool {
        matches!(*self.nccl.lock().expect("nccl slot"), NcclSlot::Lazy { .. })
    }

    /// Decides and queues `output[i] = sum over ranks of input[i]` on `stream` (`input:
    /// None`: in place on `output`), returning the choice it ran. Every rank must make the
    /// same calls: the decision depends only on what every rank shares (machine, sizes,
    /// settings). The spans must be on this rank's GPU, of one dtype and length, and `stream`
    /// of its context.
    pub fn all_reduce(
        &self,
        input: Option<DeviceSpan<'_>>,
        output: DeviceSpanMut<'_>,
        stream: &CudaStream,
    ) -> Result<Choice> {
        self.all_reduce_selected(Selection::Auto, input, output, stream)
    }

    /// The one call path, every caller's (the CLI's harness, Python, the engine plugins):
    /// check the operands against this rank's GPU and `stream`, read the stream's capture
    /// state, decide once ([`Communicator::decide`]: the dispatcher's choice, or the forced
    /// one once verified to run here; a refusal is returned as [`Error::Refused`] before
    /// anything is queued), enqueue it in this communicator's call order. Returns the choice
    /// that ran.
    pub fn all_reduce_selected(
        &self,
        selection: Selection,
        input: Option<DeviceSpan<'_>>,
        output: DeviceSpanMut<'_>,
        stream: &CudaStream,
    ) -> Result<Choice> {
        let operands = Operands::check(input.as_ref(), &output, self.device(), stream)?;
        let capture = self.capture(stream)?;
        let decided = self.decide(
            selection,
            operands.dtype(),
            operands.bytes() as u64,
            capture.is_capturing(),
        );
        let choice = match &*decided {
            Ok(decision) => decision.choice,
            Err(refused) => return Err(refused.clone().into()),
        };
        self.enqueue(choice, &operands, stream, capture)?;
        Ok(choice)
    }

    /// Queues the allreduce on `choice` without asking the dispatcher for a choice
    /// (benchmarks, tests): refused, typed, where this group cannot run it
    /// ([`Communicator::eligibility`]); as [`Communicator::all_reduce`] otherwise.
    pub fn all_reduce_as(
        &self,
        choice: Choice,
        input: Option<DeviceSpan<'_>>,
        output: DeviceSpanMut<'_>,
        stream: &CudaStream,
    ) -> Result<()> {
        let operands = Operands::check(input.as_ref(), &output, self.device(), stream)?;
        let capture = self.capture(stream)?;
        self.eligibility(
            choice,
            operands.dtype(),
            operands.bytes() as u64,
            capture.is_capturing(),
        )?;
        self.enqueue(choice, &operands, stream, capture)
    }

    /// The GPU of this rank.
    fn device(&self) -> usize {
        self.cuda.context().ordinal()
    }

    /// Whether `stream` is capturing a graph: read once per call, at its start, and passed to
    /// every step of the call that depends on it.
    pub(crate) fn capture(&self, stream: &CudaStream) -> Result<Capture> {
        self.order.capture(stream)
    }

    /// Whether `stream` is capturing a CUDA graph now, as a call on it would read it (for a
    /// caller asking for a call's decision beforehand: [`Communicator::decide`]).
    pub fn capturing(&self, stream: &CudaStream) -> Result<bool> {
        self.capture(stream).map(Capture::is_capturing)
    }

    /// Queues the allreduce of checked `operands` on `choice`.
    pub(crate) fn enqueue(
        &self,
        choice: Choice,
        operands: &Operands,
        stream: &CudaStream,
        capture: Capture,
    ) -> Result<()> {
        if choice == Choice::Nccl {
            // Created (collectively) before the ordered section, which must not block; the
            // dispatcher refused it inside capture if it was still to be created.
            self.nccl().map_err(Error::Unsupported)?;
        }
        self.ordered(stream, capture, || match choice {
            Choice::Tpar(algorithm) => self.cuda.enqueue(operands, algorithm, stream),
            Choice::Nccl => {
                let nccl = self.nccl().map_err(Error::Unsupported)?;
                // NCCL connects peers (and allocates their buffers) at the first calls that
                // need them, not at its init: what our own NCCL takes then is measured around
                // the call too (outside capture, where the driver can be asked).
                let queue = || nccl.all_reduce(operands, stream);
                if nccl.is_owned() && !capture.is_capturing() {
                    let (queued, taken) =
                        crate::backend::cuda::free_memory_taken_by(self.cuda.context(), queue);
                    self.nccl_bytes
                        .fetch_add(taken, std::sync::atomic::Ordering::Relaxed);
                    queued
                } else {
                    queue()
                }
            }
        })
    }

    /// Queues one call's work with `enqueue` after this communicator's previous call, whatever
    /// stream that was on (see [`StreamOrder`]): every call that takes an epoch goes through here.
    pub(crate) fn ordered<T>(
        &self,
        stream: &CudaStream,
        capture: Capture,
        enqueue: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        self.order.ordered(stream, capture, enqueue)
    }

    /// Errors the kernels or NCCL reported since the last check.
    pub fn check(&self) -> Result<()> {
        self.cuda.check()?;
        if let Some(nccl) = self.nccl_ready.get() {
            nccl.check()?;
        }
        Ok(())
    }

    /// Everything creating and using this communicator took on this rank, by part: tpar's
    /// buffers, its kernels' modules (shared by the process's communicators on this GPU) and
    /// the NCCL communicator tpar created itself (nccl=own, once created; measured).
    pub fn memory_footprint(&self) -> MemoryFootprint {
        let mut m = self.cuda.memory_footprint();
        if self.own_nccl_created() == 1 {
            m.nccl_bytes = self.nccl_bytes.load(std::sync::atomic::Ordering::Relaxed);
            m.device_bytes += m.nccl_bytes;
        }
        m
    }
}

/// Init self-test findings per group key (GPUs in rank order and settings) in this process.
type SelfTestFailures = Vec<(Choice, String)>;

fn selftest_cache() -> &'static Mutex<HashMap<String, SelfTestFailures>> {
    static CACHE: OnceLock<Mutex<HashMap<String, SelfTestFailures>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// What a rank of a `world_size` group will take, by part, before anything is allocated (for
/// `tpar plan memory`, `tpar doctor` and an engine's KV-cache budget): tpar's buffers from
/// `config` and, with `nccl` = [`NcclMode::Own`], NCCL's communicator estimated from its
/// settings (`nccl_estimated` is then true). The kernels' modules are planned as their code in
/// whole 2 MiB pages for the architecture that needs the most, the GPU not being known yet
/// ([`crate::backend::cuda::PLANNED_MODULE_BYTES`]); [`planned_footprint_on`] plans a known one.
pub fn planned_footprint(world_size: usize, config: &Config, nccl: NcclMode) -> MemoryFootprint {
    planned_footprint_on(world_size, config, nccl, None)
}

/// [`planned_footprint`] on GPUs of compute capability `capability` ("9.0"; None: not known),
/// whose kernels take [`crate::backend::cuda::planned_module_bytes`].
pub fn planned_footprint_on(
    world_size: usize,
    config: &Config,
    nccl: NcclMode,
    capability: Option<&str>,
) -> MemoryFootprint {
    let mut m = CudaCommunicator::planned_footprint_on(world_size, config, capability);
    if nccl == NcclMode::Own {
        m.nccl_bytes =
            crate::backend::nccl::estimated_footprint(world_size, |k| std::env::var(k).ok());
        m.nccl_estimated = true;
        m.device_bytes += m.nccl_bytes;
    }
    m
}

/// Every rank's self-test findings (algorithm name, why) as one list of failed paths, each once
/// (with the first rank's reason), in the same order on every rank.
fn merge_findings(everyone: Vec<Vec<(String, String)>>) -> Result<Vec<(Choice, String)>> {
    let mut failed: Vec<(Choice, String)> = Vec::new();
    for (name, why) in everyone.into_iter().flatten() {
        let choice = Choice::Tpar(name.parse::<Algorithm>()?);
        if !failed.iter().any(|(c, _)| *c == choice) {
            failed.push((choice, why));
        }
    }
    Ok(failed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Algorithm;

    #[test]
    fn self_test_findings_of_all_ranks_merge_into_one_list() {
        let rank = |items: &[(&str, &str)]| {
            items
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect::<Vec<_>>()
        };
        let merged = merge_findings(vec![
            rank(&[]),
            rank(&[("two-shot", "rank 1: element 3")]),
            rank(&[
                ("two-shot", "rank 2: element 9"),
                ("host-staged", "rank 2: element 0"),
            ]),
        ])
        .unwrap();
        assert_eq!(
            merged,
            vec![
                (
                    Choice::Tpar(Algorithm::TwoShot),
                    "rank 1: element 3".to_owned()
                ),
                (
                    Choice::Tpar(Algorithm::HostStaged),
                    "rank 2: element 0".to_owned()
                ),
            ]
        );
        assert!(merge_findings(vec![rank(&[("rings", "?")])]).is_err());
    }

    #[test]
    fn nccl_modes_parse_and_unknown_names_say_the_choices() {
        assert_eq!("own".parse::<NcclMode>().unwrap(), NcclMode::Own);
        assert_eq!("none".parse::<NcclMode>().unwrap(), NcclMode::None);
        let err = "mine".parse::<NcclMode>().unwrap_err().to_string();
        assert!(err.contains("\"own\"") && err.contains("\"none\""), "{err}");
    }

    #[test]
    fn the_planned_footprint_shows_its_nccl_part_as_an_estimate() {
        let config = Config::default();
        let none = planned_footprint(8, &config, NcclMode::None);
        let own = planned_footprint(8, &config, NcclMode::Own);
        assert_eq!((none.nccl_bytes, none.nccl_estimated), (0, false));
        assert!(own.nccl_estimated && own.nccl_bytes > 400 << 20, "{own:?}");
        assert_eq!(own.device_bytes, none.device_bytes + own.nccl_bytes);
        assert_eq!(
            none.device_bytes,
            none.device_buffer_bytes + none.module_bytes
        );
        assert!(none.module_bytes > 0 && none.device_buffer_bytes % (2 << 20) == 0);
    }

    #[test]
    fn tpar_algo_forces_a_choice_and_rejects_unknown_names() {
        assert_eq!(forced_choice(None).unwrap(), None);
        assert_eq!(forced_choice(Some("auto")).unwrap(), None);
        assert_eq!(forced_choice(Some("")).unwrap(), None);
        assert_eq!(forced_choice(Some("nccl")).unwrap(), Some(Choice::Nccl));
        assert_eq!(
            forced_choice(Some("host-staged")).unwrap(),
            Some(Choice::Tpar(Algorithm::HostStaged))
        );
        let err = forced_choice(Some("rings")).unwrap_err().to_string();
        assert!(err.contains("TPAR_ALGO=rings"), "{err}");
    }
}
