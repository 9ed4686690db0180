//! The dispatcher: which algorithm runs an allreduce of so many bytes on this machine, and why;
//! or an error that says why nothing can. It is a total function (every request yields a plan
//! whose algorithm can run there, or an explicit error), checked by enumeration in its tests.
//!
//! Order of authority: a forced choice (`TPAR_ALGO`, `--algo`; one that cannot run is an error,
//! never a substitute), then the tuning table measured on this machine by `tpar tune`, then
//! built-in rules per topology class. The findings (`Findings`) can veto a path that failed a check.
//! Every decision is logged with its reason at debug level (`RUST_LOG=tpar=debug`).
//!
//! Whether a choice can run is decided here only ([`eligibility`]): from the machine
//! (`Topology`, `Findings`) and, for a call of a communicator, from what its group was built
//! with ([`GroupFacts`]: the backend's kernels, host-staged inboxes, measured peer access, the
//! state of its NCCL). A request that gets no choice gets a typed [`NoDecision`]. The fused
//! op's path is decided here too ([`decide_fused`]).
//!
//! Pure policy: no backend, no NCCL, no files except the tuning table's. One concern per file:
//! [`refusal`] (whether a choice can run a request, as a typed [`Refusal`]), [`rules`] (the
//! machine's class and the built-in ladder per class), [`tuning`] (the measured table and where
//! it is kept), [`explain`] (the words of a decision); this file puts them in their order.

pub mod explain;
pub mod refusal;
pub mod rules;
pub mod tuning;

use serde::Serialize;

use crate::algorithm::Algorithm;
pub use crate::algorithm::Choice;
use crate::dtype::DType;
use crate::memory::human_bytes;
use crate::norm::FusedDecision;
pub use crate::topology::Findings;
use crate::topology::Topology;
pub use explain::describe_ranges;
use explain::{describe_machine, rung_text};
pub use refusal::{eligibility, fused_eligibility, held, NoDecision, Reason, Refusal};
pub use rules::{classify, Class};
use rules::{ladder, Rung, NCCL_WHY};
pub use tuning::{TuningEntry, TuningTable};

/// One allreduce to plan.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    pub topology: &'a Topology,
    /// What checks and measurements found on this machine (paths that failed a check, link
    /// bandwidths), if anything was looked for.
    pub findings: Option<&'a Findings>,
    pub tuning: Option<&'a TuningTable>,
    pub world_size: usize,
    pub dtype: DType,
    pub bytes: u64,
    /// Inside CUDA-graph capture (tpar's own NCCL cannot be created there).
    pub capturing: bool,
    pub forced: Option<Choice>,
    /// What the group of the communicator making the call was built with; None for a
    /// question about the machine alone (`tpar doctor`, the planner).
    pub group: Option<&'a GroupFacts>,
}

/// What one communicator's group was built with, found when it was created: inputs of the
/// eligibility of each choice beside the machine's topology and findings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupFacts {
    /// The tpar algorithms the group's backend has kernels for.
    pub kernels: Vec<Algorithm>,
    /// Whether host-staged inboxes (pinned host memory mapped into every GPU) were built.
    pub host_staged: bool,
    /// Whether every peer's device memory was mapped into this rank's GPU when the group was
    /// built, or why not (then only host-staged and NCCL run).
    pub peer_access: std::result::Result<(), String>,
    /// Lines of one inbox chunk (what the fused kernels' rows must fit).
    pub payload_lines: usize,
    /// Where the group's NCCL stands.
    pub nccl: NcclAvailability,
}

/// Where a communicator's NCCL stands, as the dispatcher needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NcclAvailability {
    /// Created, or borrowed from the caller.
    Ready,
    /// tpar's own, created at the first call planned for NCCL (collective; never inside
    /// CUDA-graph capture).
    AtFirstCall,
    /// Created with `nccl="none"`: calls planned for NCCL are refused, so that the caller
    /// keeps them on its own NCCL ([`held`]).
    NotHeld,
    /// This group has no NCCL, and why (no library, ranks sharing a GPU, a failed creation).
    Unavailable(String),
}

/// The dispatcher's answer for one call: what runs it, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Decision {
    pub choice: Choice,
    pub reason: String,
}

/// Decides one allreduce. Never returns a choice that cannot run or that the request's group
/// does not hold; every refusal says why, typed.
pub fn decide(req: &Request) -> Result<Decision, NoDecision> {
    let result = decide_inner(req);
    match &result {
        Ok(p) => log::debug!(
            "plan: {} ranks, {} of {}: {} because {}",
            req.world_size,
            human_bytes(req.bytes),
            req.dtype,
            p.choice,
            p.reason
        ),
        Err(e) => log::debug!(
            "plan: {} ranks, {}: no plan: {e}",
            req.world_size,
            human_bytes(req.bytes)
        ),
    }
    result
}

fn decide_inner(req: &Request) -> Result<Decision, NoDecision> {
    if let Some(forced) = req.forced {
        return match eligibility(req, forced).and_then(|()| held(req, forced)) {
            Ok(()) => Ok(Decision {
                choice: forced,
                reason: "forced (TPAR_ALGO or --algo)".into(),
            }),
            Err(refusal) => Err(NoDecision::Forced(refusal)),
        };
    }
    let decision = choose(req)?;
    match held(req, decision.choice) {
        Ok(()) => Ok(decision),
        Err(refusal) => Err(NoDecision::NotHeld { decision, refusal }),
    }
}

/// The dispatcher's choice for a request that forces none: the tuning table's where it can
/// run, else the built-in rules' (falling back rung by rung, each skip in the reason).
fn choose(req: &Request) -> Result<Decision, NoDecision> {
    if req.world_size == 1 {
        let choice = Choice::Tpar(Algorithm::OneShot);
        eligibility(req, choice).map_err(|r| NoDecision::Nothing(vec![r]))?;
        return Ok(Decision {
            choice,
            reason: "one rank: the allreduce is a copy".into(),
        });
    }
    let mut refusals: Vec<Refusal> = Vec::new();
    let mut skipped: Vec<String> = Vec::new();
    if let Some(table) = req
        .tuning
        .filter(|t| t.world_size == req.world_size && t.dtype == req.dtype)
    {
        if let Some(entry) = table.entries.iter().find(|e| req.bytes <= e.max_bytes) {
            match eligibility(req, entry.choice) {
                Ok(()) => {
                    return Ok(Decision {
                        choice: entry.choice,
                        reason: if entry.max_bytes == u64::MAX {
                            format!(
                                "fastest for the largest sizes in the tuning table measured on this machine ({:.1} us at the largest measured)",
                                entry.p50_us
                            )
                        } else {
                            format!(
                                "fastest up to {} in the tuning table measured on this machine ({:.1} us there)",
                                human_bytes(entry.max_bytes),
                                entry.p50_us
                            )
                        },
                    })
                }
                Err(why) => {
                    skipped.push(format!("tuned {} skipped: {why}", entry.choice));
                    refusals.push(why);
                }
            }
        }
    }
    let class = classify(req.topology, req.world_size);
    let rungs = ladder(class, req.world_size, req.findings);
    let first = rungs
        .iter()
        .position(|r| req.bytes <= r.max_bytes)
        .unwrap_or(rungs.len() - 1);
    // The rung for this size, then the rungs for larger sizes, then smaller ones, then the
    // paths every machine has.
    let fallback = [
        Rung {
            max_bytes: u64::MAX,
            choice: Choice::Tpar(Algorithm::HostStaged),
            why: "host-staged needs no P2P and runs on every machine",
        },
        Rung {
            max_bytes: u64::MAX,
            choice: Choice::Nccl,
            why: NCCL_WHY,
        },
    ];
    let order = rungs[first..]
        .iter()
        .chain(rungs[..first].iter().rev())
        .chain(fallback.iter());
    for rung in order {
        match eligibility(req, rung.choice) {
            Ok(()) => {
                let mut reason = format!(
                    "{}: {} [{}; rules: {}]",
                    rung.choice,
                    rung.why,
                    describe_machine(req.topology, req.world_size, class),
                    rung_text(&rungs)
                );
                if !skipped.is_empty() {
                    reason = format!("{}; so {reason}", skipped.join("; "));
                }
                return Ok(Decision {
                    choice: rung.choice,
                    reason,
                });
            }
            Err(why) => {
                let line = format!("{} skipped: {why}", rung.choice);
                if !skipped.contains(&line) {
                    skipped.push(line);
                    refusals.push(why);
                }
            }
        }
    }
    Err(NoDecision::Nothing(refusals))
}

/// The path of a fused call whose allreduce the dispatcher gave to `choice`, in a group whose
/// inbox chunks hold `payload_lines` lines: the fused kernel where [`fused_eligibility`]
/// allows, else the allreduce followed by tpar's separate residual + RMSNorm kernel (the same
/// results to the bit), with the refusal as the reason.
pub fn decide_fused(
    choice: Choice,
    dtype: DType,
    hidden: usize,
    payload_lines: usize,
) -> FusedDecision {
    match fused_eligibility(choice, dtype, hidden, payload_lines) {
        Ok(()) => FusedDecision {
            fused: true,
            reason: format!(
                "fused {choice} kernel: {} rows per launch",
                crate::norm::rows_per_chunk(dtype, hidden, payload_lines)
            ),
        },
        Err(refusal) => FusedDecision {
            fused: false,
            reason: format!("allreduce + separate residual/RMSNorm kernel: {refusal}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::rules::{KIB, MIB};
    use super::*;
    use crate::topology::FIXTURES;

    // The fixtures of every test in dispatch/ (refusal.rs's too).

    /// The topology fixture called `name`.
    pub(super) fn fixture(name: &str) -> Topology {
        Topology::from_json(FIXTURES.iter().find(|f| f.0 == name).unwrap().1).unwrap()
    }

    /// A plain bf16 request of `bytes` by `world_size` ranks on `t`: nothing forced, measured
    /// or captured.
    pub(super) fn request(t: &Topology, world_size: usize, bytes: u64) -> Request<'_> {
        Request {
            topology: t,
            findings: None,
            tuning: None,
            world_size,
            dtype: DType::Bf16,
            bytes,
            capturing: false,
            forced: None,
            group: None,
        }
    }

    /// Every fixture (with and without NCCL, and as one GPU), world sizes 1 to 16, every dtype,
    /// sizes 0 to 1 GiB (and a size that is no whole element), every forced choice, capturing
    /// or not: each request yields a plan whose choice can run, or an error with a reason.
    #[test]
    fn the_dispatcher_is_total() {
        let mut topologies: Vec<Topology> = FIXTURES
            .iter()
            .map(|(_, t)| Topology::from_json(t).unwrap())
            .collect();
        for t in topologies.clone() {
            topologies.push(Topology {
                nccl_version: None,
                ..t.clone()
            });
            topologies.push(Topology {
                gpus: t.gpus[..1].to_vec(),
                links: Vec::new(),
                ..t
            });
        }
        let sizes = [
            0,
            3,
            2,
            4 * KIB,
            42 * KIB,
            64 * KIB,
            256 * KIB,
            MIB,
            16 * MIB,
            256 * MIB,
            1024 * MIB,
        ];
        let forced: Vec<Option<Choice>> =
            std::iter::once(None).chain(Choice::ALL.map(Some)).collect();
        let findings = Findings {
            failed: vec![(
                Choice::Tpar(Algorithm::TwoShot),
                "numerical self-test failed".into(),
            )],
            push_gbps: Some(3.0),
            pull_gbps: Some(50.0),
        };
        let (mut plans, mut errors) = (0, 0);
        for t in &topologies {
            for world_size in 1..=16 {
                for dtype in DType::ALL {
                    for &bytes in &sizes {
                        for &force in &forced {
                            for capturing in [false, true] {
                                for f in [None, Some(&findings)] {
                                    let req = Request {
                                        topology: t,
                                        findings: f,
                                        tuning: None,
                                        world_size,
                                        dtype,
                                        bytes,
                                        capturing,
                                        forced: force,
                                        group: None,
                                    };
                                    match decide(&req) {
                                        Ok(plan) => {
                                            plans += 1;
                                            assert_eq!(
                                                eligibility(&req, plan.choice),
                                                Ok(()),
                                                "{req:?} -> {plan:?}"
                                            );
                                            assert!(!plan.reason.is_empty());
                                            if let Some(f) = force {
                                                assert_eq!(plan.choice, f);
                                            }
                                        }
                                        Err(e) => {
                                            errors += 1;
                                            assert!(e.to_string().len() > 20, "{e}");
                                            if force.is_none()
                                                && bytes % dtype.size() as u64 == 0
                                                && world_size <= 16
                                            {
                                                // Host-staged runs everywhere up to 16 ranks unless the findings veto it.
                                                panic!("no plan although host-staged can always run: {req:?}: {e}");
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(
            plans > 10_000 && errors > 1_000,
            "{plans} plans, {errors} errors"
        );
    }

    #[test]
    fn rules_pick_what_each_machine_can_do_best() {
        let h200 = fixture("8x-h200-nvswitch");
        assert_eq!(
            decide(&request(&h200, 8, 4 * KIB)).unwrap().choice,
            Choice::Tpar(Algorithm::OneShot)
        );
        assert_eq!(
            decide(&request(&h200, 8, 128 * KIB)).unwrap().choice,
            Choice::Tpar(Algorithm::TwoShot)
        );
        assert_eq!(
            decide(&request(&h200, 8, MIB)).unwrap().choice,
            Choice::Nccl
        );
        assert_eq!(
            decide(&request(&h200, 8, 256 * MIB)).unwrap().choice,
            Choice::Nccl
        );
        // Two ranks on NVLink: one-shot up to 256 KiB, then NCCL (measured on 2 H200s).
        assert_eq!(
            decide(&request(&h200, 2, 256 * KIB)).unwrap().choice,
            Choice::Tpar(Algorithm::OneShot)
        );
        assert_eq!(
            decide(&request(&h200, 2, MIB)).unwrap().choice,
            Choice::Nccl
        );
        let rtx = fixture("4x-rtx-4090-no-p2p");
        assert_eq!(
            decide(&request(&rtx, 4, 42 * KIB)).unwrap().choice,
            Choice::Tpar(Algorithm::HostStaged)
        );
        assert_eq!(
            decide(&request(&rtx, 4, 64 * MIB)).unwrap().choice,
            Choice::Nccl
        );
        // L40S: P2P only within a NUMA node. 4 ranks stay on node 0; 8 ranks cross.
        let l40s = fixture("8x-l40s-2numa");
        assert_eq!(
            decide(&request(&l40s, 4, 4 * KIB)).unwrap().choice,
            Choice::Tpar(Algorithm::OneShot)
        );
        assert_eq!(
            decide(&request(&l40s, 8, 4 * KIB)).unwrap().choice,
            Choice::Tpar(Algorithm::HostStaged)
        );
        // More ranks than GPUs: NCCL cannot, tpar can.
        let big = decide(&request(&h200, 12, 512 * MIB)).unwrap();
        assert_eq!(big.choice, Choice::Tpar(Algorithm::TwoShot), "{big:?}");
        assert!(
            big.reason.contains("NCCL needs one GPU per rank"),
            "{}",
            big.reason
        );
    }

    #[test]
    fn a_path_that_failed_its_check_is_never_planned_and_the_plan_says_so() {
        let h200 = fixture("8x-h200-nvswitch");
        let findings = Findings {
            failed: vec![(
                Choice::Tpar(Algorithm::OneShot),
                "the init self-test on rank 3, 4099 bf16 elements: element 7 was 1, expected 2"
                    .into(),
            )],
            ..Findings::default()
        };
        let req = Request {
            findings: Some(&findings),
            ..request(&h200, 8, 4 * KIB)
        };
        let p = decide(&req).unwrap();
        assert_ne!(p.choice, Choice::Tpar(Algorithm::OneShot));
        assert!(
            p.reason
                .contains("one-shot cannot run here: the init self-test on rank 3"),
            "{}",
            p.reason
        );
        // Forcing the failed path is an error naming the failure, never a silent substitute.
        let forced = Request {
            forced: Some(Choice::Tpar(Algorithm::OneShot)),
            ..req
        };
        let err = decide(&forced).unwrap_err().to_string();
        assert!(err.contains("element 7"), "{err}");
    }

    #[test]
    fn a_probe_that_saw_writes_collapse_turns_push_into_pull() {
        let pro = fixture("8x-rtx-pro-6000-pcie-2switch");
        let findings = Findings {
            push_gbps: Some(4.0),
            pull_gbps: Some(50.0),
            ..Findings::default()
        };
        let req = Request {
            findings: Some(&findings),
            ..request(&pro, 8, 16 * KIB)
        };
        assert_eq!(
            decide(&req).unwrap().choice,
            Choice::Tpar(Algorithm::OneShotPull)
        );
    }

    #[test]
    fn a_forced_choice_that_cannot_run_is_an_error_not_a_substitute() {
        let rtx = fixture("4x-rtx-4090-no-p2p");
        let req = Request {
            forced: Some(Choice::Tpar(Algorithm::OneShot)),
            ..request(&rtx, 4, 4 * KIB)
        };
        let err = decide(&req).unwrap_err().to_string();
        assert!(
            err.contains("forced algorithm one-shot cannot run")
                && err.contains("no peer-to-peer writes"),
            "{err}"
        );
    }

    #[test]
    fn the_tuning_table_wins_over_rules_when_it_can_run() {
        let h200 = fixture("8x-h200-nvswitch");
        let table = TuningTable {
            fingerprint: "x".into(),
            world_size: 8,
            dtype: DType::Bf16,
            entries: vec![TuningEntry {
                max_bytes: 8 * KIB,
                choice: Choice::Tpar(Algorithm::TwoShot),
                p50_us: 3.0,
            }],
        };
        let req = Request {
            tuning: Some(&table),
            ..request(&h200, 8, 4 * KIB)
        };
        let p = decide(&req).unwrap();
        assert_eq!(p.choice, Choice::Tpar(Algorithm::TwoShot));
        assert!(p.reason.contains("tuning table"));
        // Past the table's last entry the rules decide.
        let req = Request {
            tuning: Some(&table),
            ..request(&h200, 8, 16 * KIB)
        };
        assert_eq!(
            decide(&req).unwrap().choice,
            Choice::Tpar(Algorithm::OneShot)
        );
    }

    #[test]
    fn choices_parse_and_serialise_by_name() {
        for c in Choice::ALL {
            assert_eq!(c.name().parse::<Choice>().unwrap(), c);
            assert_eq!(
                serde_json::to_string(&c).unwrap(),
                format!("\"{}\"", c.name())
            );
        }
        assert!("rings".parse::<Choice>().is_err());
    }
}
