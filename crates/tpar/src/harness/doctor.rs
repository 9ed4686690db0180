//! `tpar doctor`: what tpar sees on this machine (or on a machine described in a topology
//! file) and what it will do there: GPUs and versions, a link matrix in the spirit of
//! `nvidia-smi topo -m` with P2P read/write capability, the result of a quick numerical check
//! of every path on the real GPUs, the memory tpar reserves per rank, and for each message size
//! which algorithm runs and why. Exits non-zero when tpar cannot work, with the reason and fix.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;
use tpar::algorithm::Selection;
use tpar::backend::cuda::link_probe::LinkProbe;
use tpar::backend::cuda::{CudaCommunicator, CudaConfig};
use tpar::dispatch::{classify, plan, Choice, Class, Probe, Request, TuningTable};
use tpar::memory::{human_bytes, MemoryFootprint};
use tpar::topology::Topology;
use tpar::DType;

use crate::report::{emit, Table};

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct DoctorArgs {
    /// Explain a machine described in this JSON file instead of this one (touches no GPU).
    /// Fixtures: crates/tpar/fixtures/topologies/*.json.
    #[arg(long, value_name = "FILE")]
    topology: Option<PathBuf>,
    /// Ranks to plan for [default: one per GPU].
    #[arg(long, short = 'n', value_parser = crate::args::world_size_arg)]
    world_size: Option<usize>,
    /// Element type to plan for: f32, f16 or bf16.
    #[arg(long, default_value = "bf16")]
    dtype: DType,
    #[arg(long, value_name = "NAME", help = concat!(
        "Plan as if this algorithm were forced (also TPAR_ALGO), one of: ", tpar::route_names!()
    ))]
    algo: Option<String>,
    /// Print the report as JSON on stdout (the text goes to stderr).
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Check {
    name: String,
    ok: bool,
    detail: String,
}

#[derive(Serialize)]
struct SizePlan {
    bytes: u64,
    choice: Option<Choice>,
    reason: String,
    /// The latency tpar's model predicts for this size on this class of machine
    /// (`planner::latency_model`), when it has one; a measurement (`tpar bench`) beats it.
    #[serde(skip_serializing_if = "Option::is_none")]
    model_us: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    topology: Topology,
    source: String,
    world_size: usize,
    dtype: DType,
    class: Class,
    memory_per_rank: MemoryFootprint,
    tuning_table: Option<String>,
    checks: Vec<Check>,
    /// The init probe of the links between this machine's GPUs (two or more GPUs).
    links: Option<LinkProbe>,
    plans: Vec<SizePlan>,
    ok: bool,
}

/// 4 KiB to 256 MiB in steps of 4.
fn size_buckets() -> Vec<u64> {
    (0..=8).map(|k| 4096u64 << (2 * k)).collect()
}

pub fn run(args: DoctorArgs) -> Result<ExitCode> {
    // The library's one parse of a forced choice, naming where the name came from.
    let forced = match &args.algo {
        Some(name) => Selection::parse_from("--algo", Some(name)),
        None => Selection::from_env(),
    }
    .map(Selection::forced)
    .map_err(|e| crate::args::usage(e.into()))?;
    let mut checks = Vec::new();
    let (topology, source) = match &args.topology {
        Some(path) => (
            Topology::load(path).map_err(|e| crate::args::usage(e.into()))?,
            format!("file {}", path.display()),
        ),
        None => match Topology::detect() {
            Ok(t) => (t, "this machine (NVML)".to_owned()),
            Err(e) => {
                let text = format!(
                    "tpar doctor: no GPU to examine here ({e}).\n\
                     tpar's GPU paths cannot run on this machine; the CPU backend can (`tpar bench --backend cpu`).\n\
                     To plan for another machine, describe it: `tpar doctor --topology FILE` (fixtures in crates/tpar/fixtures/topologies/)."
                );
                eprintln!("{text}");
                return Ok(ExitCode::FAILURE);
            }
        },
    };
    let world_size = args.world_size.unwrap_or(topology.gpus.len()).max(1);
    let config = CudaConfig::default();
    let memory = CudaCommunicator::planned_footprint(world_size, &config);

    let mut probe = Probe::default();
    let mut links = None;
    if args.topology.is_none() {
        checks.extend(gpu_checks(&topology, world_size, &mut probe));
        if checks.first().is_some_and(|c| c.ok) {
            let (check, measured) = link_probe(&topology, &mut probe);
            checks.extend(check);
            links = measured;
        }
    }
    let tuning = TuningTable::load_for(&topology, world_size, args.dtype);
    // The model follows the built-in rules; with a forced path or a tuning table it would
    // describe another plan than the one shown, so it is left out then.
    let model = (forced.is_none() && tuning.is_none())
        .then(|| {
            tpar::planner::latency_model::modelled_latency(&topology, world_size, args.dtype).ok()
        })
        .flatten()
        .map(|(latency, _)| latency);
    let mut plans = Vec::new();
    for bytes in size_buckets() {
        let req = Request {
            topology: &topology,
            probe: Some(&probe),
            tuning: tuning.as_ref(),
            world_size,
            dtype: args.dtype,
            bytes,
            capturing: true,
            forced,
        };
        plans.push(match plan(&req) {
            Ok(p) => SizePlan {
                bytes,
                choice: Some(p.choice),
                reason: p.reason,
                model_us: model.as_ref().map(|m| m.at(bytes)),
            },
            Err(e) => SizePlan {
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
        dtype: args.dtype,
        memory_per_rank: memory,
        tuning_table: tuning.map(|t| {
            TuningTable::path(&t.fingerprint, world_size, args.dtype)
                .display()
                .to_string()
        }),
        checks,
        links,
        plans,
        ok,
    };
    emit(&render(&report), args.json.then_some("-"), &report)?;
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// On a real machine: the CUDA backend loads and compiles, and every path gives the exact sum
/// on a few ranks; NCCL loads. A path that fails goes into the probe and is never planned.
fn gpu_checks(topology: &Topology, world_size: usize, probe: &mut Probe) -> Vec<Check> {
    let mut checks = Vec::new();
    let mut add = |name: &str, result: Result<String>| {
        let (ok, detail) = match result {
            Ok(d) => (true, d),
            Err(e) => (false, format!("{e:#}")),
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
        tpar::backend::cuda::probe()
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
                probe: None,
                tuning: None,
                world_size: ranks,
                dtype: DType::Bf16,
                bytes: 0,
                capturing: false,
                forced: None,
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
        let result =
            tpar::harness::cuda_ranks::quick_check(ranks, algo).map_err(anyhow::Error::from);
        if let Err(e) = &result {
            probe
                .failed
                .push((choice, format!("its self-test failed: {e:#}")));
        }
        add(&format!("self-test {algo}"), result);
    }
    checks
}

/// With two or more GPUs: measures every link (push and pull bandwidth, latency, then all
/// links at once), keeps the result where communicators find it, and feeds it to the plans.
fn link_probe(topology: &Topology, probe: &mut Probe) -> (Option<Check>, Option<LinkProbe>) {
    let Ok(gpus) = tpar::backend::cuda::probe() else {
        return (None, None);
    };
    if gpus < 2 {
        return (None, None);
    }
    let devices: Vec<usize> = (0..gpus).collect();
    let measured = tpar::backend::cuda::link_probe::probe_links(
        &devices,
        64 << 20,
        std::time::Duration::from_secs(10),
    );
    match measured {
        Ok(links) => {
            let saved = links.save(&LinkProbe::path(topology));
            let p = links.to_probe();
            probe.push_gbps = p.push_gbps;
            probe.pull_gbps = p.pull_gbps;
            let detail = format!(
                "every GPU to every peer at once: push {:.1} GB/s, pull {:.1} GB/s per GPU; {}",
                links.all_push_gbps,
                links.all_pull_gbps,
                match saved {
                    Ok(()) => format!("kept in {}", LinkProbe::path(topology).display()),
                    Err(e) => format!("not kept: {e}"),
                }
            );
            let check = Check {
                name: "link probe".into(),
                ok: true,
                detail,
            };
            (Some(check), Some(links))
        }
        // No P2P between some pair is a machine tpar serves (host-staged), not a failure.
        Err(e @ tpar::Error::Unsupported(_)) => (
            Some(Check {
                name: "link probe".into(),
                ok: true,
                detail: format!("not measured: {e}; the device-memory paths need P2P between every pair, host-staged does not"),
            }),
            None,
        ),
        Err(e) => (
            Some(Check {
                name: "link probe".into(),
                ok: false,
                detail: e.to_string(),
            }),
            None,
        ),
    }
}

fn render(r: &Report) -> String {
    let t = &r.topology;
    let mut out = format!(
        "tpar doctor: {} ({})\ndriver {}, CUDA {}, NCCL {}\n\n",
        t.description,
        r.source,
        t.driver_version.as_deref().unwrap_or("?"),
        t.cuda_version.as_deref().unwrap_or("?"),
        t.nccl_version.as_deref().unwrap_or("not found"),
    );
    let mut gpus = Table::new(&["GPU", "name", "CC", "memory", "PCIe", "NUMA"], 2);
    for g in &t.gpus {
        gpus.push(vec![
            g.index.to_string(),
            g.name.clone(),
            g.compute_capability.clone().unwrap_or_default(),
            human_bytes(g.memory_bytes),
            match (g.pcie_gen, g.pcie_width) {
                (Some(gen), Some(w)) => format!("Gen{gen} x{w}"),
                _ => "?".into(),
            },
            g.numa_node.map_or("?".into(), |n| n.to_string()),
        ]);
    }
    out.push_str(&gpus.render());
    out.push_str("\n\nLinks (path; P2P r = reads, w = writes):\n");
    let header: Vec<String> = std::iter::once(String::new())
        .chain(t.gpus.iter().map(|g| format!("GPU{}", g.index)))
        .collect();
    let header_refs: Vec<&str> = header.iter().map(String::as_str).collect();
    let mut matrix = Table::new(&header_refs, 1);
    for a in &t.gpus {
        let mut row = vec![format!("GPU{}", a.index)];
        for b in &t.gpus {
            row.push(match t.link(a.index, b.index) {
                _ if a.index == b.index => "X".into(),
                Some(l) => format!(
                    "{} {}{}",
                    l.path.label(),
                    if l.p2p_read { "r" } else { "-" },
                    if l.p2p_write { "w" } else { "-" }
                ),
                None => "?".into(),
            });
        }
        matrix.push(row);
    }
    out.push_str(&matrix.render());
    if !r.checks.is_empty() {
        out.push_str("\n\nChecks on this machine:\n");
        let mut c = Table::new(&["check", "result"], 2);
        for check in &r.checks {
            c.push(vec![
                check.name.clone(),
                format!(
                    "{}: {}",
                    if check.ok { "ok" } else { "FAILED" },
                    check.detail
                ),
            ]);
        }
        out.push_str(&c.render());
    }
    if let Some(links) = &r.links {
        out.push_str(&format!(
            "\n\nLinks measured, each alone ({} per copy):\n",
            human_bytes(links.bytes_per_copy as u64)
        ));
        let mut t = Table::new(&["from", "to", "push GB/s", "pull GB/s", "latency us"], 2);
        for l in &links.links {
            t.push(vec![
                format!("GPU{}", l.a),
                format!("GPU{}", l.b),
                format!("{:.1}", l.push_gbps),
                format!("{:.1}", l.pull_gbps),
                format!("{:.2}", l.latency_us),
            ]);
        }
        out.push_str(&t.render());
        out.push_str(&format!(
            "\nall links at once, per GPU: push {:.1} GB/s, pull {:.1} GB/s{}",
            links.all_push_gbps,
            links.all_pull_gbps,
            if links.all_push_gbps < 0.5 * links.all_pull_gbps {
                " (writes collapse while reads hold: tpar reads its peers)"
            } else {
                ""
            }
        ));
    }
    let m = &r.memory_per_rank;
    let ranks = crate::report::ranks(r.world_size);
    out.push_str(&format!(
        "\n\nMemory tpar reserves per rank with {ranks}: {} device (buffers {} + kernels {}; with an NCCL of its own, `nccl=own`, about {} more, an estimate), {} pinned host, {} shared host (host-staged inboxes); {} in all.\n",
        human_bytes(m.device_bytes),
        human_bytes(m.device_buffer_bytes),
        human_bytes(m.module_bytes),
        human_bytes(tpar::backend::nccl::estimated_footprint(r.world_size, |k| std::env::var(k).ok())),
        human_bytes(m.pinned_host_bytes),
        human_bytes(m.shared_host_bytes),
        human_bytes(m.allocated_bytes()),
    ));
    out.push_str(&format!(
        "\nWhat runs, {ranks}, {} ({}{}):\n",
        r.dtype,
        classify_text(r.class),
        r.tuning_table
            .as_ref()
            .map_or(String::new(), |p| format!("; tuning table {p}"))
    ));
    let modelled = r.plans.iter().any(|s| s.model_us.is_some());
    let header: &[&str] = if modelled {
        &["size", "algorithm", "model us", "why"]
    } else {
        &["size", "algorithm", "why"]
    };
    let mut p = Table::new(header, header.len());
    for s in &r.plans {
        let mut row = vec![
            crate::report::size(s.bytes),
            s.choice.map_or("NONE".into(), |c| c.to_string()),
        ];
        if modelled {
            row.push(s.model_us.map_or("-".into(), |us| format!("{us:.1}")));
        }
        row.push(s.reason.clone());
        p.push(row);
    }
    out.push_str(&p.render());
    if modelled {
        out.push_str("\n(model us: tpar's latency model for this class of machine, not a measurement; `tpar bench` and `tpar tune` measure)");
    }
    if !r.ok {
        out.push_str("\n\ntpar cannot work as asked here: see the FAILED checks or the sizes with no algorithm above.");
    }
    out
}

fn classify_text(class: Class) -> &'static str {
    match class {
        Class::OneGpu => "all ranks on one GPU",
        Class::Nvlink => "NVLink between every pair",
        Class::PcieP2p => "PCIe with P2P between every pair",
        Class::NoP2p => "no P2P between some pair: host-staged or NCCL",
    }
}
