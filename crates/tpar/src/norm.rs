//! Fused allreduce + residual add + RMSNorm: its exact semantics, which path runs a call and
//! why, and the CPU reference that the GPU kernels (`fused_oneshot.cu`,
//! `fused_oneshot_small.cu`, `twoshot_fused.cu`, `fused_norm.cu`) must match bit for bit.
//!
//! # Semantics (every path, every rank, bitwise the same)
//! Inputs: `x` (tokens x hidden, this rank's partial sums), `residual` (tokens x hidden),
//! `weight` (hidden), `eps`; all of one dtype (f32, f16 or bf16), `eps` an f32. Per element:
//! 1. `s = round(x_0 + x_1 + ... + x_{n-1})`: summed in fp32 in rank order (rank 0 first),
//!    rounded once to the dtype (round to nearest even). This is exactly the plain allreduce.
//! 2. `residual_out = round(f32(s) + f32(residual))`: one fp32 add of the two rounded values,
//!    rounded once. This is vLLM's `fused_add_rms_norm` (`z = input; z += residual` in the
//!    dtype, which adds in fp32 and rounds), run on the rounded allreduce output.
//! 3. Per row, from the ROUNDED `residual_out` values `v`: `ss = sum(v * v)` in fp32 in a
//!    fixed tree (below), `inv = 1 / sqrt(ss / hidden + eps)` with an IEEE (correctly
//!    rounded) square root and division.
//! 4. `y = round(f32(round(v * inv)) * f32(weight))`: as vLLM's
//!    `((scalar_t)(x * s_variance)) * weight[idx]`, two products each rounded to the dtype (for
//!    f32 the roundings are exact).
//!
//! Differences from vLLM's kernel, on purpose: vLLM takes `rsqrtf` (an approximation, within
//! 2 ulp) and lets `cub::BlockReduce` pick the order of the row's sum of squares; tpar uses a
//! correctly rounded `1/sqrt` and the fixed order below, so that every rank, the fused and the
//! unfused path, eager and graph replays, and this CPU reference agree to the bit. `y` may
//! differ from vLLM's by that last bit of `inv`, never by more than the dtype's rounding.
//!
//! The sum of squares of one row: the row's quads (a quad is two 32-bit words: 4 f16/bf16 or
//! 2 f32 elements, zero past the row's end) are cut into segments of [`NORM_THREADS`] quads.
//! In segment `k`, thread `t` of a block of [`NORM_THREADS`] owns quad `k * 512 + t` and adds
//! `v * v` of its elements in order into its partial, starting from 0; each warp of 32 folds
//! its partials with an xor butterfly (offsets 16, 8, 4, 2, 1: `p = p + p[lane ^ offset]`);
//! one warp folds the 16 warp sums (lanes 16..31 holding 0) with the same butterfly: the
//! segment's sum. The row's sum is the segment sums added in segment order (`s0 + s1 + ...`,
//! left to right). The order does not depend on how many blocks share a row, so the fused
//! kernel can spread a row over several blocks (which exchange their segment sums) and the
//! separate norm kernel can keep it in one. Every multiply and add is a separate IEEE f32
//! operation (no fused multiply-add), as Rust's f32 arithmetic is.
//!
//! In place: `residual_out` may be `residual` (vLLM's convention), and `y` may be `x`. `y`
//! must not overlap `residual` or `residual_out`.
//!
//! `residual` is the same tensor on every rank (the replicated residual stream of tensor
//! parallelism). One-shot and the unfused paths add each rank's own copy; the fused two-shot
//! kernel (`twoshot_fused.cu`) adds, for each row segment, the copy of the rank that owns the
//! segment and sends the result to the others, so its ranks agree to the bit even if their
//! residuals differed.

use serde::{Deserialize, Serialize};

use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Threads per block of the norm kernels; the order of the sum of squares depends on it.
pub const NORM_THREADS: usize = 512;

/// The largest hidden size the fused kernels are built and tested for.
pub const MAX_HIDDEN: usize = 16384;

/// Elements of one quad (two 32-bit payload words: one 16-byte LL line).
pub fn quad_elements(dtype: DType) -> usize {
    8 / dtype.size()
}

/// Quads of one row of `hidden` elements: a row starts a fresh quad, so rows never share a
/// line (odd hidden sizes included).
pub fn row_quads(dtype: DType, hidden: usize) -> usize {
    hidden.div_ceil(quad_elements(dtype))
}

/// Segments of one row (the module doc's tree): [`NORM_THREADS`] quads each.
pub fn row_segments(dtype: DType, hidden: usize) -> usize {
    row_quads(dtype, hidden).div_ceil(NORM_THREADS).max(1)
}

/// Warps of one row: the tree's first level, 32 quads each (a segment is 16 of them); the
/// fused one-shot's blocks exchange one sum per row warp.
pub fn row_warps(dtype: DType, hidden: usize) -> usize {
    row_quads(dtype, hidden).div_ceil(32).max(1)
}

/// Lines of a rank's device state where the blocks of one fused launch exchange their rows'
/// warp sums, one per (row, row warp) (`TPAR_STATE_EXCHANGE_LINES`, fused.cuh).
pub const EXCHANGE_LINES: usize = 8192;

/// Rows one fused launch carries: as many as a slot of `payload_lines` 8-byte lines holds (two
/// per quad), and whose warp sums fit the [`EXCHANGE_LINES`].
pub fn rows_per_chunk(dtype: DType, hidden: usize, payload_lines: usize) -> usize {
    let in_slot = payload_lines / (2 * row_quads(dtype, hidden).max(1));
    in_slot.min(EXCHANGE_LINES / row_warps(dtype, hidden))
}

/// What runs a fused call: the fused kernel, or the allreduce followed by tpar's separate
/// residual + RMSNorm kernel (same results to the bit), and why. Decided by
/// `dispatch::decide_fused` (the fused kernel's eligibility is the dispatcher's, with the
/// numbers of this module).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedDecision {
    pub fused: bool,
    pub reason: String,
}

/// Whether tpar has a fused kernel for `algorithm`: one-shot, two-shot and host-staged. Pull's
/// (one block per row, 93012b5) was slower than the pull and the separate norm kernel; the
/// PCIe-fabric algorithms (staged, islands, ring) run the allreduce and the separate kernel.
pub const fn has_fused_kernel(algorithm: Algorithm) -> bool {
    matches!(
        algorithm,
        Algorithm::OneShot | Algorithm::TwoShot | Algorithm::HostStaged
    )
}

/// Which of the two paths a fused call takes where both can run (the fused kernel, and the
/// allreduce followed by the separate norm kernel): they give the same bits, so only speed
/// decides (`dispatch::decide_fused`).
#[derive(Clone, Copy, Debug)]
pub enum Prefer<'a> {
    /// The fused kernel wherever it can run: what benchmarks, `tpar tune` and the self-tests
    /// time and check.
    Fused,
    /// The faster path for a call of `tokens` rows on `world_size` ranks: as `tpar tune`
    /// measured on this machine (`measured`, the table for this world size, dtype and hidden
    /// size) where it measured this many tokens, else [`built_in_limit`].
    Faster {
        world_size: usize,
        tokens: usize,
        measured: Option<&'a FusedTable>,
    },
}

/// Whether the fused kernel is the faster path for `tokens` rows of `hidden` on `world_size`
/// ranks on `algorithm`, and why: measured where the table covers it, else the built-in rule.
pub fn faster_path(
    algorithm: Algorithm,
    dtype: DType,
    hidden: usize,
    world_size: usize,
    tokens: usize,
    measured: Option<&FusedTable>,
) -> (bool, String) {
    if let Some(verdict) = measured.and_then(|t| t.verdict(algorithm, tokens)) {
        return verdict;
    }
    let bytes = (tokens * hidden * dtype.size()) as u64;
    let per_rank = |limit: u64| crate::memory::human_bytes(limit);
    match built_in_limit(algorithm, world_size) {
        Some((limit, source)) if bytes <= limit => (
            true,
            format!(
                "faster than allreduce + norm up to {} per rank on {world_size} ranks by tpar's measurements (bench/README.md, \"{source}\"); no tuning table here",
                per_rank(limit)
            ),
        ),
        Some((limit, source)) => (
            false,
            format!(
                "the fused {algorithm} kernel was slower than allreduce + norm at the sizes tpar measured just above {} per rank on {world_size} ranks (bench/README.md, \"{source}\"); no tuning table here (`tpar tune` measures both on this machine)",
                per_rank(limit)
            ),
        ),
        None => (false, format!("{algorithm} has no fused kernel")),
    }
}

/// The built-in rule, until `tpar tune` measured this machine: the fused kernel runs while each
/// rank's message stays within the returned limit for `world_size` ranks, the largest up to
/// which it was measured faster than allreduce + the separate norm kernel at every size
/// measured (ranks as streams, bf16, hidden 8192, graph chain, p50 us of the fused op against
/// allreduce + norm), with the bench/README.md section that has the run:
/// - one-shot, measured again at every world size with the kernels of the twenty-eighth session
///   (one H100, bench/results/2026-12-07-s28, calls 1, 2 and 5; tokens of 8192):
///   - 2 ranks, 256 KiB: faster at 1 to 16 tokens (3.38 against 5.74 at 1, 5.32 against 7.19
///     at 16), slower at 24 (11.12 against 9.97) and even at 32 (10.59 against 10.56);
///   - 3 ranks, 64 KiB: faster at 2 and 4 tokens, even at 6 and 8 (7.26 against 7.24-7.25,
///     7.37-7.39 against 7.38-7.40), faster at 12 and 16, slower at 24 (17.34 against 12.47);
///   - 4 ranks, 256 KiB: faster at 1 to 16 tokens (8.02 against 8.09-8.12 at 6, 9.92-9.93
///     against 10.60-10.62 at 16), slower at 24 (20.40 against 15.72) and 32. The tenth
///     session's kernels were slower from 6 tokens (8.44 against 7.74, one H200);
///   - 5 and 6 ranks, 32 KiB: faster at 1 and 2 tokens, slower at 4 (5 ranks 9.01-9.04 against
///     8.43, 6 ranks 9.87-9.91 against 9.06-9.11) and at 5 x 6; faster again at 5 x 8, 6 x 6
///     and 6 x 8, which a limit cannot express: `tpar tune` measures each;
///   - 7 ranks, 192 KiB: faster at 1 to 12 tokens (10.25-10.27 against 11.02 at 4, 20.30-20.34
///     against 21.62-21.66 at 12), slower at 16 (26.80 against 25.37-25.38). The tenth
///     session's kernels were slower at 4 tokens (10.10 against 9.96, one H200);
///   - 8 ranks and more (8 measured), 192 KiB: faster at 1 to 12 tokens (22.62 against 24.79 at
///     12), slower at 14 and 16 (30.66 against 30.15 at 16), as in the tenth session.
///
///   Until the tenth session one-shot fused up to 128 KiB at every world size, from the sixth
///   session's 1, 8 and 32 tokens at 2 and 8 ranks; from the tenth to the twenty-seventh it
///   fused up to 64 KiB at 3-4 ranks and 32 KiB at 7 (one H200, bench/results/
///   2026-12-02-h200-s10-spread).
/// - two-shot, 128 KiB (`tpar tune -n 8`, call3's tune8.json): faster up to 8 tokens (11.66
///   against 12.51 at 8), slower from 16 (15.95 against 15.28); the kernels before this
///   session's had been faster up to 8 x 32 (a8aa1e3); other world sizes not measured;
/// - host-staged, 128 KiB (the same tune, 8 ranks through one GPU's link): faster up to 8
///   tokens (536.75 against 560.77), slower from 16 (1056.66 against 1043.28); on 2 ranks the
///   kernels before this session's were even at 2 x 16 (44.76 against 45.34) and slower at
///   2 x 32 (88.17 against 85.78, 4527420).
///
/// `None` for an algorithm without a fused kernel.
pub fn built_in_limit(algorithm: Algorithm, world_size: usize) -> Option<(u64, &'static str)> {
    match algorithm {
        Algorithm::OneShot => {
            let limit: u64 = match world_size {
                0..=2 | 4 => 256 << 10,
                3 => 64 << 10,
                5 | 6 => 32 << 10,
                _ => 192 << 10,
            };
            Some((limit, "Twenty-eighth session"))
        }
        Algorithm::TwoShot => Some((128 << 10, "Sixth session")),
        Algorithm::HostStaged => Some((128 << 10, "Sixth session")),
        _ => None,
    }
}

/// The fused op against allreduce + norm, measured by `tpar tune` on one machine for one world
/// size, dtype and hidden size, kept beside the tuning table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FusedTable {
    pub fingerprint: String,
    /// The kernels it timed, as `TuningTable::kernels` (a table of other kernels is not read).
    #[serde(default)]
    pub kernels: String,
    pub world_size: usize,
    pub dtype: DType,
    pub hidden: usize,
    pub rows: Vec<FusedRow>,
}

/// One algorithm at one token count: the fused kernel and allreduce + norm, us per call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FusedRow {
    pub algorithm: Algorithm,
    pub tokens: usize,
    pub fused_us: f64,
    pub separate_us: f64,
}

impl FusedTable {
    /// Where the table lives: `tuning/` in tpar's cache, beside the allreduce's.
    pub fn path(
        fingerprint: &str,
        world_size: usize,
        dtype: DType,
        hidden: usize,
    ) -> std::path::PathBuf {
        crate::cache::cache_root().join("tuning").join(format!(
            "{fingerprint}-n{world_size}-{dtype}-fused-h{hidden}.json"
        ))
    }

    /// The table `tpar tune` wrote for this machine, world size, dtype and hidden size, if it
    /// timed the kernels `kernels` (`TuningTable::kernels`).
    pub fn load(
        (fingerprint, kernels): (&str, &str),
        world_size: usize,
        dtype: DType,
        hidden: usize,
    ) -> Option<FusedTable> {
        let path = Self::path(fingerprint, world_size, dtype, hidden);
        let table: FusedTable = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
        (table.kernels == kernels).then_some(table)
    }

    /// Writes it where [`FusedTable::load`] looks (atomically).
    pub fn save(&self) -> Result<std::path::PathBuf> {
        let path = Self::path(&self.fingerprint, self.world_size, self.dtype, self.hidden);
        let text = serde_json::to_vec_pretty(self).expect("tables serialise");
        crate::sys::write_file_atomically(&path, &text, "cannot write the fused tuning table")?;
        Ok(path)
    }

    /// What the measurements say of `tokens` rows on `algorithm`: fused only where the
    /// measured token counts around it (the nearest at or below and at or above) both had the
    /// fused kernel faster; not fused where either had it slower, nor above the largest
    /// measured where that one had it slower. `None` where nothing measured decides (no row
    /// of this algorithm, or above the largest measured where that one had the kernel faster).
    pub fn verdict(&self, algorithm: Algorithm, tokens: usize) -> Option<(bool, String)> {
        let mut rows: Vec<&FusedRow> = self
            .rows
            .iter()
            .filter(|r| r.algorithm == algorithm && r.fused_us > 0.0 && r.separate_us > 0.0)
            .collect();
        rows.sort_by_key(|r| r.tokens);
        let below = rows.iter().rev().find(|r| r.tokens <= tokens);
        let above = rows.iter().find(|r| r.tokens >= tokens);
        let say = |r: &FusedRow| {
            format!(
                "{} tokens: fused {:.2} us, allreduce + norm {:.2}",
                r.tokens, r.fused_us, r.separate_us
            )
        };
        let faster = |r: &FusedRow| r.fused_us < r.separate_us;
        match (below, above) {
            (Some(b), Some(a)) => {
                let fused = faster(b) && faster(a);
                let mut cited = vec![say(b)];
                if a.tokens != b.tokens {
                    cited.push(say(a));
                }
                Some((
                    fused,
                    format!(
                        "{} than allreduce + norm as `tpar tune` measured on this machine ({})",
                        if fused { "faster" } else { "not faster" },
                        cited.join("; ")
                    ),
                ))
            }
            (None, Some(a)) => Some((
                faster(a),
                format!(
                    "{} as `tpar tune` measured on this machine at the fewest tokens ({})",
                    if faster(a) {
                        "faster than allreduce + norm"
                    } else {
                        "not faster than allreduce + norm"
                    },
                    say(a)
                ),
            )),
            (Some(b), None) if !faster(b) => Some((
                false,
                format!(
                    "not faster than allreduce + norm as `tpar tune` measured on this machine at the most tokens ({})",
                    say(b)
                ),
            )),
            _ => None,
        }
    }
}

/// Checks the shape and `eps` of a call; `Ok(false)` when there is nothing to do (0 tokens).
pub fn validate(tokens: usize, hidden: usize, eps: f32) -> Result<bool> {
    if hidden == 0 {
        return Err(Error::InvalidArgument(
            "fused_add_rms_norm: hidden size 0; pass the last dimension of x".to_owned(),
        ));
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(Error::InvalidArgument(format!(
            "fused_add_rms_norm: eps {eps} must be finite and >= 0 (e.g. 1e-6)"
        )));
    }
    Ok(tokens > 0)
}

fn round(dtype: DType, v: f32) -> f32 {
    let mut b = [0u8; 4];
    dtype.store_f32(&mut b, 0, v);
    dtype.load_f32(&b, 0)
}

/// Sums of squares per warp (see the module doc): the butterfly of 32 values.
fn butterfly(mut lanes: [f32; 32]) -> f32 {
    for offset in [16, 8, 4, 2, 1] {
        let before = lanes;
        for (i, lane) in lanes.iter_mut().enumerate() {
            *lane = before[i] + before[i ^ offset];
        }
    }
    lanes[0]
}

/// The tree's first level for one row of rounded values: each warp's sum of squares (32
/// quads, a thread's partial `0 + v0*v0 + v1*v1 + ...` in element order, then the butterfly),
/// 16 warps for every segment (those past the row sum zeros).
fn warp_sums(dtype: DType, row: &[f32]) -> impl Iterator<Item = f32> + '_ {
    let q = quad_elements(dtype);
    let warps = row.len().div_ceil(q).max(1).div_ceil(NORM_THREADS) * (NORM_THREADS / 32);
    (0..warps).map(move |w| {
        let mut partial = [0f32; 32];
        for (t, p) in partial.iter_mut().enumerate() {
            for e in 0..q {
                let v = row.get((w * 32 + t) * q + e).copied().unwrap_or(0.0);
                *p += v * v;
            }
        }
        butterfly(partial)
    })
}

/// The fixed-order sum of squares of one row of rounded values (the module doc's tree): each
/// segment's 16 warp sums by the butterfly (lanes 16..31 holding 0), the segments in order.
pub fn row_sum_of_squares(dtype: DType, row: &[f32]) -> f32 {
    let mut warps = warp_sums(dtype, row);
    let mut total = 0f32;
    for k in 0..row_segments(dtype, row.len()) {
        let mut lanes = [0f32; 32];
        for lane in lanes.iter_mut().take(NORM_THREADS / 32) {
            *lane = warps.next().expect("16 warps a segment");
        }
        let segment = butterfly(lanes);
        total = if k == 0 { segment } else { total + segment };
    }
    total
}

/// Steps 2-4 for one call, from the rounded allreduce output `sum` (all little-endian bytes
/// of `dtype`): returns (`residual_out`, `y`).
pub fn add_rms_norm_reference(
    dtype: DType,
    sum: &[u8],
    residual: &[u8],
    weight: &[u8],
    hidden: usize,
    eps: f32,
) -> (Vec<u8>, Vec<u8>) {
    let count = sum.len() / dtype.size();
    let mut residual_out = vec![0u8; sum.len()];
    let mut y = vec![0u8; sum.len()];
    let mut row = vec![0f32; hidden];
    for start in (0..count).step_by(hidden) {
        for (e, v) in row.iter_mut().enumerate() {
            let i = start + e;
            *v = round(dtype, dtype.load_f32(sum, i) + dtype.load_f32(residual, i));
            dtype.store_f32(&mut residual_out, i, *v);
        }
        let ss = row_sum_of_squares(dtype, &row);
        let inv = 1.0f32 / (ss / hidden as f32 + eps).sqrt();
        for (e, v) in row.iter().enumerate() {
            let scaled = round(dtype, *v * inv);
            dtype.store_f32(&mut y, start + e, scaled * dtype.load_f32(weight, e));
        }
    }
    (residual_out, y)
}

/// The whole fused op on the CPU: every rank's `x` (rank order), then steps 2-4.
pub fn fused_reference(
    dtype: DType,
    xs: &[&[u8]],
    residual: &[u8],
    weight: &[u8],
    hidden: usize,
    eps: f32,
) -> (Vec<u8>, Vec<u8>) {
    let count = residual.len() / dtype.size();
    let mut sum = vec![0u8; residual.len()];
    for i in 0..count {
        let mut acc = 0f32;
        for (r, x) in xs.iter().enumerate() {
            let v = dtype.load_f32(x, i);
            acc = if r == 0 { v } else { acc + v };
        }
        dtype.store_f32(&mut sum, i, acc);
    }
    add_rms_norm_reference(dtype, &sum, residual, weight, hidden, eps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Choice;
    use crate::dispatch::decide_fused;

    fn bytes(dtype: DType, values: &[f32]) -> Vec<u8> {
        let mut b = vec![0u8; values.len() * dtype.size()];
        for (i, v) in values.iter().enumerate() {
            dtype.store_f32(&mut b, i, *v);
        }
        b
    }

    #[test]
    fn the_reference_normalises_each_row_to_unit_rms_times_weight() {
        let hidden = 3;
        let dtype = DType::F32;
        let x0 = bytes(dtype, &[1.0, 2.0, 3.0, 0.5, 0.5, 0.5]);
        let x1 = bytes(dtype, &[1.0, 0.0, -1.0, 0.5, 0.5, 0.5]);
        let residual = bytes(dtype, &[0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        let weight = bytes(dtype, &[1.0, 2.0, 1.0]);
        let (res, y) = fused_reference(dtype, &[&x0, &x1], &residual, &weight, hidden, 0.0);
        let res: Vec<f32> = (0..6).map(|i| dtype.load_f32(&res, i)).collect();
        assert_eq!(res, vec![2.0, 2.0, 2.0, 2.0, 2.0, 2.0]);
        // Every row is constant 2: rms 2, so y = weight.
        let y: Vec<f32> = (0..6).map(|i| dtype.load_f32(&y, i)).collect();
        assert_eq!(y, vec![1.0, 2.0, 1.0, 1.0, 2.0, 1.0]);
    }

    #[test]
    fn bf16_rounds_the_sum_before_the_residual_add() {
        // 1 + 2^-8 is not a bf16: the allreduce output rounds it to 1 (a tie, to even)
        // before the residual is added, so residual_out is rounded from 1 + 2^-8, not from
        // the unrounded 1 + 2^-7.
        let dtype = DType::Bf16;
        let x0 = bytes(dtype, &[1.0]);
        let x1 = bytes(dtype, &[2f32.powi(-8)]);
        let residual = bytes(dtype, &[2f32.powi(-8)]);
        let weight = bytes(dtype, &[1.0]);
        let (res, _) = fused_reference(dtype, &[&x0, &x1], &residual, &weight, 1, 1e-6);
        // Rounded sum 1.0, + 2^-8 = 1.00390625, a tie between 1 and 1 + 2^-7: even is 1.
        assert_eq!(dtype.load_f32(&res, 0), 1.0);
        // Without the rounding of the sum: 1 + 2^-7 exactly.
        assert_eq!(round(dtype, 1.0 + 2f32.powi(-8) + 2f32.powi(-8)), 1.0078125);
    }

    #[test]
    fn the_sum_of_squares_tree_depends_only_on_the_row() {
        // A row long enough to use every thread and more than one quad per thread.
        let row: Vec<f32> = (0..5000).map(|i| ((i * 37) % 101) as f32 * 0.01).collect();
        let tree = row_sum_of_squares(DType::F32, &row);
        let sequential: f64 = row.iter().map(|v| f64::from(*v) * f64::from(*v)).sum();
        assert!((f64::from(tree) - sequential).abs() / sequential < 1e-5);
        // Trailing zeros (padding of the last quad) change nothing.
        let mut padded = row.clone();
        padded.push(0.0);
        assert_eq!(
            row_sum_of_squares(DType::F32, &padded).to_bits(),
            tree.to_bits()
        );
    }

    /// fused_oneshot_small.cu's fold: the warp sums of the row (0 past its last warp), two
    /// segments in the two halves of a warp, + 0, then offsets 8, 4, 2, 1 within each half;
    /// the halves' first lanes added in segment order.
    fn small_blocks_fold(dtype: DType, row: &[f32]) -> f32 {
        let warp_sums: Vec<f32> = warp_sums(dtype, row).collect();
        let segments = row_segments(dtype, row.len());
        let mut ss = 0f32;
        for pair in 0..segments.div_ceil(2) {
            let mut lanes = [0f32; 32];
            for (lane, v) in lanes.iter_mut().enumerate() {
                let warp = (2 * pair + lane / 16) * 16 + lane % 16;
                *v = warp_sums.get(warp).copied().unwrap_or(0.0) + 0.0;
            }
            for offset in [8, 4, 2, 1] {
                let before = lanes;
                for (i, lane) in lanes.iter_mut().enumerate() {
                    *lane = before[i] + before[i ^ offset];
                }
            }
            ss = if pair == 0 { lanes[0] } else { ss + lanes[0] };
            if 2 * pair + 1 < segments {
                ss += lanes[16];
            }
        }
        ss
    }

    #[test]
    fn the_small_blocks_fold_of_warp_sums_is_the_tree() {
        // Rows of 1 to 16 segments, partial warps and partial segments, every dtype's quad.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for dtype in DType::ALL {
            for hidden in [1, 7, 127, 128, 2049, 4099, 8192, 12288, 16383, 16384] {
                for _ in 0..3 {
                    let row: Vec<f32> = (0..hidden)
                        .map(|_| {
                            seed ^= seed << 13;
                            seed ^= seed >> 7;
                            seed ^= seed << 17;
                            round(dtype, (seed % 20001) as f32 / 1000.0 - 10.0)
                        })
                        .collect();
                    assert_eq!(
                        small_blocks_fold(dtype, &row).to_bits(),
                        row_sum_of_squares(dtype, &row).to_bits(),
                        "{dtype} hidden {hidden}"
                    );
                }
            }
        }
    }

    #[test]
    fn launches_carry_whole_rows_within_the_slot_and_the_exchange_lines() {
        assert_eq!(rows_per_chunk(DType::Bf16, 8192, 65536), 16);
        assert_eq!(rows_per_chunk(DType::F32, 16384, 65536), 4);
        // Short rows: the exchange lines bound a launch before the slot does.
        assert_eq!(rows_per_chunk(DType::Bf16, 4, 65536), EXCHANGE_LINES);
        for dtype in DType::ALL {
            for hidden in [1, 4, 7, 512, 2048, 4099, 8192, 16384] {
                for payload_lines in [1024, 65536, 1 << 20] {
                    let rows = rows_per_chunk(dtype, hidden, payload_lines);
                    assert!(rows * row_warps(dtype, hidden) <= EXCHANGE_LINES);
                    assert!(rows * 2 * row_quads(dtype, hidden) <= payload_lines);
                }
            }
        }
        assert_eq!(row_quads(DType::Bf16, 4099), 1025);
        // Warps of 32 quads, 16 a segment: the last one may be partial.
        assert_eq!(row_warps(DType::Bf16, 8192), 64);
        assert_eq!(row_warps(DType::Bf16, 4099), 33);
        assert_eq!(row_warps(DType::F32, 7), 1);
        for hidden in [1, 7, 4099, 8192, 16384] {
            assert!(row_warps(DType::F32, hidden) <= 16 * row_segments(DType::F32, hidden));
        }
    }

    fn faster(world_size: usize, tokens: usize, measured: Option<&FusedTable>) -> Prefer<'_> {
        Prefer::Faster {
            world_size,
            tokens,
            measured,
        }
    }

    #[test]
    fn without_a_table_the_built_in_rule_never_fuses_where_the_kernel_measured_slower() {
        let at = |a, n, tokens| {
            decide_fused(
                Choice::Tpar(a),
                DType::Bf16,
                8192,
                65536,
                faster(n, tokens, None),
            )
        };
        // Fused faster at these (bf16, 8192; built_in_limit says where measured).
        const S28: &str = "Twenty-eighth session";
        for (a, n, tokens, section) in [
            (Algorithm::OneShot, 2, 1, S28),
            (Algorithm::OneShot, 2, 8, S28),
            (Algorithm::OneShot, 2, 16, S28),
            (Algorithm::OneShot, 3, 4, S28),
            (Algorithm::OneShot, 4, 4, S28),
            (Algorithm::OneShot, 4, 6, S28),
            (Algorithm::OneShot, 4, 16, S28),
            (Algorithm::OneShot, 5, 2, S28),
            (Algorithm::OneShot, 6, 2, S28),
            (Algorithm::OneShot, 7, 4, S28),
            (Algorithm::OneShot, 7, 12, S28),
            (Algorithm::OneShot, 8, 8, S28),
            (Algorithm::OneShot, 8, 12, S28),
            (Algorithm::TwoShot, 2, 8, "Sixth session"),
            (Algorithm::TwoShot, 8, 8, "Sixth session"),
            (Algorithm::HostStaged, 2, 8, "Sixth session"),
        ] {
            let p = at(a, n, tokens);
            assert!(p.fused, "{a} {n} x {tokens}: {p:?}");
            assert!(p.reason.contains(section), "{p:?}");
        }
        // ... and slower (or even) at these: 2 x 64 is issue 25's 21.51 against 19.18 us.
        for (a, n, tokens) in [
            (Algorithm::OneShot, 2, 24),
            (Algorithm::OneShot, 2, 32),
            (Algorithm::OneShot, 8, 32),
            (Algorithm::OneShot, 2, 64),
            (Algorithm::OneShot, 8, 14),
            (Algorithm::OneShot, 8, 16),
            (Algorithm::OneShot, 4, 24),
            (Algorithm::OneShot, 3, 6),
            (Algorithm::OneShot, 3, 8),
            (Algorithm::OneShot, 5, 4),
            (Algorithm::OneShot, 6, 4),
            (Algorithm::OneShot, 7, 16),
            (Algorithm::TwoShot, 8, 16),
            (Algorithm::HostStaged, 2, 16),
            (Algorithm::HostStaged, 2, 32),
            (Algorithm::HostStaged, 2, 64),
        ] {
            let p = at(a, n, tokens);
            assert!(!p.fused, "{a} {n} x {tokens}: {p:?}");
            assert!(p.reason.contains("tpar tune"), "{p:?}");
        }
        // Where the kernel cannot run, the preference changes nothing.
        let pull = decide_fused(
            Choice::Tpar(Algorithm::OneShotPull),
            DType::Bf16,
            8192,
            65536,
            faster(2, 1, None),
        );
        assert!(!pull.fused && pull.reason.contains("no fused pull kernel"));
    }

    #[test]
    fn a_measured_table_decides_where_it_measured_and_never_fuses_where_it_lost() {
        let row = |tokens, fused_us, separate_us| FusedRow {
            algorithm: Algorithm::OneShot,
            tokens,
            fused_us,
            separate_us,
        };
        let table = FusedTable {
            kernels: String::new(),
            fingerprint: "fp".into(),
            world_size: 2,
            dtype: DType::Bf16,
            hidden: 8192,
            rows: vec![
                row(1, 4.5, 6.8),
                row(8, 4.6, 7.0),
                row(16, 9.0, 8.0),
                row(32, 10.8, 12.2),
                row(128, 40.0, 50.0),
            ],
        };
        let at = |tokens| {
            decide_fused(
                Choice::Tpar(Algorithm::OneShot),
                DType::Bf16,
                8192,
                65536,
                faster(2, tokens, Some(&table)),
            )
        };
        assert!(at(1).fused && at(4).fused && at(8).fused);
        // Slower at 16: not at 16, nor between 8 and 16, nor between 16 and 32.
        assert!(!at(16).fused && !at(12).fused && !at(20).fused);
        assert!(at(16)
            .reason
            .contains("fused 9.00 us, allreduce + norm 8.00"));
        // Faster at 32 and 128 (unlike the built-in rule, which stops at 12 tokens of 8192).
        assert!(at(64).fused, "{:?}", at(64));
        // Above the largest measured, where it was faster: the built-in rule decides.
        assert!(!at(256).fused && at(256).reason.contains("Twenty-eighth session"));
        // Another algorithm: nothing measured, the built-in rule.
        let two = decide_fused(
            Choice::Tpar(Algorithm::TwoShot),
            DType::Bf16,
            8192,
            65536,
            faster(2, 8, Some(&table)),
        );
        assert!(two.fused && two.reason.contains("Sixth session"), "{two:?}");
        // Slower at the largest measured: not fused above it either.
        let mut lost = table.clone();
        lost.rows.push(row(512, 300.0, 200.0));
        assert_eq!(
            lost.verdict(Algorithm::OneShot, 1000).map(|v| v.0),
            Some(false)
        );
    }

    #[test]
    fn bad_shapes_and_eps_are_named() {
        assert!(validate(1, 0, 1e-6)
            .unwrap_err()
            .to_string()
            .contains("hidden"));
        assert!(validate(1, 8, f32::NAN)
            .unwrap_err()
            .to_string()
            .contains("eps"));
        assert!(!validate(0, 8, 1e-6).unwrap());
        assert!(validate(3, 8, 1e-6).unwrap());
    }
}
