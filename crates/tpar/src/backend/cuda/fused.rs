//! Fused allreduce + residual add + RMSNorm on the CUDA backend (issue 15): the launch of
//! `fused_oneshot.cu` (one-shot push and host-staged, each row spread over blocks; on smaller
//! blocks `fused_oneshot_small.cu`, see `fused_block_threads`), of
//! `twoshot_fused.cu` (two-shot: each row segment reduced and normalised by its owner) and of
//! the separate norm kernel `fused_norm.cu` that follows a plain allreduce wherever no fused
//! kernel runs (NCCL, pull, rows above the fused kernels' longest). Both paths give the same
//! bits: the semantics and the CPU reference are in [`crate::norm`]; the path is picked by
//! `dispatch::decide_fused` and given to the launch. The entry an engine calls,
//! with the dispatcher's decision for the allreduce, is on the call path:
//! `Communicator::fused_add_rms_norm` (crate::communicator's `fused` module).

use cudarc::driver::CudaStream;

use super::errors::HEADER_FUSED;
use super::kernels::{KernelArgs, KernelId, MAX_BLOCKS, THREADS};
use super::knobs::Knob;
use super::loader::MAX_CLUSTER;
use super::span::FusedOperands;
// The fused op's operands are defined with the other operands, in `span.rs`.
pub use super::span::{FusedCall, FusedInput, FusedResidual, FusedSpans};
use super::{driver, CudaCommunicator};
use crate::algorithm::Algorithm;
use crate::error::Result;
use crate::norm;

/// The epilogue's operands (`struct TparNormArgs` in fused.cuh), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct NormArgs {
    sum: u64,
    residual: u64,
    residual_out: u64,
    weight: u64,
    y: u64,
    hidden: u64,
    rows: u64,
    eps: f32,
    /// Blocks sharing one row (fused kernel; the grid is a multiple of it).
    blocks_per_row: u32,
}

/// `struct TparFusedArgs`: the allreduce's block, then the epilogue's.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FusedArgs {
    base: KernelArgs,
    norm: NormArgs,
}

impl CudaCommunicator {
    /// Queues the fused op with its allreduce on tpar's `algorithm`, as the fused kernel where
    /// `fused` (the dispatcher's `decide_fused`) says so, else the allreduce into `y` and the
    /// separate norm kernel; its operands given as spans checked against this rank's GPU,
    /// `stream`, one dtype and the call's shape.
    pub fn fused_add_rms_norm(
        &self,
        spans: FusedSpans<'_>,
        algorithm: Algorithm,
        fused: bool,
        stream: &CudaStream,
    ) -> Result<()> {
        let operands = FusedOperands::check(&spans, self.ctx.ordinal(), stream)?;
        self.refuse_unsupported(algorithm)?;
        // The spans live until this returns, after the work is queued.
        self.fused_enqueue(&operands, algorithm, fused, stream)
    }

    /// Lines of one inbox chunk: what a fused launch's rows must fit (an input of the
    /// dispatcher's `fused_eligibility`).
    pub fn payload_lines(&self) -> usize {
        self.layout.payload_lines
    }

    /// Queues the fused op with its allreduce on tpar's `algorithm`: the fused kernel where
    /// `fused` (the dispatcher's decision) says so, else the allreduce into `y` followed by
    /// the separate norm kernel.
    pub(crate) fn fused_enqueue(
        &self,
        operands: &FusedOperands,
        algorithm: Algorithm,
        fused: bool,
        cuda_stream: &CudaStream,
    ) -> Result<()> {
        let call = operands.call();
        let stream = cuda_stream.cu_stream();
        if !call.validate()? {
            return Ok(());
        }
        if !fused {
            // The allreduce checks the error word.
            return self.unfused_enqueue(operands, algorithm, cuda_stream);
        }
        // The dispatcher's fused_eligibility let it through; launching a kernel that does not
        // exist or rows that do not fit would be a bug, never a fallback.
        assert!(
            norm::has_fused_kernel(algorithm)
                && norm::rows_per_chunk(call.dtype, call.hidden, self.layout.payload_lines) > 0,
            "fused {algorithm} launched for rows of {} that the dispatcher refuses",
            call.hidden
        );
        // Both fused kernels take launches of whole rows, as many as norm::rows_per_chunk:
        // one-shot's slot holds the launch's quads by rows; two-shot's stage-one and gather
        // slots hold them at the same positions and the segment sums in lines the quads leave
        // free (twoshot_fused.cu).
        self.check()?;
        self.assert_supported(algorithm);
        driver::bind(&self.ctx)?;
        self.next_call(call.elements() as u64, call.dtype, algorithm, true);
        let rows_per_chunk =
            norm::rows_per_chunk(call.dtype, call.hidden, self.layout.payload_lines);
        let quads = norm::row_quads(call.dtype, call.hidden) as u32;
        static SMALL_ON_WHOLE: Knob = Knob::new("TPAR_FUSED_SMALL_KERNEL_WHOLE_BLOCKS");
        for (index, first) in (0..call.tokens).step_by(rows_per_chunk).enumerate() {
            let rows = rows_per_chunk.min(call.tokens - first);
            let per_peer_sites = peer_sites(self.world_size, rows, fused_peer_site_ranks());
            let threads = fused_block_threads(
                algorithm,
                per_peer_sites,
                rows as u32,
                quads,
                self.max_blocks,
                self.kernels.pdl,
            );
            let kernel = match algorithm {
                Algorithm::TwoShot => KernelId::FusedTwoShot(call.dtype),
                Algorithm::OneShot
                    if threads < THREADS
                        || (per_peer_sites
                            && small_kernel_on_whole_blocks(rows, SMALL_ON_WHOLE.get())) =>
                {
                    KernelId::FusedOneShotSmallBlocks(call.dtype)
                }
                Algorithm::OneShot if per_peer_sites => KernelId::FusedOneShotPeerSites(call.dtype),
                _ => KernelId::FusedOneShot(call.dtype),
            };
            let (units, spread) = launch_units(algorithm, rows as u32, quads.div_ceil(threads));
            // The shape chosen for PDL stays where PDL may not follow the last grid (as the
            // allreduce's, same_grid_behind_last): its rows keep the blocks it was cut for.
            let (grid, shaped_for_pdl) =
                fused_shape(units, spread, self.max_blocks, self.kernels.pdl);
            let per_row = blocks_per_row(spread, self.max_blocks, shaped_for_pdl);
            let clustered = kernel
                .in_clusters()
                .filter(|_| self.in_clusters(grid, threads, per_row, rows));
            let cluster = if clustered.is_some() { per_row } else { 1 };
            let pdl = self.same_grid_behind_last(
                clustered.unwrap_or(kernel),
                grid,
                threads,
                cluster,
                shaped_for_pdl,
            );
            let args = self.fused_chunk_args(call, algorithm, index, first, rows, per_row);
            // SAFETY: the argument block mirrors TparFusedArgs; inboxes, state and error are
            // ours for the communicator's lifetime; the operands are checked (or promised at
            // the FFI edge). The kernels run griddepcontrol.wait before touching memory. A
            // cluster form is launched in clusters of a row's blocks, as it is written for.
            unsafe {
                match clustered {
                    Some(clustered) => self
                        .kernels
                        .get(clustered)
                        .launch_cluster(grid, threads, per_row, stream, &args, pdl)?,
                    None => self
                        .kernels
                        .get(kernel)
                        .launch_ex(grid, threads, stream, &args, pdl)?,
                }
            };
        }
        Ok(())
    }

    /// Whether the fused one-shot launch of `rows` rows on `grid` blocks of `threads`,
    /// `per_row` to a row, runs in its cluster form: where [`clusters_wanted`] and
    /// [`clusters_fit`].
    fn in_clusters(&self, grid: u32, threads: u32, per_row: u32, rows: usize) -> bool {
        static CLUSTERS: Knob = Knob::new("TPAR_FUSED_CLUSTERS");
        clusters_wanted(threads, rows, CLUSTERS.get())
            && clusters_fit(
                grid,
                per_row,
                self.kernels.active_clusters(threads, per_row),
                self.max_blocks,
                self.kernels.sm_count * self.kernels.blocks_per_sm,
            )
    }

    /// The argument block of launch `index` of a fused call: its rows `first .. first + rows`,
    /// each shared by `blocks_per_row` blocks (one-shot's kernel; two-shot's ignores it).
    fn fused_chunk_args(
        &self,
        call: &FusedCall,
        algorithm: Algorithm,
        index: usize,
        first: usize,
        rows: usize,
        blocks_per_row: u32,
    ) -> FusedArgs {
        let offset = (first * call.hidden * call.dtype.size()) as u64;
        let residual_out = call.residual_out.unwrap_or(call.residual);
        FusedArgs {
            // Header words 2 and 3: tokens and hidden, so that calls of the same total size
            // but another row length are named as a mismatch.
            base: self.kernel_args(
                algorithm,
                index,
                (call.x + offset, 0),
                (rows * call.hidden) as u64,
                (
                    call.tokens as u64 | (call.hidden as u64) << 32,
                    u32::from(call.dtype.code()) | HEADER_FUSED,
                ),
            ),
            norm: NormArgs {
                sum: 0,
                residual: call.residual + offset,
                residual_out: residual_out + offset,
                weight: call.weight,
                y: call.y + offset,
                hidden: call.hidden as u64,
                rows: rows as u64,
                eps: call.eps,
                blocks_per_row,
            },
        }
    }

    /// The unfused sequence with the same results: the allreduce of `x` into `y` on tpar's
    /// `algorithm`, then the separate residual add + RMSNorm kernel reading `y`.
    pub(crate) fn unfused_enqueue(
        &self,
        operands: &FusedOperands,
        algorithm: Algorithm,
        stream: &CudaStream,
    ) -> Result<()> {
        let call = operands.call();
        if !call.validate()? {
            return Ok(());
        }
        self.enqueue(&operands.allreduce(), algorithm, stream)?;
        // The allreduce's last launch, as it was made (its grid, spread or squeezed).
        let before = self.last_launch().map_or(0, |launch| launch.grid);
        self.norm_enqueue(operands, NormInput::Y, Some(before), stream)
    }

    /// Queues the separate residual add + RMSNorm kernel on the rounded allreduce output,
    /// read from `y` or `x` as `sum` says. `after_grid`: the blocks of the spinning kernel just
    /// before it on `stream` (`Some(0)` when none spins; `None` when unknown).
    ///
    /// With programmatic dependent launch this kernel's blocks become resident while that
    /// kernel still spins, so PDL is used only where both grids fit this rank's share of the
    /// co-resident blocks: 8 ranks sharing one H200 deadlocked (a timeout in the all-gather)
    /// when a 16-block two-shot was followed by an 8-block norm kernel with PDL (2026-12-01).
    pub(crate) fn norm_enqueue(
        &self,
        operands: &FusedOperands,
        sum: NormInput,
        after_grid: Option<u32>,
        stream: &CudaStream,
    ) -> Result<()> {
        let call = operands.call();
        let sum = match sum {
            NormInput::Y => call.y,
            NormInput::X => call.x,
        };
        if !call.validate()? {
            return Ok(());
        }
        driver::bind(&self.ctx)?;
        let args = NormArgs {
            sum,
            residual: call.residual,
            residual_out: call.residual_out.unwrap_or(call.residual),
            weight: call.weight,
            y: call.y,
            hidden: call.hidden as u64,
            rows: call.tokens as u64,
            eps: call.eps,
            blocks_per_row: 1,
        };
        // No spinning: any grid is correct; one block per row up to what fills the GPU.
        let grid = (call.tokens as u32)
            .min(self.kernels.sm_count * self.kernels.blocks_per_sm)
            .max(1);
        let kernel = KernelId::AddRmsNorm(call.dtype);
        let pdl = self.same_grid_behind_last(
            kernel,
            grid,
            THREADS,
            1,
            self.kernels.pdl && after_grid.is_some(),
        );
        let f = self.kernels.get(kernel);
        // SAFETY: the argument block mirrors TparNormArgs; the operands are checked (or
        // promised at the FFI edge). The kernel waits for its predecessor
        // (griddepcontrol.wait) first.
        unsafe { f.launch_ex(grid, THREADS, stream.cu_stream(), &args, pdl) }
    }
}

/// Where the separate norm kernel reads the rounded allreduce output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NormInput {
    /// `y`: the allreduce wrote its output there (the unfused path).
    Y,
    /// `x`: the allreduce ran in place (benchmarks of the norm kernel alone).
    X,
}

/// What a fused launch of `rows` rows of `chunks` chunks (a block's threads' quads each, at
/// [`fused_block_threads`]) deals out to its blocks: its units and the most blocks one unit
/// may take. Two-shot: every row segment (its chunk), a block each. One-shot and host-staged:
/// every row, over a block per chunk (as the plain one-shot gives each thread one line);
/// host-staged's grid stays within [`HOST_STAGED_FUSED_GRID`] blocks: its waits poll host
/// memory, and more polling blocks slowed it (see there).
fn launch_units(algorithm: Algorithm, rows: u32, chunks: u32) -> (u32, u32) {
    match algorithm {
        Algorithm::TwoShot => (rows * chunks, 1),
        Algorithm::HostStaged => (
            rows,
            chunks.min((HOST_STAGED_FUSED_GRID / rows.max(1)).max(1)),
        ),
        _ => (rows, chunks),
    }
}

/// Threads of a fused block, which are also the quads of the chunk of a row it takes. Only the
/// one-shot with one wait site per peer (`per_peer_sites`, up to [`FUSED_PEER_SITE_RANKS`])
/// takes blocks smaller than [`THREADS`], in a kernel of its own whose warps exchange their
/// sums (`KernelId::FusedOneShotSmallBlocks`; two-shot's, host-staged's and the separate norm
/// kernel's trees are per block of [`THREADS`]): the smallest of [`FUSED_BLOCK_THREADS`] whose
/// blocks, one a chunk of every row, fit the grid (half the co-resident bound with PDL), as
/// the plain one-shot spreads its lines over small blocks; where none fits, whole blocks.
/// `TPAR_FUSED_BLOCK_THREADS` sets it (32, 64, 128, 256 or 512), for experiments.
///
/// One H100, hidden 8192 bf16, ranks as streams, 2026-12-06 (bench/results/2026-12-06-s15,
/// call 6, the small-block kernel's code against main bb607a2, twice each way): 2 ranks x 1 /
/// 2 / 4 tokens 3.99 / 4.16 / 4.27 -> 3.54 / 3.58 / 3.77 us (16 / 32 blocks of 128, 32 of
/// 256); 4 ranks x 1 / 2 4.73 / 5.00 -> 4.57 / 4.80 (16 of 128, 16 of 256); the sizes left on
/// whole blocks within 0.05 us. One H200 (call 4, an earlier form): 2 ranks 3.92 / 4.13 / 4.23
/// -> 3.60 / 3.62 / 3.82, 4 ranks 4.62 / 4.85 -> 4.08 / 4.29. Sizes (call 1, H100, 2 ranks x 1):
/// blocks of 64 / 128 / 256 / 512 threads 3.75 / 3.65 / 3.75 / 4.04; at 4 tokens 64 took 7.22
/// (4 rows a block) and 256 3.89. From 5 ranks only launches of up to [`FUSED_PEER_SITE_ROWS`]
/// rows wait per peer, and so take small blocks: at 8 ranks sharing one GPU x 1 token, 8
/// blocks of 256 measured 6.36 -> 6.32 (call 1) and 6.38 -> 6.72 (call 3) on the H100 and 6.13
/// -> 5.58 on the H200 (call 2) in the fifteenth session, in binaries that moved 8-rank figures
/// by up to 0.6 us with the same PTX (bench/README.md, "Fifteenth session"), and, in their
/// cluster form, 6.38-6.49 -> 5.61-5.64 on one H100 in the twenty-third (against 4 whole blocks
/// of group sites, each way twice in one binary).
fn fused_block_threads(
    algorithm: Algorithm,
    per_peer_sites: bool,
    rows: u32,
    quads: u32,
    max_blocks: u32,
    pdl_supported: bool,
) -> u32 {
    if algorithm != Algorithm::OneShot || !per_peer_sites {
        return THREADS;
    }
    static SET: Knob = Knob::with("TPAR_FUSED_BLOCK_THREADS", |name, v| {
        v.filter(|t| {
            let divides = [32, 64, 128, 256, 512].contains(t);
            if !divides {
                log::warn!(
                    "{name}={t} ignored: a fused block takes 32, 64, 128, 256 or 512 threads (a \
                     multiple of 32 dividing 512)"
                );
            }
            divides
        })
    });
    if let Some(threads) = SET.get() {
        return threads;
    }
    let bound = if pdl_supported {
        max_blocks / 2
    } else {
        max_blocks
    };
    FUSED_BLOCK_THREADS
        .into_iter()
        .find(|&threads| rows.max(1) * quads.div_ceil(threads).max(1) <= bound)
        .unwrap_or(THREADS)
}

/// The blocks the fused one-shot tries, smallest first (see [`fused_block_threads`]).
const FUSED_BLOCK_THREADS: [u32; 2] = [128, 256];

/// Ranks up to which the fused one-shot launches its kernel compiled with one wait site per
/// peer instead of one per group of peers (tuning.cuh, TPAR_WAIT_SITE_PER_GROUP). One H100,
/// hidden 8192 bf16, ranks as streams, 2026-12-06 (bench/results/2026-12-06-s14, call 8, each
/// way twice in one call): 2 ranks x 1 / 2 / 8 / 16 tokens 4.40 / 4.57 / 4.81 / 5.73 -> 3.99 /
/// 4.17 / 4.39 / 5.36 us; 4 ranks 5.19 / 5.46 / 8.72 / 10.45 -> 4.72 / 5.01 / 8.14 / 10.14.
/// At 8 ranks sharing the GPU per peer was faster at 1 and 2 tokens (6.39 / 7.14 -> 6.13 /
/// 6.70) but slower at 4 and 8 (10.83 -> 11.03-11.06, 16.0 -> 16.86; calls 5 and 7, through
/// the knob), so from 5 ranks only launches of up to [`FUSED_PEER_SITE_ROWS`] rows take one
/// site per peer (5 to 7 ranks not measured). Host-staged's fused call keeps one site per group
/// (the same kernel over host inboxes; not measured per peer).
const FUSED_PEER_SITE_RANKS: usize = 4;

/// Rows up to which a fused one-shot launch takes one wait site per peer at any number of
/// ranks (and so, where they fit, small blocks). One H100, 8 ranks as streams, hidden 8192 bf16,
/// 2026-12-07 (bench/results/2026-12-07-s23, calls 4 and 5, each way twice, through
/// `TPAR_FUSED_PEER_SITE_RANKS=8`): 1 token 6.38-6.49 -> 5.61-5.64 us (8 blocks of 256 in place
/// of 4 of 512), 2 tokens 7.43 -> 7.07-7.08 (8 whole blocks either way), but 4 tokens
/// 12.08-12.11 -> 12.84-12.87 and 8 tokens 15.85-15.86 -> 16.85-16.91; the fourteenth
/// session's figures above agree.
const FUSED_PEER_SITE_ROWS: usize = 2;

/// Whether a fused one-shot launch of `rows` rows at `world_size` ranks waits at one site per
/// peer: every launch up to `all_launches_up_to` ranks ([`FUSED_PEER_SITE_RANKS`]), beyond
/// that launches of up to [`FUSED_PEER_SITE_ROWS`] rows.
fn peer_sites(world_size: usize, rows: usize, all_launches_up_to: usize) -> bool {
    world_size <= all_launches_up_to || rows <= FUSED_PEER_SITE_ROWS
}

/// [`FUSED_PEER_SITE_RANKS`], or `TPAR_FUSED_PEER_SITE_RANKS` where set, for experiments: the
/// ranks up to which every launch waits at one site per peer (the small-block kernels, which
/// need one site per peer, then also run up to that many ranks).
fn fused_peer_site_ranks() -> usize {
    static SET: Knob = Knob::new("TPAR_FUSED_PEER_SITE_RANKS");
    SET.get()
        .map_or(FUSED_PEER_SITE_RANKS, |ranks| ranks as usize)
}

/// Host-staged's fused grid bound while rows are spread. One H200, 2 ranks as streams, hidden
/// 8192 bf16, 2026-12-01 (bench/results/2026-12-01-h200-s5-fused-grid): one block per row
/// 14.64 / 16.13 / 18.61 / 26.46 us at 1 / 2 / 4 / 8 tokens; within 8 blocks 10.50 / 13.78 /
/// 17.02 / 26.33; every row spread over 4 blocks 10.12 / 13.60 / 18.11 / 28.57.
const HOST_STAGED_FUSED_GRID: u32 = 8;

/// Launches of up to this many rows on whole blocks ([`THREADS`]) run the small-block kernel
/// where they wait at one site per peer ([`small_kernel_on_whole_blocks`]) and exchange their
/// sums through device memory, not in clusters ([`clusters_wanted`]). One H100, hidden 8192
/// bf16, ranks as streams, 2026-12-07 (bench/results/2026-12-07-s27, calls 1 and 2, each way
/// twice in one binary), fused us, fused_oneshot.cu in clusters (main before) -> the
/// small-block kernel in clusters -> through device memory: 2 ranks x 8 tokens 4.43 -> 4.28 ->
/// 4.18; 4 x 4 5.49-5.52 -> 5.22-5.25 -> 5.35-5.36; 4 x 8 9.28 -> 9.06-9.08 -> 8.20-8.21; 8 x 2
/// 7.11-7.15 -> 6.92-6.97 -> 6.76-6.78; and 8 x 4 (group sites, fused_oneshot.cu either way)
/// 12.13-12.24 in clusters, 10.91 through device memory. From 16 rows the small-block kernel
/// was slower (2 x 16 5.36 -> 5.59, 2 x 128 42.76 -> 44.55, 4 x 512 368.8 -> 385.8), and on
/// smaller blocks the clusters stay faster (through device memory -> in clusters: 2 x 1 3.64 ->
/// 3.38, 4 x 1 4.61 -> 4.02, 8 x 1 6.24 -> 5.42). As the default against the knobs' old choice
/// in one binary (bench/results/2026-12-07-s28, call 1, one H100): 2 x 8 4.44 -> 4.15, 4 x 4
/// 5.53 -> 5.33, 4 x 8 9.29 -> 8.15, 8 x 2 7.05 -> 6.75, 8 x 4 12.02 -> 10.86.
const WHOLE_BLOCK_FEW_ROWS: usize = 8;

/// Whether a fused one-shot launch of `rows` rows on whole blocks that waits at one site per
/// peer runs the small-block kernel on them (up to [`WHOLE_BLOCK_FEW_ROWS`] rows): its warps
/// store their sums straight into the row's blocks and every warp folds them after one
/// barrier, where fused_oneshot.cu's whole blocks fold each segment after a block barrier and
/// hand 1/rms on after another. The same bits either way. `knob` is
/// `TPAR_FUSED_SMALL_KERNEL_WHOLE_BLOCKS`, for comparison: 0 never, any other number at every
/// row count.
fn small_kernel_on_whole_blocks(rows: usize, knob: Option<u32>) -> bool {
    knob.map_or(rows <= WHOLE_BLOCK_FEW_ROWS, |on| on != 0)
}

/// Whether a fused one-shot launch of `rows` rows on blocks of `threads` wants its cluster
/// form (where [`clusters_fit`]): blocks smaller than [`THREADS`] always, whole blocks beyond
/// [`WHOLE_BLOCK_FEW_ROWS`] rows. `knob` is `TPAR_FUSED_CLUSTERS`, for comparison: 0 never,
/// any other number wherever they fit. On one H200 (2026-12-07, bench/results/2026-12-07-s23,
/// call 1) the cluster forms were faster at every size measured then, 0.03-0.5 us
/// (fused_oneshot_small.cu's header has the run); the later H100 run above found whole blocks
/// faster through device memory at 1-8 rows but one size (4 x 4, by 0.13 us).
fn clusters_wanted(threads: u32, rows: usize, knob: Option<u32>) -> bool {
    match knob {
        Some(on) => on != 0,
        None => threads < THREADS || rows > WHOLE_BLOCK_FEW_ROWS,
    }
}

/// Whether a fused one-shot launch of `grid` blocks, `per_row` to a row, may run a row's
/// blocks as one thread block cluster (their sums exchanged in shared memory): where a row has
/// several blocks, at most [`MAX_CLUSTER`], the grid is whole rows, and this rank's share of
/// the GPU's co-resident blocks (`max_blocks` of `capacity`) holds the launch's clusters at
/// the GPU's `active_clusters` of that shape: its blocks spin, so all must be resident at once.
fn clusters_fit(
    grid: u32,
    per_row: u32,
    active_clusters: u32,
    max_blocks: u32,
    capacity: u32,
) -> bool {
    if !(2..=MAX_CLUSTER).contains(&per_row) || grid % per_row != 0 {
        return false;
    }
    let share = u64::from(active_clusters) * u64::from(max_blocks) / u64::from(capacity.max(1));
    u64::from(grid / per_row) <= share
}

/// Blocks sharing one unit of a fused launch: `spread` ([`launch_units`]) within the grid's
/// bound (half the co-resident blocks with PDL).
fn blocks_per_row(spread: u32, max_blocks: u32, pdl: bool) -> u32 {
    let bound = if pdl { max_blocks / 2 } else { max_blocks };
    spread.min(bound).max(1)
}

/// How many units (rows, or two-shot's row segments) a block of a fused launch may take with
/// PDL, which halves the co-resident bound. Each further unit costs the kernel's whole chain
/// after the data again, so where the GPU gives this rank the full [`MAX_BLOCKS`] (one GPU per
/// rank, or two ranks sharing one) PDL only where every block takes one unit, else the full
/// grid without it; with fewer co-resident blocks (more ranks sharing a GPU) two, as for the
/// allreduce. One H200, hidden 8192 bf16, 2026-12-01 (bench/results/2026-12-01-h200-s5-fused-grid):
/// one-shot 2 ranks x 16 tokens 7.23 -> 5.36 us in a chain of fused calls and 9.7 -> 6.9 us
/// per allreduce in `tpar bench step` (Llama-3.1-70B); but 8 ranks sharing the GPU (a bound of
/// 16) x 4 tokens, 10.04 -> 9.54 in the chain and 18.3 -> 21.9 in `bench step`.
fn units_per_block_with_pdl(max_blocks: u32) -> u32 {
    if max_blocks >= MAX_BLOCKS {
        1
    } else {
        2
    }
}

/// Blocks and PDL for a fused launch of `units` units ([`launch_units`]), each spread over up
/// to `spread` blocks ([`blocks_per_row`]): the units' blocks up to the co-resident bound, as
/// whole units (a block loops over units `grid / per_row` apart); PDL where half the bound
/// holds the units at [`units_per_block_with_pdl`] a block.
fn fused_shape(units: u32, spread: u32, max_blocks: u32, pdl_supported: bool) -> (u32, bool) {
    let grid = |pdl: bool| {
        let bound = if pdl { max_blocks / 2 } else { max_blocks };
        let per_row = blocks_per_row(spread, max_blocks, pdl);
        per_row * units.max(1).min((bound / per_row).max(1))
    };
    let half = max_blocks / 2;
    let per_row = blocks_per_row(spread, max_blocks, true);
    let units_per_block = units.max(1).div_ceil((half / per_row).max(1));
    let pdl = pdl_supported && half >= 1 && units_per_block <= units_per_block_with_pdl(max_blocks);
    (grid(pdl), pdl)
}

#[cfg(test)]
mod tests {
    use super::super::errors::header_note;
    use super::super::kernels;
    use super::*;
    use crate::dtype::DType;

    #[test]
    fn the_argument_blocks_mirror_the_header() {
        let header = kernels::HEADERS
            .iter()
            .find(|(name, _)| *name == "fused.cuh")
            .unwrap()
            .1;
        assert!(header.contains(&format!("#define TPAR_HEADER_FUSED {HEADER_FUSED:#x}")));
        assert!(header.contains(&format!("#define TPAR_NORM_THREADS {}", norm::NORM_THREADS)));
        assert_eq!(norm::NORM_THREADS as u32, THREADS);
        // 5 pointers, hidden, rows (u64) and eps + blocks per row; after the allreduce's block.
        assert_eq!(std::mem::size_of::<NormArgs>(), 7 * 8 + 8);
        assert_eq!(
            std::mem::size_of::<FusedArgs>(),
            std::mem::size_of::<KernelArgs>() + std::mem::size_of::<NormArgs>()
        );
    }

    #[test]
    fn whole_blocks_of_few_rows_take_the_small_kernel_through_device_memory() {
        let few = WHOLE_BLOCK_FEW_ROWS;
        assert!(small_kernel_on_whole_blocks(1, None));
        assert!(small_kernel_on_whole_blocks(few, None));
        assert!(!small_kernel_on_whole_blocks(few + 1, None));
        assert!(!small_kernel_on_whole_blocks(1, Some(0)));
        assert!(small_kernel_on_whole_blocks(512, Some(1)));
        // Small blocks in clusters at any rows; whole blocks only beyond the few rows.
        assert!(clusters_wanted(128, 1, None));
        assert!(clusters_wanted(256, few + 1, None));
        assert!(!clusters_wanted(THREADS, few, None));
        assert!(clusters_wanted(THREADS, few + 1, None));
        assert!(!clusters_wanted(128, 1, Some(0)));
        assert!(clusters_wanted(THREADS, 1, Some(1)));
    }

    #[test]
    fn fused_launches_spread_rows_over_blocks_within_the_co_resident_bound() {
        // 1 token of 8192 bf16: 4 segments, 4 blocks, as the plain one-shot of 16 KiB.
        assert_eq!(fused_shape(1, 4, 64, true), (4, true));
        assert_eq!(blocks_per_row(4, 64, true), 4);
        // 8 tokens: 32 blocks, with PDL where half the bound holds them: a row a block with
        // the full bound, two with less.
        assert_eq!(fused_shape(8, 4, 64, true), (32, true));
        assert_eq!(fused_shape(16, 4, 64, true), (64, false));
        assert_eq!(fused_shape(8, 4, 33, true), (16, true));
        assert_eq!(fused_shape(8, 4, 33, false), (32, false));
        assert_eq!(fused_shape(40, 4, 33, true), (32, false));
        // A row with more segments than the bound: every block of the grid on one row.
        assert_eq!(fused_shape(3, 16, 8, false), (8, false));
        assert_eq!(blocks_per_row(16, 8, false), 8);
        // Host-staged: 4 blocks a row at 1 and 2 tokens, 2 at 4, one from 8.
        let spread = |rows| launch_units(Algorithm::HostStaged, rows, 4);
        assert_eq!(
            [1, 2, 4, 8, 16].map(spread),
            [(1, 4), (2, 4), (4, 2), (8, 1), (16, 1)]
        );
        assert_eq!(launch_units(Algorithm::OneShot, 16, 4), (16, 4));
        // Two-shot: every row segment a unit of one block.
        assert_eq!(launch_units(Algorithm::TwoShot, 4, 4), (16, 1));
        for rows in 1..40 {
            for segments in 1..=16 {
                for max_blocks in 1..70 {
                    for pdl in [false, true] {
                        let (grid, used) = fused_shape(rows, segments, max_blocks, pdl);
                        let per_row = blocks_per_row(segments, max_blocks, used);
                        let bound = if used { max_blocks / 2 } else { max_blocks };
                        assert!(grid >= 1 && grid <= bound && grid % per_row == 0);
                        assert!(per_row <= segments && grid / per_row <= rows);
                        // With PDL a block has one row (full bound) or at most two.
                        let most = units_per_block_with_pdl(max_blocks);
                        assert!(!used || rows.div_ceil(grid / per_row) <= most);
                        assert!(max_blocks < MAX_BLOCKS || !used || grid / per_row == rows);
                    }
                }
            }
        }
    }

    #[test]
    fn peer_sites_up_to_four_ranks_and_beyond_for_launches_of_two_rows() {
        let default = FUSED_PEER_SITE_RANKS;
        for rows in [1, 2, 8, 64] {
            assert!(peer_sites(2, rows, default) && peer_sites(4, rows, default));
        }
        for ranks in [5, 8] {
            assert!(peer_sites(ranks, 1, default) && peer_sites(ranks, 2, default));
            assert!(!peer_sites(ranks, 3, default) && !peer_sites(ranks, 8, default));
        }
        // The knob moves where every launch does.
        assert!(peer_sites(8, 8, 8) && !peer_sites(4, 8, 2));
    }

    #[test]
    fn rows_run_as_clusters_only_where_the_gpu_holds_them() {
        // One H100-like GPU: 132 co-resident whole blocks, 2 ranks sharing it (66 each).
        assert!(clusters_fit(16, 16, 28, 66, 132), "one row of 16 blocks");
        assert!(
            clusters_fit(64, 16, 28, 66, 132),
            "4 rows within a share of 14 clusters"
        );
        assert!(
            !clusters_fit(240, 16, 28, 66, 132),
            "15 rows: more than the share"
        );
        assert!(
            !clusters_fit(16, 1, 28, 66, 132),
            "a row of one block needs no cluster"
        );
        assert!(
            !clusters_fit(34, 17, 28, 66, 132),
            "above the largest cluster"
        );
        assert!(!clusters_fit(24, 16, 28, 66, 132), "not whole rows");
        assert!(
            !clusters_fit(16, 16, 0, 66, 132),
            "a GPU without clusters of 16"
        );
    }

    #[test]
    fn the_fused_oneshot_takes_small_blocks_where_the_grid_holds_them() {
        let quads = 2048; // a row of 8192 bf16
        let threads = |rows, max_blocks, pdl| {
            fused_block_threads(Algorithm::OneShot, true, rows, quads, max_blocks, pdl)
        };
        // Two ranks on one GPU (64 blocks each, 32 with PDL): 16 blocks of 128 at 1 token,
        // 32 at 2; 32 of 256 at 4; whole blocks from 8.
        assert_eq!(
            [1, 2, 4, 8, 64].map(|rows| threads(rows, 64, true)),
            [128, 128, 256, 512, 512]
        );
        // Without PDL the whole bound: 4 tokens on blocks of 128.
        assert_eq!(threads(4, 64, false), 128);
        // Only the one-shot with one wait site per peer: the other kernels' trees are per block.
        for algorithm in [Algorithm::TwoShot, Algorithm::HostStaged] {
            assert_eq!(
                fused_block_threads(algorithm, true, 1, quads, 64, true),
                THREADS
            );
        }
        assert_eq!(
            fused_block_threads(Algorithm::OneShot, false, 1, quads, 64, true),
            THREADS
        );
        for rows in 1..20 {
            for quads in [1, 2, 31, 33, 1025, 2048, 4096, 8192] {
                for max_blocks in 1..70 {
                    let t = fused_block_threads(
                        Algorithm::OneShot,
                        true,
                        rows,
                        quads,
                        max_blocks,
                        true,
                    );
                    // A warp's 32 quads stay within one segment of the tree.
                    assert!(t % 32 == 0 && norm::NORM_THREADS as u32 % t == 0);
                    assert!(t == THREADS || rows * quads.div_ceil(t) <= max_blocks / 2);
                }
            }
        }
    }

    #[test]
    fn fused_twoshot_launches_a_block_per_unit_within_the_co_resident_bound() {
        // Two-shot's units (row segments) take a block each: fused_shape with a spread of 1.
        // 4 tokens of 8192 bf16: 16 units (4 segments a row).
        assert_eq!(fused_shape(16, 1, 33, true), (16, true));
        assert_eq!(fused_shape(16, 1, 33, false), (16, false));
        // 16 tokens: 64 units; with PDL 16 blocks would take 4 each: without, 33.
        assert_eq!(fused_shape(64, 1, 33, true), (33, false));
        assert_eq!(fused_shape(32, 1, 33, true), (16, true));
        // With the full bound, PDL only at a unit a block.
        assert_eq!(fused_shape(32, 1, 64, true), (32, true));
        assert_eq!(fused_shape(64, 1, 64, true), (64, false));
        for units in 0..200 {
            for max_blocks in 1..70 {
                for pdl in [false, true] {
                    let (grid, used) = fused_shape(units, 1, max_blocks, pdl);
                    let bound = if used { max_blocks / 2 } else { max_blocks };
                    assert!(grid >= 1 && grid <= bound && grid <= units.max(1));
                    let most = units_per_block_with_pdl(max_blocks);
                    assert!(!used || (pdl && units.max(1) <= most * grid));
                }
            }
        }
    }

    /// The rank that owns unit `u` of `units` (as the kernel's owner_of_line).
    fn unit_owner(units: usize, world: usize, u: usize) -> usize {
        use crate::protocol::layout::owned_lines;
        (0..world)
            .find(|&o| owned_lines(units, world, o).contains(&u))
            .expect("every unit has an owner")
    }

    /// The payload line of unit `u`'s first quad, which also carries the unit's segment sum.
    fn unit_first_line(quads: usize, segments: usize, u: usize) -> usize {
        2 * ((u / segments) * quads + (u % segments) * norm::NORM_THREADS)
    }

    /// Where `twoshot_fused.cu` writes, one launch on an inbox of `payload_lines`: the lines
    /// (inbox, region, line) every rank's writes land on, each with its one writer, as the
    /// kernel's formulas place them: region `Some(o)` is stage-one slot `o` (header first),
    /// `None` the gather slot. Panics where two writes land on one line or one lands outside
    /// its region.
    fn twoshot_fused_writes(
        world: usize,
        dtype: DType,
        hidden: usize,
        rows: usize,
        payload_lines: usize,
    ) -> std::collections::HashMap<(usize, Option<usize>, usize), &'static str> {
        use crate::protocol::header::HEADER_LINES;
        let quads = norm::row_quads(dtype, hidden);
        let segments = norm::row_segments(dtype, hidden);
        let units = rows * segments;
        let quads_of = |u: usize| {
            let first = (u % segments) * norm::NORM_THREADS;
            (first..(first + norm::NORM_THREADS).min(quads)).map(move |q| (u / segments, q))
        };
        let mut writes = std::collections::HashMap::new();
        let mut write = |inbox: usize, region: Option<usize>, line: usize, what: &'static str| {
            let size = if region.is_some() {
                HEADER_LINES + payload_lines
            } else {
                payload_lines
            };
            assert!(line < size, "{what} at line {line} of a region of {size}");
            if let Some(before) = writes.insert((inbox, region, line), what) {
                panic!("{what} and {before} both at {inbox} {region:?} line {line}");
            }
        };
        for r in 0..world {
            for p in (0..world).filter(|&p| p != r) {
                for line in 0..HEADER_LINES {
                    write(p, Some(r), line, "header");
                }
            }
        }
        for u in 0..units {
            let o = unit_owner(units, world, u);
            for (row, q) in quads_of(u) {
                let line = 2 * (row * quads + q);
                for r in (0..world).filter(|&r| r != o) {
                    write(o, Some(r), HEADER_LINES + line, "x (low half)");
                    write(o, Some(r), HEADER_LINES + line + 1, "x (high half)");
                }
                for p in 0..world {
                    write(p, None, line, "residual_out (low half)");
                    write(p, None, line + 1, "residual_out (high half)");
                }
            }
            let first_line = unit_first_line(quads, segments, u);
            for p in 0..world {
                write(p, Some(o), HEADER_LINES + first_line, "segment sum");
            }
        }
        writes
    }

    #[test]
    fn fused_twoshot_lines_fit_their_slots_and_never_share_a_line() {
        use crate::protocol::header::HEADER_LINES;
        for dtype in DType::ALL {
            for hidden in [1, 7, 9, 1000, 2048, 4099, 8192] {
                for payload_lines in [2 * norm::row_quads(dtype, hidden), 4096] {
                    let most = norm::rows_per_chunk(dtype, hidden, payload_lines);
                    for rows in [1, 2, 3, most].into_iter().filter(|&r| r >= 1 && r <= most) {
                        for world in [1, 2, 3, 5, 8, 16] {
                            let writes =
                                twoshot_fused_writes(world, dtype, hidden, rows, payload_lines);
                            // Every line a rank reads was written: its own stage-one terms come
                            // from its input, every other read from its inbox.
                            let segments = norm::row_segments(dtype, hidden);
                            let quads = norm::row_quads(dtype, hidden);
                            for p in 0..world {
                                for u in 0..rows * segments {
                                    let o = unit_owner(rows * segments, world, u);
                                    let first = unit_first_line(quads, segments, u);
                                    assert_eq!(
                                        writes.get(&(p, Some(o), HEADER_LINES + first)),
                                        Some(&"segment sum")
                                    );
                                    assert!(writes.contains_key(&(p, None, first)));
                                    if p == o {
                                        for r in (0..world).filter(|&r| r != o) {
                                            assert_eq!(
                                                writes.get(&(p, Some(r), HEADER_LINES + first)),
                                                Some(&"x (low half)")
                                            );
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn aliasing_is_checked() {
        let call = FusedCall {
            dtype: DType::Bf16,
            tokens: 2,
            hidden: 8,
            x: 0x1000,
            residual: 0x2000,
            residual_out: None,
            weight: 0x3000,
            y: 0x1000,
            eps: 1e-6,
        };
        assert!(call.validate().unwrap());
        let bad = FusedCall { y: 0x2010, ..call };
        assert!(bad.validate().unwrap_err().to_string().contains("overlaps"));
        let partial = FusedCall {
            residual_out: Some(0x2002),
            ..call
        };
        assert!(partial.validate().is_err());
        assert!(!FusedCall { tokens: 0, ..call }.validate().unwrap());
        assert_eq!(
            header_note(3 | 1 << 8 | HEADER_FUSED),
            ", fused with residual add + RMSNorm"
        );
        assert_eq!(header_note(3 | 1 << 8), "");
    }
}
