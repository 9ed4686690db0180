//! The first-use measurement: a communicator created on a machine with no tuning table times
//! the few candidates the fabric model ranks closest (`dispatch::first_use::plan`), every rank
//! the same plan, each as CUDA graphs of two chains of calls (a call's time is their
//! difference over the calls between them, [`LONG_CHAIN_FACTOR`]); the slowest rank's times,
//! gathered so that every rank holds the same table, correct the model's estimates from then
//! on and are cached beside `tpar tune`'s tables under the machine's fingerprint
//! (`~/.cache/tpar/tuning/*-first-use.json`), so the next job on this machine reads them
//! instead of measuring. It takes at most [`BUDGET`] or its first size's probes, whichever is
//! longer: the model sizes the plan to fit, and after the first size the ranks agree on how
//! much slower than modelled it ran and time only the sizes that still fit
//! (`ProbePlan::probes_within_budget`; before, two processes time-slicing one GPU under
//! `TPAR_FIRST_USE=force` took 37 s, bench/results/2026-12-06-s18, call 5). Every rank
//! prepares its probes (graphs captured, nothing launched) and the ranks agree that all did
//! before any launches. The time it took is logged. It measures bf16 (what engines reduce),
//! never creates NCCL, and is off with `TPAR_FIRST_USE=0` (set the same on every rank);
//! `TPAR_FIRST_USE=force` also runs it where processes' ranks share a GPU (tests of this path
//! on one GPU).
//!
//! [`measure_local`] runs it for ranks that are streams of this process (`tpar doctor -n 8` on
//! one GPU); `Communicator::first_use` for this process's rank of a job.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream};

use super::Communicator;
use crate::backend::cuda::driver::DeviceMemory;
use crate::backend::cuda::kernels;
use crate::dispatch::fabric::Fabric;
pub use crate::dispatch::first_use::{
    enabled, forced, ProbePlan, BUDGET, ENV_FIRST_USE, LONG_CHAIN_FACTOR,
};
use crate::dispatch::{eligibility, Request, TuningTable};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::rendezvous::Rendezvous;

/// The dtype the first use measures.
pub const DTYPE: DType = DType::Bf16;

/// What a first-use measurement did.
#[derive(Clone, Debug)]
pub struct FirstUse {
    pub plan: ProbePlan,
    /// The table made (probes with the slowest rank's times).
    pub table: TuningTable,
    /// Wall time of the whole measurement.
    pub took: Duration,
    /// Where rank 0 cached it (`None` on other ranks, or where it could not be written, with
    /// the reason logged).
    pub saved: Option<std::path::PathBuf>,
}

impl FirstUse {
    /// One line for logs and `tpar doctor`.
    pub fn describe(&self) -> String {
        let probes: Vec<String> = self
            .table
            .probes
            .iter()
            .map(|p| {
                format!(
                    "{} at {} {:.1} us (model {:.1})",
                    p.choice,
                    crate::memory::human_bytes(p.bytes),
                    p.measured_us,
                    p.modelled_us
                )
            })
            .collect();
        format!(
            "{} candidates timed in {:.0} ms (budget {} ms): {}{}",
            self.table.probes.len(),
            self.took.as_secs_f64() * 1e3,
            BUDGET.as_millis(),
            if probes.is_empty() {
                "none close enough to time".to_owned()
            } else {
                probes.join(", ")
            },
            self.saved
                .as_ref()
                .map_or(String::new(), |p| format!("; cached in {}", p.display()))
        )
    }
}

/// The plan for `comm`'s group: the model's close candidates that this group can run.
fn plan_for(comm: &Communicator) -> ProbePlan {
    let n = comm.cuda.world_size();
    let fabric = Fabric::new(&comm.topology, n, Some(&comm.findings));
    let group = comm.group.lock().expect("group facts");
    let eligible = |choice| {
        eligibility(
            &Request {
                topology: &comm.topology,
                findings: Some(&comm.findings),
                tuning: None,
                world_size: n,
                dtype: DTYPE,
                bytes: 4096,
                capturing: true,
                forced: None,
                group: Some(&group),
            },
            choice,
        )
        .is_ok()
    };
    crate::dispatch::first_use::plan(&fabric, DTYPE, &eligible)
}

/// The probes of a plan made ready to time on some local ranks: per probe, each rank's graph
/// of `plan.chain` calls and one of [`LONG_CHAIN_FACTOR`] times as many, captured but never
/// launched, and the buffers they read and write (declared after the graphs, so dropped after
/// them). A capture runs no kernel: a rank that fails to prepare has made no collective call,
/// so the ranks of a job agree that every one of them is prepared before any launches (a rank
/// launching alone would wait out the deadline for its peers and leave its call counter ahead
/// of theirs, which no later call recovers from).
pub struct PreparedProbes {
    graphs: Vec<[Vec<CudaGraph>; 2]>,
    _buffers: Vec<(DeviceMemory, DeviceMemory)>,
}

fn cuda_error(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    let what = what.to_owned();
    move |e| Error::Cuda(format!("first-use measurement: {what}: {e}"))
}

/// Captures every probe of `plan` on the local ranks `comms` (one stream each), launching
/// nothing.
pub fn prepare_probes(
    comms: &[&Communicator],
    streams: &[Arc<CudaStream>],
    plan: &ProbePlan,
) -> Result<PreparedProbes> {
    let largest = plan.probes.iter().map(|p| p.bytes).max().unwrap_or(0) as usize;
    let elements = largest / plan.dtype.size();
    let mut buffers: Vec<(DeviceMemory, DeviceMemory)> = comms
        .iter()
        .map(|c| {
            let ctx = c.cuda.context();
            Ok((
                DeviceMemory::zeroed(ctx, largest.max(16))?,
                DeviceMemory::zeroed(ctx, largest.max(16))?,
            ))
        })
        .collect::<Result<_>>()?;
    let (short, long) = (plan.chain, plan.chain * LONG_CHAIN_FACTOR);
    let mut graphs = Vec::with_capacity(plan.probes.len());
    for probe in &plan.probes {
        let count = (probe.bytes as usize / plan.dtype.size()).min(elements);
        // One graph per rank of `calls` calls of this probe.
        let mut capture = |calls: usize| -> Result<Vec<CudaGraph>> {
            let mut graphs = Vec::with_capacity(comms.len());
            for ((comm, stream), (input, output)) in
                comms.iter().zip(streams).zip(buffers.iter_mut())
            {
                stream
                    .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                    .map_err(cuda_error("begin capture"))?;
                let queued = (0..calls).try_for_each(|_| {
                    comm.all_reduce_as(
                        probe.choice,
                        Some(input.span(plan.dtype, count)?),
                        output.span_mut(plan.dtype, count)?,
                        stream,
                    )
                });
                let graph = stream.end_capture(CUgraphInstantiate_flags(0));
                queued?;
                graphs.push(graph.map_err(cuda_error("end capture"))?.ok_or_else(|| {
                    Error::Cuda("first-use measurement: capture made no graph".into())
                })?);
            }
            Ok(graphs)
        };
        graphs.push([capture(short)?, capture(long)?]);
    }
    Ok(PreparedProbes {
        graphs,
        _buffers: buffers,
    })
}

/// Times the prepared probes of `plan` on the local ranks `comms` (one stream each, all
/// launched together: their kernels meet each other and the ranks of other processes). Per
/// probe timed, the slowest local rank's time per call, us: the difference of its median
/// replays of a chain of `plan.chain` calls and one of [`LONG_CHAIN_FACTOR`] times as many,
/// over the calls between. After the probes of the first size (`ProbePlan::first_size_probes`),
/// `keep` hears their wall time, ms, and says how many probes to time in all
/// (`ProbePlan::probes_within_budget`, from figures every rank of the job agreed on, so that
/// every rank launches the same calls).
pub fn time_prepared(
    comms: &[&Communicator],
    streams: &[Arc<CudaStream>],
    plan: &ProbePlan,
    prepared: &PreparedProbes,
    keep: &mut dyn FnMut(f64) -> Result<usize>,
) -> Result<Vec<f64>> {
    let mut out = Vec::with_capacity(plan.probes.len());
    let (short, long) = (plan.chain, plan.chain * LONG_CHAIN_FACTOR);
    let mut count = prepared.graphs.len();
    let first_size = plan.first_size_probes();
    let first_started = Instant::now();
    for (index, graphs) in prepared.graphs.iter().enumerate() {
        if index >= count {
            break;
        }
        // Each rank's replay times, us, of the short and of the long graph, alternating.
        let mut times: Vec<[Vec<f64>; 2]> = vec![[Vec::new(), Vec::new()]; comms.len()];
        for replay in 0..plan.warmup + plan.replays {
            for (which, graphs) in graphs.iter().enumerate() {
                let mut events = Vec::with_capacity(comms.len());
                for (graph, stream) in graphs.iter().zip(streams) {
                    let start = stream
                        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                        .map_err(cuda_error("event"))?;
                    graph.launch().map_err(cuda_error("graph launch"))?;
                    let end = stream
                        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                        .map_err(cuda_error("event"))?;
                    events.push((start, end));
                }
                for (i, (stream, (start, end))) in streams.iter().zip(events).enumerate() {
                    stream.synchronize().map_err(cuda_error("synchronise"))?;
                    comms[i].check()?;
                    if replay >= plan.warmup {
                        let ms = start.elapsed_ms(&end).map_err(cuda_error("elapsed"))?;
                        times[i][which].push(f64::from(ms) * 1e3);
                    }
                }
            }
        }
        let slowest = times
            .into_iter()
            .map(|[a, b]| per_call_us(median(a), short, median(b), long))
            .fold(0.0, f64::max);
        out.push(slowest);
        if index + 1 == first_size {
            count = keep(first_started.elapsed().as_secs_f64() * 1e3)?;
        }
    }
    Ok(out)
}

/// [`prepare_probes`] then [`time_prepared`], for ranks that are all streams of this process
/// (nothing to agree with: a failed preparation launched nothing on any of them, and one
/// clock times them all), started at `started`.
pub fn time_probes(
    comms: &[&Communicator],
    streams: &[Arc<CudaStream>],
    plan: &ProbePlan,
    started: Instant,
) -> Result<Vec<f64>> {
    let prepared = prepare_probes(comms, streams, plan)?;
    let before_ms = started.elapsed().as_secs_f64() * 1e3;
    time_prepared(comms, streams, plan, &prepared, &mut |first_ms| {
        Ok(plan.probes_within_budget(before_ms, first_ms))
    })
}

fn median(mut replays: Vec<f64>) -> f64 {
    replays.sort_by(f64::total_cmp);
    replays[replays.len() / 2]
}

/// The time of one call, us, from the median replays of a graph of `short` calls and of one of
/// `long`: their difference over the calls between them, so that what a replay pays once
/// cancels ([`LONG_CHAIN_FACTOR`]); where noise leaves no positive difference, the long
/// graph's replay over its calls (an upper bound).
fn per_call_us(short_us: f64, short: usize, long_us: f64, long: usize) -> f64 {
    let slope = (long_us - short_us) / (long - short) as f64;
    if slope > 0.0 {
        slope
    } else {
        long_us / long as f64
    }
}

/// Whether `comm` should measure at its creation: on, more than one rank, no table for this
/// machine yet (none of this build's kernels among those the communicator read as it was made,
/// nor one it adopted since), and its GPU not time-sliced with another process's rank (timings
/// there are milliseconds of scheduling, not the machine's) unless `TPAR_FIRST_USE=force`.
fn wanted(comm: &Communicator) -> bool {
    let setting = std::env::var(ENV_FIRST_USE).ok();
    enabled(setting.as_deref())
        && comm.cuda.world_size() > 1
        && (comm.cuda.time_sliced_with().is_empty() || forced(setting.as_deref()))
        && !comm.tuning.contains_key(&DTYPE)
}

/// Measures for ranks that are all streams of this process (`comms[i]` on `streams[i]`), when
/// there is no table yet, and gives every one of them the table; saves it. `Ok(None)`: not
/// wanted here (off, one rank, a table exists, no candidate close enough).
pub fn measure_local(
    comms: &mut [Communicator],
    streams: &[Arc<CudaStream>],
) -> Result<Option<FirstUse>> {
    let Some(first) = comms.first() else {
        return Ok(None);
    };
    if !wanted(first) {
        return Ok(None);
    }
    let started = Instant::now();
    let plan = plan_for(first);
    if plan.probes.is_empty() {
        return Ok(None);
    }
    let refs: Vec<&Communicator> = comms.iter().collect();
    let times = time_probes(&refs, streams, &plan, started)?;
    let table = plan.table(
        (first.topology.fingerprint(), kernels::build_id()),
        first.cuda.world_size(),
        &times.iter().copied().map(Some).collect::<Vec<_>>(),
    );
    let saved = save(&table);
    for comm in comms.iter_mut() {
        comm.adopt(table.clone());
    }
    Ok(Some(FirstUse {
        plan,
        table,
        took: started.elapsed(),
        saved,
    }))
}

fn save(table: &TuningTable) -> Option<std::path::PathBuf> {
    match table.save() {
        Ok(path) => Some(path),
        Err(e) => {
            log::warn!("the first-use measurement could not be cached: {e}");
            None
        }
    }
}

impl Communicator {
    /// Takes `table` as this machine's measurement for its dtype: later decisions use it.
    fn adopt(&mut self, table: TuningTable) {
        self.tuning.insert(table.dtype, table);
        self.decisions.lock().expect("decision cache").clear();
    }

    /// The first-use measurement for this process's rank of the job behind `rendezvous`
    /// (collective: every rank calls it at its creation). Every rank agrees first that it
    /// wants to and planned the same probes; then each times them, the times are gathered and
    /// every rank takes the slowest rank's, and rank 0 caches the table. A failure is logged
    /// and leaves the model's choice: it never fails the communicator.
    pub(super) fn first_use(&mut self, rendezvous: &Rendezvous, instance: &str, timeout: Duration) {
        if !enabled(std::env::var(ENV_FIRST_USE).ok().as_deref()) || self.cuda.world_size() < 2 {
            return;
        }
        let started = Instant::now();
        let plan = plan_for(self);
        let rank = self.cuda.rank();
        let this: &Communicator = self;
        let slowest = agree_and_time(
            &Agreement {
                rendezvous,
                instance,
                timeout,
                plan: &plan,
                wanted: wanted(this),
                started,
            },
            || {
                let stream = this
                    .cuda
                    .context()
                    .new_stream()
                    .map_err(cuda_error("a stream"))?;
                let probes = prepare_probes(&[this], std::slice::from_ref(&stream), &plan)?;
                Ok((stream, probes))
            },
            |(stream, probes), keep| {
                time_prepared(&[this], std::slice::from_ref(&stream), &plan, &probes, keep)
            },
        );
        let Some(slowest) = slowest else { return };
        let table = plan.table(
            (self.topology.fingerprint(), kernels::build_id()),
            self.cuda.world_size(),
            &slowest,
        );
        let saved = if rank == 0 { save(&table) } else { None };
        let outcome = FirstUse {
            plan: plan.clone(),
            table: table.clone(),
            took: started.elapsed(),
            saved,
        };
        if outcome.took > BUDGET {
            log::warn!(
                "rank {rank}: the first-use measurement took {:.0} ms, over its {} ms budget",
                outcome.took.as_secs_f64() * 1e3,
                BUDGET.as_millis()
            );
        }
        log::info!("rank {rank}: first-use measurement: {}", outcome.describe());
        self.adopt(table);
    }
}

/// The job-wide side of one rank's first-use measurement: where the ranks meet, under which
/// creation's name, how long to wait, what every rank planned and whether this one wants it.
pub(crate) struct Agreement<'a> {
    pub rendezvous: &'a Rendezvous,
    pub instance: &'a str,
    pub timeout: Duration,
    pub plan: &'a ProbePlan,
    pub wanted: bool,
    pub started: Instant,
}

/// One rank's part of the first-use measurement, collective over the job: every rank agrees
/// that it wants it and planned the same probes; every rank `prepare`s (a stream, buffers,
/// the captured graphs: nothing launched), and all time or none does, so a rank that failed
/// there leaves no peer's call counter ahead; each `time`s the prepared probes, and after the
/// first size's (`keep`) the ranks agree on their wall time, the slowest rank's, and time the
/// sizes that still fit the budget by it (the same count on every rank, so the same calls;
/// a rank whose timing failed before that agreement takes part in it all the same, so that
/// none waits for it); the times are gathered. The slowest rank's time per probe (`None` past the probes timed),
/// or `None` where any step failed on any rank, which is logged: the fabric model decides.
pub(crate) fn agree_and_time<P>(
    job: &Agreement<'_>,
    prepare: impl FnOnce() -> Result<P>,
    time: impl FnOnce(P, &mut dyn FnMut(f64) -> Result<usize>) -> Result<Vec<f64>>,
) -> Option<Vec<Option<f64>>> {
    let (rendezvous, instance, timeout, plan) =
        (job.rendezvous, job.instance, job.timeout, job.plan);
    let rank = rendezvous.rank();
    let ready = job.wanted && !plan.probes.is_empty();
    let agree = format!("first-use-{instance}-plan");
    let everyone: Result<Vec<(bool, String)>> = rendezvous
        .publish(&agree, &(ready, plan.key()))
        .and_then(|()| rendezvous.gather(&agree, timeout));
    match everyone {
        Ok(all) if all.iter().all(|(r, k)| *r && *k == plan.key()) => {}
        Ok(_) => return None,
        Err(e) => {
            log::warn!("first-use measurement skipped: {e}");
            return None;
        }
    }
    let prepared = prepare();
    if let Err(e) = &prepared {
        log::warn!("first-use measurement on rank {rank}: {e}");
    }
    let ready = format!("first-use-{instance}-prepared");
    let everyone: Result<Vec<bool>> = rendezvous
        .publish(&ready, &prepared.is_ok())
        .and_then(|()| rendezvous.gather(&ready, timeout));
    let prepared = match (everyone, prepared) {
        (Ok(all), Ok(prepared)) if all.iter().all(|r| *r) => prepared,
        (Ok(_), _) => {
            log::warn!(
                "first-use measurement: a rank could not prepare it; the fabric model decides"
            );
            return None;
        }
        (Err(e), _) => {
            log::warn!("first-use measurement skipped: {e}");
            return None;
        }
    };
    let before_ms = job.started.elapsed().as_secs_f64() * 1e3;
    let first = format!("first-use-{instance}-first");
    let mut published_first = false;
    let mut keep = |first_ms: f64| -> Result<usize> {
        published_first = true;
        rendezvous.publish(&first, &(before_ms, first_ms))?;
        let all: Vec<(f64, f64)> = rendezvous.gather(&first, timeout)?;
        let slowest = |pick: fn(&(f64, f64)) -> f64| all.iter().map(pick).fold(0.0, f64::max);
        Ok(plan.probes_within_budget(slowest(|r| r.0), slowest(|r| r.1)))
    };
    let mine = time(prepared, &mut keep)
        .map_err(|e| log::warn!("first-use measurement on rank {rank}: {e}"))
        .ok();
    if mine.is_none() && !published_first {
        // The other ranks wait for this rank's first size in `keep`: a first size too long
        // for anything more stops them there at once, not at the timeout (all then fall back
        // to the model, as this rank's missing times below say).
        let _ = rendezvous.publish(&first, &(before_ms, f64::MAX));
    }
    let key = format!("first-use-{instance}-times");
    let gathered: Result<Vec<Option<Vec<f64>>>> = rendezvous
        .publish(&key, &mine)
        .and_then(|()| rendezvous.gather(&key, timeout));
    let all = match gathered {
        Ok(all) if all.iter().all(Option::is_some) => all,
        Ok(_) => {
            log::warn!("first-use measurement failed on some rank; the fabric model decides");
            return None;
        }
        Err(e) => {
            log::warn!("first-use measurement: {e}");
            return None;
        }
    };
    Some(
        (0..plan.probes.len())
            .map(|i| {
                all.iter()
                    .map(|t| t.as_ref().and_then(|t| t.get(i).copied()))
                    .try_fold(0.0f64, |m, t| Some(m.max(t?)))
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::first_use::PlannedProbe;
    use crate::dispatch::Choice;
    use crate::rendezvous::{ensure_private_dir, random_token, RankEnv};
    use crate::{Algorithm, DType};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Three sizes of two probes, each size modelled at 3.2 ms of GPU time.
    fn plan() -> ProbePlan {
        let probe = |bytes, algorithm| PlannedProbe {
            bytes,
            choice: Choice::Tpar(algorithm),
            modelled_us: 5.0,
        };
        let probes = [4096, 16384, 65536]
            .into_iter()
            .flat_map(|b| [probe(b, Algorithm::OneShot), probe(b, Algorithm::TwoShot)])
            .collect();
        ProbePlan {
            dtype: DType::Bf16,
            probes,
            chain: 8,
            warmup: 2,
            replays: 6,
        }
    }

    /// What each rank did: its result, and how many ranks prepared and timed.
    struct Outcome {
        results: Vec<Option<Vec<Option<f64>>>>,
        prepared: usize,
        timed: usize,
    }

    /// `n` threads as the ranks of one job, each agreeing on [`plan`] with `wanted(rank)`,
    /// preparing with `prepare(rank)` and timing with `time(rank, keep)`.
    fn job(
        n: usize,
        wanted: impl Fn(usize) -> bool + Sync,
        prepare: impl Fn(usize) -> Result<()> + Sync,
        time: impl Fn(usize, &mut dyn FnMut(f64) -> Result<usize>) -> Result<Vec<f64>> + Sync,
    ) -> Outcome {
        let token = random_token().unwrap();
        let dir = std::env::temp_dir().join(format!("tpar-first-use-test-{token}"));
        ensure_private_dir(&dir).unwrap();
        let (prepared, timed) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let plan = plan();
        let results = std::thread::scope(|scope| {
            let ranks: Vec<_> = (0..n)
                .map(|rank| {
                    let env = RankEnv::on_one_host(rank, n, &dir, &token);
                    let (plan, wanted, prepare, time) = (&plan, &wanted, &prepare, &time);
                    let (prepared, timed) = (&prepared, &timed);
                    scope.spawn(move || {
                        let rendezvous = Rendezvous::join(env).unwrap();
                        let job = Agreement {
                            rendezvous: &rendezvous,
                            instance: "test",
                            timeout: Duration::from_secs(20),
                            plan,
                            wanted: wanted(rank),
                            started: Instant::now(),
                        };
                        agree_and_time(
                            &job,
                            || {
                                prepared.fetch_add(1, Ordering::SeqCst);
                                prepare(rank)
                            },
                            |(), keep| {
                                timed.fetch_add(1, Ordering::SeqCst);
                                time(rank, keep)
                            },
                        )
                    })
                })
                .collect();
            ranks.into_iter().map(|r| r.join().unwrap()).collect()
        });
        let _ = std::fs::remove_dir_all(&dir);
        Outcome {
            results,
            prepared: prepared.into_inner(),
            timed: timed.into_inner(),
        }
    }

    /// Times 10 * (probe + 1) + rank us for the probes `keep` allows, after reporting the
    /// first size's wall time as `first_ms(rank)`.
    fn timing(
        first_ms: impl Fn(usize) -> f64 + Sync,
    ) -> impl Fn(usize, &mut dyn FnMut(f64) -> Result<usize>) -> Result<Vec<f64>> + Sync {
        move |rank, keep| {
            let count = keep(first_ms(rank))?;
            Ok((0..count)
                .map(|i| 10.0 * (i + 1) as f64 + rank as f64)
                .collect())
        }
    }

    #[test]
    fn every_rank_takes_the_slowest_ranks_times_of_the_probes_that_fit_the_slowest_ranks_budget() {
        // As fast as modelled: every probe timed; each probe's figure the slowest rank's.
        let fast = job(3, |_| true, |_| Ok(()), timing(|_| 3.2));
        let all: Vec<Option<f64>> = (0..6).map(|i| Some(10.0 * (i + 1) as f64 + 2.0)).collect();
        assert_eq!(fast.results, vec![Some(all); 3]);
        assert_eq!((fast.prepared, fast.timed), (3, 3));
        // Rank 1's first size took 150 ms: the ranks that ran it fast stop after it too, so
        // every rank launches the same calls, and the untimed probes have no figure.
        let first_ms = |r| if r == 1 { 150.0 } else { 3.2 };
        let slow = job(
            3,
            |_| true,
            |_| Ok(()),
            |rank, keep| {
                let count = keep(first_ms(rank))?;
                assert_eq!(count, 2, "rank {rank} would time {count} probes");
                timing(first_ms)(rank, &mut |_| Ok(count))
            },
        );
        let first: Vec<Option<f64>> = vec![Some(12.0), Some(22.0), None, None, None, None];
        assert_eq!(slow.results, vec![Some(first); 3]);
    }

    #[test]
    fn no_rank_times_unless_every_rank_wants_it_and_prepared_it() {
        let unwanted = job(3, |r| r != 2, |_| Ok(()), timing(|_| 3.2));
        assert_eq!(unwanted.results, vec![None, None, None]);
        assert_eq!((unwanted.prepared, unwanted.timed), (0, 0));
        // Before, a rank that failed here left its peers' call counters ahead.
        let failed = job(
            3,
            |_| true,
            |r| match r {
                1 => Err(Error::Cuda("no memory for the probes".into())),
                _ => Ok(()),
            },
            timing(|_| 3.2),
        );
        assert_eq!(failed.results, vec![None, None, None]);
        assert_eq!((failed.prepared, failed.timed), (3, 0));
    }

    #[test]
    fn a_rank_whose_timing_fails_leaves_every_rank_to_the_model_without_waiting_out_the_timeout() {
        // Rank 1 fails after the first size's agreement, or before it (its first launch).
        for before_first_size in [false, true] {
            let failed = job(
                3,
                |_| true,
                |_| Ok(()),
                |rank, keep| {
                    if rank == 1 && before_first_size {
                        return Err(Error::Cuda("the first launch failed".into()));
                    }
                    // Every probe fits; where rank 1 failed before its first size, the others
                    // stop after theirs, told at once (before, they waited here the job's 20 s
                    // for rank 1, then failed).
                    let count = keep(3.2);
                    let fit = if before_first_size { 2 } else { 6 };
                    assert!(matches!(count, Ok(c) if c == fit), "rank {rank}: {count:?}");
                    match rank {
                        1 => Err(Error::Cuda("a launch failed".into())),
                        _ => Ok(vec![1.0; fit]),
                    }
                },
            );
            let case = format!("failed before the first size: {before_first_size}");
            assert_eq!(failed.results, vec![None, None, None], "{case}");
            assert_eq!(failed.timed, 3, "{case}");
        }
    }

    #[test]
    fn a_call_costs_the_difference_of_two_chains_over_their_calls() {
        // 8 calls in 100 us and 32 in 220: 5 us a call, the 60 us every replay pays once gone.
        assert!((per_call_us(100.0, 8, 220.0, 32) - 5.0).abs() < 1e-12);
        // Noise that leaves no positive difference: the long chain's replay over its calls.
        assert!((per_call_us(230.0, 8, 220.0, 32) - 220.0 / 32.0).abs() < 1e-12);
    }
}
