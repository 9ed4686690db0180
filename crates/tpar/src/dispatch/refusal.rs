//! Whether a choice can run a request on this machine and in this group, and if not, a typed
//! [`Refusal`] that says which choice and why; and [`NoDecision`], why a request got no choice
//! at all. The reasons are values (tests and callers match on them, the Python edge raises
//! them with their [`Reason::code`]); their words come from `Display`, once, and are what
//! users read in plans, `tpar doctor` and errors. This is the one place that decides whether a
//! choice can run: the backends assert it at launch, and the fused op's path is refused here
//! too ([`fused_eligibility`]).

use std::fmt;

use super::rules::distinct_pairs;
use super::{Decision, GroupFacts, NcclAvailability, Request};
use crate::algorithm::{Algorithm, Choice, MAX_RANKS};
use crate::dtype::DType;
use crate::error::Error;
use crate::norm;
use crate::topology::PathClass;

/// Why a choice cannot run a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The request names no ranks.
    NoRanks,
    /// The machine described has no GPU.
    NoGpu,
    /// The size is not a whole number of elements.
    PartialElement { bytes: u64, dtype: DType },
    /// A check on this machine found the path cannot run (the init self-test, a measurement):
    /// its finding.
    FailedCheck(String),
    /// No NCCL library, or no NCCL communicator for these ranks.
    NcclMissing,
    /// NCCL runs one rank per GPU.
    NcclNeedsGpuPerRank { ranks: usize, gpus: usize },
    /// tpar's kernels address at most [`MAX_RANKS`] ranks.
    TooManyRanks { ranks: usize },
    /// tpar's kernels need compute capability 8.0 (Ampere) or newer: GPU `gpu` of the group
    /// has `capability` (the loader refuses it too).
    OldGpu { gpu: usize, capability: String },
    /// Two GPUs of the group cannot reach each other the way the algorithm needs (`reads`:
    /// peer reads, else peer writes); `path` is how they are connected, where known.
    NoPeerAccess {
        a: usize,
        b: usize,
        path: Option<PathClass>,
        reads: bool,
    },
    /// The group's backend has no kernel for this algorithm.
    NoKernel,
    /// The group was built without host-staged inboxes (`Config::host_staged` off).
    HostStagedOff,
    /// Mapping the peers' device memory failed when the group was built: why.
    GroupPeerAccess(String),
    /// This group has no NCCL communicator, and why.
    NcclUnavailable(String),
    /// tpar's own NCCL communicator is created at the first call that needs it, which cannot
    /// be inside CUDA-graph capture.
    NcclAtFirstCall,
    /// The communicator was created with `nccl="none"`: calls planned for NCCL stay with the
    /// caller's own NCCL.
    NcclNotHeld,
    /// Fused op: the allreduce runs on NCCL, which has no fused epilogue.
    FusedOnNccl,
    /// Fused op: tpar has no fused kernel for this algorithm.
    NoFusedKernel,
    /// Fused op: rows longer than the fused kernels are built for.
    HiddenTooLarge { hidden: usize },
    /// Fused op: the inbox slots are not 16-byte aligned.
    OddPayloadLines,
    /// Fused op: one row does not fit a chunk of the inbox.
    RowTooLong {
        hidden: usize,
        dtype: DType,
        payload_lines: usize,
    },
}

impl Reason {
    /// A short, stable name of the reason, for programs (the Python edge's
    /// `TparRefused.reason`).
    pub fn code(&self) -> &'static str {
        match self {
            Reason::NoRanks => "no-ranks",
            Reason::NoGpu => "no-gpu",
            Reason::PartialElement { .. } => "partial-element",
            Reason::FailedCheck(_) => "failed-check",
            Reason::NcclMissing => "nccl-missing",
            Reason::NcclNeedsGpuPerRank { .. } => "nccl-needs-gpu-per-rank",
            Reason::TooManyRanks { .. } => "too-many-ranks",
            Reason::OldGpu { .. } => "old-gpu",
            Reason::NoPeerAccess { .. } => "no-peer-access",
            Reason::NoKernel => "no-kernel",
            Reason::HostStagedOff => "host-staged-off",
            Reason::GroupPeerAccess(_) => "group-peer-access",
            Reason::NcclUnavailable(_) => "nccl-unavailable",
            Reason::NcclAtFirstCall => "nccl-at-first-call",
            Reason::NcclNotHeld => "nccl-not-held",
            Reason::FusedOnNccl => "fused-on-nccl",
            Reason::NoFusedKernel => "no-fused-kernel",
            Reason::HiddenTooLarge { .. } => "hidden-too-large",
            Reason::OddPayloadLines => "odd-payload-lines",
            Reason::RowTooLong { .. } => "row-too-long",
        }
    }
}

/// `choice` cannot run the request, because `reason`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub choice: Choice,
    pub reason: Reason,
}

impl Refusal {
    pub fn new(choice: Choice, reason: Reason) -> Refusal {
        Refusal { choice, reason }
    }
}

/// The sentence a call planned for NCCL on a communicator created with `nccl="none"` gets.
const NCCL_NOT_HELD: &str = "this communicator was created with nccl=none (tpar's kernels only), so it refuses calls planned for NCCL: keep such calls on your own NCCL (should_use() says False for them), or create the communicator with nccl=\"own\" or with your NCCL communicator to borrow";

impl fmt::Display for Refusal {
    /// The reason as users read it (without the "CHOICE skipped: " that callers put before it).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.reason {
            Reason::NoRanks => f.write_str("the world size is 0"),
            Reason::NoGpu => f.write_str("the topology has no GPU"),
            Reason::PartialElement { bytes, dtype } => {
                write!(f, "{bytes} bytes is not a whole number of {dtype} elements")
            }
            Reason::FailedCheck(why) => write!(f, "{} cannot run here: {why}", self.choice),
            Reason::NcclMissing => f.write_str(
                "NCCL is not available (no libnccl.so.2 found, or no NCCL communicator for these ranks)",
            ),
            Reason::NcclNeedsGpuPerRank { ranks, gpus } => write!(
                f,
                "NCCL needs one GPU per rank: {ranks} ranks on {gpus} GPU(s)"
            ),
            Reason::TooManyRanks { ranks } => write!(
                f,
                "tpar's kernels address at most {MAX_RANKS} ranks; {ranks} asked"
            ),
            Reason::OldGpu { gpu, capability } => write!(
                f,
                "GPU {gpu} has compute capability {capability}; tpar's kernels need 8.0 (Ampere) or newer"
            ),
            Reason::NoPeerAccess { a, b, path, reads } => write!(
                f,
                "GPUs {a} and {b} ({}) have no peer-to-peer {}",
                path.map_or("?", PathClass::label),
                if *reads { "reads" } else { "writes" }
            ),
            Reason::NoKernel => write!(f, "the CUDA backend has no {} kernel", self.choice),
            Reason::HostStagedOff => {
                f.write_str("host-staged inboxes were not built (Config::host_staged is off)")
            }
            Reason::GroupPeerAccess(why) => write!(f, "{} on this group: {why}", self.choice),
            Reason::NcclUnavailable(why) => write!(f, "NCCL is not available for this group: {why}"),
            Reason::NcclAtFirstCall => f.write_str(
                "tpar's own NCCL communicator (nccl=own) is created at the first call planned for NCCL, which cannot be inside CUDA-graph capture: make one call of this size before capturing, or call ensure_nccl() first",
            ),
            Reason::NcclNotHeld => f.write_str(NCCL_NOT_HELD),
            Reason::FusedOnNccl => f.write_str("the allreduce goes to NCCL"),
            Reason::NoFusedKernel if self.choice == Choice::Tpar(Algorithm::OneShotPull) => {
                f.write_str(
                    "no fused pull kernel: one that gave each row a block (93012b5) was slower than the pull and \
                     this kernel at 1 and 32 tokens on one H200 (bench/README.md, \"Fourth session\")",
                )
            }
            Reason::NoFusedKernel => write!(f, "{} has no fused kernel", self.choice),
            Reason::HiddenTooLarge { hidden } => write!(
                f,
                "hidden {hidden} is above the fused kernel's {}",
                norm::MAX_HIDDEN
            ),
            Reason::OddPayloadLines => {
                f.write_str("the inbox slots are not 16-byte aligned (odd payload lines)")
            }
            Reason::RowTooLong {
                hidden,
                dtype,
                payload_lines,
            } => write!(
                f,
                "one row of {hidden} {dtype} does not fit a chunk of {payload_lines} lines"
            ),
        }
    }
}

impl std::error::Error for Refusal {}

impl From<Refusal> for Error {
    fn from(r: Refusal) -> Error {
        Error::Refused {
            choice: Some(r.choice.name()),
            reason: r.reason.code(),
            message: r.to_string(),
        }
    }
}

/// Why a request got no decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoDecision {
    /// The choice the caller forced cannot run here.
    Forced(Refusal),
    /// The dispatcher chose `decision`, which this group does not hold (NCCL on a communicator
    /// created with `nccl="none"`): the caller keeps such calls on its own path.
    NotHeld {
        decision: Decision,
        refusal: Refusal,
    },
    /// No choice can run the request: every candidate's refusal, in the order tried.
    Nothing(Vec<Refusal>),
}

impl NoDecision {
    /// The choice the request needed, where there was one.
    pub fn choice(&self) -> Option<Choice> {
        match self {
            NoDecision::Forced(r) | NoDecision::NotHeld { refusal: r, .. } => Some(r.choice),
            NoDecision::Nothing(_) => None,
        }
    }

    /// The code of the refusal (`nothing-runs` when every candidate was refused).
    pub fn code(&self) -> &'static str {
        match self {
            NoDecision::Forced(r) | NoDecision::NotHeld { refusal: r, .. } => r.reason.code(),
            NoDecision::Nothing(_) => "nothing-runs",
        }
    }
}

impl fmt::Display for NoDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NoDecision::Forced(r) => {
                write!(f, "the forced algorithm {} cannot run here: {r}", r.choice)
            }
            NoDecision::NotHeld { decision, refusal } => write!(
                f,
                "this call is planned for {} ({}); {refusal}",
                decision.choice, decision.reason
            ),
            NoDecision::Nothing(refusals) if refusals.is_empty() => write!(
                f,
                "no algorithm can run this allreduce: none of tpar's is a candidate for this group"
            ),
            NoDecision::Nothing(refusals) => {
                let skipped: Vec<(String, String)> = refusals
                    .iter()
                    .map(|r| (r.choice.to_string(), r.to_string()))
                    .collect();
                write!(
                    f,
                    "no algorithm can run this allreduce: {}",
                    super::join_skipped(&skipped)
                )
            }
        }
    }
}

impl std::error::Error for NoDecision {}

impl From<NoDecision> for Error {
    fn from(n: NoDecision) -> Error {
        Error::Refused {
            choice: n.choice().map(Choice::name),
            reason: n.code(),
            message: n.to_string(),
        }
    }
}

/// The first GPU of the group (ranks index the topology's GPUs) older than tpar's kernels
/// need, with its compute capability; capabilities the topology does not give pass.
pub(super) fn old_gpu(req: &Request) -> Option<(usize, String)> {
    req.topology
        .gpus
        .iter()
        .take(req.world_size)
        .enumerate()
        .find(|(_, g)| g.too_old_for_tpar())
        .map(|(i, g)| (i, g.compute_capability.clone().unwrap_or_default()))
}

/// Whether `choice` can run the request on this machine (and, where the request names one,
/// in its group), and if not, why. Whether the group holds the choice (NCCL with
/// `nccl="none"`) is [`held`], asked of the choice the dispatcher makes.
pub fn eligibility(req: &Request, choice: Choice) -> Result<(), Refusal> {
    let refuse = |reason| Err(Refusal::new(choice, reason));
    if req.world_size == 0 {
        return refuse(Reason::NoRanks);
    }
    if req.topology.gpus.is_empty() {
        return refuse(Reason::NoGpu);
    }
    if req.bytes % req.dtype.size() as u64 != 0 {
        return refuse(Reason::PartialElement {
            bytes: req.bytes,
            dtype: req.dtype,
        });
    }
    if let Some((_, why)) = req
        .findings
        .and_then(|f| f.failed.iter().find(|(c, _)| *c == choice))
    {
        return refuse(Reason::FailedCheck(why.clone()));
    }
    if let Some(group) = req.group {
        group_eligibility(group, choice, req.capturing)?;
    }
    if let (Choice::Tpar(_), Some((gpu, capability))) = (choice, old_gpu(req)) {
        return refuse(Reason::OldGpu { gpu, capability });
    }
    match choice {
        Choice::Nccl => {
            if req.topology.nccl_version.is_none() {
                return refuse(Reason::NcclMissing);
            }
            if req.world_size > req.topology.gpus.len() {
                return refuse(Reason::NcclNeedsGpuPerRank {
                    ranks: req.world_size,
                    gpus: req.topology.gpus.len(),
                });
            }
            Ok(())
        }
        Choice::Tpar(_) if req.world_size > MAX_RANKS => refuse(Reason::TooManyRanks {
            ranks: req.world_size,
        }),
        Choice::Tpar(Algorithm::HostStaged) => Ok(()),
        Choice::Tpar(algorithm) => {
            let reads = matches!(
                algorithm,
                Algorithm::OneShotPull | Algorithm::StagedPull | Algorithm::IslandsPull
            );
            for (a, b) in pairs_used(req, algorithm) {
                let link = req.topology.link(a, b);
                let ok = link.is_some_and(|l| if reads { l.p2p_read } else { l.p2p_write });
                if !ok {
                    return refuse(Reason::NoPeerAccess {
                        a,
                        b,
                        path: link.map(|l| l.path),
                        reads,
                    });
                }
            }
            Ok(())
        }
    }
}

/// The pairs of distinct GPUs whose peer access `algorithm` needs for the request's ranks (as
/// placed round-robin): every pair, but for the ring (neighbours only) and the islands
/// algorithms' push form (pairs inside an island: between islands it goes through host memory
/// where there is no peer access).
fn pairs_used(req: &Request, algorithm: Algorithm) -> Vec<(usize, usize)> {
    let n = req.world_size;
    let placement = req.topology.placement(n);
    let mut pairs: Vec<(usize, usize)> = match algorithm {
        Algorithm::Ring => (0..n)
            .map(|r| (placement[r], placement[(r + 1) % n]))
            .collect(),
        Algorithm::Islands => {
            let islands = req
                .topology
                .islands(n)
                .unwrap_or_else(|| crate::islands::Islands::single(n.clamp(1, MAX_RANKS)));
            (0..n)
                .flat_map(|a| (0..n).map(move |b| (a, b)))
                .filter(|&(a, b)| {
                    a < islands.world_size()
                        && b < islands.world_size()
                        && islands.island_of(a) == islands.island_of(b)
                })
                .map(|(a, b)| (placement[a], placement[b]))
                .collect()
        }
        _ => return distinct_pairs(req.topology, n),
    };
    pairs = pairs
        .into_iter()
        .filter(|(a, b)| a != b)
        .map(|(a, b)| (a.min(b), a.max(b)))
        .collect();
    pairs.sort_unstable();
    pairs.dedup();
    pairs
}

/// What the group's own build rules out for `choice`: a kernel it lacks, inboxes it did not
/// build, peers it could not map, an NCCL it has not (or not yet, inside capture).
fn group_eligibility(group: &GroupFacts, choice: Choice, capturing: bool) -> Result<(), Refusal> {
    let refuse = |reason| Err(Refusal::new(choice, reason));
    match choice {
        Choice::Nccl => match &group.nccl {
            NcclAvailability::Unavailable(why) => refuse(Reason::NcclUnavailable(why.clone())),
            NcclAvailability::AtFirstCall if capturing => refuse(Reason::NcclAtFirstCall),
            _ => Ok(()),
        },
        Choice::Tpar(a) if !group.kernels.contains(&a) => refuse(Reason::NoKernel),
        Choice::Tpar(Algorithm::HostStaged) if !group.host_staged => refuse(Reason::HostStagedOff),
        Choice::Tpar(Algorithm::HostStaged) => Ok(()),
        // The islands need peer access inside each island only; between islands they go
        // through the host-staged inboxes where there is none (the group found which).
        Choice::Tpar(Algorithm::Islands) => match &group.islands {
            Err(why) => refuse(Reason::GroupPeerAccess(why.clone())),
            Ok(_) => Ok(()),
        },
        // Its pull form reads the other islands' memory.
        Choice::Tpar(Algorithm::IslandsPull) => match (&group.islands, &group.peer_access) {
            (Err(why), _) | (_, Err(why)) => refuse(Reason::GroupPeerAccess(why.clone())),
            (Ok(true), _) => refuse(Reason::GroupPeerAccess(
                "the islands exchange through host memory here, which islands-pull cannot read"
                    .into(),
            )),
            (Ok(false), Ok(())) => Ok(()),
        },
        Choice::Tpar(_) => match &group.peer_access {
            Err(why) => refuse(Reason::GroupPeerAccess(why.clone())),
            Ok(()) => Ok(()),
        },
    }
}

/// Whether the request's group holds `choice` (the dispatcher's, or the forced one): a
/// communicator created with `nccl="none"` leaves calls planned for NCCL to its caller.
pub fn held(req: &Request, choice: Choice) -> Result<(), Refusal> {
    match req.group.map(|g| &g.nccl) {
        Some(NcclAvailability::NotHeld) if choice == Choice::Nccl => {
            Err(Refusal::new(choice, Reason::NcclNotHeld))
        }
        _ => Ok(()),
    }
}

/// Whether a fused call whose allreduce runs on `choice` can run as one fused kernel on a group
/// whose inbox chunks hold `payload_lines` lines, for rows of `hidden` elements of `dtype`;
/// where it cannot, the call runs the allreduce and tpar's separate norm kernel, with the same
/// results.
pub fn fused_eligibility(
    choice: Choice,
    dtype: DType,
    hidden: usize,
    payload_lines: usize,
) -> Result<(), Refusal> {
    let refuse = |reason| Err(Refusal::new(choice, reason));
    let Choice::Tpar(algorithm) = choice else {
        return refuse(Reason::FusedOnNccl);
    };
    if hidden > norm::MAX_HIDDEN {
        return refuse(Reason::HiddenTooLarge { hidden });
    }
    if payload_lines % 2 != 0 {
        return refuse(Reason::OddPayloadLines);
    }
    if norm::rows_per_chunk(dtype, hidden, payload_lines) == 0 {
        return refuse(Reason::RowTooLong {
            hidden,
            dtype,
            payload_lines,
        });
    }
    if !norm::has_fused_kernel(algorithm) {
        return refuse(Reason::NoFusedKernel);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::decide;
    use crate::dispatch::tests::{fixture, request};

    #[test]
    fn refusals_carry_the_choice_and_a_typed_reason_and_read_as_before() {
        let rtx = fixture("4x-rtx-4090-no-p2p");
        let one_shot = Choice::Tpar(Algorithm::OneShot);
        let r = eligibility(&request(&rtx, 4, 4096), one_shot).unwrap_err();
        assert_eq!(r.choice, one_shot);
        assert!(
            matches!(
                r.reason,
                Reason::NoPeerAccess {
                    a: 0,
                    b: 1,
                    reads: false,
                    path: Some(_)
                }
            ),
            "{r:?}"
        );
        assert!(
            r.to_string().starts_with("GPUs 0 and 1 (")
                && r.to_string().ends_with(") have no peer-to-peer writes"),
            "{r}"
        );
        let pull = eligibility(
            &request(&rtx, 4, 4096),
            Choice::Tpar(Algorithm::OneShotPull),
        );
        assert!(pull.unwrap_err().to_string().ends_with("reads"));
        assert!(eligibility(&request(&rtx, 4, 4096), Choice::Tpar(Algorithm::HostStaged)).is_ok());

        let h200 = fixture("8x-h200-nvswitch");
        let r = eligibility(&request(&h200, 12, 4096), Choice::Nccl).unwrap_err();
        assert_eq!(r.reason, Reason::NcclNeedsGpuPerRank { ranks: 12, gpus: 8 });
        assert_eq!(
            r.to_string(),
            "NCCL needs one GPU per rank: 12 ranks on 8 GPU(s)"
        );
        let r = eligibility(&request(&h200, 8, 3), one_shot).unwrap_err();
        assert_eq!(
            r.to_string(),
            "3 bytes is not a whole number of bf16 elements"
        );
        let r = eligibility(&request(&h200, 17, 4096), one_shot).unwrap_err();
        assert_eq!(r.reason, Reason::TooManyRanks { ranks: 17 });
        // GPUs older than the kernels: every tpar algorithm refused (host-staged too), NCCL not.
        let v100 = fixture("4x-v100-1plx");
        for algorithm in Algorithm::ALL {
            let r = eligibility(&request(&v100, 4, 4096), Choice::Tpar(algorithm)).unwrap_err();
            assert_eq!(
                r.reason,
                Reason::OldGpu {
                    gpu: 0,
                    capability: "7.0".into()
                },
                "{algorithm}"
            );
        }
        assert!(eligibility(&request(&v100, 4, 4096), Choice::Nccl).is_ok());
        let d = super::super::decide(&request(&v100, 4, 4096)).unwrap();
        assert_eq!(d.choice, Choice::Nccl);
        // The one reason is said once, after every algorithm it skipped.
        let why = "skipped: GPU 0 has compute capability 7.0; tpar's kernels need 8.0";
        assert_eq!(d.reason.matches(why).count(), 1, "{}", d.reason);
        let named = d.reason.split(why).next().unwrap();
        for algorithm in ["one-shot, ", "two-shot", "ring", "islands"] {
            assert!(named.contains(algorithm), "{}", d.reason);
        }
        let findings = crate::topology::Findings {
            failed: vec![(one_shot, "element 7 was 1".into())],
            ..Default::default()
        };
        let req = Request {
            findings: Some(&findings),
            ..request(&h200, 8, 4096)
        };
        let r = eligibility(&req, one_shot).unwrap_err();
        assert_eq!(r.to_string(), "one-shot cannot run here: element 7 was 1");
        assert_eq!(
            Error::from(r).to_string(),
            format!(
                "{}",
                Error::Unsupported("one-shot cannot run here: element 7 was 1".into())
            )
        );
    }

    fn facts(nccl: NcclAvailability) -> GroupFacts {
        GroupFacts {
            kernels: vec![
                Algorithm::OneShot,
                Algorithm::TwoShot,
                Algorithm::OneShotPull,
                Algorithm::HostStaged,
            ],
            host_staged: true,
            peer_access: Ok(()),
            islands: Ok(false),
            payload_lines: 4096,
            nccl,
        }
    }

    #[test]
    fn what_the_group_was_built_with_is_an_input_of_eligibility() {
        let h200 = fixture("8x-h200-nvswitch");
        let one_shot = Choice::Tpar(Algorithm::OneShot);
        let staged = Choice::Tpar(Algorithm::HostStaged);
        let mut group = facts(NcclAvailability::Ready);
        let with = |g: &GroupFacts, capturing: bool, choice: Choice| {
            let req = Request {
                group: Some(g),
                capturing,
                ..request(&h200, 8, 4096)
            };
            eligibility(&req, choice)
        };
        assert_eq!(with(&group, false, one_shot), Ok(()));
        assert_eq!(with(&group, false, Choice::Nccl), Ok(()));
        assert_eq!(
            with(&group, false, Choice::Tpar(Algorithm::Ring))
                .unwrap_err()
                .reason,
            Reason::NoKernel
        );
        group.peer_access = Err("cuIpcOpenMemHandle failed for rank 3".into());
        let r = with(&group, false, one_shot).unwrap_err();
        assert_eq!(r.reason.code(), "group-peer-access");
        assert!(r.to_string().contains("rank 3"), "{r}");
        assert_eq!(
            with(&group, false, staged),
            Ok(()),
            "host-staged needs no peer access"
        );
        group.host_staged = false;
        assert_eq!(
            with(&group, false, staged).unwrap_err().reason,
            Reason::HostStagedOff
        );
        // With neither, the dispatcher falls back to NCCL and says why.
        let req = Request {
            group: Some(&group),
            ..request(&h200, 8, 4096)
        };
        let d = decide(&req).unwrap();
        assert_eq!(d.choice, Choice::Nccl);
        assert!(d.reason.contains("rank 3"), "{}", d.reason);

        let lazy = facts(NcclAvailability::AtFirstCall);
        assert_eq!(with(&lazy, false, Choice::Nccl), Ok(()));
        assert_eq!(
            with(&lazy, true, Choice::Nccl).unwrap_err().reason,
            Reason::NcclAtFirstCall
        );
        let none = facts(NcclAvailability::Unavailable("no libnccl.so.2".into()));
        let r = with(&none, false, Choice::Nccl).unwrap_err();
        assert!(r.to_string().contains("no libnccl.so.2"), "{r}");
    }

    #[test]
    fn a_call_planned_for_nccl_that_the_group_does_not_hold_is_a_typed_refusal() {
        let h200 = fixture("8x-h200-nvswitch");
        let group = facts(NcclAvailability::NotHeld);
        let req = Request {
            group: Some(&group),
            ..request(&h200, 8, 64 << 20)
        };
        let refused = decide(&req).unwrap_err();
        match &refused {
            NoDecision::NotHeld { decision, refusal } => {
                assert_eq!(decision.choice, Choice::Nccl);
                assert_eq!(refusal.reason, Reason::NcclNotHeld);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(
            (refused.choice(), refused.code()),
            (Some(Choice::Nccl), "nccl-not-held")
        );
        let text = refused.to_string();
        assert!(
            text.starts_with("this call is planned for nccl (") && text.contains("nccl=none"),
            "{text}"
        );
        match Error::from(refused) {
            Error::Refused {
                choice: Some("nccl"),
                reason: "nccl-not-held",
                message,
            } => assert_eq!(message, text),
            other => panic!("unexpected {other:?}"),
        }
        // Small sizes run on tpar's kernels as before; forcing NCCL is refused the same way.
        assert_eq!(
            decide(&Request { bytes: 4096, ..req }).unwrap().choice,
            Choice::Tpar(Algorithm::OneShot)
        );
        let forced = decide(&Request {
            forced: Some(Choice::Nccl),
            ..req
        })
        .unwrap_err();
        assert_eq!(forced.code(), "nccl-not-held");
        assert!(matches!(forced, NoDecision::Forced(_)), "{forced:?}");
    }

    #[test]
    fn the_fused_path_is_refused_with_a_typed_reason() {
        let one_shot = Choice::Tpar(Algorithm::OneShot);
        let reason = |choice, hidden, lines| {
            fused_eligibility(choice, DType::Bf16, hidden, lines).map_err(|r| r.reason)
        };
        assert_eq!(reason(one_shot, 4096, 4096), Ok(()));
        assert_eq!(reason(Choice::Nccl, 4096, 4096), Err(Reason::FusedOnNccl));
        assert_eq!(
            reason(one_shot, 20000, 4096),
            Err(Reason::HiddenTooLarge { hidden: 20000 })
        );
        assert_eq!(reason(one_shot, 4096, 4095), Err(Reason::OddPayloadLines));
        assert_eq!(
            reason(one_shot, 8192, 64),
            Err(Reason::RowTooLong {
                hidden: 8192,
                dtype: DType::Bf16,
                payload_lines: 64
            })
        );
        let pull = Choice::Tpar(Algorithm::OneShotPull);
        assert_eq!(reason(pull, 4096, 4096), Err(Reason::NoFusedKernel));
        let d = crate::dispatch::decide_fused(
            pull,
            DType::Bf16,
            4096,
            4096,
            crate::norm::Prefer::Fused,
        );
        assert!(
            !d.fused && d.reason.contains("no fused pull kernel"),
            "{d:?}"
        );
        let d = crate::dispatch::decide_fused(
            one_shot,
            DType::Bf16,
            4096,
            4096,
            crate::norm::Prefer::Fused,
        );
        assert!(
            d.fused && d.reason.starts_with("fused one-shot kernel"),
            "{d:?}"
        );
    }

    /// Moved from norm.rs with the fused path's eligibility: every allreduce choice, dtype and
    /// row length gets a path and a reason; the fused kernels take exactly one-shot, two-shot
    /// and host-staged up to the longest row they are built for.
    #[test]
    fn every_shape_has_a_fused_path_and_says_why() {
        use crate::dispatch::decide_fused;
        for choice in Choice::ALL {
            for dtype in DType::ALL {
                for hidden in [1, 7, 2048, 4096, 5120, 7168, 8192, 16383, 16384, 20000] {
                    let p = decide_fused(choice, dtype, hidden, 65536, crate::norm::Prefer::Fused);
                    assert!(!p.reason.is_empty());
                    let expect_fused = choice.algorithm().is_some_and(norm::has_fused_kernel)
                        && hidden <= norm::MAX_HIDDEN;
                    assert_eq!(p.fused, expect_fused, "{choice} {dtype} {hidden}: {p:?}");
                }
            }
        }
        let odd = decide_fused(
            Choice::Tpar(Algorithm::OneShot),
            DType::Bf16,
            8192,
            65535,
            crate::norm::Prefer::Fused,
        );
        assert!(!odd.fused && odd.reason.contains("aligned"), "{odd:?}");
        let two_shot = decide_fused(
            Choice::Tpar(Algorithm::TwoShot),
            DType::Bf16,
            8192,
            65536,
            crate::norm::Prefer::Fused,
        );
        assert_eq!(two_shot.reason, "fused two-shot kernel: 16 rows per launch");
        let nccl = decide_fused(
            Choice::Nccl,
            DType::Bf16,
            8192,
            65536,
            crate::norm::Prefer::Fused,
        );
        assert!(!nccl.fused && nccl.reason.contains("NCCL"), "{nccl:?}");
    }
}
