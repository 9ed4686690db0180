//! The library's one error type. Every message names what went wrong and, where there is one,
//! the fix; callers (the CLI, the Python module) show it as it is.

use std::path::PathBuf;
use std::time::Duration;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A peer did not produce what this rank waited for before the deadline.
    #[error(
        "timed out after {waited:.1?} waiting for rank {peer} ({phase}); \
         rank {peer} stopped calling or is stuck (raise the deadline with --timeout / Config::timeout if it is only slow)"
    )]
    PeerTimeout {
        peer: usize,
        phase: String,
        waited: Duration,
    },

    /// A peer process is gone (exited or was killed) while this rank waited for it. `also`
    /// names other ranks found gone at the same check: when one rank dies, the others stop
    /// too, and the first to die is often not the one this rank was waiting for.
    #[error("rank {peer} (pid {pid}) exited while this rank waited for it ({phase}){also}")]
    PeerGone {
        peer: usize,
        pid: u32,
        phase: String,
        also: String,
    },

    /// The caller interrupted a wait (Ctrl-C); the ranks' epochs may no longer agree.
    #[error("interrupted while waiting for rank {peer} ({phase}); this communicator is unusable now: create a new one on every rank")]
    Interrupted { peer: usize, phase: String },

    /// Ranks called the same collective with different arguments.
    #[error("mismatched allreduce call #{seq}: this rank (rank {rank}) passed {mine}, rank {peer} passed {theirs}; every rank must pass the same element count, dtype and algorithm")]
    CallMismatch {
        seq: u32,
        rank: usize,
        mine: String,
        peer: usize,
        theirs: String,
    },

    /// A previous call failed; the ranks' epochs no longer agree, so the communicator refuses
    /// further calls rather than risk a wrong sum.
    #[error("communicator is unusable after an earlier error ({0}); create a new one")]
    Poisoned(String),

    /// Ranks of one job never met at the rendezvous.
    #[error("rendezvous in {dir}: rank(s) {missing:?} did not arrive within {waited:.1?} (phase: {phase}){foreign}")]
    RendezvousTimeout {
        dir: PathBuf,
        missing: Vec<usize>,
        waited: Duration,
        phase: String,
        /// Extra text naming records from another job that were found and refused.
        foreign: String,
    },

    /// Something presented by another job (a record or segment with another token) was refused.
    #[error("refused {what}: it belongs to another job (job token mismatch)")]
    ForeignJob { what: String },

    /// The rendezvous directory is not private.
    #[error("rendezvous directory {dir} is not private ({why}); use a directory of mode 0700 owned by this user")]
    InsecureRendezvous { dir: PathBuf, why: String },

    /// The environment does not describe a rank.
    #[error("invalid rank environment: {0}")]
    Environment(String),

    /// The caller passed something the call cannot take.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// Shared memory could not be created or mapped.
    #[error("shared memory {name}: {what}: {source}{hint}")]
    SharedMemory {
        name: String,
        what: &'static str,
        source: std::io::Error,
        /// A sentence that tells the fix, when one is known (e.g. a full /dev/shm).
        hint: String,
    },

    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("malformed rendezvous record {path}: {source}")]
    Record {
        path: PathBuf,
        source: serde_json::Error,
    },

    /// A CUDA driver call failed, or CUDA is not usable here (the text says which and why).
    #[error("CUDA: {0}")]
    Cuda(String),

    /// A kernel did not compile (the text carries NVRTC's log).
    #[error("kernel compilation: {0}")]
    Compile(String),

    /// The request cannot run on this backend or machine (the text names what would).
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// The dispatcher's typed refusal of a call (`dispatch::NoDecision`): `choice` names the
    /// one the call needed, where there was one (forced, or chosen but not held here),
    /// `reason` is the refusal's code (`dispatch::Reason::code`), so that callers can route
    /// the call elsewhere (the Python edge raises it as `tpar.TparRefused`).
    #[error("unsupported: {message}")]
    Refused {
        choice: Option<&'static str>,
        reason: &'static str,
        message: String,
    },

    /// A peer failed to create its side of a communicator and said so in the rendezvous
    /// (see `Rendezvous::abort`): `reason` is its own error, `cause` the rank whose failure
    /// started it (the peer itself, or a rank it heard of).
    #[error("rank {cause} could not create its communicator: {reason}{relayed}", relayed = if cause == peer { String::new() } else { format!(" (heard from rank {peer})") })]
    PeerFailed {
        peer: usize,
        cause: usize,
        reason: String,
    },

    /// The launcher could not start or finish its ranks.
    #[error("launcher: {0}")]
    Launch(String),
}
