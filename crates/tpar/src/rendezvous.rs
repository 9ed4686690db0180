//! How the ranks of one job on this host find each other: a private directory (mode 0700,
//! owned by this user) where each rank publishes small JSON records (mode 0600), each stamped
//! with the job's random token. A record with another token is refused, never used.
//!
//! The environment of a rank (set by `tpar`'s own launcher, or by an outside launcher such as
//! torchrun plus two variables):
//! - `TPAR_RENDEZVOUS`: the directory (created 0700 if missing);
//! - `TPAR_JOB_TOKEN`: the job's secret token, the same for every rank (8 to 128 characters of
//!   `[A-Za-z0-9_-]`; e.g. `openssl rand -hex 16`);
//! - `RANK`, `WORLD_SIZE`, and optionally `LOCAL_RANK`, `LOCAL_WORLD_SIZE` (torchrun's names).
//!
//! A rank that fails to create a communicator says so in the directory ([`Rendezvous::abort`]:
//! an abort record with its reason, for the creation it was in), and every rank waiting in a
//! gather of the same creation stops at its next look (within about 10 ms) with
//! [`Error::PeerFailed`] naming the rank whose failure was the cause, instead of waiting out
//! its deadline.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub const ENV_RENDEZVOUS: &str = "TPAR_RENDEZVOUS";

/// The prefix of the /dev/shm names of a job's segments (every backend's, and what `tpar`'s
/// launcher sweeps after a job).
pub fn segment_prefix(token: &str) -> String {
    format!("tpar-{token}-")
}

pub const ENV_JOB_TOKEN: &str = "TPAR_JOB_TOKEN";

/// Set to `tpar` in the ranks tpar's own launcher starts: their rendezvous directory is the
/// launcher's, which it removes after the job (so a rank may leave files there for it).
pub const ENV_LAUNCHER: &str = "TPAR_LAUNCHER";

/// Where one rank stands in its job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub dir: PathBuf,
    pub token: String,
}

impl RankEnv {
    /// Rank `rank` of `world_size` on this host, meeting in `dir` under `token`: the ranks of
    /// the tests, threads of one process.
    #[cfg(test)]
    pub(crate) fn on_one_host(rank: usize, world_size: usize, dir: &Path, token: &str) -> RankEnv {
        RankEnv {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            dir: dir.to_path_buf(),
            token: token.to_owned(),
        }
    }

    /// Reads the rank's environment; `Ok(None)` when `TPAR_RENDEZVOUS` is not set (this
    /// process is not a rank of a job), an error when it is set but the rest is wrong.
    pub fn from_env() -> Result<Option<RankEnv>> {
        Self::from_lookup(|key| std::env::var(key).ok())
    }

    /// [`RankEnv::from_env`] over any variable source, for tests.
    /// A launcher's variables without `TPAR_RENDEZVOUS` (`RANK=1 WORLD_SIZE=4` alone) are an
    /// error, not ignored: every such process would otherwise start a job of its own. So are
    /// local ranks that cannot be (`LOCAL_RANK` not below `LOCAL_WORLD_SIZE`, more local ranks
    /// than ranks).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<RankEnv>> {
        let number = |key: &str| -> Result<Option<usize>> {
            get(key)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| {
                        Error::Environment(format!("{key}={v:?} is not a non-negative integer"))
                    })
                })
                .transpose()
        };
        let Some(dir) = get(ENV_RENDEZVOUS) else {
            let launcher_vars = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"];
            let mut set = Vec::new();
            for key in launcher_vars {
                if let Some(v) = number(key)? {
                    set.push((key, v));
                }
            }
            check_local(&set)?;
            let value = |key| set.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
            // torchrun's single-process case (RANK=0 WORLD_SIZE=1) is no job to join.
            let lone = value("WORLD_SIZE").unwrap_or(1) <= 1 && value("RANK").unwrap_or(0) == 0;
            if !lone {
                let shown: Vec<String> = set.iter().map(|(k, v)| format!("{k}={v}")).collect();
                return Err(Error::Environment(format!(
                    "{} is set but {ENV_RENDEZVOUS} is not: this process would start a job of its own instead of joining yours; set {ENV_RENDEZVOUS} (a directory) and {ENV_JOB_TOKEN} for every rank, or unset RANK and WORLD_SIZE",
                    shown.join(" ")
                )));
            }
            return Ok(None);
        };
        let required = |key: &str| -> Result<usize> {
            number(key)?.ok_or_else(|| {
                Error::Environment(format!(
                    "{ENV_RENDEZVOUS} is set but {key} is not; a launcher must set RANK and WORLD_SIZE for every rank"
                ))
            })
        };
        let rank = required("RANK")?;
        let world_size = required("WORLD_SIZE")?;
        if world_size == 0 || rank >= world_size {
            return Err(Error::Environment(format!(
                "RANK={rank} is not below WORLD_SIZE={world_size}"
            )));
        }
        let local_rank = number("LOCAL_RANK")?.unwrap_or(rank);
        let local_world_size = number("LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
        check_local(&[
            ("RANK", rank),
            ("WORLD_SIZE", world_size),
            ("LOCAL_RANK", local_rank),
            ("LOCAL_WORLD_SIZE", local_world_size),
        ])?;
        let token = get(ENV_JOB_TOKEN).ok_or_else(|| {
            Error::Environment(format!(
                "{ENV_RENDEZVOUS} is set but {ENV_JOB_TOKEN} is not; give every rank the same secret token, e.g. {ENV_JOB_TOKEN}=$(openssl rand -hex 16)"
            ))
        })?;
        check_token(&token)?;
        Ok(Some(RankEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            dir: PathBuf::from(dir),
            token,
        }))
    }

    /// The variables that make a child process this rank (tpar's launcher's: they say so in
    /// [`ENV_LAUNCHER`]).
    pub fn to_vars(&self) -> Vec<(&'static str, String)> {
        vec![
            (ENV_LAUNCHER, "tpar".to_owned()),
            (ENV_RENDEZVOUS, self.dir.display().to_string()),
            (ENV_JOB_TOKEN, self.token.clone()),
            ("RANK", self.rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("LOCAL_WORLD_SIZE", self.local_world_size.to_string()),
        ]
    }
}

/// Local ranks that cannot be, among the launcher variables given as (name, value).
fn check_local(vars: &[(&str, usize)]) -> Result<()> {
    let value = |key| vars.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
    let bad = |why: String| Err(Error::Environment(why));
    if let (Some(r), Some(w)) = (value("RANK"), value("WORLD_SIZE")) {
        if w == 0 || r >= w {
            return bad(format!("RANK={r} is not below WORLD_SIZE={w}"));
        }
    }
    if value("LOCAL_WORLD_SIZE") == Some(0) {
        return bad("LOCAL_WORLD_SIZE=0: a job has at least one local rank".into());
    }
    if let (Some(r), Some(w)) = (value("LOCAL_RANK"), value("LOCAL_WORLD_SIZE")) {
        if r >= w {
            return bad(format!("LOCAL_RANK={r} is not below LOCAL_WORLD_SIZE={w}"));
        }
    }
    if let (Some(lw), Some(w)) = (value("LOCAL_WORLD_SIZE"), value("WORLD_SIZE")) {
        if lw > w {
            return bad(format!(
                "LOCAL_WORLD_SIZE={lw} is more than WORLD_SIZE={w}: a host cannot hold more ranks than the job has"
            ));
        }
    }
    if let (Some(lr), Some(w)) = (value("LOCAL_RANK"), value("WORLD_SIZE")) {
        if lr >= w {
            return bad(format!("LOCAL_RANK={lr} is not below WORLD_SIZE={w}"));
        }
    }
    Ok(())
}

pub fn check_token(token: &str) -> Result<()> {
    let ok_chars = token
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if (8..=128).contains(&token.len()) && ok_chars {
        Ok(())
    } else {
        Err(Error::Environment(format!(
            "{ENV_JOB_TOKEN} must be 8 to 128 characters of A-Z, a-z, 0-9, '_' or '-' (got {} characters)",
            token.len()
        )))
    }
}

/// A fresh random token: 128 bits as 32 hex digits.
pub fn random_token() -> Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)
        .map_err(|e| Error::Launch(format!("no random source for the job token: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Binary handles (IPC handles, NCCL ids) travel in records as lowercase hex.
pub(crate) fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The `N` bytes written as hex by [`to_hex`]; `None` for anything else.
pub(crate) fn from_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Creates `dir` with mode 0700 if it does not exist, and checks that it is private.
pub fn ensure_private_dir(dir: &Path) -> Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(source) => {
            return Err(Error::Io {
                what: "cannot create rendezvous directory",
                path: dir.to_owned(),
                source,
            })
        }
    }
    let meta = fs::symlink_metadata(dir).map_err(|source| Error::Io {
        what: "cannot read rendezvous directory",
        path: dir.to_owned(),
        source,
    })?;
    let insecure = |why: String| Error::InsecureRendezvous {
        dir: dir.to_owned(),
        why,
    };
    if !meta.is_dir() {
        return Err(insecure("not a directory (or a symbolic link)".into()));
    }
    if meta.uid() != crate::sys::effective_uid() {
        return Err(insecure(format!("owned by uid {}", meta.uid())));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(insecure(format!("mode {:o}", meta.mode() & 0o777)));
    }
    Ok(())
}

#[derive(Serialize, Deserialize)]
struct Record<T> {
    token: String,
    rank: usize,
    world_size: usize,
    value: T,
}

/// What a rank that failed to create a communicator leaves for its peers.
#[derive(Serialize, Deserialize)]
struct AbortNote {
    /// The creation it failed in ([`Rendezvous`]'s `creation`): peers of another creation
    /// ignore it.
    creation: u32,
    pid: u32,
    /// The rank whose failure started it (itself, or a rank it heard of).
    cause: usize,
    reason: String,
}

/// A rank's handle on the job's rendezvous directory, or on a subgroup of the job's ranks
/// (see [`Rendezvous::subgroup`]).
#[derive(Clone, Debug)]
pub struct Rendezvous {
    /// Asked while a gather waits; true stops it with [`Error::Interrupted`] (Ctrl-C).
    interrupt: Interrupt,
    /// This rank as the group sees it: for a subgroup, its index among the members and the
    /// number of members.
    env: RankEnv,
    /// Prefix of every record and shared-memory name of this group: empty for the whole job,
    /// `m<hash of the members>-` for a subgroup, so groups never read each other's records.
    namespace: String,
    /// The job's ranks in this group, in group-rank order (0..world for the whole job).
    members: Vec<usize>,
    /// Communicators this process had created in this group when this handle was made: the
    /// same number on every rank that creates its communicators in the same order, so it names
    /// one creation in abort records.
    creation: u32,
}

/// An optional check asked while waiting for peers (see [`Rendezvous::with_interrupt`]).
#[derive(Clone, Default)]
struct Interrupt(Option<std::sync::Arc<crate::wait::InterruptCheck>>);

impl std::fmt::Debug for Interrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Some(check)"
        } else {
            "None"
        })
    }
}

/// Communicators created so far per (directory, token, group namespace, rank) in this process.
/// Every rank creates its communicators in the same order, so the n-th one has the same number
/// on every rank; keeping the count per process (not per `Rendezvous` value) is what lets a
/// process open several communicators over one rank environment, close and re-create them.
/// (directory, token, group namespace, rank): one rank of one group of one job.
type GroupRank = (PathBuf, String, String, usize);

fn creation_counter() -> &'static Mutex<HashMap<GroupRank, u32>> {
    static COUNTERS: OnceLock<Mutex<HashMap<GroupRank, u32>>> = OnceLock::new();
    COUNTERS.get_or_init(Default::default)
}

/// The last round each rank of each group gathered in this process (see
/// [`Rendezvous::retire_previous_round`]).
fn previous_rounds() -> &'static Mutex<HashMap<GroupRank, String>> {
    static PREVIOUS: OnceLock<Mutex<HashMap<GroupRank, String>>> = OnceLock::new();
    PREVIOUS.get_or_init(Default::default)
}

/// A short, stable name for a subgroup: FNV-1a of its member list.
fn members_hash(members: &[usize]) -> u64 {
    crate::hash::fnv1a(members.iter().flat_map(|m| (*m as u64).to_le_bytes()))
}

impl Rendezvous {
    pub fn join(env: RankEnv) -> Result<Rendezvous> {
        check_token(&env.token)?;
        ensure_private_dir(&env.dir)?;
        let members = (0..env.world_size).collect();
        let mut rdv = Rendezvous {
            interrupt: Interrupt::default(),
            env,
            namespace: String::new(),
            members,
            creation: 0,
        };
        rdv.creation = rdv.created_so_far();
        Ok(rdv)
    }

    /// The group of the job's ranks `members` (job ranks, each once, this rank among them),
    /// with this rank renumbered as its index in `members`. Every member must name the same
    /// list in the same order. Groups with different members never see each other's records
    /// or shared memory, so a process may hold communicators of several groups at once.
    pub fn subgroup(&self, members: &[usize]) -> Result<Rendezvous> {
        let job_rank = self.members[self.env.rank];
        let mut seen = std::collections::HashSet::new();
        if members.is_empty() {
            return Err(Error::InvalidArgument(
                "members=[]: a group needs at least one rank".into(),
            ));
        }
        if let Some(m) = members.iter().find(|m| !seen.insert(**m)) {
            return Err(Error::InvalidArgument(format!(
                "members={members:?} names rank {m} twice; name each rank once"
            )));
        }
        if let Some(m) = members.iter().find(|m| !self.members.contains(m)) {
            return Err(Error::InvalidArgument(format!(
                "members={members:?} names rank {m}, which is not a rank of this job (ranks {:?})",
                self.members
            )));
        }
        let rank = members
            .iter()
            .position(|m| *m == job_rank)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "members={members:?} does not include this rank (rank {job_rank}); only members create the group's communicator"
                ))
            })?;
        let whole = members.len() == self.members.len() && members == self.members.as_slice();
        let mut group = Rendezvous {
            interrupt: self.interrupt.clone(),
            env: RankEnv {
                rank,
                world_size: members.len(),
                local_rank: rank,
                local_world_size: members.len(),
                dir: self.env.dir.clone(),
                token: self.env.token.clone(),
            },
            namespace: if whole {
                self.namespace.clone()
            } else {
                format!("m{:016x}-", members_hash(members))
            },
            members: members.to_vec(),
            creation: 0,
        };
        group.creation = group.created_so_far();
        Ok(group)
    }

    /// This rendezvous with `check` asked every ~10 ms while it waits for peers: when it says
    /// true the wait fails with [`Error::Interrupted`] (the Python package stops on Ctrl-C
    /// this way while ranks gather to create a communicator).
    pub fn with_interrupt(
        mut self,
        check: std::sync::Arc<crate::wait::InterruptCheck>,
    ) -> Rendezvous {
        self.interrupt = Interrupt(Some(check));
        self
    }

    pub fn env(&self) -> &RankEnv {
        &self.env
    }

    pub fn rank(&self) -> usize {
        self.env.rank
    }

    pub fn world_size(&self) -> usize {
        self.env.world_size
    }

    pub fn token(&self) -> &str {
        &self.env.token
    }

    /// The job's ranks in this group, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// A fresh name for the next communicator of this group in this process (`g<n>`), the same on every rank as long as all ranks create their
    /// communicators in the same order (as they must for collectives anyway). Records and
    /// shared-memory names of one communicator start with it, so they never collide with an
    /// earlier, a closed or a concurrently open communicator of the same job.
    pub(crate) fn next_instance(&self) -> String {
        let mut counters = creation_counter().lock().expect("creation counter");
        let n = counters.entry(self.group_rank()).or_insert(0);
        let instance = format!("g{n}");
        *n += 1;
        instance
    }

    /// How many communicators this process has created in this group so far.
    fn created_so_far(&self) -> u32 {
        let counters = creation_counter().lock().expect("creation counter");
        counters.get(&self.group_rank()).copied().unwrap_or(0)
    }

    /// This rank of this group of this job, as the key of the process's per-group state.
    fn group_rank(&self) -> GroupRank {
        (
            self.env.dir.clone(),
            self.env.token.clone(),
            self.namespace.clone(),
            self.env.rank,
        )
    }

    /// The /dev/shm name of this rank's segment `what` of this group: the job token (so
    /// another job's names never collide and a leftover is attributable) and the group's
    /// namespace in front.
    pub(crate) fn shm_name(&self, what: &str) -> String {
        format!(
            "/{}{}{what}",
            segment_prefix(&self.env.token),
            self.namespace
        )
    }

    /// Removes this rank's record for `key` (once every rank has read it: see
    /// [`Rendezvous::retire_previous_round`]), so a long-lived job does not fill its directory.
    fn retire(&self, key: &str) {
        let _ = fs::remove_file(self.path(key, self.env.rank));
    }

    fn path(&self, key: &str, rank: usize) -> PathBuf {
        self.env
            .dir
            .join(format!("{}{key}.{rank}.json", self.namespace))
    }

    /// Publishes this rank's `value` under `key`, atomically (write, then rename).
    pub fn publish<T: Serialize>(&self, key: &str, value: &T) -> Result<()> {
        let record = Record {
            token: self.env.token.clone(),
            rank: self.env.rank,
            world_size: self.env.world_size,
            value,
        };
        let final_path = self.path(key, self.env.rank);
        let tmp = self.env.dir.join(format!(
            ".{}{key}.{}.{}.tmp",
            self.namespace,
            self.env.rank,
            std::process::id()
        ));
        let io = |what, source| Error::Io {
            what,
            path: tmp.clone(),
            source,
        };
        let bytes = serde_json::to_vec(&record).expect("records serialise");
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| io("cannot write rendezvous record", e))?;
        file.write_all(&bytes)
            .map_err(|e| io("cannot write rendezvous record", e))?;
        drop(file);
        fs::rename(&tmp, &final_path).map_err(|e| io("cannot publish rendezvous record", e))
    }

    /// Every rank's value for `key`, in rank order, once all have published it.
    pub fn gather<T: DeserializeOwned>(&self, key: &str, timeout: Duration) -> Result<Vec<T>> {
        let values = self.gather_records(key, timeout)?;
        self.retire_previous_round(key);
        Ok(values)
    }

    /// Tells the peers that this rank failed to create the communicator this handle was made
    /// for, with `error` as the reason (or, where `error` is a peer's failure, that peer's),
    /// and returns the error to raise here. Peers waiting in a gather of the same creation
    /// stop at once with [`Error::PeerFailed`]. A rank claimed by two processes (the second
    /// finds the first's shared memory) is named as such.
    pub fn abort(&self, error: Error) -> Error {
        let error = match error {
            Error::SharedMemory { name, what: "create", source, .. }
                if source.kind() == std::io::ErrorKind::AlreadyExists =>
            {
                Error::Environment(format!(
                    "rank {rank} was claimed twice: shared memory {name} of rank {rank} already exists, made by another process of this job that also took rank {rank} (or left by one that crashed); give every process its own rank (RANK or rank= from 0 to {})",
                    self.env.world_size - 1,
                    rank = self.env.rank
                ))
            }
            other => other,
        };
        let (cause, reason) = match &error {
            Error::PeerFailed { cause, reason, .. } => (*cause, reason.clone()),
            other => (self.env.rank, other.to_string()),
        };
        let note = AbortNote {
            creation: self.creation,
            pid: std::process::id(),
            cause,
            reason,
        };
        // Best effort: a rank that cannot write here leaves its peers to their deadline.
        let _ = self.publish("abort", &note);
        error
    }

    /// The abort record a peer left for this creation, as the error to stop with: a missing
    /// rank's, or another process's that claimed this rank too.
    fn aborted(&self, missing: &[usize]) -> Option<Error> {
        let me = self.env.rank;
        missing.iter().copied().chain([me]).find_map(|rank| {
            let bytes = fs::read(self.path("abort", rank)).ok()?;
            let record: Record<AbortNote> = serde_json::from_slice(&bytes).ok()?;
            let note = record.value;
            let ours = record.token == self.env.token
                && note.creation == self.creation
                && (rank != me || note.pid != std::process::id());
            ours.then_some(Error::PeerFailed {
                peer: rank,
                cause: note.cause,
                reason: note.reason,
            })
        })
    }

    /// Removes this rank's record of the last round it gathered in this group, which the
    /// next round would have retired. Call it only once every rank is known to have passed
    /// that round (e.g. after a collective of the communicator it created), so that a
    /// finished creation leaves nothing in the directory.
    pub fn retire_last_round(&self) {
        if let Some(last) = previous_rounds()
            .lock()
            .expect("previous round")
            .remove(&self.group_rank())
        {
            self.retire(&last);
        }
    }

    /// Every rank of a group makes the same rounds (publish, then gather) in the same order,
    /// so once every rank has published `key`, every rank has finished gathering the round
    /// before it: this rank's record of that round is never read again and is removed here.
    /// A long-lived job keeps one record per rank and group, not one per round of every
    /// communicator it ever created.
    fn retire_previous_round(&self, key: &str) {
        let previous = previous_rounds()
            .lock()
            .expect("previous round")
            .insert(self.group_rank(), key.to_owned());
        if let Some(previous) = previous.filter(|p| p != key) {
            self.retire(&previous);
        }
    }

    fn gather_records<T: DeserializeOwned>(&self, key: &str, timeout: Duration) -> Result<Vec<T>> {
        let n = self.env.world_size;
        let mut values: Vec<Option<T>> = (0..n).map(|_| None).collect();
        let mut foreign: Vec<PathBuf> = Vec::new();
        let start = Instant::now();
        let mut pause = Duration::from_micros(200);
        loop {
            for (rank, slot) in values.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                let path = self.path(key, rank);
                let bytes = match fs::read(&path) {
                    Ok(b) => b,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(source) => {
                        return Err(Error::Io {
                            what: "cannot read rendezvous record",
                            path,
                            source,
                        })
                    }
                };
                let record: Record<T> =
                    serde_json::from_slice(&bytes).map_err(|source| Error::Record {
                        path: path.clone(),
                        source,
                    })?;
                if record.token != self.env.token {
                    // Left by another job (or planted): never used. Wait for ours.
                    if !foreign.contains(&path) {
                        foreign.push(path);
                    }
                    continue;
                }
                if record.world_size != n || record.rank != rank {
                    return Err(Error::Environment(format!(
                        "rank {} of this job says world size {}, this rank (rank {}) says {n}",
                        record.rank, record.world_size, self.env.rank
                    )));
                }
                *slot = Some(record.value);
            }
            let missing: Vec<usize> = (0..n).filter(|r| values[*r].is_none()).collect();
            if missing.is_empty() {
                return Ok(values
                    .into_iter()
                    .map(|v| v.expect("all present"))
                    .collect());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                let foreign = if foreign.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; refused {} record(s) from another job (token mismatch), e.g. {}: use a fresh directory per job",
                        foreign.len(),
                        foreign[0].display()
                    )
                };
                return Err(Error::RendezvousTimeout {
                    dir: self.env.dir.clone(),
                    missing,
                    waited,
                    phase: key.to_owned(),
                    foreign,
                });
            }
            if let Some(failed) = self.aborted(&missing) {
                return Err(failed);
            }
            if self.interrupt.0.as_ref().is_some_and(|stop| stop()) {
                return Err(Error::Interrupted {
                    peer: missing[0],
                    phase: format!("rendezvous: {key}"),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }

    /// Returns once every rank has reached the barrier named `key`.
    pub fn barrier(&self, key: &str, timeout: Duration) -> Result<()> {
        self.publish(key, &())?;
        self.gather::<()>(key, timeout)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn handles_round_trip_as_hex() {
        let handle: [u8; 64] = std::array::from_fn(|i| (i * 7) as u8);
        assert_eq!(from_hex::<64>(&to_hex(&handle)), Some(handle));
        assert_eq!(from_hex::<64>("zz"), None);
        assert_eq!(from_hex::<2>("0g01"), None);
    }

    #[test]
    fn environment_is_read_torchrun_style() {
        assert_eq!(RankEnv::from_lookup(lookup(&[])).unwrap(), None);
        let env = RankEnv::from_lookup(lookup(&[
            (ENV_RENDEZVOUS, "/tmp/x"),
            (ENV_JOB_TOKEN, "0123456789abcdef"),
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((env.rank, env.world_size, env.local_rank), (2, 4, 2));
        let back = RankEnv::from_lookup(lookup(
            &env.to_vars()
                .iter()
                .map(|(k, v)| (*k, v.as_str()))
                .collect::<Vec<_>>(),
        ))
        .unwrap()
        .unwrap();
        assert_eq!(back, env);
    }

    #[test]
    fn launcher_variables_without_a_rendezvous_or_impossible_local_ranks_are_refused() {
        let err = RankEnv::from_lookup(lookup(&[("RANK", "1"), ("WORLD_SIZE", "4")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("RANK=1 WORLD_SIZE=4") && err.contains(ENV_RENDEZVOUS),
            "{err}"
        );
        // torchrun with one process: nothing to join, not an error.
        assert_eq!(
            RankEnv::from_lookup(lookup(&[("RANK", "0"), ("WORLD_SIZE", "1")])).unwrap(),
            None
        );
        let err = RankEnv::from_lookup(lookup(&[
            ("LOCAL_RANK", "3"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("WORLD_SIZE", "1"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("LOCAL_RANK=3 is not below LOCAL_WORLD_SIZE=2"),
            "{err}"
        );
        let err = RankEnv::from_lookup(lookup(&[
            (ENV_RENDEZVOUS, "/tmp/x"),
            (ENV_JOB_TOKEN, "abcdefgh12"),
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("LOCAL_WORLD_SIZE=2 is more than WORLD_SIZE=1"),
            "{err}"
        );
    }

    #[test]
    fn environment_errors_name_the_variable() {
        let err = RankEnv::from_lookup(lookup(&[(ENV_RENDEZVOUS, "/tmp/x"), ("RANK", "0")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("WORLD_SIZE"), "{err}");
        let err = RankEnv::from_lookup(lookup(&[
            (ENV_RENDEZVOUS, "/tmp/x"),
            ("RANK", "4"),
            ("WORLD_SIZE", "4"),
            (ENV_JOB_TOKEN, "0123456789abcdef"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(err.contains("RANK=4"), "{err}");
        let err = RankEnv::from_lookup(lookup(&[
            (ENV_RENDEZVOUS, "/tmp/x"),
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(err.contains(ENV_JOB_TOKEN), "{err}");
        assert!(check_token("short").is_err());
        assert!(check_token("has space in it").is_err());
        assert!(check_token(&random_token().unwrap()).is_ok());
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("tpar-rdv-test-{tag}-{}", random_token().unwrap()));
        ensure_private_dir(&dir).unwrap();
        dir
    }

    fn env(dir: &Path, token: &str, rank: usize, world_size: usize) -> RankEnv {
        RankEnv {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            dir: dir.to_owned(),
            token: token.to_owned(),
        }
    }

    #[test]
    fn ranks_gather_each_others_values() {
        let dir = temp_dir("gather");
        let token = random_token().unwrap();
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let e = env(&dir, &token, rank, 3);
                std::thread::spawn(move || {
                    let rdv = Rendezvous::join(e).unwrap();
                    rdv.publish("k", &(rank * 10)).unwrap();
                    rdv.gather::<usize>("k", Duration::from_secs(10)).unwrap()
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), vec![0, 10, 20]);
        }
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn an_interrupt_stops_a_gather_naming_the_missing_rank() {
        let dir = temp_dir("interrupt");
        let rdv = Rendezvous::join(env(&dir, "this-job-token", 0, 2))
            .unwrap()
            .with_interrupt(std::sync::Arc::new(|| true));
        rdv.publish("k", &1u8).unwrap();
        let err = rdv.gather::<u8>("k", Duration::from_secs(30)).unwrap_err();
        assert!(matches!(err, Error::Interrupted { peer: 1, .. }), "{err}");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn records_of_another_job_are_refused_and_named() {
        let dir = temp_dir("foreign");
        let other = Rendezvous::join(env(&dir, "another-job-token", 1, 2)).unwrap();
        other.publish("k", &7u32).unwrap();
        let mine = Rendezvous::join(env(&dir, "this-job-token", 0, 2)).unwrap();
        mine.publish("k", &1u32).unwrap();
        let err = mine
            .gather::<u32>("k", Duration::from_millis(200))
            .unwrap_err();
        match &err {
            Error::RendezvousTimeout {
                missing, foreign, ..
            } => {
                assert_eq!(missing, &vec![1]);
                assert!(foreign.contains("another job"), "{err}");
            }
            other => panic!("unexpected {other}"),
        }
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_shared_directory_is_refused() {
        let dir = temp_dir("perm");
        fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let err = Rendezvous::join(env(&dir, "this-job-token", 0, 1)).unwrap_err();
        assert!(matches!(err, Error::InsecureRendezvous { .. }), "{err}");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn records_are_private() {
        let dir = temp_dir("mode");
        let rdv = Rendezvous::join(env(&dir, "this-job-token", 0, 1)).unwrap();
        rdv.publish("k", &1u8).unwrap();
        let meta = fs::metadata(dir.join("k.0.json")).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_rank_that_fails_stops_its_peers_gathers_at_once_naming_the_cause() {
        let dir = temp_dir("abort");
        let token = random_token().unwrap();
        let waiting = {
            let e = env(&dir, &token, 0, 3);
            std::thread::spawn(move || {
                let rdv = Rendezvous::join(e).unwrap();
                rdv.publish("k", &0u8).unwrap();
                let start = Instant::now();
                let err = rdv.gather::<u8>("k", Duration::from_secs(30)).unwrap_err();
                (err, start.elapsed())
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        let failing = Rendezvous::join(env(&dir, &token, 2, 3)).unwrap();
        let raised = failing.abort(Error::InvalidArgument("no such device (test)".into()));
        assert!(matches!(raised, Error::InvalidArgument(_)), "{raised}");
        let (err, waited) = waiting.join().unwrap();
        match &err {
            Error::PeerFailed {
                peer: 2,
                cause: 2,
                reason,
            } => assert!(reason.contains("no such device (test)"), "{err}"),
            other => panic!("unexpected {other}"),
        }
        assert!(
            waited < Duration::from_secs(5),
            "waited {waited:?} of a 30 s deadline"
        );
        assert!(err
            .to_string()
            .starts_with("rank 2 could not create its communicator"));
        // A rank that heard of it passes the first cause on.
        let relay = Rendezvous::join(env(&dir, &token, 1, 3)).unwrap();
        let passed = relay.abort(err);
        assert!(matches!(passed, Error::PeerFailed { cause: 2, .. }));
        // The next creation (each rank took an instance for the failed one) ignores them.
        for rank in 0..3 {
            Rendezvous::join(env(&dir, &token, rank, 3))
                .unwrap()
                .next_instance();
        }
        let next = Rendezvous::join(env(&dir, &token, 0, 3)).unwrap();
        next.publish("k2", &0u8).unwrap();
        let err = next
            .gather::<u8>("k2", Duration::from_millis(300))
            .unwrap_err();
        assert!(matches!(err, Error::RendezvousTimeout { .. }), "{err}");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_rank_claimed_by_a_second_process_is_named_as_such() {
        let dir = temp_dir("claimed");
        let rdv = Rendezvous::join(env(&dir, "this-job-token", 0, 2)).unwrap();
        let exists = Error::SharedMemory {
            name: "/tpar-this-job-token-g0-r0".into(),
            what: "create",
            source: std::io::Error::from_raw_os_error(libc::EEXIST),
            hint: String::new(),
        };
        let err = rdv.abort(exists).to_string();
        assert!(err.contains("rank 0 was claimed twice"), "{err}");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_finished_creation_can_retire_its_last_record() {
        let dir = temp_dir("retire");
        let rdv = Rendezvous::join(env(&dir, "this-job-token", 0, 1)).unwrap();
        rdv.barrier("first", Duration::from_secs(1)).unwrap();
        rdv.barrier("last", Duration::from_secs(1)).unwrap();
        let left: Vec<_> = fs::read_dir(&dir).unwrap().collect();
        assert_eq!(
            left.len(),
            1,
            "the round before the last is retired by the last"
        );
        rdv.retire_last_round();
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
        fs::remove_dir_all(dir).unwrap();
    }
}
