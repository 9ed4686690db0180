//! The settings every rank of a communicator must agree on, one type for every backend (the
//! CPU communicator, tpar's CUDA communicator and the [`crate::Communicator`] over it), the
//! CLI and the Python package's `timeout=` and `chunk_bytes=`.
//!
//! Ranks that disagree on the chunk size or on host-staged inboxes are refused when the
//! communicator is created (their buffers would not line up); the timeout is each rank's own.

use std::time::Duration;

/// Settings every rank of a communicator must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Longest wait for a peer (a CPU rank's wait, a kernel's spin, a rendezvous round)
    /// before a call fails with [`crate::Error::PeerTimeout`]. Default 30 s: far beyond any
    /// healthy call (microseconds) or a slow peer's start-up, short enough that a dead peer
    /// fails the job instead of hanging it.
    pub timeout: Duration,
    /// Payload bytes of one chunk: a larger call is cut into chunks of this size, each one
    /// exchange (one kernel launch on a GPU). Every inbox slot holds a chunk, so a rank's
    /// inbox takes about 6 x (world size + 1) x this many bytes on CUDA (an 8-byte line
    /// carries 4 payload bytes; three buffers by epoch) and 2 x (world size + 1) x on the CPU
    /// (plain data, two buffers; its islands and ring chunks of 16-bit dtypes carry half, so
    /// that their f32 partials fit a slot). `None`: each backend's own default,
    /// [`Config::CPU_CHUNK_BYTES`] or [`Config::CUDA_CHUNK_BYTES`] (their docs say why they
    /// differ); read it through [`Config::cpu_chunk_bytes`] / [`Config::cuda_chunk_bytes`].
    pub chunk_bytes: Option<usize>,
    /// CUDA only: also build pinned host-memory inboxes, so the host-staged algorithm can run
    /// (the one path for GPUs without peer access). Default on: it costs one inbox of shared
    /// host memory per rank and no device memory. The CPU backend has no other kind of inbox.
    pub host_staged: bool,
    /// The islands the islands algorithms reduce over. `None`: what the machine says (on CUDA
    /// the GPUs' PCIe switches, root complexes, sockets and peer access; the CPU backend one
    /// island), else [`crate::islands::ENV_ISLANDS`]. Every rank must give the same partition.
    pub islands: Option<crate::islands::Islands>,
}

impl Config {
    /// The default deadline for a peer.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

    /// The CPU backend's chunk when none is given: 128 KiB. Its inboxes live in /dev/shm,
    /// which containers keep small (Docker's default is 64 MiB): at 128 KiB the CPU self-test
    /// ran there with up to 6 ranks, at 256 KiB with only 4 (2026-12-01, a 64 MiB tmpfs on
    /// /dev/shm, with the LL layout; at 8 ranks one inbox set took 54 MiB at 128 KiB, 108 MiB
    /// at 256 KiB; the CPU's plain layout since takes a third of that). The
    /// 256 KiB chunk itself is sound on the CPU: `tpar selftest --backend cpu -n 7` and `-n 8`
    /// passed 10 runs each at load averages up to 15 on 2 cores, after the wait fix that
    /// explained an earlier failure there (`wait::Watch::gone_peers`).
    pub const CPU_CHUNK_BYTES: usize = 128 << 10;

    /// The CUDA backend's chunk when none is given: 256 KiB, so that every message the custom
    /// kernels are chosen for (the dispatcher hands sizes above a few hundred KiB to two-shot
    /// or NCCL) is one kernel launch. Device memory is the cheap side: about 13.5 MiB of
    /// inboxes per rank at 8 ranks.
    pub const CUDA_CHUNK_BYTES: usize = 256 << 10;

    /// The smallest chunk the CPU backend and Python's `chunk_bytes=` accept (smaller chunks
    /// only multiply the exchanges).
    pub const MIN_CHUNK_BYTES: usize = 64;

    /// The largest chunk the CUDA backend and Python's `chunk_bytes=` accept: 1 GiB. A
    /// launch's units must fit 32 bits (the kernels split them in 32-bit arithmetic,
    /// layout.cuh `share_start`); a ring launch carries up to MAX_RANKS chunks, 2^31 units
    /// at this size.
    pub const MAX_CHUNK_BYTES: usize = 1 << 30;

    /// The chunk the CPU backend uses with these settings.
    pub fn cpu_chunk_bytes(&self) -> usize {
        self.chunk_bytes.unwrap_or(Self::CPU_CHUNK_BYTES)
    }

    /// The chunk the CUDA backend uses with these settings.
    pub fn cuda_chunk_bytes(&self) -> usize {
        self.chunk_bytes.unwrap_or(Self::CUDA_CHUNK_BYTES)
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Self::DEFAULT_TIMEOUT,
            chunk_bytes: None,
            host_staged: true,
            islands: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_chunk_reaches_both_backends_and_none_takes_each_default() {
        let default = Config::default();
        assert_eq!(default.cpu_chunk_bytes(), Config::CPU_CHUNK_BYTES);
        assert_eq!(default.cuda_chunk_bytes(), Config::CUDA_CHUNK_BYTES);
        let given = Config {
            chunk_bytes: Some(4096),
            ..Config::default()
        };
        assert_eq!(
            (given.cpu_chunk_bytes(), given.cuda_chunk_bytes()),
            (4096, 4096)
        );
    }
}
