//! `tpar bench --anatomy`: what each piece of one allreduce call costs. Ranks are streams of
//! one process on GPU 0; each rank's stream captures a chain of [`CHAIN`] kernels into its own
//! graph, the graphs are replayed together, and the replay time over the chain is the cost per
//! call in a graph, as an engine's decode graph sees it. The kernels form a ladder
//! (`anatomy.cu`) built from the allreduce kernels' own primitives (prims.cuh), each adding one
//! step of the one-shot call to the one before, and the last rows run the one-shot kernel
//! itself; every row is timed with and without programmatic dependent launch (PDL). The
//! difference between two rows is what the step between them costs.

use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaGraph, CudaStream};
use serde::Serialize;

use super::stats::percentile;
use super::{bail, Context, Result};
use tpar::backend::cuda::communicator::{min_block_threads, spread_blocks};
use tpar::backend::cuda::driver;
use tpar::backend::cuda::kernels::{self, MAX_BLOCKS, MAX_RANKS, THREADS};
use tpar::backend::cuda::standalone::{StandaloneKernel, StandaloneKernels, StandaloneRanks};

/// Kernels per rank in one timed graph.
pub const CHAIN: usize = 100;
/// The largest payload timed.
const MAX_BYTES: usize = 256 << 10;
const PRODUCTION_PAYLOADS: [usize; 5] = [0, 4 << 10, 32 << 10, 42 << 10, 256 << 10];

/// What each rung adds (index = rung).
const RUNGS: [&str; kernels::ANATOMY_RUNGS] = [
    "empty kernel",
    "+ call counter read/publish",
    "+ call header pushed (never waited for)",
    "+ one unit to each peer, and one reduced from each",
];

#[derive(Serialize, Clone, Debug)]
pub struct AnatomyRow {
    pub world_size: usize,
    /// Rung of the ladder (0..ANATOMY_RUNGS), or ANATOMY_RUNGS for the one-shot kernel.
    pub rung: usize,
    pub piece: String,
    pub bytes: usize,
    pub pdl: bool,
    pub grid: u32,
    /// Threads per block: the ladder's kernels take whole blocks, the one-shot kernel the
    /// communicators' launch shape (spread over smaller blocks where small).
    pub block_threads: u32,
    /// Per call in a chain of `chain` calls per rank, median and p99 over replays.
    pub p50_us: f64,
    pub p99_us: f64,
    /// p50 over the same run's empty-kernel chain (same PDL setting).
    pub ratio_to_empty: f64,
    /// Whether the outputs were checked after the replays (payload rows).
    pub checked: bool,
}

/// The rows of one run and the device they were measured on.
pub struct Anatomy {
    /// The name of GPU 0, where every rank ran.
    pub device: String,
    pub driver_version: i32,
    pub replays: usize,
    pub rows: Vec<AnatomyRow>,
}

/// The bf16 input element `i` of rank `r`: small integers, so every sum is exact and the
/// expected result is known without rounding questions; never all zeros.
fn input_value(rank: usize, i: usize) -> f32 {
    ((i * 7 + rank * 3) % 17) as f32 - 8.0
}

struct Bench {
    ctx: Arc<CudaContext>,
    streams: Vec<Arc<CudaStream>>,
    ranks: StandaloneRanks,
    world_size: usize,
    ladder: Vec<StandaloneKernel>,
    production: StandaloneKernel,
    /// Co-resident blocks per rank without PDL (the communicators' rule).
    max_blocks: u32,
    replays: usize,
    _kernels: StandaloneKernels,
}

impl Bench {
    fn new(ctx: &Arc<CudaContext>, world_size: usize, replays: usize) -> Result<Bench> {
        let kernels = StandaloneKernels::load(ctx)?;
        let (ladder, production) = (kernels.ladder.clone(), kernels.production);
        let per_sm = ladder
            .iter()
            .chain([&production])
            .map(|f| f.max_blocks_per_sm(THREADS))
            .collect::<tpar::Result<Vec<u32>>>()?
            .into_iter()
            .min()
            .unwrap_or(1);
        let sms = driver::attribute(
            ctx,
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32;
        let max_blocks = (sms * per_sm / world_size as u32).clamp(1, MAX_BLOCKS);

        let count = MAX_BYTES / 2;
        let ranks = StandaloneRanks::new(ctx, world_size, MAX_BYTES)?;
        for r in 0..world_size {
            let input: Vec<u8> = (0..count)
                .flat_map(|i| {
                    half::bf16::from_f32(input_value(r, i))
                        .to_bits()
                        .to_le_bytes()
                })
                .collect();
            ranks.input(r).upload(&input)?;
        }
        let streams = (0..world_size)
            .map(|_| ctx.new_stream().context("cannot create a stream"))
            .collect::<Result<_>>()?;
        Ok(Bench {
            ctx: ctx.clone(),
            streams,
            ranks,
            world_size,
            ladder,
            production,
            max_blocks,
            replays,
            _kernels: kernels,
        })
    }

    /// Blocks and threads per block for `threads_needed` threads, at most half the
    /// co-resident blocks under PDL (the communicators' rule): whole blocks for the ladder,
    /// and for the one-shot kernel the communicators' spread over smaller blocks under PDL
    /// (`spread_shape`; without PDL they launch whole blocks).
    fn shape(&self, threads_needed: usize, pdl: bool, spread: bool) -> (u32, u32) {
        let cap = if pdl {
            (self.max_blocks / 2).max(1)
        } else {
            self.max_blocks
        };
        let min_block = if spread && pdl {
            min_block_threads(self.world_size)
        } else {
            THREADS
        };
        spread_blocks(threads_needed.max(1) as u32, cap, min_block)
    }

    fn launch_all(
        &self,
        f: StandaloneKernel,
        bytes: usize,
        shape: (u32, u32),
        pdl: bool,
    ) -> Result<()> {
        for (rank, stream) in self.streams.iter().enumerate() {
            self.ranks.launch(f, rank, bytes, shape, pdl, stream)?;
        }
        Ok(())
    }

    fn errors(&self) -> Result<()> {
        for rank in 0..self.world_size {
            let word = self.ranks.error_word(rank);
            if word != 0 {
                bail!("rank {rank}'s kernel reported error word {word:#x}");
            }
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        for s in &self.streams {
            s.synchronize()?;
        }
        Ok(())
    }

    /// Every rank's output equals the exact sum over ranks of the inputs.
    fn check_outputs(&self, bytes: usize) -> Result<()> {
        let n = self.world_size;
        for rank in 0..n {
            let mut out = vec![0u8; bytes];
            self.ranks.output(rank).download(&mut out)?;
            for (i, pair) in out.chunks_exact(2).enumerate() {
                let got = half::bf16::from_bits(u16::from_le_bytes([pair[0], pair[1]])).to_f32();
                let want: f32 = (0..n).map(|r| input_value(r, i)).sum();
                if got != want {
                    bail!("rank {rank}, {bytes} B: element {i} is {got}, expected {want}");
                }
            }
            self.ranks.output(rank).fill(0xff)?;
        }
        Ok(())
    }

    /// Median and p99 per call of a chain of `CHAIN` launches of `f` per rank, replayed.
    fn time(
        &self,
        f: StandaloneKernel,
        bytes: usize,
        shape: (u32, u32),
        pdl: bool,
    ) -> Result<(f64, f64)> {
        // Eagerly once first: a broken kernel fails here, not inside a capture.
        self.launch_all(f, bytes, shape, pdl)?;
        self.synchronize()?;
        self.errors()?;
        let graphs = self
            .streams
            .iter()
            .enumerate()
            .map(|(rank, s)| -> Result<CudaGraph> {
                s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
                let captured =
                    (0..CHAIN).try_for_each(|_| self.ranks.launch(f, rank, bytes, shape, pdl, s));
                let graph = s.end_capture(CUgraphInstantiate_flags(0));
                captured?;
                graph?.context("stream capture produced no graph")
            })
            .collect::<Result<Vec<_>>>()?;
        let main = &self.streams[0];
        let others = &self.streams[1..];
        let replay = || -> Result<()> {
            let fork = main.record_event(None)?;
            for s in others {
                s.wait(&fork)?;
            }
            for g in &graphs {
                g.launch()?;
            }
            for s in others {
                main.join(s)?;
            }
            Ok(())
        };
        for _ in 0..(self.replays / 10).max(3) {
            replay()?;
        }
        let mut events = Vec::with_capacity(self.replays);
        for _ in 0..self.replays {
            let start = main.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            replay()?;
            let end = main.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            events.push((start, end));
        }
        self.synchronize()?;
        self.errors()?;
        let mut us: Vec<f64> = events
            .iter()
            .map(|(s, e)| s.elapsed_ms(e).map(|ms| f64::from(ms) * 1e3 / CHAIN as f64))
            .collect::<std::result::Result<_, _>>()?;
        us.sort_by(f64::total_cmp);
        Ok((percentile(&us, 50.0), percentile(&us, 99.0)))
    }
}

fn measure(ctx: &Arc<CudaContext>, world_size: usize, replays: usize) -> Result<Vec<AnatomyRow>> {
    let bench = Bench::new(ctx, world_size, replays)?;
    driver::bind(&bench.ctx)?;
    let mut rows = Vec::new();
    for pdl in [false, true] {
        let mut empty = 0.0;
        // (rung, function, bytes, threads needed, whether the output is checked)
        let mut launches: Vec<(usize, StandaloneKernel, usize, usize, bool)> = (0
            ..kernels::ANATOMY_RUNGS)
            .map(|r| (r, bench.ladder[r], 0, 1, false))
            .collect();
        for bytes in PRODUCTION_PAYLOADS {
            // A thread per 16-byte LL line (8 bytes of data).
            let threads = bytes.div_ceil(8);
            launches.push((
                kernels::ANATOMY_RUNGS,
                bench.production,
                bytes,
                threads,
                bytes > 0,
            ));
        }
        for (rung, f, bytes, threads, checked) in launches {
            let (grid, block_threads) = bench.shape(threads, pdl, rung == kernels::ANATOMY_RUNGS);
            let (p50, p99) = bench
                .time(f, bytes, (grid, block_threads), pdl)
                .with_context(|| format!("rung {rung}, {bytes} B, pdl {pdl}"))?;
            if rung == 0 {
                empty = p50;
            }
            if checked {
                bench.check_outputs(bytes)?;
            }
            rows.push(AnatomyRow {
                world_size,
                rung,
                piece: RUNGS
                    .get(rung)
                    .map_or("one-shot kernel of this commit", |s| s)
                    .to_owned(),
                bytes,
                pdl,
                grid,
                block_threads,
                p50_us: p50,
                p99_us: p99,
                ratio_to_empty: if empty > 0.0 { p50 / empty } else { 0.0 },
                checked,
            });
        }
    }
    Ok(rows)
}

/// Runs the anatomy for `world_size` ranks (both 2 and 8 when `None`) on GPU 0.
pub fn run(world_size: Option<usize>, replays: usize) -> Result<Anatomy> {
    if !driver::driver_present() {
        bail!("--anatomy needs an NVIDIA GPU and driver; none was found");
    }
    let sizes = match world_size {
        Some(n) if !(2..=MAX_RANKS).contains(&n) => {
            bail!("--anatomy needs 2 to {MAX_RANKS} ranks, not {n}; pass -n 2 or -n 8")
        }
        Some(n) => vec![n],
        None => vec![2, 8],
    };
    if replays < 5 {
        bail!("--anatomy needs at least 5 timed replays (--iters)");
    }
    let ctx = CudaContext::new(0).context("cannot open GPU 0")?;
    let mut rows = Vec::new();
    for n in sizes {
        rows.extend(measure(&ctx, n, replays)?);
    }
    Ok(Anatomy {
        device: ctx.name().unwrap_or_else(|_| "unknown GPU".into()),
        driver_version: driver::driver_version()?,
        replays,
        rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rung_has_a_label_and_the_inputs_are_not_zero() {
        assert_eq!(RUNGS.len(), kernels::ANATOMY_RUNGS);
        assert!((0..64).any(|i| input_value(0, i) != 0.0));
        // Sums of 8 ranks stay exact in bf16 (|sum| <= 64).
        assert!((0..1000).all(|i| (0..8).map(|r| input_value(r, i).abs()).sum::<f32>() <= 64.0));
    }
}
