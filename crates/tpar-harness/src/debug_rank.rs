//! The hidden `tpar debug-rank`'s rank: scripted allreduce calls with injected faults (a
//! rank that passes another count or dtype, dies or stalls at a given call), for the
//! cross-process tests and for reproducing a failure by hand. Every call is verified.

use std::time::Duration;

use crate::known::KnownData;
use crate::ranks::{say, Rank};
use crate::{bail, Context, HarnessError, Result};
use tpar::{Algorithm, Config, CpuCommunicator, DType};

/// The calls every rank makes, and the faults: each fault names its rank, as `RANK=VALUE`
/// (count, dtype) or `RANK@CALL` (die, stall; calls count from 0).
#[derive(Clone, Debug)]
pub struct DebugScript {
    /// Elements per call.
    pub count: usize,
    pub dtype: DType,
    pub algo: Algorithm,
    /// Calls to make.
    pub calls: u64,
    /// RANK=N: that rank passes N elements instead.
    pub count_on: Option<String>,
    /// RANK=DTYPE: that rank passes another dtype.
    pub dtype_on: Option<String>,
    /// RANK@CALL: that rank SIGKILLs itself before that call.
    pub die_on: Option<String>,
    /// RANK@CALL: that rank stops calling (sleeps) before that call.
    pub stall_on: Option<String>,
}

fn parsed<T: std::str::FromStr>(text: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    text.parse()
        .map_err(|e: T::Err| HarnessError::Failed(e.to_string()))
}

fn split_pair(text: &Option<String>, sep: char) -> Result<Option<(usize, String)>> {
    text.as_ref()
        .map(|t| {
            let (rank, value) = t
                .split_once(sep)
                .with_context(|| format!("'{t}' should look like RANK{sep}VALUE"))?;
            Ok((parsed(rank.trim())?, value.trim().to_owned()))
        })
        .transpose()
}

/// Runs the script as `rank`, with `timeout` for every call; an error names the call that
/// gave a wrong sum (or the library's error).
pub fn run_rank(rank: &Rank, args: &DebugScript, timeout: Duration) -> Result<()> {
    let me = rank.rank();
    let mine = |pair: Option<(usize, String)>| pair.filter(|(r, _)| *r == me).map(|(_, v)| v);
    let count = match mine(split_pair(&args.count_on, '=')?) {
        Some(n) => parsed(&n)?,
        None => args.count,
    };
    let dtype = match mine(split_pair(&args.dtype_on, '=')?) {
        Some(d) => parsed(&d)?,
        None => args.dtype,
    };
    let call_of = |pair: Option<(usize, String)>| -> Result<Option<u64>> {
        mine(pair).map(|c| parsed(&c)).transpose()
    };
    let die_at = call_of(split_pair(&args.die_on, '@')?)?;
    let stall_at = call_of(split_pair(&args.stall_on, '@')?)?;

    let config = Config {
        timeout,
        ..Config::default()
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
    Ok(())
}
