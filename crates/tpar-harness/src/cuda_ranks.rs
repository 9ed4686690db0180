//! The CUDA ranks a `tpar` process drives. With threads (the default) one process holds every
//! rank, each with its own stream, and launches all of them; with `--processes` (or under an
//! outside launcher) it holds its own rank, and a CPU communicator beside it tallies results
//! across processes. Ranks map to GPUs round-robin, so several may share one GPU.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream};
use tpar::algorithm::Selection;
use tpar::backend::cuda::driver::DeviceMemory;
use tpar::backend::cuda::{CudaCommunicator, DeviceSpan, DeviceSpanMut};
use tpar::backend::nccl::NcclCommunicator;
use tpar::dispatch::Choice;
use tpar::topology::Topology;
use tpar::{Algorithm, Communicator, Config, CpuCommunicator, DType};

use super::known::{total_across_ranks, KnownData};
use super::ranks::Rank;
use super::{bail, Context, HarnessError, Result};
use tpar::verify::{self, CheckRanks, Finding};

/// Queues one allreduce on `stream` through `comm`: the forced choice (queued as forced,
/// without the dispatcher's check that it runs here, as the benchmarks measure it), or the
/// dispatcher's (the library's one parse of a choice is [`Selection`]'s).
pub fn queue(
    selection: Selection,
    comm: &Communicator,
    input: Option<DeviceSpan<'_>>,
    output: DeviceSpanMut<'_>,
    stream: &CudaStream,
) -> Result<()> {
    match selection {
        Selection::Forced(choice) => comm.all_reduce_as(choice, input, output, stream)?,
        Selection::Auto => {
            comm.all_reduce(input, output, stream)?;
        }
    }
    Ok(())
}

/// Builds a group of CUDA ranks with a configuration (all ranks in this process, or this
/// process's rank of a job).
pub type MakeGroup<'a> = &'a dyn Fn(Config) -> Result<CudaRanks>;

/// Whether `stream` is being captured into a graph (the dispatcher may decide differently).
pub fn stream_is_capturing(stream: &CudaStream) -> bool {
    stream.capture_status().is_ok_and(|s| {
        s == cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
    })
}

/// Every name `--algos`, `--algo` and `TPAR_ALGO` take, in the one order used by help, errors
/// and the README (a test holds them to `Choice::ALL` and `auto`).
#[macro_export]
macro_rules! selection_names {
    () => {
        concat!($crate::algorithm_names!(), ", nccl, auto")
    };
}

/// tpar's own algorithms among them (what `tpar selftest` checks), in the same order.
#[macro_export]
macro_rules! algorithm_names {
    () => {
        "one-shot, two-shot, one-shot-pull, host-staged, staged, staged-pull, islands, islands-pull, ring"
    };
}
pub const SELECTION_NAMES: &str = selection_names!();

/// A name from a list of algorithms (`--algos`): [`Selection`]'s parse, with an error that
/// lists every name `auto` included; an empty name is refused, not taken for `auto`.
pub fn parse_selection(name: &str) -> std::result::Result<Selection, tpar::Error> {
    let name = name.trim();
    let parsed = (!name.is_empty())
        .then(|| name.parse::<Selection>().ok())
        .flatten();
    parsed.ok_or_else(|| {
        tpar::Error::InvalidArgument(format!(
            "unknown algorithm '{name}'; the names are: {SELECTION_NAMES}"
        ))
    })
}

pub struct CudaRanks {
    /// One communicator per local rank: tpar's CUDA backend, NCCL where it could be created,
    /// and the dispatcher between them.
    pub comms: Vec<Communicator>,
    pub streams: Vec<Arc<CudaStream>>,
    /// The global rank of each local one.
    pub ranks: Vec<usize>,
    pub world_size: usize,
    /// Across processes: sums results over ranks. `None` when this process holds every rank.
    control: Option<CpuCommunicator>,
}

/// Buffers of one local rank: two inputs (calls alternate between them) and an output.
pub struct RankBuffers {
    pub inputs: [DeviceMemory; 2],
    pub output: DeviceMemory,
}

pub fn device_count() -> Result<usize> {
    Ok(tpar::backend::cuda::check_available()?)
}

impl CudaRanks {
    /// Every rank in this process.
    pub fn threads(world_size: usize, config: Config) -> Result<CudaRanks> {
        let gpus = device_count()?;
        let devices: Vec<usize> = (0..world_size).map(|r| r % gpus).collect();
        let cuda = CudaCommunicator::new_local_group(&devices, config)?;
        // One thread issuing NCCL calls for several ranks must group them, which per-rank
        // graph capture cannot; several ranks compare with NCCL under --processes.
        let mut nccl: Vec<std::result::Result<NcclCommunicator, String>> = if world_size == 1 {
            match NcclCommunicator::new_local_group(&devices) {
                Ok(comms) => comms.into_iter().map(Ok).collect(),
                Err(e) => vec![Err(e.to_string())],
            }
        } else {
            Vec::new()
        };
        nccl.resize_with(world_size, || {
            Err(
                "NCCL with several ranks in one process is not measured; use --processes"
                    .to_owned(),
            )
        });
        let topology = Topology::detect_or_unknown(gpus);
        let streams = cuda
            .iter()
            .map(|c| c.context().new_stream().context("cannot create a stream"))
            .collect::<Result<_>>()?;
        let comms = cuda
            .into_iter()
            .zip(nccl)
            .map(|(c, n)| Ok(Communicator::new(c, n, topology.clone())?))
            .collect::<Result<_>>()?;
        Ok(CudaRanks {
            comms,
            streams,
            ranks: (0..world_size).collect(),
            world_size,
            control: None,
        })
    }

    /// This process's rank of a job started by a launcher.
    pub fn process(rank: &Rank, config: Config) -> Result<CudaRanks> {
        let gpus = device_count()?;
        let device = rank.rendezvous.env().local_rank % gpus;
        let control = CpuCommunicator::new(
            &rank.rendezvous,
            Config {
                timeout: config.timeout.max(Duration::from_secs(30)),
                ..Config::default()
            },
        )?;
        let comm = Communicator::join(&rank.rendezvous, device, config)?;
        let stream = comm
            .cuda()
            .context()
            .new_stream()
            .context("cannot create a stream")?;
        Ok(CudaRanks {
            comms: vec![comm],
            streams: vec![stream],
            ranks: vec![rank.rank()],
            world_size: rank.world_size(),
            control: Some(control),
        })
    }

    /// The device the group runs on, for provenance records: GPU 0's name, the GPU count and
    /// the driver.
    pub fn device(&self) -> Result<String> {
        let gpus = device_count()?;
        Ok(super::backend_choice::cuda_device(
            self.comms[0].cuda().context(),
            gpus,
        ))
    }

    pub fn is_leader(&self) -> bool {
        self.ranks.contains(&0)
    }

    /// What an engine's communicator does when it is created on a machine with no tuning table
    /// (the first-use measurement: the fabric model's close candidates timed, the table cached
    /// under the machine's fingerprint), done for ranks that are threads of this process, so
    /// that `auto` here decides as it would in the engine. Ranks of `--processes` made it as
    /// they joined. `None` where it did not run: processes, one rank, `TPAR_FIRST_USE=0`, a
    /// table already read, or no candidates close enough to time; else its one-line account.
    /// A measurement that fails leaves the model's choices, as it does in an engine, and the
    /// account says why.
    pub fn measure_first_use(&mut self) -> Option<String> {
        if self.control.is_some() {
            return None;
        }
        match tpar::communicator::first_use::measure_local(&mut self.comms, &self.streams) {
            Ok(measured) => measured.map(|m| m.describe()),
            Err(e) => Some(format!("failed, so the fabric model decides: {e}")),
        }
    }

    /// The mean over the job's processes of `local` (one value per process): the same on every
    /// rank, because the sum comes from an allreduce, whose result is identical everywhere.
    /// Anything that decides how many collective calls to make must come from such a value,
    /// or the ranks' call counts (and epochs) drift apart.
    pub fn agreed_mean(&mut self, local: u64) -> Result<u64> {
        let processes = if self.control.is_some() {
            self.world_size as u64
        } else {
            1
        };
        Ok(self.total(local)? / processes)
    }

    /// After every rank but `silent` called (at `start`): how many of them did not give up with
    /// a timeout naming `silent` within `deadline` + 1 s, and a line saying what they did.
    pub fn tally_silent_peer(
        &self,
        silent: usize,
        start: std::time::Instant,
        deadline: Duration,
    ) -> (u64, String) {
        let (mut bad, mut detail) = (0, String::new());
        for (i, comm) in self.comms.iter().enumerate() {
            if self.ranks[i] == silent {
                continue;
            }
            let result = comm.cuda().synchronize(&self.streams[i]);
            let took = start.elapsed();
            match result {
                Err(tpar::Error::PeerTimeout { peer, .. })
                    if peer == silent && took <= deadline + Duration::from_secs(1) =>
                {
                    // A phase that other ranks wait behind (the fused two-shot's reduce-scatter)
                    // gives up an eighth of the deadline early, so that its notice reaches them
                    // in time: say so, or the row reads as a deadline missed.
                    let early = if took < deadline {
                        ", a phase that peers wait behind gives up an eighth early"
                    } else {
                        ""
                    };
                    detail = format!(
                        " (kernels gave up after {took:.2?}, deadline {deadline:?}{early})"
                    );
                }
                other => {
                    bad += 1;
                    detail = format!(
                        ": expected a timeout naming rank {silent}, got {other:?} after {took:.2?}"
                    );
                }
            }
        }
        (bad, detail)
    }

    /// After every local rank queued a call that disagrees with a peer's (another count or
    /// shape): (local ranks that did not report a mismatched call, a detail for the row: rank 0's
    /// message, or what a rank reported instead).
    pub fn tally_mismatch(&self) -> (u64, String) {
        let (mut bad, mut detail) = (0, String::new());
        for (i, comm) in self.comms.iter().enumerate() {
            match comm.cuda().synchronize(&self.streams[i]) {
                Err(e @ tpar::Error::CallMismatch { .. }) => {
                    if self.ranks[i] == 0 {
                        detail = format!(" (rank 0: {e})");
                    }
                }
                other => {
                    bad += 1;
                    detail = format!(
                        ": rank {}: expected a mismatch, got {other:?}",
                        self.ranks[i]
                    );
                    // With a process per rank only rank 0's detail reaches the table: each
                    // rank that got something else says what on standard error.
                    if self.control.is_some() {
                        eprintln!("tpar[rank {}]: mismatch row{detail}", self.ranks[i]);
                    }
                }
            }
        }
        (bad, detail)
    }

    /// The sum over every rank of the job of each local rank's `local` value.
    pub fn total(&mut self, local: u64) -> Result<u64> {
        match &mut self.control {
            Some(control) => total_across_ranks(control, local),
            None => Ok(local),
        }
    }

    /// Waits for every local stream and reports any error a kernel left.
    pub fn synchronize(&self) -> Result<()> {
        for (comm, stream) in self.comms.iter().zip(&self.streams) {
            let rank = comm.cuda().rank();
            comm.cuda()
                .synchronize(stream)
                .with_context(|| format!("rank {rank}"))?;
            comm.check().with_context(|| format!("rank {rank}"))?;
        }
        Ok(())
    }

    pub fn buffers(&self, bytes: usize) -> Result<Vec<RankBuffers>> {
        self.comms
            .iter()
            .map(|c| {
                let alloc = || DeviceMemory::zeroed(c.cuda().context(), bytes);
                Ok(RankBuffers {
                    inputs: [alloc()?, alloc()?],
                    output: alloc()?,
                })
            })
            .collect()
    }

    /// Uploads each local rank's known input for both variants.
    pub fn upload_inputs(
        &self,
        buffers: &[RankBuffers],
        known: &[KnownData],
        count: usize,
    ) -> Result<()> {
        for (b, k) in buffers.iter().zip(known) {
            for v in 0..2 {
                b.inputs[v].upload(k.input(v, count))?;
            }
        }
        Ok(())
    }

    /// Known data for every local rank.
    pub fn known(&self, dtype: DType, max_count: usize, seeds: [u64; 2]) -> Vec<KnownData> {
        self.ranks
            .iter()
            .map(|&r| KnownData::new(dtype, r, self.world_size, max_count, seeds))
            .collect()
    }

    /// Queues one allreduce of local rank `i` on `stream`: from input `variant` into the
    /// output, or in place on the output when `variant` is `None`. The buffers are borrowed
    /// for the queueing only: the caller synchronises before it touches or drops them, and
    /// drops a graph captured from them first.
    #[allow(clippy::too_many_arguments)]
    pub fn queue(
        &self,
        i: usize,
        stream: &CudaStream,
        buffers: &mut [RankBuffers],
        variant: Option<usize>,
        dtype: DType,
        count: usize,
        selection: Selection,
    ) -> Result<()> {
        let RankBuffers { inputs, output } = &mut buffers[i];
        let input = variant
            .map(|v| inputs[v % 2].span(dtype, count))
            .transpose()?;
        let output = output.span_mut(dtype, count)?;
        queue(selection, &self.comms[i], input, output, stream)
    }

    /// Whether `selection` can run on these ranks, and if not, why (`auto` always can: the
    /// dispatcher's decision says what it runs).
    pub fn supports(&self, selection: Selection) -> std::result::Result<(), String> {
        match selection {
            Selection::Forced(Choice::Tpar(algorithm)) => self.comms[0].cuda().supports(algorithm),
            Selection::Forced(Choice::Nccl) => self.comms[0].nccl().map(|_| ()),
            Selection::Auto => Ok(()),
        }
    }

    /// Queues one allreduce on every local rank's own stream (see [`CudaRanks::queue`]) and
    /// returns; the caller synchronises before touching or dropping the buffers.
    pub fn launch(
        &self,
        buffers: &mut [RankBuffers],
        dtype: DType,
        count: usize,
        selection: Selection,
        variant: usize,
        in_place: bool,
    ) -> Result<()> {
        for i in 0..self.comms.len() {
            self.queue(
                i,
                &self.streams[i],
                buffers,
                (!in_place).then_some(variant),
                dtype,
                count,
                selection,
            )?;
        }
        Ok(())
    }

    /// Ranks whose output differs bitwise from the expected sum of `variant`; each one is
    /// described on stderr (its first wrong element) so that a failure can be diagnosed.
    pub fn wrong_outputs(
        &self,
        buffers: &[RankBuffers],
        known: &[KnownData],
        count: usize,
        variant: usize,
        dtype: DType,
    ) -> Result<u64> {
        self.wrong_outputs_within(buffers, known, count, variant, dtype, 0.0)
    }

    /// [`CudaRanks::wrong_outputs`] allowing an error of `tolerance` x max(|expected|, 1) (0: bitwise), for
    /// NCCL, which adds in its own order and, for 16-bit types, rounds partial sums.
    pub fn wrong_outputs_within(
        &self,
        buffers: &[RankBuffers],
        known: &[KnownData],
        count: usize,
        variant: usize,
        dtype: DType,
        tolerance: f32,
    ) -> Result<u64> {
        let mut wrong = 0;
        let mut host = vec![0u8; count * dtype.size()];
        for (i, (b, k)) in buffers.iter().zip(known).enumerate() {
            b.output.download(&mut host)?;
            let expected = k.expected(variant, count);
            let mismatch = if tolerance == 0.0 {
                tpar::check::first_mismatch(dtype, &host, expected)
            } else {
                (0..count)
                    .map(|e| (e, dtype.load_f32(&host, e), dtype.load_f32(expected, e)))
                    .find(|(_, got, want)| {
                        (got - want).abs() > tolerance * want.abs().max(1.0) || got.is_nan()
                    })
            };
            if let Some((index, got, want)) = mismatch {
                wrong += 1;
                let previous = dtype.load_f32(k.expected(variant + 1, count), index) == got;
                super::ranks::say(
                    self.ranks[i],
                    &format!(
                        "wrong result at {count} {dtype} elements: first at element {index}, got {got}, expected {want}{}",
                        if previous { " (the previous call's value)" } else { "" }
                    ),
                );
            }
        }
        Ok(wrong)
    }

    /// Captures one graph per local rank on its own stream, as each GPU of a real machine
    /// would capture its own decode graph. `body` may fail with the caller's own error type.
    pub fn capture_each<E: From<HarnessError>>(
        &self,
        mut body: impl FnMut(usize, &Arc<CudaStream>) -> std::result::Result<(), E>,
    ) -> std::result::Result<Vec<CudaGraph>, E> {
        self.streams
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                    .map_err(HarnessError::from)?;
                let captured = body(i, s);
                let graph = s.end_capture(CUgraphInstantiate_flags(0));
                captured?;
                let graph = graph.map_err(HarnessError::from)?;
                Ok(graph.context("stream capture produced no graph")?)
            })
            .collect()
    }

    /// Captures one graph: `body(local_index, stream)` queues rank work on that rank's stream;
    /// the other streams fork from and join back into the first.
    pub fn capture<E: From<HarnessError>>(
        &self,
        mut body: impl FnMut(usize, &Arc<CudaStream>) -> std::result::Result<(), E>,
    ) -> std::result::Result<CudaGraph, E> {
        let main = &self.streams[0];
        main.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(HarnessError::from)?;
        let captured = (|| -> std::result::Result<(), E> {
            let fork = main.record_event(None).map_err(HarnessError::from)?;
            for s in &self.streams[1..] {
                s.wait(&fork).map_err(HarnessError::from)?;
            }
            for (i, s) in self.streams.iter().enumerate() {
                body(i, s)?;
            }
            for s in &self.streams[1..] {
                main.join(s).map_err(HarnessError::from)?;
            }
            Ok(())
        })();
        let graph = main.end_capture(CUgraphInstantiate_flags(0));
        captured?;
        match graph.map_err(HarnessError::from)? {
            Some(g) => Ok(g),
            None => Err(HarnessError::Failed("stream capture produced no graph".into()).into()),
        }
    }
}

impl CheckRanks for CudaRanks {
    type Error = HarnessError;

    fn local_ranks(&self) -> usize {
        self.comms.len()
    }

    fn rank(&self, i: usize) -> usize {
        self.ranks[i]
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn cuda(&self, i: usize) -> &CudaCommunicator {
        self.comms[i].cuda()
    }

    fn queue(
        &self,
        i: usize,
        algorithm: Algorithm,
        input: Option<DeviceSpan<'_>>,
        output: DeviceSpanMut<'_>,
    ) -> Result<()> {
        let forced = Selection::Forced(Choice::Tpar(algorithm));
        self.comms[i].all_reduce_selected(forced, input, output, &self.streams[i])?;
        Ok(())
    }

    fn synchronize(&self, i: usize) -> Result<()> {
        let comm = &self.comms[i];
        let rank = comm.cuda().rank();
        comm.cuda()
            .synchronize(&self.streams[i])
            .with_context(|| format!("rank {rank}"))?;
        comm.check().with_context(|| format!("rank {rank}"))
    }
}

/// Describes each wrong output on stderr as its rank (`tpar[rank R]: ...`), so that a failure
/// can be diagnosed.
pub fn say_findings(findings: &[Finding], dtype: DType) {
    for f in findings {
        super::ranks::say(f.rank, &f.describe(dtype));
    }
}

/// A quick numerical check of one algorithm on `world_size` ranks in this process (doctor):
/// [`verify::QUICK_CHECK`], compared bitwise with the exact sum.
pub fn quick_check(world_size: usize, algorithm: Algorithm) -> Result<String> {
    let group = CudaRanks::threads(
        world_size,
        Config {
            timeout: Duration::from_secs(10),
            ..Config::default()
        },
    )?;
    let spec = verify::QUICK_CHECK;
    let findings = verify::check(&group, algorithm, &spec)?;
    if let Some(first) = findings.first() {
        let wrong: Vec<Finding> = findings
            .iter()
            .filter(|f| f.count == first.count && f.call == first.call)
            .cloned()
            .collect();
        say_findings(&wrong, spec.dtype);
        bail!(
            "{} of {world_size} ranks got a wrong sum at {} elements",
            wrong.len(),
            first.count
        );
    }
    Ok(exact_sums(world_size, &spec))
}

/// "exact sums on 2 ranks at 0, 7, 4099 and 70001 bf16 elements": what a passed check shows.
fn exact_sums(world_size: usize, spec: &verify::CheckSpec<'_>) -> String {
    let counts: Vec<String> = spec.counts.iter().map(usize::to_string).collect();
    let (last, rest) = counts.split_last().expect("a check has counts");
    format!(
        "exact sums on {world_size} ranks at {}{last} {} elements",
        if rest.is_empty() {
            String::new()
        } else {
            format!("{} and ", rest.join(", "))
        },
        spec.dtype
    )
}

#[cfg(test)]
mod selection_name_tests {
    use super::*;

    #[test]
    fn one_list_of_algorithm_names_everywhere() {
        let mut names: Vec<&str> = Choice::ALL.iter().map(|c| c.name()).collect();
        names.push("auto");
        assert_eq!(SELECTION_NAMES, names.join(", "));
        let own: Vec<&str> = tpar::Algorithm::ALL.iter().map(|a| a.name()).collect();
        assert_eq!(crate::algorithm_names!(), own.join(", "));
        for name in &names {
            assert_eq!(parse_selection(name).unwrap().name(), *name);
        }
        assert!(parse_selection(" ").is_err());
        let err = parse_selection("rings").unwrap_err().to_string();
        assert!(err.contains(SELECTION_NAMES), "{err}");
        assert_eq!(
            exact_sums(2, &verify::QUICK_CHECK),
            "exact sums on 2 ranks at 0, 7, 4099 and 70001 bf16 elements"
        );
        let readme = include_str!("../../../README.md");
        assert!(
            readme.contains(SELECTION_NAMES),
            "README lists other algorithm names"
        );
    }
}
