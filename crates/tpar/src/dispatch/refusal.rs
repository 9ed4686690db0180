//! Whether a choice can run a request on this machine, and if not, a typed [`Refusal`] that
//! says which choice and why. The reasons are values (tests and callers match on them); their
//! words come from `Display`, once, and are what users read in plans, `tpar doctor` and errors.

use std::fmt;

use super::rules::distinct_pairs;
use super::Request;
use crate::algorithm::{Algorithm, Choice, MAX_RANKS};
use crate::dtype::DType;
use crate::error::Error;
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
    /// A check on this machine or in this group found the path cannot run (the init
    /// self-test, no peer access between the group's GPUs, no host inboxes): its finding.
    FailedCheck(String),
    /// No NCCL library, or no NCCL communicator for these ranks.
    NcclMissing,
    /// NCCL runs one rank per GPU.
    NcclNeedsGpuPerRank { ranks: usize, gpus: usize },
    /// tpar's kernels address at most [`MAX_RANKS`] ranks.
    TooManyRanks { ranks: usize },
    /// Two GPUs of the group cannot reach each other the way the algorithm needs (`reads`:
    /// peer reads, else peer writes); `path` is how they are connected, where known.
    NoPeerAccess {
        a: usize,
        b: usize,
        path: Option<PathClass>,
        reads: bool,
    },
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
            Reason::NoPeerAccess { a, b, path, reads } => write!(
                f,
                "GPUs {a} and {b} ({}) have no peer-to-peer {}",
                path.map_or("?", PathClass::label),
                if *reads { "reads" } else { "writes" }
            ),
        }
    }
}

impl std::error::Error for Refusal {}

impl From<Refusal> for Error {
    fn from(r: Refusal) -> Error {
        Error::Unsupported(r.to_string())
    }
}

/// Whether `choice` can run the request on this machine, and if not, why.
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
            let reads = algorithm == Algorithm::OneShotPull;
            for (a, b) in distinct_pairs(req.topology, req.world_size) {
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

#[cfg(test)]
mod tests {
    use super::*;
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
}
