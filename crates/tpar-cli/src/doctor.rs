//! `tpar doctor`: prints what [`tpar_harness::doctor::examine`] finds on this machine (or on
//! a machine described in a topology file): GPUs and versions, a link matrix in the spirit of
//! `nvidia-smi topo -m` with P2P read/write capability, the quick numerical checks, the memory
//! tpar reserves per rank, and for each message size which algorithm runs and why. Exits
//! non-zero when tpar cannot work, with the reason and fix.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::Args;
use tpar::algorithm::Selection;
use tpar::DType;
use tpar_harness::doctor::{examine, DoctorError, DoctorOptions, DoctorRecord, NoGpuRecord};

use crate::provenance::provenance;

use tpar_report::{doctor::doctor, emit};

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct DoctorArgs {
    /// Explain a machine described in this JSON file instead of this one (touches no GPU).
    /// Fixtures: crates/tpar/fixtures/topologies/*.json.
    #[arg(long, value_name = "FILE")]
    topology: Option<PathBuf>,
    /// Ranks to decide for [default: one per GPU].
    #[arg(long, short = 'n', value_parser = crate::args::world_size_arg)]
    world_size: Option<usize>,
    /// Element type to decide for: f32, f16 or bf16.
    #[arg(long, default_value = "bf16")]
    dtype: DType,
    #[arg(long, value_name = "NAME", help = concat!(
        "Decide as if this algorithm were forced (also TPAR_ALGO), one of: ", tpar_harness::selection_names!()
    ))]
    algo: Option<String>,
    /// Print the report as JSON on stdout (the text goes to stderr), with the command, device,
    /// date and commit; with no GPU here, the failed check and why.
    #[arg(long)]
    json: bool,
}

pub fn run(args: DoctorArgs) -> Result<ExitCode> {
    // The library's one parse of a forced choice, naming where the name came from.
    let forced = match &args.algo {
        Some(name) => Selection::parse_from("--algo", Some(name)),
        None => Selection::from_env(),
    }
    .map(Selection::forced)
    .map_err(|e| crate::args::usage(e.into()))?;
    let options = DoctorOptions {
        topology: args.topology,
        world_size: args.world_size,
        dtype: args.dtype,
        forced,
    };
    let report = match examine(&options) {
        Ok(report) => report,
        Err(DoctorError::Topology(e)) => return Err(crate::args::usage(e.into())),
        Err(no_gpu @ DoctorError::NoGpu { .. }) => {
            tpar_report::print_err(&no_gpu.to_string());
            if let (true, DoctorError::NoGpu { reason }) = (args.json, &no_gpu) {
                let record = NoGpuRecord::new(&options, reason, provenance("none".into()));
                tpar_report::write_json("-", &record)?;
            }
            return Ok(ExitCode::FAILURE);
        }
    };
    let record = DoctorRecord {
        provenance: provenance(report.device()),
        report: &report,
    };
    emit(&doctor(&report), args.json.then_some("-"), &record)?;
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
