//! What `tpar doctor` examines: what tpar sees on this machine (or on a machine described in
//! a topology file) and what it will do there: GPUs and versions, links with P2P read/write
//! capability, the result of a quick numerical check of every path on the real GPUs, the link
//! measurement, the memory tpar reserves per rank, and for each message size which algorithm runs
//! and why. [`examine`] returns that as a [`Report`] (serialisable: `tpar doctor --json`);
//! printing it is the caller's.

use std::path::PathBuf;

use serde::Serialize;

use crate::{Context, Result};
use tpar::backend::cuda::link_measurement::LinkMeasurements;
use tpar::backend::cuda::CudaCommunicator;
use tpar::dispatch::{classify, decide, Choice, Class, Findings, Request, TuningTable};
use tpar::memory::MemoryFootprint;
use tpar::topology::Topology;
use tpar::Config;
use tpar::DType;

/// What to examine and plan for.
#[derive(Clone, Debug)]
pub struct DoctorOptions {
    /// A machine described in this JSON file instead of this one (touches no GPU).
    pub topology: Option<PathBuf>,
    /// Ranks to plan for (default: one per GPU).
    pub world_size: Option<usize>,
    pub dtype: DType,
    /// Plan as if this route were forced (from `--algo` or TPAR_ALGO).
    pub forced: Option<Choice>,
}

/// Why there is no report: the request is wrong, or there is nothing to examine.
#[derive(Debug, thiserror::Error)]
pub enum DoctorError {
    /// The topology file cannot be read or parsed (the caller's input: a usage error).
    #[error(transparent)]
    Topology(tpar::Error),
    /// No GPU on this machine to examine; the message says what can run instead.
    #[error("{0}")]
    NoGpu(String),
}

/// One check made on this machine, and what it found (the reason and the fix when it failed).
#[derive(Serialize, Debug)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

/// What runs at one message size, and why.
#[derive(Serialize, Debug)]
pub struct SizeDecision {
    pub bytes: u64,
    pub choice: Option<Choice>,
    pub reason: String,
    /// The latency tpar's model predicts for this size on this class of machine
    /// (`planner::latency_model`), when it has one; a measurement (`tpar bench`) beats it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_us: Option<f64>,
}

/// Everything `tpar doctor` found; `ok` is false when tpar cannot work as asked (a failed
/// check, or a size with no algorithm).
#[derive(Serialize, Debug)]
pub struct Report {
    pub topology: Topology,
    pub source: String,
    pub world_size: usize,
    pub dtype: DType,
    pub class: Class,
    pub memory_per_rank: MemoryFootprint,
    pub tuning_table: Option<String>,
    pub checks: Vec<Check>,
    /// The init measurement of the links between this machine's GPUs (two or more GPUs).
    pub links: Option<LinkMeasurements>,
    pub plans: Vec<SizeDecision>,
    pub ok: bool,
}

/// 4 KiB to 256 MiB in steps of 4.
fn size_buckets() -> Vec<u64> {
    (0..=8).map(|k| 4096u64 << (2 * k)).collect()
}

/// Examines the machine (or the described one): on a real machine this loads CUDA and NCCL,
/// runs a quick self-test of every path and probes the links, which takes seconds.
pub fn examine(options: &DoctorOptions) -> std::result::Result<Report, DoctorError> {
    let forced = options.forced;
    let mut checks = Vec::new();
    let (topology, source) = match &options.topology {
        Some(path) => (
            Topology::load(path).map_err(DoctorError::Topology)?,
            format!("file {}", path.display()),
        ),
        None => match Topology::detect() {
            Ok(t) => (t, "this machine (NVML)".to_owned()),
            Err(e) => {
                return Err(DoctorError::NoGpu(format!(
                    "tpar doctor: no GPU to examine here ({e}).\n\
                     tpar's GPU paths cannot run on this machine; the CPU backend can (`tpar bench --backend cpu`).\n\
                     To plan for another machine, describe it: `tpar doctor --topology FILE` (fixtures in crates/tpar/fixtures/topologies/)."
                )));
            }
        },
    };
    let world_size = options.world_size.unwrap_or(topology.gpus.len()).max(1);
    let config = Config::default();
    let memory = CudaCommunicator::planned_footprint(world_size, &config);

    let mut findings = Findings::default();
    let mut links = None;
    if options.topology.is_none() {
        checks.extend(gpu_checks(&topology, world_size, &mut findings));
        if checks.first().is_some_and(|c| c.ok) {
            let (check, measured) = link_measurement(&topology, &mut findings);
            checks.extend(check);
            links = measured;
        }
    }
    let tuning = TuningTable::load_for(&topology, world_size, options.dtype);
    // The model follows the built-in rules; with a forced path or a tuning table it would
    // describe another plan than the one shown, so it is left out then.
    let model = (forced.is_none() && tuning.is_none())
        .then(|| {
            crate::planner::latency_model::modelled_latency(&topology, world_size, options.dtype)
                .ok()
        })
        .flatten()
        .map(|(latency, _)| latency);
    let mut plans = Vec::new();
    for bytes in size_buckets() {
        let req = Request {
            topology: &topology,
            findings: Some(&findings),
            tuning: tuning.as_ref(),
            world_size,
            dtype: options.dtype,
            bytes,
            capturing: true,
            forced,
            group: None,
        };
        plans.push(match decide(&req) {
            Ok(p) => SizeDecision {
                bytes,
                choice: Some(p.choice),
                reason: p.reason,
                model_us: model.as_ref().map(|m| m.at(bytes)),
            },
            Err(e) => SizeDecision {
                bytes,
                choice: None,
                reason: e.to_string(),
                model_us: None,
            },
        });
    }
    let ok = plans.iter().all(|p| p.choice.is_some()) && checks.iter().all(|c| c.ok);
    let report = Report {
        class: classify(&topology, world_size),
        topology,
        source,
        world_size,
        dtype: options.dtype,
        memory_per_rank: memory,
        tuning_table: tuning.map(|t| {
            TuningTable::path(&t.fingerprint, world_size, options.dtype)
                .display()
                .to_string()
        }),
        checks,
        links,
        plans,
        ok,
    };
    Ok(report)
}

/// On a real machine: the CUDA backend loads and compiles, and every path gives the exact sum
/// on a few ranks; NCCL loads. A path that fails goes into the findings and is never planned.
fn gpu_checks(topology: &Topology, world_size: usize, findings: &mut Findings) -> Vec<Check> {
    let mut checks = Vec::new();
    let mut add = |name: &str, result: Result<String>| {
        let (ok, detail) = match result {
            Ok(d) => (true, d),
            Err(e) => (false, e.chain()),
        };
        checks.push(Check {
            name: name.to_owned(),
            ok,
            detail,
        });
        ok
    };
    let cuda = add(
        "CUDA driver and NVRTC",
        tpar::backend::cuda::check_available()
            .map(|n| format!("{n} GPU(s) usable"))
            .context("fix: install the NVIDIA driver; pip install nvidia-cuda-nvrtc"),
    );
    match tpar::backend::nccl::Nccl::load() {
        Ok(n) => add(
            "NCCL",
            Ok(format!(
                "{} from {}",
                n.version_string(),
                n.path().display()
            )),
        ),
        Err(e) => add(
            "NCCL",
            Ok(format!(
                "not found ({e}); large messages stay on tpar's paths"
            )),
        ),
    };
    if !cuda {
        return checks;
    }
    let ranks = world_size.clamp(2, tpar::backend::cuda::kernels::MAX_RANKS);
    for algo in tpar::Algorithm::ALL {
        let choice = Choice::Tpar(algo);
        let request_ok = tpar::dispatch::eligibility(
            &Request {
                topology,
                findings: None,
                tuning: None,
                world_size: ranks,
                dtype: DType::Bf16,
                bytes: 0,
                capturing: false,
                forced: None,
                group: None,
            },
            choice,
        );
        if let Err(why) = request_ok {
            add(
                &format!("self-test {algo}"),
                Ok(format!("not applicable: {why}")),
            );
            continue;
        }
        let result = crate::cuda_ranks::quick_check(ranks, algo);
        if let Err(e) = &result {
            findings
                .failed
                .push((choice, format!("its self-test failed: {}", e.chain())));
        }
        add(&format!("self-test {algo}"), result);
    }
    checks
}

/// With two or more GPUs: measures every link (push and pull bandwidth, latency, then all
/// links at once), keeps the result where communicators find it, and feeds it to the plans.
fn link_measurement(
    topology: &Topology,
    findings: &mut Findings,
) -> (Option<Check>, Option<LinkMeasurements>) {
    let Ok(gpus) = tpar::backend::cuda::check_available() else {
        return (None, None);
    };
    if gpus < 2 {
        return (None, None);
    }
    let devices: Vec<usize> = (0..gpus).collect();
    let measured = tpar::backend::cuda::link_measurement::measure_links(
        &devices,
        64 << 20,
        std::time::Duration::from_secs(10),
    );
    match measured {
        Ok(links) => {
            let saved = links.save(&LinkMeasurements::path(topology));
            let p = links.to_findings();
            findings.push_gbps = p.push_gbps;
            findings.pull_gbps = p.pull_gbps;
            let detail = format!(
                "every GPU to every peer at once: push {:.1} GB/s, pull {:.1} GB/s per GPU; {}",
                links.all_push_gbps,
                links.all_pull_gbps,
                match saved {
                    Ok(()) => format!("kept in {}", LinkMeasurements::path(topology).display()),
                    Err(e) => format!("not kept: {e}"),
                }
            );
            let check = Check {
                name: "link measurement".into(),
                ok: true,
                detail,
            };
            (Some(check), Some(links))
        }
        // No P2P between some pair is a machine tpar serves (host-staged), not a failure.
        Err(e @ tpar::Error::Unsupported(_)) => (
            Some(Check {
                name: "link measurement".into(),
                ok: true,
                detail: format!("not measured: {e}; the device-memory paths need P2P between every pair, host-staged does not"),
            }),
            None,
        ),
        Err(e) => (
            Some(Check {
                name: "link measurement".into(),
                ok: false,
                detail: e.to_string(),
            }),
            None,
        ),
    }
}
