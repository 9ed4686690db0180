//! What `tpar doctor` examines: what tpar sees on this machine (or on a machine described in
//! a topology file) and what it will do there: GPUs and versions, links with P2P read/write
//! capability, the result of a quick numerical check of every path on the real GPUs, the link
//! measurement, the memory tpar reserves per rank, and for each message size which algorithm runs
//! and why. [`examine`] returns that as a [`Report`] (serialisable: `tpar doctor --json`);
//! printing it is the caller's.

use std::path::PathBuf;

use serde::Serialize;

use crate::provenance::Provenance;
use crate::{Context, Result};
use tpar::backend::cuda::link_measurement::LinkMeasurements;
use tpar::backend::cuda::CudaCommunicator;
use tpar::dispatch::fabric::{Collapse, Fabric};
use tpar::dispatch::{classify, decide, Choice, Class, Findings, Request, TuningTable};
use tpar::memory::MemoryFootprint;
use tpar::topology::Topology;
use tpar::Config;
use tpar::DType;

/// What to examine and decide for.
#[derive(Clone, Debug)]
pub struct DoctorOptions {
    /// A machine described in this JSON file instead of this one (touches no GPU).
    pub topology: Option<PathBuf>,
    /// Ranks to decide for (default: one per GPU).
    pub world_size: Option<usize>,
    pub dtype: DType,
    /// Decide as if this choice were forced (from `--algo` or TPAR_ALGO).
    pub forced: Option<Choice>,
}

/// What runs where there is no GPU: said by the error and by the `--json` record alike.
const CPU_INSTEAD: &str =
    "tpar's GPU paths cannot run on this machine; the CPU backend can (`tpar bench --backend cpu`)";

/// Why there is no report: the request is wrong, or there is nothing to examine.
#[derive(Debug, thiserror::Error)]
pub enum DoctorError {
    /// The topology file cannot be read or parsed (the caller's input: a usage error).
    #[error(transparent)]
    Topology(tpar::Error),
    /// No GPU on this machine to examine (`reason`: why not); the message says what can run
    /// instead.
    #[error(
        "tpar doctor: no GPU to examine here ({reason}).\n{CPU_INSTEAD}.\n\
         To see what tpar decides on another machine, describe it: `tpar doctor --topology FILE` (fixtures in crates/tpar/fixtures/topologies/)."
    )]
    NoGpu { reason: String },
}

/// `tpar doctor --json`: the report with the record every result file of tpar carries
/// (command, device, date, commit), so that a kept file names its run.
#[derive(Serialize)]
pub struct DoctorRecord<'a> {
    #[serde(flatten)]
    pub provenance: Provenance,
    #[serde(flatten)]
    pub report: &'a Report,
}

/// `tpar doctor --json` where there is no GPU to examine: the report's shape with the one check
/// that failed, why, and what runs instead, so that a script reading the JSON learns that
/// rather than reading nothing.
#[derive(Serialize)]
pub struct NoGpuRecord {
    #[serde(flatten)]
    pub provenance: Provenance,
    pub world_size: usize,
    pub dtype: DType,
    pub checks: Vec<Check>,
    pub ok: bool,
}

impl NoGpuRecord {
    /// The record of `options`' run, which found no GPU for `reason`.
    pub fn new(options: &DoctorOptions, reason: &str, provenance: Provenance) -> NoGpuRecord {
        NoGpuRecord {
            provenance,
            world_size: options.world_size.unwrap_or(1),
            dtype: options.dtype,
            checks: vec![Check {
                name: "GPU".into(),
                ok: false,
                detail: format!("no GPU to examine ({reason}); {CPU_INSTEAD}"),
            }],
            ok: false,
        }
    }
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

/// A tuning table passed over: where it lies, the kernels it timed and this build's.
#[derive(Serialize, Debug)]
pub struct IgnoredTable {
    pub path: String,
    pub kernels: String,
    pub this_build: String,
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
    /// The islands the islands algorithms reduce over (`4+4`), where the class has more than
    /// one, and whether their exchange goes through host memory.
    pub islands: Option<String>,
    pub islands_via_host: bool,
    /// Where there are islands: the largest call of the dtype whose islands exchange takes the
    /// all-units form (no gather inside the islands), as the fabric model bounds it
    /// (`Fabric::islands_all_units_max_bytes`, within one launch); larger calls exchange ranges.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub islands_all_units_up_to: Option<u64>,
    /// The fanned-out write and read bandwidths the fabric model uses, and where they come
    /// from (measured here, the file's figures, or the worst published).
    pub collapse: Collapse,
    pub memory_per_rank: MemoryFootprint,
    pub tuning_table: Option<String>,
    /// A table for this machine that is not read because it timed other kernels than this
    /// build's (an older tpar, or other `TPAR_KERNEL_DEFINES`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ignored_tuning_table: Option<IgnoredTable>,
    pub checks: Vec<Check>,
    /// The init measurement of the links between this machine's GPUs (two or more GPUs).
    pub links: Option<LinkMeasurements>,
    /// The dispatcher's decision at each size (4 KiB to 256 MiB in steps of 4).
    pub decisions: Vec<SizeDecision>,
    pub ok: bool,
}

impl Report {
    /// The GPUs the report is of, in words: `cuda: 8 x NVIDIA H200, driver 580.159.04, CUDA
    /// 13.0 (this machine (NVML))` (each name with its count, in the order first seen; the
    /// versions where the topology has them), and for a described machine the file it came from.
    pub fn device(&self) -> String {
        let mut names: Vec<(&str, usize)> = Vec::new();
        for gpu in &self.topology.gpus {
            match names.iter_mut().find(|(n, _)| *n == gpu.name) {
                Some((_, count)) => *count += 1,
                None => names.push((&gpu.name, 1)),
            }
        }
        let gpus = names
            .iter()
            .map(|(name, count)| format!("{count} x {name}"))
            .collect::<Vec<_>>()
            .join(", ");
        // The same words as a bench's device where the topology names them (a detected machine;
        // a fixture names them only if its author did).
        let mut versions = Vec::new();
        if let Some(driver) = &self.topology.driver_version {
            versions.push(format!("driver {driver}"));
        }
        if let Some(cuda) = &self.topology.cuda_version {
            versions.push(format!("CUDA {cuda}"));
        }
        let versions = if versions.is_empty() {
            String::new()
        } else {
            format!(", {}", versions.join(", "))
        };
        format!("cuda: {gpus}{versions} ({})", self.source)
    }

    /// The islands in words: `4+4`, `4+4 (via host)` where their exchange goes through host
    /// memory, `one`.
    pub fn islands_text(&self) -> String {
        match &self.islands {
            Some(i) if self.islands_via_host => format!("{i} (via host)"),
            Some(i) => i.clone(),
            None => "one".into(),
        }
    }
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
                return Err(DoctorError::NoGpu {
                    reason: e.to_string(),
                })
            }
        },
    };
    let world_size = options.world_size.unwrap_or(topology.gpus.len()).max(1);
    let config = Config::default();
    // The kernels as planned for the machine's GPUs (the architecture that needs the most,
    // where they differ).
    let capability = topology
        .gpus
        .iter()
        .filter_map(|g| g.compute_capability.as_deref())
        .max_by_key(|c| tpar::backend::cuda::planned_module_bytes(Some(c)));
    let memory = CudaCommunicator::planned_footprint_on(world_size, &config, capability);

    let mut findings = Findings::default();
    let mut links = None;
    if options.topology.is_some() {
        checks.extend(architecture_check(&topology, world_size));
    }
    if options.topology.is_none() {
        checks.extend(gpu_checks(&topology, world_size, &mut findings));
        if checks.first().is_some_and(|c| c.ok) {
            let (check, measured) = link_measurement(&topology, &mut findings);
            checks.extend(check);
            links = measured;
            checks.push(first_use_check(&topology, world_size));
        }
    }
    let this_build = tpar::backend::cuda::kernels::build_id();
    let (tuning, passed_over) =
        TuningTable::read_for(&topology, world_size, options.dtype, &this_build);
    let ignored_tuning_table = passed_over.map(|t| IgnoredTable {
        path: t.kept_at().display().to_string(),
        kernels: t.kernels,
        this_build: this_build.clone(),
    });
    // The model's time is of the model's own decision; with a forced path or a tuning table
    // it would describe another decision than the one shown, so it is left out then.
    let model = (forced.is_none() && tuning.as_ref().is_none_or(TuningTable::is_first_use))
        .then(|| {
            crate::planner::latency_model::modelled_latency_with(
                &topology,
                world_size,
                options.dtype,
                Some(&findings),
            )
            .ok()
        })
        .flatten()
        .map(|(latency, _)| latency);
    let fabric = Fabric::new(&topology, world_size, Some(&findings));
    let islands = fabric
        .islands()
        .filter(|i| i.count() > 1)
        .map(|i| i.to_string());
    let islands_via_host = islands.is_some() && fabric.cross_via_host();
    // From the topology alone, as every rank of a communicator decides it.
    let islands_all_units_up_to = islands.as_ref().map(|_| {
        Fabric::new(&topology, world_size, None).islands_all_units_launch_max_bytes(options.dtype)
            as u64
    });
    let collapse = fabric.collapse().clone();
    let mut decisions = Vec::new();
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
        decisions.push(match decide(&req) {
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
    let ok = decisions.iter().all(|d| d.choice.is_some()) && checks.iter().all(|c| c.ok);
    let report = Report {
        class: classify(&topology, world_size),
        islands,
        islands_via_host,
        islands_all_units_up_to,
        collapse,
        topology,
        source,
        world_size,
        dtype: options.dtype,
        memory_per_rank: memory,
        tuning_table: tuning.map(|t| t.kept_at().display().to_string()),
        ignored_tuning_table,
        checks,
        links,
        decisions,
        ok,
    };
    Ok(report)
}

/// For a described machine: whether its GPUs are new enough for tpar's kernels (on a real one
/// the CUDA backend's load says so, in [`gpu_checks`]). None where every GPU is, or where the
/// description gives no capability.
fn architecture_check(topology: &Topology, world_size: usize) -> Option<Check> {
    let old = topology
        .gpus
        .iter()
        .take(world_size)
        .find(|g| g.too_old_for_tpar())?;
    Some(Check {
        name: "GPU architecture".to_owned(),
        ok: false,
        detail: format!(
            "GPU {} ({}) has compute capability {}; tpar's kernels need 8.0 (Ampere) or newer, so \
             every allreduce here stays with NCCL",
            old.index,
            old.name,
            old.compute_capability.as_deref().unwrap_or("?")
        ),
    })
}

/// On a real machine: the CUDA backend loads and compiles, and every path gives the exact sum
/// on a few ranks; NCCL loads. A path that fails goes into the findings and is never chosen.
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
/// links at once, then the write fan-out over root complexes), keeps the result where
/// communicators find it, and feeds it to the decisions. With one GPU: says why the fan-out is not
/// measured.
fn link_measurement(
    topology: &Topology,
    findings: &mut Findings,
) -> (Vec<Check>, Option<LinkMeasurements>) {
    let Ok(gpus) = tpar::backend::cuda::check_available() else {
        return (Vec::new(), None);
    };
    if gpus < 2 {
        return (
            vec![Check {
                name: "write fan-out".into(),
                ok: true,
                detail: format!(
                    "not measured: {}",
                    tpar::backend::cuda::link_measurement::fanout_peers(
                        &topology.locations(),
                        &[0],
                        0
                    )
                    .unwrap_err()
                ),
            }],
            None,
        );
    }
    let devices: Vec<usize> = (0..gpus).collect();
    let measured = tpar::backend::cuda::link_measurement::measure_links(
        &devices,
        &topology.locations(),
        64 << 20,
        std::time::Duration::from_secs(10),
    );
    match measured {
        Ok(links) => {
            let saved = links.save(&LinkMeasurements::path(topology));
            let p = links.to_findings();
            findings.push_gbps = p.push_gbps;
            findings.pull_gbps = p.pull_gbps;
            findings.fanout = p.fanout;
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
            let fanout = Check {
                name: "write fan-out".into(),
                ok: true,
                detail: fanout_text(&links),
            };
            (vec![check, fanout], Some(links))
        }
        // No P2P between some pair is a machine tpar serves (host-staged), not a failure.
        Err(e @ tpar::Error::Unsupported(_)) => (
            vec![Check {
                name: "link measurement".into(),
                ok: true,
                detail: format!("not measured: {e}; the device-memory paths need P2P between every pair, host-staged does not"),
            }],
            None,
        ),
        Err(e) => (
            vec![Check {
                name: "link measurement".into(),
                ok: false,
                detail: e.to_string(),
            }],
            None,
        ),
    }
}

/// One row of the README's table of `tpar doctor --topology` over every fixture: the machine's
/// class, its islands, and what runs at 4 KiB to 1 MiB with the model's time.
pub fn summary_row(name: &str, r: &Report) -> String {
    let islands = r.islands_text();
    let mut row = format!(
        "| `{name}` | {} | {} | {islands} |",
        r.world_size,
        r.class.name()
    );
    for bytes in [4u64 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20] {
        let cell =
            r.decisions
                .iter()
                .find(|p| p.bytes == bytes)
                .map_or("-".to_owned(), |p| match (p.choice, p.model_us) {
                    (Some(c), Some(us)) => format!("{c} {us:.1}"),
                    (Some(c), None) => c.to_string(),
                    (None, _) => "none".into(),
                });
        row.push_str(&format!(" {cell} |"));
    }
    row
}

/// The first-use measurement a communicator makes on a machine with no tuning table, run here
/// for `world_size` ranks as streams of this process (on one GPU: ranks sharing it), so that
/// `tpar doctor` shows what it timed, how long it took and where it cached the table.
fn first_use_check(topology: &Topology, world_size: usize) -> Check {
    use tpar::communicator::first_use::{enabled, measure_local, ENV_FIRST_USE};
    let check = |ok: bool, detail: String| Check {
        name: "first-use measurement".into(),
        ok,
        detail,
    };
    if !enabled(std::env::var(ENV_FIRST_USE).ok().as_deref()) {
        return check(true, format!("not run: {ENV_FIRST_USE}=0"));
    }
    if world_size < 2 {
        return check(true, "not run: one rank (nothing to reduce)".into());
    }
    if let Some(t) = TuningTable::load_for(
        topology,
        world_size,
        tpar::communicator::first_use::DTYPE,
        &tpar::backend::cuda::kernels::build_id(),
    ) {
        return check(
            true,
            format!(
                "not run: this machine has a table for {world_size} ranks ({})",
                t.kept_at().display()
            ),
        );
    }
    let measured = (|| -> Result<_> {
        let mut group = crate::cuda_ranks::CudaRanks::threads(world_size, Config::default())?;
        Ok(measure_local(&mut group.comms, &group.streams)?)
    })();
    match measured {
        Ok(Some(f)) => check(true, f.describe()),
        Ok(None) => check(
            true,
            "not run: no two candidates the fabric model ranks close enough to time (or the ranks time-slice a GPU)".into(),
        ),
        Err(e) => check(false, e.chain()),
    }
}

/// The fan-out measurement in a sentence: the bandwidths, the collapse factor, and that the
/// model takes it (or why it was not measured).
pub fn fanout_text(links: &LinkMeasurements) -> String {
    match (&links.fanout, &links.fanout_skipped) {
        (Some(f), _) => {
            let b = &f.bandwidth;
            let peers: Vec<String> = f.peers.iter().map(|p| format!("GPU {p}")).collect();
            format!(
                "GPU {} to GPU {} alone: write {:.1}, read {:.1} GB/s; to {} ({} root complexes) at once: write {:.1}, read {:.1} GB/s in all; collapse factor {:.1} for writes, {:.1} for reads{}; the fabric model takes these figures",
                f.source,
                f.peers[0],
                b.pair_write_gbps,
                b.pair_read_gbps,
                peers.join(", "),
                f.peers.len(),
                b.fanout_write_gbps,
                b.fanout_read_gbps,
                b.write_collapse(),
                b.read_collapse(),
                if b.fanout_write_gbps < 0.5 * b.fanout_read_gbps {
                    " (writes collapse here: tpar keeps writes from fanning out)"
                } else {
                    ""
                }
            )
        }
        (None, Some(why)) => format!("not measured: {why}"),
        (None, None) => "not measured".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Doctor says up to which size the islands exchange all units: the model's bound where
    /// there are islands, nothing where there are none.
    #[test]
    fn doctor_names_the_islands_exchange_form_where_there_are_islands() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
        let bound = |name: &str| {
            let path = std::path::PathBuf::from(format!(
                "{root}/crates/tpar/fixtures/topologies/{name}.json"
            ));
            examine(&DoctorOptions {
                topology: Some(path),
                world_size: Some(8),
                dtype: DType::Bf16,
                forced: None,
            })
            .unwrap()
            .islands_all_units_up_to
        };
        assert_eq!(bound("8x-rtx-pro-6000-pcie-2switch"), Some(4096));
        assert_eq!(bound("8x-a800-2islands"), Some(0));
        assert_eq!(bound("8x-rtx-pro-6000-2socket-broadcom"), Some(128 << 10));
        assert_eq!(bound("8x-h200-nvswitch"), None);
    }

    /// The README shows `tpar doctor --topology` for every shipped fixture (8 ranks, or fewer
    /// where the machine has fewer GPUs, bf16): class, islands and the decisions with the model's
    /// time. The rows there must be what doctor says now.
    #[test]
    fn the_readme_table_is_doctor_over_every_fixture() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
        let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
        let start = readme.find("<!-- doctor-fixtures -->").unwrap_or(0);
        let table = &readme[start..];
        let table = &table[..table.find("<!-- /doctor-fixtures -->").unwrap_or(0)];
        let rows: Vec<String> = tpar::topology::FIXTURES
            .iter()
            .map(|(name, _)| {
                let path = std::path::PathBuf::from(format!(
                    "{root}/crates/tpar/fixtures/topologies/{name}.json"
                ));
                let gpus = Topology::load(&path).unwrap().gpus.len();
                let report = examine(&DoctorOptions {
                    topology: Some(path),
                    world_size: Some(gpus),
                    dtype: DType::Bf16,
                    forced: None,
                })
                .unwrap();
                summary_row(name, &report)
            })
            .collect();
        println!("{}", rows.join("\n"));
        for row in &rows {
            assert!(
                table.lines().any(|l| l == row),
                "README.md lacks this row, or has another for its fixture:\n{row}\n(all rows: cargo test -p tpar-harness the_readme_table -- --nocapture)"
            );
        }
        assert_eq!(
            table.lines().filter(|l| l.starts_with("| `")).count(),
            rows.len(),
            "one row per fixture"
        );
    }
}
