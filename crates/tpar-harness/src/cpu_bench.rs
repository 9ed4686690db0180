//! The CPU backend's benchmark on one rank of a job: each algorithm over a sweep of sizes,
//! timed by the wall clock per call after a warm-up, every timed call checked against the
//! exact sum (and the check tallied across ranks). Each rank runs on a core of its own where
//! there are enough.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::known::{total_across_ranks, KnownData};
use super::ranks::Rank;
use super::stats::{bus_bandwidth_gbps, percentile};
use super::Result;
use tpar::{Algorithm, Config, CpuCommunicator, DType, Islands};

/// Untimed calls before timing, unless asked otherwise: a tenth of the timed ones, at least 5.
pub fn default_warmup(iters: usize) -> usize {
    (iters / 10).max(5)
}

/// What the sweep times.
pub struct CpuBenchSettings {
    /// (bytes, elements) per size.
    pub sizes: Vec<(u64, usize)>,
    pub algorithms: Vec<Algorithm>,
    pub iters: usize,
    pub warmup: usize,
    pub dtype: DType,
    pub timeout: Duration,
    /// The island partition of the islands algorithms (`None`: the backend's default).
    pub islands: Option<Islands>,
}

#[derive(Serialize, Clone, Debug)]
pub struct CpuRow {
    pub bytes: u64,
    pub algo: String,
    pub p50_us: f64,
    pub p99_us: f64,
    pub busbw_gbps: f64,
    pub correct: bool,
}

/// The rows of a run, the shared memory each rank's communicator took and how ranks were
/// placed on cores.
pub struct CpuBench {
    pub rows: Vec<CpuRow>,
    pub memory_per_rank_bytes: u64,
    pub binding: String,
}

/// Rank r on the r-th CPU this process may use while the bench runs, where every rank can
/// have one (as mpirun binds a few ranks to cores; where ranks outnumber cores, neither binds):
/// otherwise the scheduler may run two ranks on one core while another idles, which halved
/// large-message throughput in some runs here. It also puts the rank's shared segment, which
/// it allocates next, on that core's NUMA node. Dropped, it gives the process its CPUs back.
struct Binding {
    /// How ranks are bound, for the report.
    said: String,
    restore: Vec<usize>,
}

impl Binding {
    fn new(rank: usize, world_size: usize) -> Binding {
        let cpus = tpar::allowed_cpus();
        if world_size > cpus.len() {
            return Binding {
                said: format!(
                    "none: {world_size} ranks on {} allowed cores (the scheduler places them)",
                    cpus.len()
                ),
                restore: Vec::new(),
            };
        }
        match tpar::set_allowed_cpus(&[cpus[rank]]) {
            Ok(()) => Binding {
                said: format!(
                    "rank r on the r-th allowed core ({:?})",
                    &cpus[..world_size]
                ),
                restore: cpus,
            },
            Err(e) => Binding {
                said: format!("none: pinning failed ({e})"),
                restore: Vec::new(),
            },
        }
    }
}

impl Drop for Binding {
    fn drop(&mut self) {
        if !self.restore.is_empty() {
            // Best effort: a process that cannot widen its own mask again keeps one core.
            let _ = tpar::set_allowed_cpus(&self.restore);
        }
    }
}

/// Times every (size, algorithm) of `settings` on this rank. `on_step` hears each one before it
/// starts; `on_row` sees the rows so far after each.
pub fn run(
    rank: &Rank,
    settings: &CpuBenchSettings,
    mut on_step: impl FnMut(u64, Algorithm),
    mut on_row: impl FnMut(&[CpuRow]),
) -> Result<CpuBench> {
    let world_size = rank.world_size();
    let binding = Binding::new(rank.rank(), world_size);
    let config = Config {
        timeout: settings.timeout,
        islands: settings.islands,
        ..Config::default()
    };
    let mut comm = CpuCommunicator::new(&rank.rendezvous, config)?;
    let max_count = settings.sizes.iter().map(|s| s.1).max().unwrap_or(0);
    let known = KnownData::new(settings.dtype, rank.rank(), world_size, max_count, [11, 12]);
    let mut output = vec![0u8; max_count * settings.dtype.size()];
    let mut rows = Vec::with_capacity(settings.sizes.len() * settings.algorithms.len());
    for &(bytes, count) in &settings.sizes {
        for &algo in &settings.algorithms {
            on_step(bytes, algo);
            let out = &mut output[..count * settings.dtype.size()];
            total_across_ranks(&mut comm, 0)?; // start together
            for i in 0..settings.warmup {
                comm.all_reduce_bytes(settings.dtype, Some(known.input(i, count)), out, algo)?;
            }
            let mut samples = Vec::with_capacity(settings.iters);
            let mut wrong = 0u64;
            for i in 0..settings.iters {
                let start = Instant::now();
                comm.all_reduce_bytes(settings.dtype, Some(known.input(i, count)), out, algo)?;
                samples.push(start.elapsed());
                wrong += u64::from(*out != *known.expected(i, count));
            }
            let wrong = total_across_ranks(&mut comm, wrong)?;
            let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
            us.sort_by(f64::total_cmp);
            let p50 = percentile(&us, 50.0);
            rows.push(CpuRow {
                bytes,
                algo: algo.name().to_owned(),
                p50_us: p50,
                p99_us: percentile(&us, 99.0),
                busbw_gbps: bus_bandwidth_gbps(bytes, p50, world_size),
                correct: wrong == 0,
            });
            on_row(&rows);
        }
    }
    Ok(CpuBench {
        rows,
        memory_per_rank_bytes: comm.memory_footprint().allocated_bytes(),
        binding: binding.said.clone(),
    })
}
