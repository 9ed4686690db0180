//! `tpar bench --backend cuda`: times every algorithm by CUDA-graph replay. For each size it
//! reports the cost per allreduce inside a chain of many (how an engine's decode graph sees
//! it: each rank replays its own graph, as each GPU would), the cost of one graph holding a
//! single allreduce per rank on fork/join branches (mostly launch and fork/join), and in
//! the same run the floors of that path: the same graphs with an empty kernel, and the bytes
//! the algorithm must move over the bandwidth measured on this machine. Every configuration's
//! result is checked bitwise, eagerly and after the replays.

use std::time::{Duration, Instant};

use crate::planner::latency_model::{bottleneck_bytes, Placement};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaGraph;
use serde::Serialize;
use tpar::backend::cuda::driver::{
    copy_device_async, copy_to_host_async, DeviceMemory, MappedHostMemory,
};
use tpar::backend::cuda::LaunchShape;
use tpar::dispatch::Choice;
use tpar::{Algorithm, DType};

use super::cuda_ranks::{CudaRanks, RankBuffers};
use super::stats::{bus_bandwidth_gbps, percentile};
use super::Result;
use tpar::algorithm::Selection;

/// Untimed graph replays before timing, unless asked otherwise.
pub const DEFAULT_WARMUP: usize = 5;

pub struct CudaBenchSettings {
    pub sizes: Vec<(u64, usize)>,
    /// tpar's algorithms, NCCL and `auto` (the dispatcher's pick per size), timed the same way.
    pub choices: Vec<Selection>,
    pub dtype: DType,
    pub replays: usize,
    pub warmup: usize,
    pub chain: usize,
    /// The island partition of the islands algorithms (`Config::islands`; `None`: the
    /// machine's).
    pub islands: Option<tpar::Islands>,
}

#[derive(Clone, Debug)]
pub struct CudaRow {
    pub bytes: u64,
    pub algo: String,
    /// Per allreduce, in a graph of `chain` allreduces per rank (median over replays).
    pub p50_us: f64,
    pub p99_us: f64,
    pub busbw_gbps: f64,
    pub correct: bool,
    /// A graph holding one allreduce per rank, per replay (median).
    pub graph_single_us: f64,
    /// Bytes this algorithm moves through the bottleneck (device memory of the shared GPU, or
    /// the PCIe link for host-staged) over the bandwidth measured in this run.
    pub wire_floor_us: f64,
    /// Allreduces per rank in the timed graph and timed replays, fewer than asked for where one
    /// call is slow (so that a row takes about a second).
    pub chain: usize,
    pub replays: usize,
    /// For `auto`: what the dispatcher ran at this size.
    pub runs: Option<String>,
    /// For `auto`: the dispatcher's reason (a tuning table, the first-use measurement or the
    /// fabric model, and what it skipped).
    pub why: Option<String>,
    /// How the first rank's last kernel of the timed chain was launched (tpar's algorithms;
    /// None for NCCL and where no kernel runs).
    pub launch: Option<LaunchShape>,
    /// Set when the algorithm cannot run here, with the reason; the figures are then unset
    /// (zero here, `null` in JSON: bench/schema/bench.schema.json).
    pub skipped: Option<String>,
}

impl CudaRow {
    /// `algo`'s row at `bytes` before anything is timed: no figures, not (yet) correct.
    fn untimed(bytes: u64, algo: &str) -> Self {
        CudaRow {
            bytes,
            algo: algo.to_owned(),
            p50_us: 0.0,
            p99_us: 0.0,
            busbw_gbps: 0.0,
            correct: false,
            graph_single_us: 0.0,
            wire_floor_us: 0.0,
            chain: 0,
            replays: 0,
            runs: None,
            why: None,
            launch: None,
            skipped: None,
        }
    }
}

/// A row as JSON: a skipped row has `null` figures and `correct: null`, so a reader that does
/// not look at `skipped` cannot take it for a 0 us, correct result.
#[derive(Serialize)]
struct CudaRowJson<'a> {
    bytes: u64,
    algo: &'a str,
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    busbw_gbps: Option<f64>,
    correct: Option<bool>,
    graph_single_us: Option<f64>,
    wire_floor_us: Option<f64>,
    chain: usize,
    replays: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    runs: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    why: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    launch: Option<LaunchShape>,
    #[serde(skip_serializing_if = "Option::is_none")]
    skipped: Option<&'a str>,
}

impl Serialize for CudaRow {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let timed = self.skipped.is_none();
        let figure = |v: f64| timed.then_some(v);
        CudaRowJson {
            bytes: self.bytes,
            algo: &self.algo,
            p50_us: figure(self.p50_us),
            p99_us: figure(self.p99_us),
            busbw_gbps: figure(self.busbw_gbps),
            correct: timed.then_some(self.correct),
            graph_single_us: figure(self.graph_single_us),
            wire_floor_us: figure(self.wire_floor_us),
            chain: self.chain,
            replays: self.replays,
            runs: self.runs.as_deref(),
            why: self.why.as_deref(),
            launch: self.launch,
            skipped: self.skipped.as_deref(),
        }
        .serialize(serializer)
    }
}

#[derive(Serialize, Clone, Debug)]
pub struct Floors {
    /// An empty kernel per rank in a chain graph per rank, per kernel.
    pub empty_chain_us: f64,
    /// A graph with one empty kernel per rank, per replay.
    pub empty_single_us: f64,
    /// Device-to-device copy, counting bytes read and written.
    pub device_copy_gbps: f64,
    /// Device to pinned host memory over PCIe.
    pub device_to_host_gbps: f64,
}

/// Replays `graphs` (one per local rank, each on its rank's stream, or a single graph holding
/// every rank) `warmup + replays` times, timing each replay with events on the first stream:
/// the other streams start after it and it waits for them.
pub fn time_replays(
    group: &CudaRanks,
    graphs: &[CudaGraph],
    warmup: usize,
    replays: usize,
) -> Result<Vec<f64>> {
    let stream = &group.streams[0];
    let others = &group.streams[1..graphs.len()];
    let replay = || -> Result<()> {
        let fork = stream.record_event(None)?;
        for s in others {
            s.wait(&fork)?;
        }
        for g in graphs {
            g.launch()?;
        }
        for s in others {
            stream.join(s)?;
        }
        Ok(())
    };
    for _ in 0..warmup {
        replay()?;
    }
    let mut events = Vec::with_capacity(replays);
    for _ in 0..replays {
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        replay()?;
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        events.push((start, end));
    }
    group.synchronize()?;
    let mut us: Vec<f64> = events
        .iter()
        .map(|(s, e)| s.elapsed_ms(e).map(|ms| f64::from(ms) * 1e3))
        .collect::<std::result::Result<_, _>>()?;
    us.sort_by(f64::total_cmp);
    Ok(us)
}

pub fn measure_floors(group: &CudaRanks, settings: &CudaBenchSettings) -> Result<Floors> {
    let chain = group.capture_each(|i, s| -> Result<()> {
        for _ in 0..settings.chain {
            group.comms[i].cuda().launch_empty(s)?;
        }
        Ok(())
    })?;
    let chain_us = time_replays(group, &chain, settings.warmup, settings.replays)?;
    let single =
        group.capture(|i, s| -> Result<()> { Ok(group.comms[i].cuda().launch_empty(s)?) })?;
    let single_us = time_replays(
        group,
        std::slice::from_ref(&single),
        settings.warmup,
        settings.replays,
    )?;

    let ctx = group.comms[0].cuda().context();
    let stream = &group.streams[0];
    let bytes = 256 << 20;
    let (a, b) = (
        DeviceMemory::zeroed(ctx, bytes)?,
        DeviceMemory::zeroed(ctx, bytes)?,
    );
    let pinned = MappedHostMemory::zeroed(ctx, 64 << 20)?;
    let mut copy_us = Vec::new();
    let mut d2h_us = Vec::new();
    for _ in 0..5 {
        let t0 = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        copy_device_async(&b, &a, bytes, stream)?;
        let t1 = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        copy_to_host_async(&pinned, &a, 64 << 20, stream)?;
        let t2 = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        stream.synchronize()?;
        copy_us.push(f64::from(t0.elapsed_ms(&t1)?) * 1e3);
        d2h_us.push(f64::from(t1.elapsed_ms(&t2)?) * 1e3);
    }
    copy_us.sort_by(f64::total_cmp);
    d2h_us.sort_by(f64::total_cmp);
    Ok(Floors {
        empty_chain_us: percentile(&chain_us, 50.0) / settings.chain as f64,
        empty_single_us: percentile(&single_us, 50.0),
        device_copy_gbps: 2.0 * bytes as f64 / (copy_us[2] * 1e3),
        device_to_host_gbps: (64u64 << 20) as f64 / (d2h_us[2] * 1e3),
    })
}

pub fn run(
    group: &mut CudaRanks,
    settings: &CudaBenchSettings,
    floors: &Floors,
    mut progress: impl FnMut(u64, Selection),
) -> Result<Vec<CudaRow>> {
    let dtype = settings.dtype;
    let n = group.world_size as f64;
    let max_count = settings.sizes.iter().map(|s| s.1).max().unwrap_or(0);
    let known = group.known(dtype, max_count, [41, 42]);
    let mut buffers = group.buffers(max_count * dtype.size())?;
    group.upload_inputs(&buffers, &known, max_count)?;
    let mut rows = Vec::new();
    for &(bytes, count) in &settings.sizes {
        for &algo in &settings.choices {
            progress(bytes, algo);
            let mut row = CudaRow::untimed(bytes, algo.name());
            // What actually runs: the fixed choice, or the dispatcher's for this size.
            let choice = match algo {
                Selection::Forced(c) => group.supports(algo).map(|_| c),
                Selection::Auto => group.comms[0]
                    .decision(dtype, bytes, true)
                    .map(|p| {
                        row.why = Some(p.reason);
                        p.choice
                    })
                    .map_err(|e| e.to_string()),
            };
            let choice = match choice {
                Ok(c) => c,
                Err(why) => {
                    // Not a failure (the run passes), but no result either: JSON writes null.
                    row.skipped = Some(why);
                    row.correct = true;
                    rows.push(row);
                    continue;
                }
            };
            if algo == Selection::Auto {
                row.runs = Some(choice.name().to_owned());
            }
            // NCCL adds in its own order and rounds every 16-bit partial sum: checked within
            // the worst case of that; tpar's paths bitwise.
            let tolerance = if choice == Choice::Nccl {
                tpar::check::unordered_sum_error_bound(dtype, group.world_size)
            } else {
                0.0
            };
            let check = |group: &CudaRanks, buffers: &[RankBuffers], variant: usize| {
                group.wrong_outputs_within(buffers, &known, count, variant, dtype, tolerance)
            };
            let mut wrong = 0;
            let mut eager = Duration::ZERO;
            for variant in 0..2 {
                let start = Instant::now();
                group.launch(&mut buffers, dtype, count, algo, variant, false)?;
                group.synchronize()?;
                eager = start.elapsed();
                wrong += check(group, &buffers, variant)?;
            }
            // About 20 ms per replay and one second per row at most: large host-staged calls
            // take milliseconds each. Every rank must pick the same counts (they are collective
            // calls), so the time comes from the job-wide mean, not this process's own clock.
            let per_call = (group.agreed_mean(eager.as_nanos() as u64)? as f64 / 1e9).max(1e-6);
            let chain_len = settings.chain.min(((0.02 / per_call) as usize).max(1));
            let replays = settings
                .replays
                .min(((1.0 / (per_call * chain_len as f64)) as usize).max(5));
            row.chain = chain_len;
            row.replays = replays;

            let chain = group.capture_each(|i, s| -> Result<()> {
                for k in 0..chain_len {
                    group.queue(i, s, &mut buffers, Some(k % 2), dtype, count, algo)?;
                }
                Ok(())
            })?;
            // The chain's last launch: the shape its steady state runs on.
            if let Choice::Tpar(_) = choice {
                row.launch = group.comms[0].cuda().last_launch();
            }
            let chain_us = time_replays(group, &chain, settings.warmup.min(replays), replays)?;
            wrong += check(group, &buffers, (chain_len - 1) % 2)?;
            drop(chain);

            let single = group.capture(|i, s| -> Result<()> {
                group.queue(i, s, &mut buffers, Some(0), dtype, count, algo)
            })?;
            let single_us = time_replays(
                group,
                std::slice::from_ref(&single),
                settings.warmup.min(replays),
                replays,
            )?;
            wrong += check(group, &buffers, 0)?;
            drop(single);

            let wrong = group.total(wrong)?;
            row.p50_us = percentile(&chain_us, 50.0) / chain_len as f64;
            row.p99_us = percentile(&chain_us, 99.0) / chain_len as f64;
            row.graph_single_us = percentile(&single_us, 50.0);
            row.busbw_gbps = bus_bandwidth_gbps(bytes, row.p50_us, group.world_size);
            let bandwidth = if choice == Choice::Tpar(Algorithm::HostStaged) {
                floors.device_to_host_gbps
            } else {
                floors.device_copy_gbps
            };
            row.wire_floor_us =
                bottleneck_bytes(choice, n, bytes as f64, Placement::SharedGpu) / (bandwidth * 1e3);
            row.correct = wrong == 0;
            rows.push(row);
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_shot_moves_the_most_bytes_at_many_ranks() {
        let n = 8.0;
        assert!(
            bottleneck_bytes(
                Choice::Tpar(Algorithm::OneShot),
                n,
                1.0,
                Placement::SharedGpu
            ) > bottleneck_bytes(
                Choice::Tpar(Algorithm::TwoShot),
                n,
                1.0,
                Placement::SharedGpu
            )
        );
        assert_eq!(
            bottleneck_bytes(
                Choice::Tpar(Algorithm::HostStaged),
                2.0,
                1.0,
                Placement::SharedGpu
            ),
            8.0
        );
    }
}

#[cfg(test)]
mod json_tests {
    use super::*;

    fn row(skipped: Option<&str>) -> CudaRow {
        CudaRow {
            correct: true,
            skipped: skipped.map(str::to_owned),
            ..CudaRow::untimed(4096, "nccl")
        }
    }

    #[test]
    fn a_skipped_row_has_null_figures_and_no_verdict() {
        let v = serde_json::to_value(row(Some("NCCL needs one GPU per rank"))).unwrap();
        for key in [
            "p50_us",
            "p99_us",
            "busbw_gbps",
            "correct",
            "graph_single_us",
            "wire_floor_us",
        ] {
            assert!(v[key].is_null(), "{key}: {v}");
        }
        assert_eq!(v["skipped"], "NCCL needs one GPU per rank");
        let v = serde_json::to_value(row(None)).unwrap();
        assert_eq!(v["p50_us"], 0.0);
        assert_eq!(v["correct"], true);
        assert!(v.get("skipped").is_none());
    }
}
