//! Parsing of the list arguments shared by the commands: sizes with binary suffixes, element
//! counts, algorithm and dtype lists, durations in seconds; the value parsers clap runs on
//! numeric flags; the checks made before any rank starts (output targets, what the host
//! holds); and the [`Usage`] marker that makes `main` exit 2 for a usage error.

use std::time::Duration;

use tpar_harness::backend_choice::{BackendRequest, Setup, SetupError};
use tpar_harness::cuda_ranks::parse_selection;

use anyhow::{bail, Context, Result};
use tpar::DType;

/// Marks an error as the user's input being wrong (exit 2) rather than the run failing (exit 1).
#[derive(Debug)]
pub struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// Turns any error found while checking arguments into a usage error with the same message.
pub fn usage(e: anyhow::Error) -> anyhow::Error {
    if is_usage(&e) {
        return e;
    }
    anyhow::Error::new(Usage(tpar_harness::error_chain(e.as_ref())))
}

/// A usage error anywhere in the chain.
pub fn is_usage(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<Usage>().is_some())
}

/// The most ranks a command starts or plans for: the most tpar's communicators serve (its
/// kernels address at most this many peers).
pub const MAX_WORLD_SIZE: usize = tpar::algorithm::MAX_RANKS;

/// The longest peer timeout: a day. Beyond that a hung peer is never reported in practice, and
/// `Duration` would overflow on values such as 1e30.
pub const MAX_TIMEOUT_SECS: f64 = 86_400.0;

/// A whole number in `min..=max`, with messages that say which bound was crossed. Negative
/// numbers reach here (`allow_negative_numbers`) so they get "must be >= 1", not clap's
/// "unexpected argument '-1'".
pub fn whole_in(text: &str, min: u64, max: u64) -> std::result::Result<u64, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err(format!("empty; give a whole number >= {min}"));
    }
    let value: i128 = match t.parse() {
        Ok(v) => v,
        Err(_) if t.bytes().all(|b| b.is_ascii_digit()) => {
            return Err(format!("'{t}' is too large; must be <= {max}"))
        }
        Err(_) => return Err(format!("'{t}' is not a whole number (must be >= {min})")),
    };
    if value < i128::from(min) {
        return Err(format!("must be >= {min} (got {t})"));
    }
    if value > i128::from(max) {
        return Err(format!("must be <= {max} (got {t})"));
    }
    Ok(value as u64)
}

/// `-n/--world-size`: 1 to [`MAX_WORLD_SIZE`], with a message that says why the bound.
pub fn world_size_arg(text: &str) -> std::result::Result<usize, String> {
    match whole_in(text, 1, u64::MAX)? {
        n if n > MAX_WORLD_SIZE as u64 => {
            Err(tpar::algorithm::too_many_ranks(&format!("{n} ranks")))
        }
        n => Ok(n as usize),
    }
}

/// Iteration counts (`--iters`, `--replays`, `--chain`): 1 to a million.
pub fn iterations_arg(text: &str) -> std::result::Result<usize, String> {
    whole_in(text, 1, 1_000_000).map(|v| v as usize)
}

/// Warm-up calls: 0 to a million.
pub fn warmup_arg(text: &str) -> std::result::Result<usize, String> {
    whole_in(text, 0, 1_000_000).map(|v| v as usize)
}

/// `-n/--world-size` of the planner (`--tp` is its old name): as [`world_size_arg`].
pub fn tp_arg(text: &str) -> std::result::Result<u64, String> {
    world_size_arg(text).map(|n| n as u64)
}

/// Token counts (`--tokens`, `--context`): 1 to 2^40.
pub fn tokens_arg(text: &str) -> std::result::Result<u64, String> {
    whole_in(text, 1, 1 << 40)
}

/// `bench step --tokens`: 1 to a million (a verify pass of draft tokens + 1, or a prefill
/// chunk; each rank holds `tokens x hidden` activations).
pub fn step_tokens_arg(text: &str) -> std::result::Result<usize, String> {
    whole_in(text, 1, 1_000_000).map(|v| v as usize)
}

/// `bench step --layers`: at least 1 (the model's count bounds it once the config is read).
pub fn layers_arg(text: &str) -> std::result::Result<u64, String> {
    whole_in(text, 1, 1 << 20)
}

/// `--kv-bytes`: bytes per KV element, 1 (fp8), 2 (bf16/fp16) or 4 (f32).
pub fn kv_bytes_arg(text: &str) -> std::result::Result<u64, String> {
    match whole_in(text, 1, 4)? {
        v @ (1 | 2 | 4) => Ok(v),
        v => Err(format!(
            "must be 1 (fp8), 2 (bf16/fp16) or 4 (f32), not {v}"
        )),
    }
}

/// A finite number > 0 (throughputs, latencies, memory sizes).
pub fn positive_f64(text: &str) -> std::result::Result<f64, String> {
    let v = finite_f64(text)?;
    if v <= 0.0 {
        return Err(format!("must be positive (got {})", text.trim()));
    }
    Ok(v)
}

/// A finite number >= 0.
pub fn non_negative_f64(text: &str) -> std::result::Result<f64, String> {
    let v = finite_f64(text)?;
    if v < 0.0 {
        return Err(format!("must be >= 0 (got {})", text.trim()));
    }
    Ok(v)
}

/// A GPU architecture (`--compute-capability`): "9.0" as NVML writes it, or "sm_90" / "90";
/// one tpar builds its kernels for ([`tpar::backend::cuda::planned_architecture`]), as "9.0".
pub fn compute_capability_arg(text: &str) -> std::result::Result<String, String> {
    let t = text.trim();
    let digits = t.strip_prefix("sm_").unwrap_or(t);
    // "90" and "120" as "9.0" and "12.0": the last digit is the minor version.
    let dotted = match digits.len() {
        n if n >= 2 && digits.is_ascii() && !digits.contains('.') => {
            format!("{}.{}", &digits[..n - 1], &digits[n - 1..])
        }
        _ => digits.to_owned(),
    };
    let name = |a: u32| format!("{}.{}", a / 10, a % 10);
    tpar::backend::cuda::planned_architecture(&dotted)
        .map(name)
        .ok_or_else(|| {
            format!(
                "'{t}' is not a compute capability tpar builds for; give one of {} (`nvidia-smi --query-gpu=compute_cap --format=csv` prints yours)",
                tpar::backend::cuda::PLANNED_MODULE_BYTES_BY_ARCH
                    .map(|(a, _)| name(a))
                    .join(", ")
            )
        })
}

/// A fraction in (0, 1] (memory fractions of engines).
pub fn fraction_arg(text: &str) -> std::result::Result<f64, String> {
    let v = finite_f64(text)?;
    if !(v > 0.0 && v <= 1.0) {
        return Err(format!("must be in (0, 1] (got {})", text.trim()));
    }
    Ok(v)
}

fn finite_f64(text: &str) -> std::result::Result<f64, String> {
    let t = text.trim();
    let v: f64 = t.parse().map_err(|_| format!("'{t}' is not a number"))?;
    if !v.is_finite() {
        return Err(format!("must be a finite number (got {t})"));
    }
    Ok(v)
}

/// `"4K"` -> 4096 (`tpar_harness::sizes::parse_size`).
pub fn parse_size(text: &str) -> Result<u64> {
    Ok(tpar_harness::sizes::parse_size(text)?)
}

/// Sizes in bytes with their counts of `dtype` elements, refusing sizes that are not whole
/// elements (a usage error).
pub fn sizes_with_counts(sizes: &[u64], dtype: DType) -> Result<Vec<(u64, usize)>> {
    tpar_harness::sizes::with_counts(sizes, dtype).map_err(|e| usage(e.into()))
}

/// A comma-separated list; an empty item (`4K,,8K`) or a repeated one is refused, as is an
/// empty list. Errors are usage errors naming the flag.
pub fn parse_list<T: PartialEq + std::fmt::Debug>(
    text: &str,
    what: &str,
    parse: impl Fn(&str) -> Result<T>,
) -> Result<Vec<T>> {
    parse_list_inner(text, what, parse).map_err(usage)
}

fn parse_list_inner<T: PartialEq + std::fmt::Debug>(
    text: &str,
    what: &str,
    parse: impl Fn(&str) -> Result<T>,
) -> Result<Vec<T>> {
    if text.trim().is_empty() {
        bail!("--{what} is empty; give a comma-separated list");
    }
    let mut items: Vec<T> = Vec::new();
    for (i, s) in text.split(',').enumerate() {
        if s.trim().is_empty() {
            bail!(
                "--{what} '{text}' has an empty item (number {}); remove the extra comma",
                i + 1
            );
        }
        let item = parse(s).with_context(|| format!("in --{what} '{text}'"))?;
        if items.contains(&item) {
            bail!(
                "--{what} '{text}' names '{}' twice; give each once",
                s.trim()
            );
        }
        items.push(item);
    }
    Ok(items)
}

pub fn parse_dtypes(text: &str) -> Result<Vec<DType>> {
    parse_list(text, "dtypes", |s| Ok(s.parse::<DType>()?))
}

/// `--timeout`: seconds, > 0 and at most [`MAX_TIMEOUT_SECS`].
pub fn timeout_arg(text: &str) -> std::result::Result<Duration, String> {
    let t = text.trim();
    let secs: f64 = t
        .parse()
        .map_err(|_| format!("'{t}' is not a number of seconds"))?;
    if secs.is_nan() || secs <= 0.0 {
        return Err(format!(
            "a timeout must be positive (got {t}); give seconds, e.g. 30"
        ));
    }
    if secs > MAX_TIMEOUT_SECS {
        return Err(format!(
            "a timeout must be at most {MAX_TIMEOUT_SECS} s (a day), got {t}"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Checks before any work (before any rank starts) that the `--json` and `--plot` targets can
/// be written (`tpar_report::check_target`), and that they do not collide: both on stdout, or
/// both one file. A bad target is a usage error naming the flag and the path.
pub fn check_outputs(json: Option<&str>, plot: Option<&str>) -> Result<()> {
    for (flag, target) in [("json", json), ("plot", plot)] {
        if let Some(target) = target {
            tpar_report::check_target(flag, target).map_err(|e| usage(e.into()))?;
        }
    }
    match (json, plot) {
        (Some("-"), Some("-")) => bail!(Usage(
            "--json - and --plot - both write to standard output; send one of them to a file"
                .into()
        )),
        (Some(a), Some(b)) if a == b => bail!(Usage(format!(
            "--json and --plot both name {a}; give each its own file"
        ))),
        _ => Ok(()),
    }
}

/// Help of `--islands` (bench and selftest).
pub const ISLANDS_HELP: &str = "The island partition of the islands algorithms: sizes in rank order (4+4, 3+5, 2+2+4) or members with ':' between islands (0-3:4-7, 0,2,4,6:1,3,5,7) [default: TPAR_ISLANDS, else the machine's (CPU: one island; selftest: several)]";

/// `--islands TEXT` for `world_size` ranks: the partition, or a usage error saying what is
/// wrong with it. Without the flag, a `TPAR_ISLANDS` the ranks would refuse is refused here
/// the same way, before any rank starts (the ranks then read it themselves).
pub fn parse_islands(text: Option<&str>, world_size: usize) -> Result<Option<tpar::Islands>> {
    match text {
        Some(t) => tpar::Islands::parse(t, world_size)
            .map(Some)
            .map_err(|e| usage(anyhow::anyhow!("--islands: {e}"))),
        None => tpar::Islands::from_env(world_size)
            .map(|_| None)
            .map_err(|e| usage(anyhow::Error::new(e))),
    }
}

/// `--backend auto|cpu|cuda`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendArg {
    /// CUDA where a usable GPU exists, otherwise CPU (with a note saying why).
    Auto,
    /// POSIX shared memory between processes on this host.
    Cpu,
    /// NVIDIA GPUs (driver and NVRTC loaded at run time).
    Cuda,
}

/// Prints a job's note (TPAR_ALGO forced, the backend fallen back) on standard error once per
/// job: by the process the user started, not again by each rank process it launches (they
/// run with the job's rendezvous set).
pub fn print_note_once(note: Option<&str>) {
    if std::env::var_os(tpar::rendezvous::ENV_RENDEZVOUS).is_none() {
        if let Some(note) = note {
            tpar_report::print_err(note);
        }
    }
}

/// Settles the backend, world size and algorithms of a job from its flags (see
/// [`Setup::resolve`]); a wrong request is a usage error.
pub fn setup(backend: BackendArg, world_size: Option<usize>, algos: Option<&str>) -> Result<Setup> {
    let backend = match backend {
        BackendArg::Auto => BackendRequest::Auto,
        BackendArg::Cpu => BackendRequest::Cpu,
        BackendArg::Cuda => BackendRequest::Cuda,
    };
    let algos = algos.map(|list| {
        parse_list(list, "algos", |s| Ok(parse_selection(s)?))
            .map_err(|e| tpar_harness::error_chain(e.as_ref()))
    });
    Setup::resolve(backend, world_size, algos).map_err(setup_error)
}

/// A usage error for a request the library refused as such; any other failure as it is.
pub fn setup_error(e: SetupError) -> anyhow::Error {
    match e {
        SetupError::Usage(message) => anyhow::Error::new(Usage(message)),
        SetupError::Failed(e) => e.into(),
    }
}

/// Whether a job's timings are its output (a bench) or not (a self-test): the warning that
/// ranks outnumber cores is about timings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timed {
    Yes,
    No,
}

/// Checks a CPU job against this host before any rank starts; a job that cannot fit is a usage
/// error (see [`tpar_harness::limits::CpuJobNeeds::check`]). Its warnings are printed once per
/// job: by rank 0 (every rank runs this check again, and so does the launcher before them),
/// and only for a job whose timings they concern.
pub fn check_cpu_job(needs: tpar_harness::limits::CpuJobNeeds, timed: Timed) -> Result<()> {
    let room = tpar_harness::limits::HostRoom::here();
    let warnings = needs.check(&room).map_err(|e| usage(e.into()))?;
    let rank_zero = matches!(tpar::RankEnv::from_env(), Ok(Some(env)) if env.rank == 0);
    if timed == Timed::Yes && rank_zero {
        for warning in warnings {
            tpar_report::print_err(&warning);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compute_capability_reads_as_nvml_writes_it() {
        for (given, read) in [
            ("9.0", "9.0"),
            ("sm_90", "9.0"),
            ("120", "12.0"),
            (" 8.6", "8.6"),
        ] {
            assert_eq!(
                compute_capability_arg(given).as_deref(),
                Ok(read),
                "{given}"
            );
        }
        for bad in ["7.5", "9", "9.05", "sm_", "h100", ""] {
            let e = compute_capability_arg(bad).unwrap_err();
            assert!(
                e.contains("give one of 8.0, 8.6, 8.9, 9.0, 10.0, 12.0"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn lists_name_the_flag_in_errors() {
        let err = parse_list("1K,,zz", "sizes", parse_size).unwrap_err();
        assert!(format!("{err:#}").contains("--sizes"), "{err:#}");
        assert!(parse_list(",", "sizes", parse_size).is_err());
        let algos = parse_list("one-shot,two-shot", "algos", |s| {
            Ok(s.parse::<tpar::Algorithm>()?)
        })
        .unwrap();
        assert_eq!(
            algos,
            [tpar::Algorithm::OneShot, tpar::Algorithm::TwoShot].to_vec()
        );
    }

    #[test]
    fn lists_refuse_empty_items_and_repeats() {
        let err = parse_list("4K,,8K", "sizes", parse_size).unwrap_err();
        assert!(
            is_usage(&err) && err.to_string().contains("empty item"),
            "{err}"
        );
        let err = parse_list("4K,4096", "sizes", parse_size).unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
    }

    #[test]
    fn whole_numbers_name_the_bound() {
        assert_eq!(world_size_arg("8").unwrap(), 8);
        assert!(world_size_arg("-1").unwrap_err().contains("must be >= 1"));
        assert!(world_size_arg("0").unwrap_err().contains("must be >= 1"));
        assert_eq!(world_size_arg("16").unwrap(), 16);
        for over in ["17", "4096", "18446744073709551615"] {
            let err = world_size_arg(over).unwrap_err();
            assert!(err.contains("serves 1 to 16 ranks"), "{err}");
        }
        assert!(tp_arg("17").unwrap_err().contains("serves 1 to 16 ranks"));
        assert!(world_size_arg("99999999999999999999999999999999999999999")
            .unwrap_err()
            .contains("too large"));
        assert!(positive_f64("nan").is_err() && positive_f64("0").is_err());
        assert!(fraction_arg("1.5").is_err() && fraction_arg("1").is_ok());
    }

    #[test]
    fn timeouts_are_positive() {
        assert_eq!(timeout_arg("1.5").unwrap(), Duration::from_millis(1500));
        assert!(timeout_arg("0").is_err());
        assert!(timeout_arg("-3").unwrap_err().contains("must be positive"));
        assert!(timeout_arg("soon").is_err());
        assert!(timeout_arg("nan").is_err());
        // Duration::from_secs_f64 panics on these: they must be refused first.
        assert!(timeout_arg("1e30").unwrap_err().contains("at most"));
        assert!(timeout_arg("inf").is_err());
    }
}
