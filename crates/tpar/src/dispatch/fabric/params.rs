//! The physical parameters of the fabric model, each with where it comes from: link
//! bandwidths and per-hop latencies of each kind of path, the cost of tpar's kernels around
//! the data (from tpar's own runs on H200s, bench/README.md), NCCL's own cost model
//! constants, and the write fan-out rule's collapsed bandwidth. Published figures are in
//! `../shared/pcie-published.md` (tables A-E, copied with their sources into
//! `crates/tpar/fixtures/published/`); a machine's own measurements (`tpar doctor`, a
//! topology file's `measured`) replace the defaults where they exist.

use crate::topology::PathClass;

/// PCIe bandwidth of one x16 link, per direction, GB/s, by generation: what a GPU moves to a
/// peer alone. Gen5: table A's one pair (52.5 written, 53.4 read) and table B's single hop on
/// sm_120 (53.2-55.0); Gen4: table B's single hop on L40S (26.26); Gen3: the same 83% of the
/// raw 15.75 GB/s that Gen4 and Gen5 reach (26.26 / 31.5, 53 / 63). A narrower link scales by
/// its width.
pub fn pcie_gbps(generation: Option<u32>, width: Option<u32>) -> f64 {
    let x16 = match generation {
        Some(g) if g <= 3 => 13.1,
        Some(4) => 26.3,
        // Gen5 and unknown: the generation of the machines tpar is for.
        _ => 53.0,
    };
    let width = f64::from(width.unwrap_or(16).clamp(1, 16));
    x16 * width / 16.0
}

/// One-way latency of a flag written by one GPU until its peer sees it, us, by path. PIX: a
/// posted P2P write hop on PCIe Gen5 is 0.36-0.45 us (DESIGN.md, published figures); NODE and
/// SYS: the CUDA sample's P2P latency on table D's host, 0.71-0.74 us within a socket and
/// 1.27-1.36 us across (queued 16-byte copies, the nearest published figure); PXB and PHB lie
/// between. NVLink: `tpar doctor`'s flag latency on 4 H200s, 0.65-0.67 us (bench/README.md,
/// e92132c).
pub fn hop_us(path: PathClass) -> f64 {
    match path {
        PathClass::Nvlink => 0.66,
        PathClass::SameSwitch => 0.40,
        PathClass::MultipleSwitches => 0.50,
        PathClass::HostBridge => 0.60,
        PathClass::SameNumaNode => 0.72,
        PathClass::CrossNuma => 1.31,
    }
}

/// Latency of a flag between two ranks on one GPU (device memory), one way: half the 0.85 us
/// round trip between two streams measured on one H200 (DESIGN.md).
pub const LOCAL_HOP_US: f64 = 0.42;

/// A hop through pinned host memory (written over one GPU's link, polled by the peer over
/// its own), us: what NCCL's shared-memory hop costs on table D's host, 65.6 us at 4 KiB over
/// 14 LL ring steps, less NCCL's own 6.6 us and 1.0 us a step, is 3.2 us for the slowest
/// step, which crosses the sockets ([`CROSS_SOCKET_US`]): 2.6 within a socket. About the
/// 1.67 us GPU-host flag round trip (DESIGN.md) and a poll of host memory (1.15 us).
pub const HOST_HOP_US: f64 = 2.6;

/// What tpar's host-staged kernel adds to each hop through host memory today, us: its header
/// exchange and a second round trip there (host-staged took 7.87 us at 4 KiB with 2 ranks on
/// one H200 against one-shot's 2.86, issue 25; issue 25 item 3 is to remove it).
pub const TPAR_HOST_EXTRA_US: f64 = 2.6;

/// Host memory (and the CPU's IO die) that every transfer through pinned host memory crosses
/// twice, per socket, GB/s: tpar's host-staged on 4 H200s moved 12 MB through it in 62.77 us
/// at 256 KiB, far below four x16 links (bench/README.md, e92132c).
pub const HOST_MEMORY_GBPS: f64 = 190.0;

/// One GPU read of pinned host memory (a non-posted PCIe round trip), us: 1.15 on one H200
/// (DESIGN.md).
pub const HOST_READ_US: f64 = 1.15;

/// What crossing a CPU socket adds to a hop through host memory: the difference between
/// table D's cross-socket and same-socket P2P latencies (1.27-1.36 against 0.71-0.74 us).
pub const CROSS_SOCKET_US: f64 = 0.6;

/// The link between two CPU sockets, per direction, GB/s, where the machine's is not known:
/// table B's 4+4 L40S host moved 9.70 GB/s per flow with four flows across at once (38.8 in
/// all); the lower of its two hosts (the sm_120 host: 4 x 23.75 = 95).
pub const SOCKET_LINK_GBPS: f64 = 38.8;

/// Device memory bandwidth for ranks sharing one GPU, as tpar's LL writes use it, GB/s: 8
/// ranks on one H200 ran one-shot at 64 and 80 KiB in 7.53 and 9.60 us (7.3 and 9.2 MB of
/// LL lines written) against 4.26 us at 4 KiB (bench/README.md, 2026-12-01).
pub const LOCAL_GBPS: f64 = 2500.0;

/// NVLink per GPU and direction, GB/s: `tpar doctor` on 4 H200s, every GPU to every peer at
/// once, 338 GB/s pushed (bench/README.md, e92132c).
pub const NVLINK_GBPS: f64 = 338.0;

/// A tpar kernel in a CUDA-graph chain before any peer traffic, us: 2 ranks on one H200 ran
/// one-shot at 0 B in 2.12 us (issue 25), one local hop and one inbound stream included.
pub const CALL_US: f64 = 1.25;

/// What each step of an algorithm adds beyond its hop (the wait loop and fences), us: the
/// two-shot's second step on one H200 (5.8 against one-shot's 4.1 us at 4 KiB, 2 ranks, the
/// step and a hop; bench/README.md, 277b255).
pub const STEP_US: f64 = 0.25;

/// Polling and reducing one more inbound stream in a step, us: one-shot at 4 KiB took 4.26 us
/// with 8 ranks on one H200 against 2.86 with 2 (six more streams; issue 25).
pub const INBOUND_US: f64 = 0.23;

/// The largest payload one tpar kernel launch carries (`Config::CUDA_CHUNK_BYTES`): a larger
/// call is several launches, each paying the call and its steps' latency again. One-shot at
/// 1 MiB took 20.05 us on 2 H200s against 4.92 at 256 KiB (bench/README.md, 5260727).
pub const CHUNK_BYTES: u64 = crate::config::Config::CUDA_CHUNK_BYTES as u64;

/// The collapsed write bandwidth of one source (a switch, or a GPU without one) that writes to
/// peers behind two or more root complexes at once, GB/s, where nothing was measured: the
/// lowest published, table C's 2.6 GB/s of peer writes under load (reads held at ~52). Until a
/// machine is measured the model assumes its writes collapse that far.
pub const FANOUT_WRITE_GBPS: f64 = 2.6;

/// Below this fraction of the pair bandwidth, fanned-out writes count as collapsed (the model
/// then says so of every plan that fans out).
pub const COLLAPSED_BELOW: f64 = 0.5;

/// NCCL's own cost model (NVIDIA/nccl `src/graph/tuning.cc`: `baseLat`, `hwLat`; LL on PCIe
/// per pcie-published.md section 4): a base per call and a latency per ring step, per
/// protocol; to each PCIe step the model adds the hop of the ring's slowest path, which NCCL's
/// constants leave out (table E: 19.4 us at 4 KiB over 6 steps on one PLX switch).
pub mod nccl {
    /// LL: base and per ring step on PCIe (section 4: about 1.0 us a step plus 6.6 us).
    pub const LL_BASE_US: f64 = 6.6;
    pub const LL_STEP_PCIE_US: f64 = 1.0;
    /// LL on NVLink: `hwLat` NVLink ring LL.
    pub const LL_STEP_NVLINK_US: f64 = 0.47;
    /// Simple: `baseLat` ring Simple, `hwLat` ring Simple on PCIe and NVLink.
    pub const SIMPLE_BASE_US: f64 = 8.4;
    pub const SIMPLE_STEP_PCIE_US: f64 = 5.7;
    pub const SIMPLE_STEP_NVLINK_US: f64 = 3.4;
    /// LL128 (NVLink only: off on PCIe, section 4): `baseLat` and `hwLat` NVLink ring LL128;
    /// 120 of every 128 bytes carry data.
    pub const LL128_BASE_US: f64 = 14.0;
    pub const LL128_STEP_NVLINK_US: f64 = 1.9;
    pub const LL128_PAYLOAD: f64 = 120.0 / 128.0;
}
