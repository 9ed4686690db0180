//! The one numerical check behind every self-test: known inputs reduced by one algorithm on
//! every local rank, each output compared bitwise with the exact sum. [`crate::Communicator`]'s
//! init check ([`INIT_CHECK`], one rank per process, through the backend), `tpar doctor`
//! ([`QUICK_CHECK`], every rank as a thread) and the eager rows of `tpar selftest` (one spec
//! per row) all call [`check`]; they differ in the spec and in how they share their findings.
//!
//! It depends on the CUDA backend and the known data only, so the communicator can run it while
//! it is being built: it sits beside the communicator in the call-path layer, below the
//! harness (`crate::harness`), which runs it on its rank groups.

use cudarc::driver::CudaStream;

use crate::backend::cuda::driver::DeviceMemory;
use crate::backend::cuda::{CudaCommunicator, DeviceSpan, DeviceSpanMut};
use crate::check::{fill_expected, fill_input, first_mismatch};
use crate::{Algorithm, DType};

/// What one check covers: every count, each called `calls` times with alternating inputs (a
/// call that wrote nothing leaves the previous call's result, which does not match).
#[derive(Clone, Copy, Debug)]
pub struct CheckSpec<'a> {
    pub dtype: DType,
    pub counts: &'a [usize],
    pub calls: usize,
    /// In place: the output starts as the input. Out of place: the output starts poisoned, so
    /// that an unwritten element cannot pass.
    pub in_place: bool,
    /// Input `v` of a count uses `seeds[v % 2]`.
    pub seeds: [u64; 2],
}

/// `Communicator::join`'s check: one chunk and several, in place, once each.
pub const INIT_CHECK: CheckSpec<'static> = CheckSpec {
    dtype: DType::Bf16,
    counts: &[4099, 140_001],
    calls: 1,
    in_place: true,
    seeds: [0, 1],
};

/// `tpar doctor`'s check: empty, tiny and odd sizes, two calls each, out of place.
pub const QUICK_CHECK: CheckSpec<'static> = CheckSpec {
    dtype: DType::Bf16,
    counts: &[0, 7, 4099, 70001],
    calls: 2,
    in_place: false,
    seeds: [51, 52],
};

/// The ranks a check drives: every local rank's call is queued before any is waited for, so
/// ranks that are threads of one process meet inside their kernels.
pub trait CheckRanks {
    type Error: From<crate::Error>;

    /// Ranks held by this process.
    fn local_ranks(&self) -> usize;
    /// The job rank of local rank `i`.
    fn rank(&self, i: usize) -> usize;
    fn world_size(&self) -> usize;
    fn cuda(&self, i: usize) -> &CudaCommunicator;
    /// Queues `algorithm` on local rank `i`: `input` (`None`: in place) into `output`, spans
    /// of rank `i`'s GPU checked by the call.
    fn queue(
        &self,
        i: usize,
        algorithm: Algorithm,
        input: Option<DeviceSpan<'_>>,
        output: DeviceSpanMut<'_>,
    ) -> Result<(), Self::Error>;
    /// Waits for local rank `i`'s stream and reports any error its kernels left.
    fn synchronize(&self, i: usize) -> Result<(), Self::Error>;
}

/// A wrong output: the first wrong element of one rank's output after one call.
#[derive(Clone, Debug, PartialEq)]
pub struct Finding {
    pub algorithm: Algorithm,
    pub rank: usize,
    pub count: usize,
    /// Which call of the count (0-based).
    pub call: usize,
    pub index: usize,
    pub got: f32,
    pub want: f32,
    /// The element holds the other input's sum: the call left the previous result behind.
    pub previous: bool,
}

impl Finding {
    /// "wrong result at 7 bf16 elements: first at element 3, got 2, expected 5".
    pub fn describe(&self, dtype: DType) -> String {
        format!(
            "wrong result at {} {dtype} elements: first at element {}, got {}, expected {}{}",
            self.count,
            self.index,
            self.got,
            self.want,
            if self.previous {
                " (the previous call's value)"
            } else {
                ""
            }
        )
    }
}

/// Runs `spec` for `algorithm` on every local rank of `ranks` and returns every wrong output.
/// Every rank makes every call (they are collective), wrong or not.
pub fn check<R: CheckRanks>(
    ranks: &R,
    algorithm: Algorithm,
    spec: &CheckSpec<'_>,
) -> Result<Vec<Finding>, R::Error> {
    let dtype = spec.dtype;
    let max = spec.counts.iter().copied().max().unwrap_or(0);
    let bytes = (max * dtype.size()).max(dtype.size());
    let mut buffers = (0..ranks.local_ranks())
        .map(|i| {
            let ctx = ranks.cuda(i).context();
            Ok((
                DeviceMemory::zeroed(ctx, bytes)?,
                DeviceMemory::zeroed(ctx, bytes)?,
            ))
        })
        .collect::<crate::Result<Vec<_>>>()?;
    let mut input = vec![0u8; max * dtype.size()];
    let mut expected = [vec![0u8; max * dtype.size()], vec![0u8; max * dtype.size()]];
    let mut output = vec![0u8; max * dtype.size()];
    let mut findings = Vec::new();
    for &count in spec.counts {
        let size = count * dtype.size();
        for (e, &seed) in expected.iter_mut().zip(&spec.seeds) {
            fill_expected(dtype, seed, ranks.world_size(), &mut e[..size]);
        }
        for call in 0..spec.calls {
            let seed = spec.seeds[call % 2];
            for (i, (inp, out)) in buffers.iter().enumerate() {
                fill_input(dtype, seed, ranks.rank(i), &mut input[..size]);
                if spec.in_place {
                    out.upload(&input[..size])?;
                } else {
                    inp.upload(&input[..size])?;
                    out.fill(0xA5)?;
                }
            }
            for (i, (inp, out)) in buffers.iter_mut().enumerate() {
                let source = if spec.in_place {
                    None
                } else {
                    Some(inp.span(dtype, count)?)
                };
                ranks.queue(i, algorithm, source, out.span_mut(dtype, count)?)?;
            }
            for i in 0..ranks.local_ranks() {
                ranks.synchronize(i)?;
            }
            let want = &expected[call % 2][..size];
            let other = &expected[(call + 1) % 2][..size];
            for (i, (_, out)) in buffers.iter().enumerate() {
                out.download(&mut output[..size])?;
                if let Some((index, got, want)) = first_mismatch(dtype, &output[..size], want) {
                    findings.push(Finding {
                        algorithm,
                        rank: ranks.rank(i),
                        count,
                        call,
                        index,
                        got,
                        want,
                        previous: dtype.load_f32(other, index) == got,
                    });
                }
            }
        }
    }
    Ok(findings)
}

/// One rank of a process (the communicator's init check), calling the backend directly.
pub struct BackendRank<'a> {
    pub cuda: &'a CudaCommunicator,
    pub stream: &'a CudaStream,
}

impl CheckRanks for BackendRank<'_> {
    type Error = crate::Error;

    fn local_ranks(&self) -> usize {
        1
    }

    fn rank(&self, _: usize) -> usize {
        self.cuda.rank()
    }

    fn world_size(&self) -> usize {
        self.cuda.world_size()
    }

    fn cuda(&self, _: usize) -> &CudaCommunicator {
        self.cuda
    }

    fn queue(
        &self,
        _: usize,
        algorithm: Algorithm,
        input: Option<DeviceSpan<'_>>,
        output: DeviceSpanMut<'_>,
    ) -> crate::Result<()> {
        self.cuda.all_reduce(input, output, algorithm, self.stream)
    }

    fn synchronize(&self, _: usize) -> crate::Result<()> {
        self.cuda.synchronize(self.stream)
    }
}
