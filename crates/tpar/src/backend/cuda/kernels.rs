//! tpar's kernel sources (in `crates/tpar/kernels/`, one algorithm per file; the shared
//! headers, one concern each, behind the umbrella `tpar_ll.cuh`), the Rust mirror of their
//! argument block, and which kernel runs which algorithm and dtype.

use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::islands::Islands;

/// What names the kernels this build runs: tpar's version and a hash of every kernel source
/// and header with the experiment defines (`TPAR_KERNEL_DEFINES`). Tuning tables keep it, and
/// one measured with other kernels is not used: its times are of code that no longer runs (on
/// one H200 the ring's 1 MiB went from 71 to 38 us between two builds, 2026-12-06). Changes to
/// the host's launch rules alone do not change it.
pub fn build_id() -> String {
    // The sources are constant: hashed once (a communicator asks several times as it is made).
    static SOURCES_HASH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let sources = SOURCES_HASH.get_or_init(|| {
        let hash = crate::hash::fnv1a_texts(
            HEADERS
                .iter()
                .chain(SOURCES.iter())
                .flat_map(|(name, text)| [*name, *text]),
        );
        format!("{hash:016x}")
    });
    let defines = super::nvrtc::extra_defines().join(" ");
    let hash = crate::hash::fnv1a_texts([sources.as_str(), defines.as_str()]);
    format!("{}+{hash:016x}", env!("CARGO_PKG_VERSION"))
}

/// The umbrella header every `.cu` includes (it includes the others).
pub const HEADER_NAME: &str = "tpar_ll.cuh";
pub const HEADER_SOURCE: &str = include_str!("../../../kernels/tpar_ll.cuh");

/// Every header a kernel source may include: (file name, source). NVRTC finds includes only
/// among the headers it is given, and the kernel cache key hashes every one given, so a kernel
/// is compiled with, and cached under, the text of all of them.
pub const HEADERS: [(&str, &str); 8] = [
    (HEADER_NAME, HEADER_SOURCE),
    ("abi.cuh", include_str!("../../../kernels/abi.cuh")),
    ("tuning.cuh", include_str!("../../../kernels/tuning.cuh")),
    (
        "memorder.cuh",
        include_str!("../../../kernels/memorder.cuh"),
    ),
    ("layout.cuh", include_str!("../../../kernels/layout.cuh")),
    ("dtype.cuh", include_str!("../../../kernels/dtype.cuh")),
    ("prims.cuh", include_str!("../../../kernels/prims.cuh")),
    ("fused.cuh", include_str!("../../../kernels/fused.cuh")),
];

/// Every kernel source file: (file name, source).
pub const SOURCES: [(&str, &str); 14] = [
    (
        "oneshot_push.cu",
        include_str!("../../../kernels/oneshot_push.cu"),
    ),
    (
        "twoshot_push.cu",
        include_str!("../../../kernels/twoshot_push.cu"),
    ),
    (
        "oneshot_pull.cu",
        include_str!("../../../kernels/oneshot_pull.cu"),
    ),
    // The PCIe-fabric algorithms (protocol::schedule).
    ("staged.cu", include_str!("../../../kernels/staged.cu")),
    (
        "staged_pull.cu",
        include_str!("../../../kernels/staged_pull.cu"),
    ),
    ("islands.cu", include_str!("../../../kernels/islands.cu")),
    (
        "islands_pull.cu",
        include_str!("../../../kernels/islands_pull.cu"),
    ),
    ("ring.cu", include_str!("../../../kernels/ring.cu")),
    ("floor.cu", include_str!("../../../kernels/floor.cu")),
    ("probe.cu", include_str!("../../../kernels/probe.cu")),
    // Fused allreduce + residual add + RMSNorm (backend/cuda/fused.rs).
    (
        "fused_oneshot.cu",
        include_str!("../../../kernels/fused_oneshot.cu"),
    ),
    (
        "fused_oneshot_small.cu",
        include_str!("../../../kernels/fused_oneshot_small.cu"),
    ),
    (
        "fused_norm.cu",
        include_str!("../../../kernels/fused_norm.cu"),
    ),
    (
        "twoshot_fused.cu",
        include_str!("../../../kernels/twoshot_fused.cu"),
    ),
];

/// The ladder of `tpar bench --anatomy` (`anatomy.cu`): timed by the CLI, never loaded by a
/// communicator. Its kernels are `tpar_anatomy_<rung>` for rungs `0..ANATOMY_RUNGS`.
pub const ANATOMY_SOURCE: (&str, &str) =
    ("anatomy.cu", include_str!("../../../kernels/anatomy.cu"));
pub const ANATOMY_RUNGS: usize = 4;

/// Architectures tpar builds for (compute capability x 10): Ampere to Blackwell.
pub const ARCHITECTURES: [u32; 6] = [80, 86, 89, 90, 100, 120];

/// Mirrors `TPAR_MAX_RANKS` in the header.
pub const MAX_RANKS: usize = crate::algorithm::MAX_RANKS;
/// Mirrors `TPAR_MAX_BLOCKS`.
pub const MAX_BLOCKS: u32 = 64;
/// Mirrors the 128-byte flag stride of the pull algorithms (`TPAR_FLAG_STRIDE_U64` u64s).
pub const FLAG_STRIDE_BYTES: usize = 128;
/// Mirrors `TPAR_PULL_PHASES`: flags per buffer and block of the pull algorithms.
pub const PULL_PHASES: usize = 3;
/// Threads per block of every kernel at most (`TPAR_THREADS`, its `__launch_bounds__`): the
/// push algorithms' small launches take smaller blocks (`communicator::spread_shape`).
pub const THREADS: u32 = 512;
/// `TparArgs::flags`: the islands exchange in its all-units form (`TPAR_FLAG_ISLANDS_ALL_UNITS`).
pub const FLAG_ISLANDS_ALL_UNITS: u32 = 1;
/// A rank's device state (`TparArgs::state`): the epoch of its last launch, the blocks done,
/// then the lines where a fused launch's blocks exchange segment sums
/// (`TPAR_STATE_EXCHANGE_LINES`).
pub const STATE_BYTES: usize = 16 + 8 * crate::norm::EXCHANGE_LINES;

/// Error word codes (`TPAR_ERR_*` in abi.cuh).
pub const ERR_TIMEOUT: u64 = 1;
pub const ERR_MISMATCH: u64 = 2;
/// Where each field sits in the error word (`TPAR_ERR_*_SHIFT`): code in bits 0..8, then the
/// peer, the phase, the header field (a byte each) and the detail (the high 32 bits).
pub const ERR_PEER_SHIFT: u32 = 8;
pub const ERR_PHASE_SHIFT: u32 = 16;
pub const ERR_FIELD_SHIFT: u32 = 24;
pub const ERR_DETAIL_SHIFT: u32 = 32;

/// The phase of a call an error word names (`TPAR_PHASE_*`).
pub const PHASE_HEADER: u64 = 1;
pub const PHASE_ONE_SHOT: u64 = 2;
pub const PHASE_REDUCE_SCATTER: u64 = 3;
pub const PHASE_ALL_GATHER: u64 = 4;
pub const PHASE_PULL_FLAG: u64 = 5;
pub const PHASE_STAGED: u64 = 6;
pub const PHASE_ISLANDS_INSIDE: u64 = 7;
pub const PHASE_ISLANDS_ACROSS: u64 = 8;
pub const PHASE_ISLANDS_GATHER: u64 = 9;
pub const PHASE_RING_REDUCE: u64 = 10;
pub const PHASE_RING_GATHER: u64 = 11;

/// What a user reads for a phase code of the error word.
pub fn phase_name(code: u64) -> &'static str {
    match code {
        PHASE_HEADER => "header exchange",
        PHASE_ONE_SHOT => "one-shot receive",
        PHASE_REDUCE_SCATTER => "two-shot reduce-scatter",
        PHASE_ALL_GATHER => "two-shot all-gather",
        PHASE_PULL_FLAG => "pull: waiting for the peer's flag",
        PHASE_STAGED => "staged receive",
        PHASE_ISLANDS_INSIDE => "islands: the island's inputs",
        PHASE_ISLANDS_ACROSS => "islands: another island's partial",
        PHASE_ISLANDS_GATHER => "islands: the island's results",
        PHASE_RING_REDUCE => "ring reduce-scatter",
        PHASE_RING_GATHER => "ring all-gather",
        _ => "unknown phase",
    }
}

/// The kernels' argument block (`struct TparArgs` in the header), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KernelArgs {
    pub input: u64,
    pub output: u64,
    pub count: u64,
    pub total_count: u64,
    pub payload_lines: u64,
    pub timeout_ns: u64,
    pub state: u64,
    pub error: u64,
    /// Every rank's inbox as this rank writes its lines there (device memory, host memory for
    /// host-staged, and for the islands' exchange between islands where it goes through host
    /// memory: `inboxes_by_pair` in the communicator).
    pub inboxes: [u64; MAX_RANKS],
    /// The islands kernels: this rank's inbox that each rank's lines arrive in (its host inbox
    /// for ranks of other islands where the islands exchange through host memory, whose
    /// `inboxes` entries are then their host inboxes; else its device inbox). Other kernels
    /// read their own inbox from `inboxes`.
    pub recv_inboxes: [u64; MAX_RANKS],
    pub rank: u32,
    pub world_size: u32,
    pub chunk: u32,
    pub algo: u32,
    /// The call's identity every LL line carries ([`call_hash`]).
    pub call_hash: u32,
    /// `TPAR_FLAG_*` (abi.cuh): how the islands exchange runs.
    pub flags: u32,
    /// The island partition, as the islands kernels look it up.
    pub islands: IslandTables,
}

/// The island partition as the kernels take it (the `island_*` fields of `struct TparArgs`):
/// every lookup the islands kernels make per unit (an island's size, its member at a
/// position, a rank's position) is one load, not a count over the ranks.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IslandTables {
    /// The island of each rank, islands numbered by their lowest rank.
    pub island_of: [u8; MAX_RANKS],
    /// Each rank's index among its island's members (rank order).
    pub position: [u8; MAX_RANKS],
    /// The ranks island by island, each island's in rank order.
    pub members: [u8; MAX_RANKS],
    /// Where each island's ranks start in `members`.
    pub first: [u8; MAX_RANKS],
    /// How many ranks each island has.
    pub sizes: [u8; MAX_RANKS],
    /// How many islands.
    pub count: u8,
}

impl IslandTables {
    /// For kernels that take no islands (every field 0).
    pub const NONE: IslandTables = IslandTables {
        island_of: [0; MAX_RANKS],
        position: [0; MAX_RANKS],
        members: [0; MAX_RANKS],
        first: [0; MAX_RANKS],
        sizes: [0; MAX_RANKS],
        count: 0,
    };
}

impl From<&Islands> for IslandTables {
    fn from(islands: &Islands) -> IslandTables {
        let mut t = IslandTables::NONE;
        // Every value fits a byte: ranks, islands and positions are below MAX_RANKS.
        let byte = |v: usize| v as u8;
        t.island_of = islands.island_of_ranks();
        t.count = byte(islands.count());
        let mut next = 0;
        for island in 0..islands.count() {
            t.first[island] = byte(next);
            for (position, rank) in islands.members(island).enumerate() {
                t.members[next] = byte(rank);
                t.position[rank] = byte(position);
                next += 1;
            }
            t.sizes[island] = byte(next) - t.first[island];
        }
        t
    }
}

/// The identity of one launch of a call (`TparArgs::call_hash`; header word 6): a hash of the
/// header words a peer must agree on (count, dtype with the op's flags, algorithm, chunk),
/// never 0. Every LL line of the launch carries `tag ^ call_hash` beside its tag, so a line
/// from a peer that called with other arguments never satisfies a wait (layout.cuh).
pub fn call_hash(total_count: u64, header_code: u32, algorithm: Algorithm, chunk: u32) -> u32 {
    let words = [
        total_count as u32,
        (total_count >> 32) as u32,
        header_code | u32::from(algorithm.code()) << 8,
        chunk,
    ];
    let h = crate::hash::fnv1a(words.iter().flat_map(|w| w.to_le_bytes()));
    match (h ^ (h >> 32)) as u32 {
        0 => 1,
        folded => folded,
    }
}

/// Every kernel a communicator launches, as a key built once: the loader looks each one up
/// at load time into an array indexed by [`KernelId::index`], so a launch indexes an array
/// instead of building and hashing a name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// One-shot push (also host-staged: the same kernel over host inboxes).
    OneShotPush(DType),
    TwoShotPush(DType),
    OneShotPull(DType),
    StagedPush(DType),
    StagedPull(DType),
    IslandsPush(DType),
    IslandsPull(DType),
    Ring(DType),
    /// Allreduce + residual add + RMSNorm in one kernel (`fused_oneshot.cu`).
    FusedOneShot(DType),
    /// The same compiled with one wait site per peer, for small world sizes (fused.rs,
    /// `FUSED_PEER_SITE_RANKS`).
    FusedOneShotPeerSites(DType),
    /// The same with one wait site per peer on blocks smaller than [`THREADS`], whose warps
    /// exchange their sums (`fused_oneshot_small.cu`; fused.rs, `fused_block_threads`).
    FusedOneShotSmallBlocks(DType),
    /// The same kernel whose row's blocks are one thread block cluster (sm_90+): the warps'
    /// sums go into every block's shared memory instead of through device memory
    /// (`fused_oneshot_small.cu`; fused.rs, `cluster_per_row`).
    FusedOneShotSmallClusters(DType),
    /// [`KernelId::FusedOneShot`] whose row's blocks are one thread block cluster (sm_90+):
    /// the segment sums go into every block's shared memory (`fused_oneshot.cu`).
    FusedOneShotClusters(DType),
    /// [`KernelId::FusedOneShotPeerSites`] in clusters, as above.
    FusedOneShotPeerSitesClusters(DType),
    /// The separate residual add + RMSNorm after an allreduce (`fused_norm.cu`).
    AddRmsNorm(DType),
    /// Two-shot allreduce + residual add + RMSNorm in one kernel (`twoshot_fused.cu`).
    FusedTwoShot(DType),
    /// The empty kernel with the allreduce's launch shape: the fixed cost floor.
    Empty,
    /// The init link measurement's copy and flag ping-pong (`probe.cu`).
    ProbeCopy,
    ProbePingpong,
}

/// Position of `dtype` in [`DType::ALL`] (f32, f16, bf16).
const fn dtype_index(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Bf16 => 2,
    }
}

/// Names per dtype in [`DType::ALL`]'s order.
const fn by_dtype(dtype: DType, names: [&'static str; 3]) -> &'static str {
    names[dtype_index(dtype)]
}

impl KernelId {
    /// How many kernels a communicator looks up.
    pub const COUNT: usize = 51;

    /// Every key, at its index.
    pub const ALL: [KernelId; KernelId::COUNT] = {
        use DType::{Bf16, F16, F32};
        use KernelId::*;
        [
            OneShotPush(F32),
            OneShotPush(F16),
            OneShotPush(Bf16),
            TwoShotPush(F32),
            TwoShotPush(F16),
            TwoShotPush(Bf16),
            OneShotPull(F32),
            OneShotPull(F16),
            OneShotPull(Bf16),
            FusedOneShot(F32),
            FusedOneShot(F16),
            FusedOneShot(Bf16),
            AddRmsNorm(F32),
            AddRmsNorm(F16),
            AddRmsNorm(Bf16),
            FusedTwoShot(F32),
            FusedTwoShot(F16),
            FusedTwoShot(Bf16),
            StagedPush(F32),
            StagedPush(F16),
            StagedPush(Bf16),
            StagedPull(F32),
            StagedPull(F16),
            StagedPull(Bf16),
            IslandsPush(F32),
            IslandsPush(F16),
            IslandsPush(Bf16),
            IslandsPull(F32),
            IslandsPull(F16),
            IslandsPull(Bf16),
            Ring(F32),
            Ring(F16),
            Ring(Bf16),
            Empty,
            ProbeCopy,
            ProbePingpong,
            FusedOneShotPeerSites(F32),
            FusedOneShotPeerSites(F16),
            FusedOneShotPeerSites(Bf16),
            FusedOneShotSmallBlocks(F32),
            FusedOneShotSmallBlocks(F16),
            FusedOneShotSmallBlocks(Bf16),
            FusedOneShotSmallClusters(F32),
            FusedOneShotSmallClusters(F16),
            FusedOneShotSmallClusters(Bf16),
            FusedOneShotClusters(F32),
            FusedOneShotClusters(F16),
            FusedOneShotClusters(Bf16),
            FusedOneShotPeerSitesClusters(F32),
            FusedOneShotPeerSitesClusters(F16),
            FusedOneShotPeerSitesClusters(Bf16),
        ]
    };

    /// The allreduce kernel of `algorithm` on `dtype`, or None where the CUDA backend has no
    /// kernel for it.
    pub const fn allreduce(algorithm: Algorithm, dtype: DType) -> Option<KernelId> {
        match algorithm {
            Algorithm::OneShot | Algorithm::HostStaged => Some(KernelId::OneShotPush(dtype)),
            Algorithm::TwoShot => Some(KernelId::TwoShotPush(dtype)),
            Algorithm::OneShotPull => Some(KernelId::OneShotPull(dtype)),
            Algorithm::Staged => Some(KernelId::StagedPush(dtype)),
            Algorithm::StagedPull => Some(KernelId::StagedPull(dtype)),
            Algorithm::Islands => Some(KernelId::IslandsPush(dtype)),
            Algorithm::IslandsPull => Some(KernelId::IslandsPull(dtype)),
            Algorithm::Ring => Some(KernelId::Ring(dtype)),
        }
    }

    /// Where this kernel sits in [`KernelId::ALL`] and in the loader's array.
    pub const fn index(self) -> usize {
        match self {
            KernelId::OneShotPush(d) => dtype_index(d),
            KernelId::TwoShotPush(d) => 3 + dtype_index(d),
            KernelId::OneShotPull(d) => 6 + dtype_index(d),
            KernelId::FusedOneShot(d) => 9 + dtype_index(d),
            KernelId::AddRmsNorm(d) => 12 + dtype_index(d),
            KernelId::FusedTwoShot(d) => 15 + dtype_index(d),
            KernelId::StagedPush(d) => 18 + dtype_index(d),
            KernelId::StagedPull(d) => 21 + dtype_index(d),
            KernelId::IslandsPush(d) => 24 + dtype_index(d),
            KernelId::IslandsPull(d) => 27 + dtype_index(d),
            KernelId::Ring(d) => 30 + dtype_index(d),
            KernelId::Empty => 33,
            KernelId::ProbeCopy => 34,
            KernelId::ProbePingpong => 35,
            KernelId::FusedOneShotPeerSites(d) => 36 + dtype_index(d),
            KernelId::FusedOneShotSmallBlocks(d) => 39 + dtype_index(d),
            KernelId::FusedOneShotSmallClusters(d) => 42 + dtype_index(d),
            KernelId::FusedOneShotClusters(d) => 45 + dtype_index(d),
            KernelId::FusedOneShotPeerSitesClusters(d) => 48 + dtype_index(d),
        }
    }

    /// The `extern "C"` function name in its module.
    pub const fn name(self) -> &'static str {
        match self {
            KernelId::OneShotPush(d) => by_dtype(
                d,
                [
                    "tpar_oneshot_push_f32",
                    "tpar_oneshot_push_f16",
                    "tpar_oneshot_push_bf16",
                ],
            ),
            KernelId::TwoShotPush(d) => by_dtype(
                d,
                [
                    "tpar_twoshot_push_f32",
                    "tpar_twoshot_push_f16",
                    "tpar_twoshot_push_bf16",
                ],
            ),
            KernelId::OneShotPull(d) => by_dtype(
                d,
                [
                    "tpar_oneshot_pull_f32",
                    "tpar_oneshot_pull_f16",
                    "tpar_oneshot_pull_bf16",
                ],
            ),
            KernelId::FusedOneShot(d) => by_dtype(
                d,
                [
                    "tpar_fused_oneshot_f32",
                    "tpar_fused_oneshot_f16",
                    "tpar_fused_oneshot_bf16",
                ],
            ),
            KernelId::FusedOneShotPeerSites(d) => by_dtype(
                d,
                [
                    "tpar_fused_oneshot_peer_sites_f32",
                    "tpar_fused_oneshot_peer_sites_f16",
                    "tpar_fused_oneshot_peer_sites_bf16",
                ],
            ),
            KernelId::FusedOneShotSmallBlocks(d) => by_dtype(
                d,
                [
                    "tpar_fused_oneshot_small_blocks_f32",
                    "tpar_fused_oneshot_small_blocks_f16",
                    "tpar_fused_oneshot_small_blocks_bf16",
                ],
            ),
            KernelId::FusedOneShotSmallClusters(d) => by_dtype(
                d,
                [
                    "tpar_fused_oneshot_small_clusters_f32",
                    "tpar_fused_oneshot_small_clusters_f16",
                    "tpar_fused_oneshot_small_clusters_bf16",
                ],
            ),
            KernelId::FusedOneShotClusters(d) => by_dtype(
                d,
                [
                    "tpar_fused_oneshot_clusters_f32",
                    "tpar_fused_oneshot_clusters_f16",
                    "tpar_fused_oneshot_clusters_bf16",
                ],
            ),
            KernelId::FusedOneShotPeerSitesClusters(d) => by_dtype(
                d,
                [
                    "tpar_fused_oneshot_peer_sites_clusters_f32",
                    "tpar_fused_oneshot_peer_sites_clusters_f16",
                    "tpar_fused_oneshot_peer_sites_clusters_bf16",
                ],
            ),
            KernelId::AddRmsNorm(d) => by_dtype(
                d,
                [
                    "tpar_add_rms_norm_f32",
                    "tpar_add_rms_norm_f16",
                    "tpar_add_rms_norm_bf16",
                ],
            ),
            KernelId::FusedTwoShot(d) => by_dtype(
                d,
                [
                    "tpar_fused_twoshot_f32",
                    "tpar_fused_twoshot_f16",
                    "tpar_fused_twoshot_bf16",
                ],
            ),
            KernelId::StagedPush(d) => by_dtype(
                d,
                [
                    "tpar_staged_push_f32",
                    "tpar_staged_push_f16",
                    "tpar_staged_push_bf16",
                ],
            ),
            KernelId::StagedPull(d) => by_dtype(
                d,
                [
                    "tpar_staged_pull_f32",
                    "tpar_staged_pull_f16",
                    "tpar_staged_pull_bf16",
                ],
            ),
            KernelId::IslandsPush(d) => by_dtype(
                d,
                [
                    "tpar_islands_push_f32",
                    "tpar_islands_push_f16",
                    "tpar_islands_push_bf16",
                ],
            ),
            KernelId::IslandsPull(d) => by_dtype(
                d,
                [
                    "tpar_islands_pull_f32",
                    "tpar_islands_pull_f16",
                    "tpar_islands_pull_bf16",
                ],
            ),
            KernelId::Ring(d) => by_dtype(d, ["tpar_ring_f32", "tpar_ring_f16", "tpar_ring_bf16"]),
            KernelId::Empty => "tpar_empty",
            KernelId::ProbeCopy => "tpar_probe_copy",
            KernelId::ProbePingpong => "tpar_probe_pingpong",
        }
    }

    /// The source file (in [`SOURCES`]) that defines it.
    pub const fn file(self) -> &'static str {
        match self {
            KernelId::OneShotPush(_) => "oneshot_push.cu",
            KernelId::TwoShotPush(_) => "twoshot_push.cu",
            KernelId::OneShotPull(_) => "oneshot_pull.cu",
            KernelId::FusedOneShot(_)
            | KernelId::FusedOneShotPeerSites(_)
            | KernelId::FusedOneShotClusters(_)
            | KernelId::FusedOneShotPeerSitesClusters(_) => "fused_oneshot.cu",
            KernelId::FusedOneShotSmallBlocks(_) | KernelId::FusedOneShotSmallClusters(_) => {
                "fused_oneshot_small.cu"
            }
            KernelId::AddRmsNorm(_) => "fused_norm.cu",
            KernelId::FusedTwoShot(_) => "twoshot_fused.cu",
            KernelId::StagedPush(_) => "staged.cu",
            KernelId::StagedPull(_) => "staged_pull.cu",
            KernelId::IslandsPush(_) => "islands.cu",
            KernelId::IslandsPull(_) => "islands_pull.cu",
            KernelId::Ring(_) => "ring.cu",
            KernelId::Empty => "floor.cu",
            KernelId::ProbeCopy | KernelId::ProbePingpong => "probe.cu",
        }
    }

    /// The form of this fused one-shot kernel whose row's blocks run as one thread block
    /// cluster, or None for kernels without one.
    pub const fn in_clusters(self) -> Option<KernelId> {
        match self {
            KernelId::FusedOneShotSmallBlocks(d) => Some(KernelId::FusedOneShotSmallClusters(d)),
            KernelId::FusedOneShot(d) => Some(KernelId::FusedOneShotClusters(d)),
            KernelId::FusedOneShotPeerSites(d) => Some(KernelId::FusedOneShotPeerSitesClusters(d)),
            _ => None,
        }
    }

    /// Whether its blocks spin waiting for peers, so all must be resident at once: these
    /// bound the blocks per SM of the co-residency check (the empty kernel and the probe,
    /// launched alone with their own shapes, do not).
    pub const fn spins(self) -> bool {
        !matches!(
            self,
            KernelId::Empty | KernelId::ProbeCopy | KernelId::ProbePingpong
        )
    }
}

/// The kernels of `tpar bench --anatomy`'s ladder (`anatomy.cu`), rung by rung.
pub const ANATOMY_KERNELS: [&str; ANATOMY_RUNGS] = [
    "tpar_anatomy_0",
    "tpar_anatomy_1",
    "tpar_anatomy_2",
    "tpar_anatomy_3",
];

/// The source file and function name of the kernel for `algorithm` on `dtype`, for code that
/// loads a module itself (the CLI's anatomy ladder); communicators use [`KernelId`].
pub fn kernel_for(algorithm: Algorithm, dtype: DType) -> Option<(&'static str, String)> {
    let id = KernelId::allreduce(algorithm, dtype)?;
    Some((id.file(), id.name().to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::nvrtc;
    use crate::error::Error;
    use crate::protocol::header::{HEADER_LINES, HEADER_MAGIC};
    use crate::protocol::layout::{BUFFERS, SEGMENT_HEADER_LINES};

    /// The value of `#define name` in the kernel headers, which must define it exactly once
    /// (tuning knobs, under `#ifndef`, are not mirrored and not read here).
    fn define(name: &str) -> u64 {
        let lines: Vec<(&str, &str)> = HEADERS
            .iter()
            .flat_map(|(file, source)| source.lines().map(move |l| (*file, l)))
            .filter(|(_, l)| l.starts_with("#define") && l.split_whitespace().nth(1) == Some(name))
            .collect();
        assert_eq!(
            lines.len(),
            1,
            "{name} must be defined once in the kernel headers: {lines:?}"
        );
        let value = lines[0]
            .1
            .split_whitespace()
            .nth(2)
            .unwrap()
            .trim_end_matches('u');
        match value.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).unwrap(),
            None => value.parse().unwrap(),
        }
    }

    /// The files named by `#include "..."` in `source`.
    fn includes(source: &str) -> Vec<&str> {
        source
            .lines()
            .filter_map(|l| l.trim().strip_prefix("#include \""))
            .filter_map(|rest| rest.split('"').next())
            .collect()
    }

    #[test]
    fn every_include_is_a_registered_header_and_every_header_is_used() {
        let registered: Vec<&str> = HEADERS.iter().map(|(name, _)| *name).collect();
        let mut reached: Vec<&str> = Vec::new();
        let mut pending: Vec<(&str, &str)> = SOURCES.into_iter().chain([ANATOMY_SOURCE]).collect();
        while let Some((file, source)) = pending.pop() {
            for included in includes(source) {
                assert!(
                    registered.contains(&included),
                    "{file} includes {included}, which is not in HEADERS (NVRTC would not find it)"
                );
                if !reached.contains(&included) {
                    reached.push(included);
                    pending.extend(HEADERS.iter().copied().filter(|(n, _)| *n == included));
                }
            }
        }
        for name in registered {
            assert!(
                reached.contains(&name),
                "{name} is registered but no kernel includes it"
            );
        }
    }

    #[test]
    fn the_header_and_the_rust_protocol_agree() {
        assert_eq!(define("TPAR_HEADER_LINES"), HEADER_LINES as u64);
        assert_eq!(define("TPAR_BUFFERS"), BUFFERS as u64);
        assert_eq!(
            define("TPAR_SEGMENT_HEADER_LINES"),
            SEGMENT_HEADER_LINES as u64
        );
        assert_eq!(define("TPAR_HEADER_MAGIC"), u64::from(HEADER_MAGIC));
        assert_eq!(define("TPAR_MAX_RANKS"), MAX_RANKS as u64);
        assert_eq!(define("TPAR_MAX_BLOCKS"), u64::from(MAX_BLOCKS));
        assert_eq!(define("TPAR_THREADS"), u64::from(THREADS));
        assert_eq!(
            define("TPAR_FLAG_ISLANDS_ALL_UNITS"),
            u64::from(FLAG_ISLANDS_ALL_UNITS)
        );
        assert_eq!(
            define("TPAR_HEADER_ISLANDS_ALL"),
            u64::from(super::super::errors::HEADER_ISLANDS_ALL)
        );
        assert_eq!(
            16 + 8 * define("TPAR_STATE_EXCHANGE_LINES"),
            STATE_BYTES as u64
        );
        assert_eq!(define("TPAR_FLAG_STRIDE_U64") * 8, FLAG_STRIDE_BYTES as u64);
        assert_eq!(define("TPAR_ERR_TIMEOUT"), ERR_TIMEOUT);
        assert_eq!(define("TPAR_ERR_MISMATCH"), ERR_MISMATCH);
        for (name, shift) in [
            ("TPAR_ERR_PEER_SHIFT", ERR_PEER_SHIFT),
            ("TPAR_ERR_PHASE_SHIFT", ERR_PHASE_SHIFT),
            ("TPAR_ERR_FIELD_SHIFT", ERR_FIELD_SHIFT),
            ("TPAR_ERR_DETAIL_SHIFT", ERR_DETAIL_SHIFT),
        ] {
            assert_eq!(define(name), u64::from(shift), "{name}");
        }
        for d in DType::ALL {
            assert_eq!(
                define(&format!("TPAR_DTYPE_{}", d.name().to_uppercase())),
                u64::from(d.code())
            );
        }
        for (a, name) in [
            (Algorithm::OneShot, "TPAR_ALGO_ONE_SHOT"),
            (Algorithm::TwoShot, "TPAR_ALGO_TWO_SHOT"),
            (Algorithm::OneShotPull, "TPAR_ALGO_ONE_SHOT_PULL"),
            (Algorithm::HostStaged, "TPAR_ALGO_HOST_STAGED"),
            (Algorithm::Staged, "TPAR_ALGO_STAGED"),
            (Algorithm::StagedPull, "TPAR_ALGO_STAGED_PULL"),
            (Algorithm::Islands, "TPAR_ALGO_ISLANDS"),
            (Algorithm::IslandsPull, "TPAR_ALGO_ISLANDS_PULL"),
            (Algorithm::Ring, "TPAR_ALGO_RING"),
        ] {
            assert_eq!(define(name), u64::from(a.code()), "{name}");
        }
        assert_eq!(define("TPAR_PULL_PHASES"), PULL_PHASES as u64);
        assert_eq!(
            define("TPAR_FIELD_NOTICE"),
            super::super::errors::FIELD_NOTICE
        );
    }

    /// How a kernel written out in full in a `.cu` file begins its line.
    const KERNEL_DECLARATION: &str = "extern \"C\" __global__";

    /// The instantiation macros of `abi.cuh`: a line `MACRO(stem, body, Args)` in a source declares
    /// one kernel `stem_<suffix>` per suffix.
    const INSTANTIATION_MACROS: [&str; 1] = ["TPAR_KERNELS_PER_DTYPE"];

    /// The suffixes `macro_name` appends to its stem: the dtype names, or the anatomy rungs.
    fn instantiation_suffixes(macro_name: &str) -> Vec<String> {
        match macro_name {
            "TPAR_KERNELS_PER_DTYPE" => DType::ALL.iter().map(|d| d.name().to_owned()).collect(),
            other => unreachable!("{other} is not an instantiation macro"),
        }
    }

    /// The kernels a source file declares, by name (test only: the loader looks kernels up by
    /// [`KernelId`]): each `extern "C" __global__` line (the first
    /// word after the return type and the launch bound, `__launch_bounds__(...)` or
    /// `TPAR_LAUNCH_BOUNDS`, up to its parameter list) and
    /// each instantiation macro's expansion.
    fn kernel_names(source: &str) -> Vec<String> {
        let mut names = Vec::new();
        for line in source.lines() {
            if let Some(rest) = line.strip_prefix(KERNEL_DECLARATION) {
                names.extend(
                    rest.split_whitespace()
                        .filter(|word| {
                            *word != "void"
                                && *word != "TPAR_LAUNCH_BOUNDS"
                                && !word.starts_with("__launch_bounds__")
                        })
                        .map(|word| word.split('(').next().unwrap_or(word).to_owned())
                        .next(),
                );
                continue;
            }
            for macro_name in INSTANTIATION_MACROS {
                let Some(arguments) = line
                    .strip_prefix(macro_name)
                    .and_then(|rest| rest.strip_prefix('('))
                else {
                    continue;
                };
                let stem = arguments.split(',').next().unwrap_or_default().trim();
                names.extend(
                    instantiation_suffixes(macro_name)
                        .iter()
                        .map(|suffix| format!("{stem}_{suffix}")),
                );
            }
        }
        names
    }

    #[test]
    fn every_key_sits_at_its_index() {
        for (i, id) in KernelId::ALL.into_iter().enumerate() {
            assert_eq!(id.index(), i, "{id:?}");
        }
        let mut names: Vec<&str> = KernelId::ALL.iter().map(|k| k.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), KernelId::COUNT, "two keys share a name");
    }

    #[test]
    fn every_key_names_a_kernel_declared_in_its_file_and_every_kernel_has_a_key() {
        let mut declared = Vec::new();
        for (file, source) in SOURCES {
            declared.extend(kernel_names(source).into_iter().map(|n| (file, n)));
        }
        for id in KernelId::ALL {
            assert!(
                declared.contains(&(id.file(), id.name().to_owned())),
                "{id:?}: {} is not declared in {}",
                id.name(),
                id.file()
            );
        }
        for (file, name) in &declared {
            assert!(
                KernelId::ALL
                    .iter()
                    .any(|k| k.name() == name && k.file() == *file),
                "{file} declares {name}, which no KernelId names (the loader would never load it)"
            );
        }
        for a in Algorithm::ALL {
            for d in DType::ALL {
                let Some((file, function)) = kernel_for(a, d) else {
                    continue;
                };
                let source = SOURCES.iter().find(|(f, _)| *f == file).unwrap().1;
                assert!(kernel_names(source).contains(&function), "{function}");
            }
        }
    }

    #[test]
    fn every_anatomy_rung_has_a_kernel_and_nothing_more() {
        let expected: Vec<String> = (0..ANATOMY_RUNGS)
            .map(|rung| format!("tpar_anatomy_{rung}"))
            .collect();
        assert_eq!(kernel_names(ANATOMY_SOURCE.1), expected);
        assert_eq!(ANATOMY_KERNELS.map(str::to_owned).to_vec(), expected);
    }

    #[test]
    fn kernel_names_are_found_in_sources() {
        let names = kernel_names(SOURCES[0].1);
        assert_eq!(
            names,
            [
                "tpar_oneshot_push_f32",
                "tpar_oneshot_push_f16",
                "tpar_oneshot_push_bf16"
            ]
        );
    }

    #[test]
    fn every_kernel_file_yields_plain_function_names() {
        // Each file's names must be C identifiers that the module lookup can find: a parse
        // that returned a brace or a fragment of a parameter list failed every load on a GPU.
        let mut all = Vec::new();
        for (file, source) in SOURCES {
            let names = kernel_names(source);
            assert!(!names.is_empty(), "{file} declares no kernel");
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
        assert!(all.contains(&KernelId::Empty.name().to_owned()), "{all:?}");
        let mut unique = all.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(
            unique.len(),
            all.len(),
            "a kernel name is declared twice: {all:?}"
        );
    }

    /// The names [`kernel_names`] derives from an instantiation line must be the ones the
    /// macro's definition in the header pastes together, with the launch bound the host uses.
    #[test]
    fn instantiation_macros_declare_the_names_rust_expects() {
        let abi = HEADERS.iter().find(|(n, _)| *n == "abi.cuh").unwrap().1;
        for macro_name in INSTANTIATION_MACROS {
            let definition: Vec<&str> = abi
                .lines()
                .skip_while(|l| !l.starts_with(&format!("#define {macro_name}(NAME,")))
                .scan(true, |continued, l| {
                    let this = continued.then_some(l);
                    *continued = l.ends_with('\\');
                    this
                })
                .collect();
            assert!(
                !definition.is_empty(),
                "{macro_name} is not defined in abi.cuh"
            );
            let pasted: Vec<String> = definition
                .iter()
                .filter_map(|l| l.split("NAME##_").nth(1))
                .map(|rest| rest.split('(').next().unwrap().to_owned())
                .collect();
            assert_eq!(pasted, instantiation_suffixes(macro_name), "{macro_name}");
            let bounded = definition
                .iter()
                .filter(|l| l.contains("TPAR_LAUNCH_BOUNDS NAME##_"))
                .count();
            assert_eq!(
                bounded,
                pasted.len(),
                "{macro_name}: every kernel has the launch bound"
            );
        }
        // Whichever way tuning.cuh's knob is set, the bound is THREADS threads a block.
        let tuning = HEADERS.iter().find(|(n, _)| *n == "tuning.cuh").unwrap().1;
        let bounds: Vec<&str> = tuning
            .lines()
            .filter_map(|l| l.strip_prefix("#define TPAR_LAUNCH_BOUNDS "))
            .collect();
        assert_eq!(
            bounds.len(),
            2,
            "tuning.cuh defines TPAR_LAUNCH_BOUNDS both ways"
        );
        for bound in bounds {
            assert!(
                bound.starts_with("__launch_bounds__(TPAR_THREADS"),
                "TPAR_LAUNCH_BOUNDS is {bound}"
            );
        }
    }

    #[test]
    fn every_phase_of_the_header_has_its_rust_code_and_a_name() {
        let rust = [
            ("TPAR_PHASE_HEADER", PHASE_HEADER),
            ("TPAR_PHASE_ONE_SHOT", PHASE_ONE_SHOT),
            ("TPAR_PHASE_REDUCE_SCATTER", PHASE_REDUCE_SCATTER),
            ("TPAR_PHASE_ALL_GATHER", PHASE_ALL_GATHER),
            ("TPAR_PHASE_PULL_FLAG", PHASE_PULL_FLAG),
            ("TPAR_PHASE_STAGED", PHASE_STAGED),
            ("TPAR_PHASE_ISLANDS_INSIDE", PHASE_ISLANDS_INSIDE),
            ("TPAR_PHASE_ISLANDS_ACROSS", PHASE_ISLANDS_ACROSS),
            ("TPAR_PHASE_ISLANDS_GATHER", PHASE_ISLANDS_GATHER),
            ("TPAR_PHASE_RING_REDUCE", PHASE_RING_REDUCE),
            ("TPAR_PHASE_RING_GATHER", PHASE_RING_GATHER),
        ];
        // Every TPAR_PHASE_ the headers define is one of these: a phase added on the kernel
        // side alone would reach users as "unknown phase".
        let defined: Vec<&str> = HEADERS
            .iter()
            .flat_map(|(_, source)| source.lines())
            .filter_map(|l| l.strip_prefix("#define "))
            .filter_map(|l| l.split_whitespace().next())
            .filter(|name| name.starts_with("TPAR_PHASE_"))
            .collect();
        assert_eq!(defined, rust.map(|(name, _)| name));
        let mut names = Vec::new();
        for (name, code) in rust {
            assert_eq!(define(name), code, "{name}");
            assert_ne!(phase_name(code), phase_name(0), "{name} has no name");
            names.push(phase_name(code));
        }
        names.sort();
        names.dedup();
        assert_eq!(names.len(), rust.len(), "two phases share a name");
    }

    /// The fields of `struct name` in the kernel headers, in order: (C type, field, elements).
    fn c_struct_fields(name: &str) -> Vec<(String, String, usize)> {
        let opening = format!("struct {name} {{");
        let (file, source) = HEADERS
            .iter()
            .find(|(_, s)| s.lines().any(|l| l.trim() == opening))
            .unwrap_or_else(|| panic!("struct {name} is not in the kernel headers"));
        source
            .lines()
            .skip_while(|l| l.trim() != opening)
            .skip(1)
            .take_while(|l| l.trim() != "};")
            .map(|l| l.split("//").next().unwrap().trim())
            .filter(|l| !l.is_empty())
            .map(|l| {
                let declaration = l
                    .strip_suffix(';')
                    .unwrap_or_else(|| panic!("{file}: {l:?} is not one field"));
                let (c_type, declarator) = declaration.rsplit_once(' ').unwrap();
                let (field, elements) = match declarator.split_once('[') {
                    Some((field, rest)) => {
                        let length = rest.trim_end_matches(']');
                        let n = length.parse().unwrap_or_else(|_| define(length) as usize);
                        (field, n)
                    }
                    None => (declarator, 1),
                };
                (c_type.trim().to_owned(), field.to_owned(), elements)
            })
            .collect()
    }

    /// Size (and alignment) of the C types the argument blocks use, on a 64-bit target.
    fn c_size(c_type: &str) -> usize {
        match c_type {
            t if t.ends_with('*') => 8,
            "u64" => 8,
            "u32" => 4,
            "unsigned char" => 1,
            other => panic!("no size known for the C type {other:?}: add it here"),
        }
    }

    #[test]
    fn the_island_tables_answer_every_lookup_as_the_partition_does() {
        // The kernels' lookups (layout.cuh) over the tables, against Islands' own answers.
        let mut partitions: Vec<Islands> =
            (1..=MAX_RANKS).flat_map(Islands::test_partitions).collect();
        partitions.push(Islands::parse("0,3:1,2", 4).unwrap());
        partitions.push(Islands::parse("3+5", 8).unwrap());
        for islands in partitions {
            let t = IslandTables::from(&islands);
            assert_eq!(usize::from(t.count), islands.count(), "{islands}");
            for island in 0..islands.count() {
                let size = usize::from(t.sizes[island]);
                assert_eq!(size, islands.size(island), "{islands}: island {island}");
                for position in 0..size {
                    let member = t.members[usize::from(t.first[island]) + position];
                    assert_eq!(
                        usize::from(member),
                        islands.member(island, position),
                        "{islands}"
                    );
                }
            }
            for rank in 0..islands.world_size() {
                assert_eq!(usize::from(t.island_of[rank]), islands.island_of(rank));
                assert_eq!(
                    usize::from(t.position[rank]),
                    islands.position(rank),
                    "{islands}: rank {rank}"
                );
            }
        }
    }

    #[test]
    fn kernel_args_has_the_layout_of_tpar_args() {
        // Each Rust field: (name, offset, size); the C side is laid out from the header text.
        let rust = [
            ("input", std::mem::offset_of!(KernelArgs, input), 8),
            ("output", std::mem::offset_of!(KernelArgs, output), 8),
            ("count", std::mem::offset_of!(KernelArgs, count), 8),
            (
                "total_count",
                std::mem::offset_of!(KernelArgs, total_count),
                8,
            ),
            (
                "payload_lines",
                std::mem::offset_of!(KernelArgs, payload_lines),
                8,
            ),
            (
                "timeout_ns",
                std::mem::offset_of!(KernelArgs, timeout_ns),
                8,
            ),
            ("state", std::mem::offset_of!(KernelArgs, state), 8),
            ("error", std::mem::offset_of!(KernelArgs, error), 8),
            (
                "inboxes",
                std::mem::offset_of!(KernelArgs, inboxes),
                8 * MAX_RANKS,
            ),
            (
                "recv_inboxes",
                std::mem::offset_of!(KernelArgs, recv_inboxes),
                8 * MAX_RANKS,
            ),
            ("rank", std::mem::offset_of!(KernelArgs, rank), 4),
            (
                "world_size",
                std::mem::offset_of!(KernelArgs, world_size),
                4,
            ),
            ("chunk", std::mem::offset_of!(KernelArgs, chunk), 4),
            ("algo", std::mem::offset_of!(KernelArgs, algo), 4),
            ("call_hash", std::mem::offset_of!(KernelArgs, call_hash), 4),
            ("flags", std::mem::offset_of!(KernelArgs, flags), 4),
        ];
        // The island tables are the C struct's last fields, one by one.
        use std::mem::offset_of;
        let at = |name, field: usize, size| (name, offset_of!(KernelArgs, islands) + field, size);
        let rust: Vec<(&str, usize, usize)> = rust
            .into_iter()
            .chain([
                at("island_of", offset_of!(IslandTables, island_of), MAX_RANKS),
                at(
                    "island_position",
                    offset_of!(IslandTables, position),
                    MAX_RANKS,
                ),
                at(
                    "island_members",
                    offset_of!(IslandTables, members),
                    MAX_RANKS,
                ),
                at("island_first", offset_of!(IslandTables, first), MAX_RANKS),
                at("island_sizes", offset_of!(IslandTables, sizes), MAX_RANKS),
                at("islands", offset_of!(IslandTables, count), 1),
            ])
            .collect();
        let mut c = Vec::new();
        let (mut offset, mut align) = (0usize, 1usize);
        for (c_type, field, elements) in c_struct_fields("TparArgs") {
            let size = c_size(&c_type);
            offset = offset.next_multiple_of(size);
            align = align.max(size);
            c.push((field, offset, size * elements));
            offset += size * elements;
        }
        let c_total = offset.next_multiple_of(align);
        let c: Vec<(&str, usize, usize)> = c.iter().map(|(f, o, s)| (f.as_str(), *o, *s)).collect();
        assert_eq!(c, rust, "struct TparArgs (abi.cuh) and KernelArgs differ");
        assert_eq!(std::mem::size_of::<KernelArgs>(), c_total);
    }

    /// Compiles every kernel for every architecture. Needs NVRTC but no GPU; CI sets
    /// TPAR_REQUIRE_NVRTC=1 so that a missing NVRTC fails instead of skipping.
    #[test]
    fn every_kernel_compiles_for_every_architecture() {
        if !nvrtc::nvrtc_present() {
            let why = "NVRTC not loadable (pip install nvidia-cuda-nvrtc; put nvidia/cu13/lib on LD_LIBRARY_PATH)";
            assert!(
                std::env::var("TPAR_REQUIRE_NVRTC").is_err(),
                "TPAR_REQUIRE_NVRTC is set but {why}"
            );
            eprintln!("SKIPPED every_kernel_compiles_for_every_architecture: {why}");
            return;
        }
        let version = nvrtc::nvrtc_version().unwrap();
        let jobs: Vec<(u32, &str, &str)> = ARCHITECTURES
            .into_iter()
            .flat_map(|arch| {
                SOURCES
                    .into_iter()
                    .chain([ANATOMY_SOURCE])
                    .map(move |(name, source)| (arch, name, source))
            })
            .collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cubins = nvrtc::side_by_side(&jobs, threads, |&(arch, name, source)| {
            nvrtc::compile_cubin(name, source, &HEADERS, arch)
                .map_err(|e| Error::Compile(format!("{name} sm_{arch} (NVRTC {version:?}): {e}")))
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let mut cubin_bytes: std::collections::BTreeMap<u32, usize> = Default::default();
        for (&(arch, name, _), cubin) in jobs.iter().zip(cubins) {
            if name != ANATOMY_SOURCE.0 {
                *cubin_bytes.entry(arch).or_default() += cubin.len();
            }
            {
                assert!(
                    cubin.starts_with(b"\x7fELF"),
                    "{name} sm_{arch}: not an ELF CUBIN"
                );
                // The symbols the loader looks up by key are in the module (whatever macros
                // the source uses to declare them).
                for id in KernelId::ALL.into_iter().filter(|k| k.file() == name) {
                    let symbol = [id.name().as_bytes(), b"\0"].concat();
                    assert!(
                        cubin.windows(symbol.len()).any(|w| w == symbol),
                        "{name} sm_{arch}: no symbol {}",
                        id.name()
                    );
                }
            }
        }
        // The planned footprint counts what loading the kernels takes as their CUBINs in whole
        // 2 MiB pages, as the driver takes device memory (group.rs, PLANNED_MODULE_BYTES_BY_ARCH
        // and reserved_device_bytes): each entry must be that, so kernels that grow (or shrink)
        // past a page change the plan with them.
        let mut stale = Vec::new();
        for (&arch, &bytes) in &cubin_bytes {
            let pages = super::super::group::reserved_device_bytes(bytes);
            let planned = crate::backend::cuda::PLANNED_MODULE_BYTES_BY_ARCH
                .iter()
                .find(|(a, _)| *a == arch)
                .map(|(_, planned)| *planned);
            eprintln!("sm_{arch}: kernels' CUBINs {bytes} bytes, {pages} in 2 MiB pages");
            if planned != Some(pages) {
                stale.push(format!(
                    "sm_{arch}: CUBINs {bytes} bytes, planned {planned:?}: set its entry to {pages}"
                ));
            }
        }
        assert!(
            stale.is_empty(),
            "PLANNED_MODULE_BYTES_BY_ARCH (group.rs) must be each architecture's kernel CUBINs in \
             whole 2 MiB pages:\n{}",
            stale.join("\n")
        );
        eprintln!(
            "compiled {} kernel files for sm_{:?} with NVRTC {version:?}",
            SOURCES.len(),
            ARCHITECTURES
        );
    }
}
