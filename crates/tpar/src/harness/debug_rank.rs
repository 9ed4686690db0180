//! `tpar debug-rank` (hidden): scripted allreduce calls with injected faults, for the
//! cross-process tests and for reproducing a failure by hand. Every call is verified.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use tpar::{Algorithm, CommConfig, CpuCommunicator, DType};

use crate::ranks::{run_ranks, say, world_size_or, Rank};
use tpar::harness::known::KnownData;

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

fn split_pair(text: &Option<String>, sep: char) -> Result<Option<(usize, String)>> {
    text.as_ref()
        .map(|t| {
            let (rank, value) = t
                .split_once(sep)
                .with_context(|| format!("'{t}' should look like RANK{sep}VALUE"))?;
            Ok((rank.trim().parse()?, value.trim().to_owned()))
        })
        .transpose()
}

pub fn run(args: DebugRankArgs) -> Result<std::process::ExitCode> {
    let world_size = world_size_or(args.world_size, 2)?;
    let timeout = args.timeout;
    run_ranks(world_size, timeout, |rank| debug_rank(rank, &args, timeout))
}

fn debug_rank(rank: Rank, args: &DebugRankArgs, timeout: Duration) -> Result<()> {
    let me = rank.rank();
    let mine = |pair: Option<(usize, String)>| pair.filter(|(r, _)| *r == me).map(|(_, v)| v);
    let count = match mine(split_pair(&args.count_on, '=')?) {
        Some(n) => n.parse()?,
        None => args.count,
    };
    let dtype = match mine(split_pair(&args.dtype_on, '=')?) {
        Some(d) => d.parse()?,
        None => args.dtype,
    };
    let call_of = |pair: Option<(usize, String)>| -> Result<Option<u64>> {
        mine(pair).map(|c| Ok(c.parse()?)).transpose()
    };
    let die_at = call_of(split_pair(&args.die_on, '@')?)?;
    let stall_at = call_of(split_pair(&args.stall_on, '@')?)?;

    let config = CommConfig {
        timeout,
        ..CommConfig::default()
    };
    let mut comm = CpuCommunicator::new(&rank.rendezvous, config)?;
    let known = KnownData::new(dtype, me, rank.world_size(), count, [1, 2]);
    let mut output = vec![0u8; count * dtype.size()];
    for call in 0..args.calls {
        if die_at == Some(call) {
            say(
                me,
                &format!("debug-rank: killing myself (SIGKILL) before call {call}"),
            );
            tpar::launch::send_sigkill(std::process::id());
        }
        if stall_at == Some(call) {
            say(me, &format!("debug-rank: stalling before call {call}"));
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        let variant = call as usize;
        comm.all_reduce_bytes(
            dtype,
            Some(known.input(variant, count)),
            &mut output,
            args.algo,
        )?;
        if output != known.expected(variant, count) {
            bail!("call {call} gave a wrong sum");
        }
    }
    if rank.is_leader() {
        println!(
            "debug-rank: {} call(s) of {count} {dtype} ({}) correct on {} rank(s)",
            args.calls,
            args.algo,
            rank.world_size()
        );
    }
    Ok(())
}
