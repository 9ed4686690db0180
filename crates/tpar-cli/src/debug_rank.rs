//! `tpar debug-rank` (hidden): scripted allreduce calls with injected faults, for the
//! cross-process tests and for reproducing a failure by hand (the rank's script is
//! `tpar_harness::debug_rank`'s). Every call is verified.

use anyhow::Result;
use clap::Args;
use tpar::{Algorithm, DType};
use tpar_harness::debug_rank::{run_rank, DebugScript};

use crate::ranks::{run_ranks, world_size_or, PartialRows};

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct DebugRankArgs {
    #[arg(long, short = 'n', value_parser = crate::args::world_size_arg)]
    world_size: Option<usize>,
    /// Elements per call.
    #[arg(long, default_value_t = 1024)]
    count: usize,
    #[arg(long, default_value = "f32")]
    dtype: DType,
    #[arg(long, default_value = "one-shot")]
    algo: Algorithm,
    /// Calls to make.
    #[arg(long, default_value_t = 1)]
    calls: u64,
    /// RANK=N: that rank passes N elements instead.
    #[arg(long, value_name = "RANK=N")]
    count_on: Option<String>,
    /// RANK=DTYPE: that rank passes another dtype.
    #[arg(long, value_name = "RANK=DTYPE")]
    dtype_on: Option<String>,
    /// RANK@CALL: that rank SIGKILLs itself before that call (counting from 0).
    #[arg(long, value_name = "RANK@CALL")]
    die_on: Option<String>,
    /// RANK@CALL: that rank stops calling (sleeps) before that call.
    #[arg(long, value_name = "RANK@CALL")]
    stall_on: Option<String>,
    #[arg(long, default_value = "30", value_name = "SECONDS", value_parser = crate::args::timeout_arg)]
    timeout: std::time::Duration,
}

pub fn run(args: DebugRankArgs) -> Result<std::process::ExitCode> {
    let world_size = world_size_or(args.world_size, 2)?;
    let timeout = args.timeout;
    let script = DebugScript {
        count: args.count,
        dtype: args.dtype,
        algo: args.algo,
        calls: args.calls,
        count_on: args.count_on,
        dtype_on: args.dtype_on,
        die_on: args.die_on,
        stall_on: args.stall_on,
    };
    run_ranks(world_size, timeout, PartialRows::Stdout, |rank| {
        run_rank(&rank, &script, timeout)?;
        if rank.is_leader() {
            let (calls, count, dtype, algo) =
                (script.calls, script.count, script.dtype, script.algo);
            tpar_report::print_out(&format!(
                "debug-rank: {calls} call(s) of {count} {dtype} ({algo}) correct on {} rank(s)",
                rank.world_size()
            ))?;
        }
        Ok(())
    })
}
