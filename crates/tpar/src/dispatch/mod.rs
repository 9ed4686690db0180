//! The dispatcher: which algorithm runs an allreduce of so many bytes on this machine, and why;
//! or an error that says why nothing can. It is a total function (every request yields a decision
//! whose choice can run there, or an explicit error), checked by enumeration in its tests.
//!
//! Order of authority: a forced choice (`TPAR_ALGO`, `--algo`; one that cannot run is an error,
//! never a substitute), then the tuning table measured on this machine by `tpar tune`, then
//! the fabric model's ranking ([`fabric`]: each algorithm's schedule costed on this machine's
//! links), corrected by what the first-use measurement timed here where it did. The model
//! chooses writes that collapse (fanned out over root complexes on a machine where that
//! collapses) only when nothing else can run, unless they were measured here. The findings
//! (`Findings`) veto paths that failed a check and carry what `tpar doctor` measured. Every
//! decision is logged with its reason at debug level (`RUST_LOG=tpar=debug`).
//!
//! Whether a choice can run is decided here only ([`eligibility`]): from the machine
//! (`Topology`, `Findings`) and, for a call of a communicator, from what its group was built
//! with ([`GroupFacts`]: the backend's kernels, host-staged inboxes, measured peer access, the
//! state of its NCCL). A request that gets no choice gets a typed [`NoDecision`]. The fused
//! op's path is decided here too ([`decide_fused`]).
//!
//! Pure policy: no backend, no NCCL, no files except the tuning table's. One concern per file:
//! [`refusal`] (whether a choice can run a request, as a typed [`Refusal`]), [`rules`] (the
//! machine's class), [`fabric`] (the model), [`tuning`] (the measured table and where it is
//! kept), [`explain`] (the words of a decision); this file puts them in their order.

pub mod explain;
pub mod fabric;
pub mod first_use;
pub mod refusal;
pub mod rules;
pub mod tuning;

use serde::Serialize;

use crate::algorithm::Algorithm;
pub use crate::algorithm::Choice;
use crate::dtype::DType;
use crate::memory::human_bytes;
use crate::norm::{FusedDecision, Prefer};
pub use crate::topology::Findings;
use crate::topology::Topology;
use explain::describe_machine;
pub use explain::describe_ranges;
use fabric::{Estimate, Fabric};
pub use refusal::{eligibility, fused_eligibility, held, NoDecision, Reason, Refusal};
pub use rules::{classify, Class};
pub use tuning::{Probe, TuningEntry, TuningTable};

/// One allreduce to decide.
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
    /// How the islands algorithms' exchange between islands travels in this group (`true`:
    /// through the host-staged inboxes), or why they cannot run here (no peer access inside an
    /// island, no host inboxes where they are needed).
    pub islands: std::result::Result<bool, String>,
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
    /// tpar's own, created at the first call decided for NCCL (collective; never inside
    /// CUDA-graph capture).
    AtFirstCall,
    /// Created with `nccl="none"`: calls decided for NCCL are refused, so that the caller
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
            "decision: {} ranks, {} of {}: {} because {}",
            req.world_size,
            human_bytes(req.bytes),
            req.dtype,
            p.choice,
            p.reason
        ),
        Err(e) => log::debug!(
            "decision: {} ranks, {}: no decision: {e}",
            req.world_size,
            human_bytes(req.bytes)
        ),
    }
    result
}

/// Why NCCL runs where the model cannot cost it.
const NCCL_WHY: &str = "NCCL's pipelined ring/tree runs large messages at link bandwidth";

/// How the first-use measurement moved a candidate's estimate.
#[derive(Clone, Debug, PartialEq)]
pub enum Measured {
    /// It timed this choice near this size: the estimate is scaled by the probe's measured
    /// over modelled time, or, between two probes, by that interpolated in log size
    /// ([`TuningTable::correction`]; the probes in size order).
    Timed(Vec<Probe>),
    /// It did not time this choice here but timed two or more others near this size: the
    /// estimate is scaled by the smallest of their measured over modelled times (what this
    /// machine adds to the model for every algorithm, at least), so that timing its rivals
    /// cannot by itself make an untimed choice win.
    Scaled(f64),
}

/// The fabric model's estimates for a request, fastest first, each corrected by the
/// first-use measurement where it measured near this size ([`Measured`]).
pub fn ranked(req: &Request) -> Vec<(Estimate, Option<Measured>)> {
    let fabric = Fabric::new(req.topology, req.world_size, req.findings);
    ranked_on(&fabric, req)
}

/// The first-use measurement's table for `req`: the tuning table of its world size and dtype,
/// where it holds probes.
fn first_use_probes<'a>(req: &Request<'a>) -> Option<&'a TuningTable> {
    req.tuning
        .filter(|t| t.world_size == req.world_size && t.dtype == req.dtype && !t.probes.is_empty())
}

fn ranked_on(fabric: &Fabric, req: &Request) -> Vec<(Estimate, Option<Measured>)> {
    let probes = first_use_probes(req);
    let estimates = fabric.rank(req.dtype, req.bytes);
    let timed: Vec<Option<(f64, Vec<Probe>)>> = estimates
        .iter()
        .map(|e| {
            let c = probes.and_then(|t| t.correction(e.choice, req.bytes));
            c.map(|c| (c.factor, c.probes.into_iter().cloned().collect()))
        })
        .collect();
    // One probe alone cannot tell what the machine adds to every algorithm from what it adds
    // to the one timed (a collapse): with two or more, the smallest factor is common to all.
    let factors: Vec<f64> = timed.iter().flatten().map(|(f, _)| *f).collect();
    let common = (factors.len() >= 2).then(|| factors.iter().copied().fold(f64::MAX, f64::min));
    let mut ranked: Vec<(Estimate, Option<Measured>)> = estimates
        .into_iter()
        .zip(timed)
        .map(|(mut e, timed)| {
            let measured = match (timed, common) {
                (Some((factor, probe)), _) => {
                    e.us *= factor;
                    Some(Measured::Timed(probe))
                }
                (None, Some(factor)) => {
                    e.us *= factor;
                    Some(Measured::Scaled(factor))
                }
                (None, None) => None,
            };
            (e, measured)
        })
        .collect();
    ranked.sort_by(|a, b| a.0.us.total_cmp(&b.0.us));
    ranked
}

/// What a [`Measured::Timed`] correction comes from, for a decision's reason: "one-shot
/// measured 4.7 us at 32 KiB, modelled 5.0", and between two probes "one-shot measured 4.7 /
/// 8.9 us at 32 / 64 KiB, modelled 5.0 / 6.5, interpolated".
fn timed_probes(probes: &[Probe]) -> String {
    let joined =
        |each: &dyn Fn(&Probe) -> String| probes.iter().map(each).collect::<Vec<_>>().join(" / ");
    let choice = probes
        .first()
        .map_or(String::new(), |p| p.choice.to_string());
    format!(
        "{choice} measured {} us at {}, modelled {}{}",
        joined(&|p| format!("{:.1}", p.measured_us)),
        joined(&|p| human_bytes(p.bytes)),
        joined(&|p| format!("{:.1}", p.modelled_us)),
        if probes.len() > 1 {
            ", interpolated"
        } else {
            ""
        }
    )
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

/// "A skipped: why; B, C skipped: why2": what was skipped for the same reason named together,
/// each reason once, in the order first met (on a machine tpar's kernels do not run on, every
/// algorithm is skipped for the one reason).
pub(crate) fn join_skipped(skipped: &[(String, String)]) -> String {
    let mut reasons: Vec<(&str, Vec<&str>)> = Vec::new();
    for (what, why) in skipped {
        match reasons.iter_mut().find(|(w, _)| w == why) {
            Some((_, whats)) => whats.push(what),
            None => reasons.push((why, vec![what])),
        }
    }
    reasons
        .iter()
        .map(|(why, whats)| format!("{} skipped: {why}", whats.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The dispatcher's choice for a request that forces none: the tuning table's where it can
/// run, else the fabric model's fastest that can (each skip in the reason), then what every
/// machine has.
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
    // (what was skipped, why), in the order the dispatcher met them.
    let mut skipped: Vec<(String, String)> = Vec::new();
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
                    skipped.push((format!("tuned {}", entry.choice), why.to_string()));
                    refusals.push(why);
                }
            }
        }
    }
    let fabric = Fabric::new(req.topology, req.world_size, req.findings);
    let ranked = ranked_on(&fabric, req);
    // Writes that collapse go last unless the first-use measurement timed them here; then
    // what the model cannot cost but every machine has.
    let (clean, collapsing): (Vec<_>, Vec<_>) = ranked
        .iter()
        .partition(|(e, measured)| !e.collapses || matches!(measured, Some(Measured::Timed(_))));
    let mut deferred: Option<&Estimate> = None;
    if let (Some((c, _)), best) = (collapsing.first(), clean.first()) {
        if best.is_none_or(|(b, _)| c.us < b.us) {
            deferred = Some(c);
        }
    }
    let fallback = [Choice::Tpar(Algorithm::HostStaged), Choice::Nccl];
    // What the model cannot cost here says why, where that is a refusal (NCCL with ranks
    // sharing a GPU).
    for choice in fallback {
        if !ranked.iter().any(|(e, _)| e.choice == choice) {
            if let Err(why) = eligibility(req, choice) {
                skipped.push((choice.to_string(), why.to_string()));
            }
        }
    }
    let order: Vec<_> = clean
        .iter()
        .map(|x| (x.0.choice, Some(*x)))
        .chain(collapsing.iter().map(|x| (x.0.choice, Some(*x))))
        .chain(
            fallback
                .into_iter()
                .filter(|c| !ranked.iter().any(|(e, _)| e.choice == *c))
                .map(|c| (c, None)),
        )
        .collect();
    for (at, &(choice, estimate)) in order.iter().enumerate() {
        match eligibility(req, choice) {
            Ok(()) => {
                let why = match estimate {
                    Some((e, measured)) => {
                        let mut why = match measured {
                            Some(Measured::Timed(probes)) => format!(
                                "fastest in the fabric model corrected by the first-use measurement on this machine: {:.1} us ({})",
                                e.us,
                                timed_probes(probes)
                            ),
                            Some(Measured::Scaled(factor)) => format!(
                                "fastest in the fabric model scaled by the first-use measurement on this machine: {:.1} us (not timed here; x{factor:.2}, the least that its rivals timed near this size measured over their model)",
                                e.us
                            ),
                            None if first_use_probes(req).is_some() => format!(
                                "fastest in the fabric model (the first-use measurement timed nothing near this size): {:.1} us modelled",
                                e.us
                            ),
                            None => format!(
                                "fastest in the fabric model (no tuning table on this machine): {:.1} us modelled",
                                e.us
                            ),
                        };
                        if e.collapses && !matches!(measured, Some(Measured::Timed(_))) {
                            why.push_str(&format!(
                                "; its writes fan out over root complexes, which collapse here, but nothing else can run ({})",
                                fabric.collapse().source
                            ));
                        }
                        // The runner-up is what would run in its place: the next in this
                        // order that can run here (a faster one that cannot is named above,
                        // as skipped, not as next).
                        let next = order[at + 1..]
                            .iter()
                            .filter(|(c, _)| eligibility(req, *c).is_ok())
                            .find_map(|(_, est)| *est);
                        if let Some((next, _)) = next {
                            why.push_str(&format!(
                                "; next in the model {} {:.1} us",
                                next.choice, next.us
                            ));
                        }
                        why
                    }
                    None if choice == Choice::Nccl => NCCL_WHY.to_owned(),
                    None => "host-staged needs no P2P and runs on every machine".to_owned(),
                };
                if let Some(d) = deferred.filter(|d| d.choice != choice) {
                    skipped.push((
                        format!("{} ({:.1} us modelled)", d.choice, d.us),
                        format!(
                            "its writes fan out over root complexes, which collapse here ({})",
                            fabric.collapse().source
                        ),
                    ));
                }
                let mut reason = format!(
                    "{choice}: {why} [{}]",
                    describe_machine(req.topology, req.world_size, &fabric)
                );
                if !skipped.is_empty() {
                    reason = format!("{}; so {reason}", join_skipped(&skipped));
                }
                return Ok(Decision { choice, reason });
            }
            Err(why) => {
                let line = (choice.to_string(), why.to_string());
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
/// allows and `prefer` picks it (both paths give the same bits: where both can run, only speed
/// decides, by `tpar tune`'s table or the built-in rule of [`crate::norm::faster_path`]), else
/// the allreduce followed by tpar's separate residual + RMSNorm kernel, with the reason.
pub fn decide_fused(
    choice: Choice,
    dtype: DType,
    hidden: usize,
    payload_lines: usize,
    prefer: Prefer,
) -> FusedDecision {
    let unfused = |why: String| FusedDecision {
        fused: false,
        reason: format!("allreduce + separate residual/RMSNorm kernel: {why}"),
    };
    if let Err(refusal) = fused_eligibility(choice, dtype, hidden, payload_lines) {
        return unfused(refusal.to_string());
    }
    let fused = FusedDecision {
        fused: true,
        reason: format!(
            "fused {choice} kernel: {} rows per launch",
            crate::norm::rows_per_chunk(dtype, hidden, payload_lines)
        ),
    };
    match (prefer, choice) {
        (
            Prefer::Faster {
                world_size,
                tokens,
                measured,
            },
            Choice::Tpar(algorithm),
        ) => match crate::norm::faster_path(algorithm, dtype, hidden, world_size, tokens, measured)
        {
            (true, why) => FusedDecision {
                reason: format!("{}; {why}", fused.reason),
                ..fused
            },
            (false, why) => unfused(why),
        },
        _ => fused,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;
    use crate::topology::FIXTURES;

    // The fixtures of every test in dispatch/ (refusal.rs's too).

    /// The topology fixture called `name`.
    pub(super) fn fixture(name: &str) -> Topology {
        Topology::fixture(name).unwrap()
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
    /// or not: each request yields a decision whose choice can run, or an error with a reason.
    #[test]
    fn the_dispatcher_is_total() {
        let mut topologies: Vec<Topology> = FIXTURES
            .iter()
            .map(|(_, t)| Topology::from_json(t).unwrap())
            .collect();
        // A machine described without GPUs: every request refused, none panics.
        topologies.push(Topology {
            gpus: Vec::new(),
            links: Vec::new(),
            ..topologies[0].clone()
        });
        for t in topologies.clone() {
            if t.gpus.is_empty() {
                continue;
            }
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
            fanout: None,
        };
        let (mut decisions, mut errors) = (0, 0);
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
                                        Ok(decision) => {
                                            decisions += 1;
                                            assert_eq!(
                                                eligibility(&req, decision.choice),
                                                Ok(()),
                                                "{req:?} -> {decision:?}"
                                            );
                                            assert!(!decision.reason.is_empty());
                                            if let Some(f) = force {
                                                assert_eq!(decision.choice, f);
                                            }
                                        }
                                        Err(e) => {
                                            errors += 1;
                                            assert!(e.to_string().len() > 20, "{e}");
                                            if force.is_none()
                                                && bytes % dtype.size() as u64 == 0
                                                && world_size <= 16
                                                && !t.gpus.is_empty()
                                                && refusal::old_gpu(&req).is_none()
                                            {
                                                // Host-staged runs everywhere up to 16 ranks unless the findings veto it
                                                // (or the GPUs are older than tpar's kernels).
                                                panic!("no decision although host-staged can always run: {req:?}: {e}");
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
            decisions > 10_000 && errors > 1_000,
            "{decisions} decisions, {errors} errors"
        );
    }

    /// The choice at each size on a machine (nothing measured, nothing forced).
    fn choice(t: &Topology, world_size: usize, bytes: u64) -> Choice {
        decide(&request(t, world_size, bytes)).unwrap().choice
    }

    #[test]
    fn the_model_picks_what_tpar_measured_fastest_on_h200s() {
        use Algorithm::*;
        let h200 = fixture("8x-h200-nvswitch");
        // 2 H200s over NVLink (bench/README.md, 5260727): one-shot up to 256 KiB, NCCL from
        // 1 MiB. 4 H200s (e92132c): one-shot to 64 KiB, two-shot at 256 KiB, NCCL from 1 MiB.
        assert_eq!(choice(&h200, 2, 256 * KIB), Choice::Tpar(OneShot));
        assert_eq!(choice(&h200, 2, MIB), Choice::Nccl);
        assert_eq!(choice(&h200, 4, 64 * KIB), Choice::Tpar(OneShot));
        assert_eq!(choice(&h200, 4, 256 * KIB), Choice::Tpar(TwoShot));
        assert_eq!(choice(&h200, 4, MIB), Choice::Nccl);
        assert_eq!(choice(&h200, 8, 4 * KIB), Choice::Tpar(OneShot));
        assert_eq!(choice(&h200, 8, 256 * MIB), Choice::Nccl);
        // 8 ranks sharing one H200 (bench/README.md, 2026-12-01): one-shot up to 64 KiB,
        // two-shot from 80 KiB; 2 ranks: one-shot at every size measured.
        let one = Topology {
            gpus: h200.gpus[..1].to_vec(),
            links: Vec::new(),
            ..h200.clone()
        };
        assert_eq!(choice(&one, 8, 64 * KIB), Choice::Tpar(OneShot));
        assert_eq!(choice(&one, 8, 80 * KIB), Choice::Tpar(TwoShot));
        for kib in [4, 42, 256] {
            assert_eq!(choice(&one, 2, kib * KIB), Choice::Tpar(OneShot));
        }
        // No P2P at all: host-staged for small messages, NCCL for large ones.
        let rtx = fixture("4x-rtx-4090-no-p2p");
        assert_eq!(choice(&rtx, 4, 42 * KIB), Choice::Tpar(HostStaged));
        assert_eq!(choice(&rtx, 4, 64 * MIB), Choice::Nccl);
        // More ranks than GPUs: NCCL cannot, tpar can.
        let big = decide(&request(&h200, 12, 512 * MIB)).unwrap();
        assert_eq!(big.choice, Choice::Tpar(TwoShot), "{big:?}");
        assert!(
            big.reason.contains("NCCL needs one GPU per rank"),
            "{}",
            big.reason
        );
    }

    #[test]
    fn the_runner_up_a_reason_names_can_run_here() {
        // On the L40S fixture islands-pull is the model's fastest at 64 KiB but cannot read
        // across the sockets: the reason names it as skipped, and names as next what would run
        // in host-staged's place (it once named islands-pull, faster than the choice).
        let l40s = fixture("8x-l40s-2numa");
        let d = decide(&request(&l40s, 8, 64 * KIB)).unwrap();
        assert_eq!(d.choice, Choice::Tpar(Algorithm::HostStaged), "{d:?}");
        assert!(d.reason.contains("islands-pull skipped"), "{}", d.reason);
        assert!(d.reason.contains("next in the model nccl"), "{}", d.reason);
        // Everywhere: the runner-up named is another choice, and one that can run here.
        for (name, _) in FIXTURES {
            let t = fixture(name);
            for world_size in [2, 4, 8] {
                for bytes in sweep().step_by(4) {
                    let req = request(&t, world_size, bytes);
                    let Ok(d) = decide(&req) else { continue };
                    let Some(rest) = d.reason.split("; next in the model ").nth(1) else {
                        continue;
                    };
                    let next = rest.split(' ').next().unwrap();
                    let (e, _) = ranked(&req)
                        .into_iter()
                        .find(|(e, _)| e.choice.to_string() == next)
                        .unwrap_or_else(|| panic!("{name} {bytes}: {next} is not ranked"));
                    assert_ne!(e.choice, d.choice, "{name} {bytes}: {}", d.reason);
                    assert_eq!(
                        eligibility(&req, e.choice),
                        Ok(()),
                        "{name} {bytes}: {}",
                        d.reason
                    );
                }
            }
        }
    }

    /// Message sizes from 1 KiB to 64 MiB, four per doubling.
    fn sweep() -> impl Iterator<Item = u64> {
        (0..=64).map(|i| ((1024.0 * 2f64.powf(f64::from(i) / 4.0)) as u64) & !7)
    }

    #[test]
    fn on_the_two_socket_rtx_pro_6000_auto_stays_fast_and_never_picks_what_collapses() {
        for name in [
            "8x-rtx-pro-6000-pcie-2switch",
            "8x-rtx-pro-6000-2socket-broadcom",
        ] {
            let t = fixture(name);
            let fabric = Fabric::new(&t, 8, None);
            for bytes in sweep() {
                let d = decide(&request(&t, 8, bytes)).unwrap();
                let e = fabric.estimate(d.choice, DType::Bf16, bytes).unwrap();
                assert!(!e.collapses, "{name} {bytes}: {d:?}");
            }
        }
        // Issue 26's target: 42 KiB on the two-switch, two-socket machine in at most 25 us.
        let t = fixture("8x-rtx-pro-6000-pcie-2switch");
        let d = decide(&request(&t, 8, 42 * KIB)).unwrap();
        let e = Fabric::new(&t, 8, None)
            .estimate(d.choice, DType::Bf16, 42 * KIB)
            .unwrap();
        println!(
            "42 KiB, 8 ranks, 8x-rtx-pro-6000-pcie-2switch: {} {:.1} us",
            d.choice, e.us
        );
        assert!(e.us <= 25.0, "{d:?}: {e:?}");
    }

    #[test]
    fn nvlink_and_one_gpu_never_take_the_pcie_algorithms() {
        use Algorithm::*;
        let h200 = fixture("8x-h200-nvswitch");
        let one = Topology {
            gpus: h200.gpus[..1].to_vec(),
            links: Vec::new(),
            ..h200.clone()
        };
        for (t, sizes) in [(&h200, vec![2, 3, 4, 8]), (&one, vec![2, 3, 4, 8, 16])] {
            for n in sizes {
                for bytes in sweep() {
                    let c = choice(t, n, bytes);
                    assert!(
                        !matches!(
                            c,
                            Choice::Tpar(Staged | StagedPull | Islands | IslandsPull | Ring)
                        ),
                        "{} n={n} {bytes}: {c}",
                        t.description
                    );
                }
            }
        }
    }

    #[test]
    fn the_reason_says_the_model_chose_and_nothing_was_measured() {
        let t = fixture("8x-rtx-pro-6000-pcie-2switch");
        let d = decide(&request(&t, 8, 42 * KIB)).unwrap();
        assert!(
            d.reason
                .contains("fastest in the fabric model (no tuning table on this machine)")
                && d.reason.contains("us modelled")
                && d.reason.contains("islands 4+4")
                && d.reason.contains("PCIe across CPU sockets"),
            "{}",
            d.reason
        );
        // Where a faster choice would collapse, the reason names it and why it was skipped: on
        // the two-socket machine with every GPU on its own root complex, measured to lose a
        // little over half its write bandwidth when writes fan out, one-shot is still the
        // fastest at 1 KiB in the model, but collapses.
        let d = fixture("8x-rtx-pro-6000-2socket-broadcom");
        let findings = Findings {
            fanout: Some(crate::topology::Fanout {
                pair_write_gbps: 52.5,
                pair_read_gbps: 53.4,
                fanout_write_gbps: 25.0,
                fanout_read_gbps: 53.2,
            }),
            ..Findings::default()
        };
        let req = Request {
            findings: Some(&findings),
            ..request(&d, 8, KIB)
        };
        let fastest = ranked(&req)[0].0.clone();
        assert!(fastest.collapses, "{fastest:?}");
        let decision = decide(&req).unwrap();
        assert_ne!(decision.choice, fastest.choice);
        let said = format!(
            "{} ({:.1} us modelled) skipped: its writes fan out over root complexes, which collapse here (writes fanned out over root complexes 25.0 GB/s against 52.5 alone (2.1x), reads 53.2: measured here by tpar doctor)",
            fastest.choice, fastest.us
        );
        assert!(decision.reason.contains(&said), "{}", decision.reason);
    }

    /// A first-use table of 8 ranks in bf16 on `t` holding `probes`.
    fn first_use_table(t: &Topology, probes: Vec<Probe>) -> TuningTable {
        TuningTable {
            fingerprint: t.fingerprint(),
            kernels: String::new(),
            world_size: 8,
            dtype: DType::Bf16,
            entries: Vec::new(),
            probes,
        }
    }

    #[test]
    fn first_use_measurements_correct_the_model_near_their_sizes() {
        let t = fixture("8x-rtx-pro-6000-pcie-2switch");
        let req = request(&t, 8, 42 * KIB);
        let best = ranked(&req)[0].0.clone();
        // The first use measured the model's pick three times slower than modelled.
        let table = first_use_table(
            &t,
            vec![Probe {
                bytes: 32 * KIB,
                choice: best.choice,
                measured_us: 3.0 * best.us,
                modelled_us: best.us,
            }],
        );
        let corrected = Request {
            tuning: Some(&table),
            ..req
        };
        let d = decide(&corrected).unwrap();
        assert_ne!(d.choice, best.choice, "{d:?}");
        // Far from the probe the model stands as it is, and the reason says nothing was timed
        // there.
        let far = Request {
            tuning: Some(&table),
            ..request(&t, 8, 4 * MIB)
        };
        let (far, unmeasured) = (
            decide(&far).unwrap(),
            decide(&request(&t, 8, 4 * MIB)).unwrap(),
        );
        assert_eq!(far.choice, unmeasured.choice);
        assert_eq!(
            far.reason.replace(
                "the first-use measurement timed nothing near this size",
                "no tuning table on this machine"
            ),
            unmeasured.reason
        );
        // A measured pick says so.
        let slow_rival = TuningTable {
            probes: vec![Probe {
                bytes: 42 * KIB,
                choice: best.choice,
                measured_us: 0.5 * best.us,
                modelled_us: best.us,
            }],
            ..table.clone()
        };
        let d = decide(&Request {
            tuning: Some(&slow_rival),
            ..req
        })
        .unwrap();
        assert_eq!(d.choice, best.choice);
        assert!(d.reason.contains("first-use measurement"), "{}", d.reason);
    }

    #[test]
    fn between_probes_the_correction_follows_both_and_auto_runs_what_measured_faster() {
        // One H100 with 8 ranks as streams, 2026-12-07 (bench/results/2026-12-07-s24, call 4):
        // the first use's probes (us), and what `tpar bench` measured between them.
        let mut t = fixture("8x-h200-nvswitch");
        t.gpus.truncate(1);
        t.links.clear();
        let one_shot = Choice::Tpar(Algorithm::OneShot);
        let two_shot = Choice::Tpar(Algorithm::TwoShot);
        let measured: [(u64, f64, f64); 4] = [
            (16 * KIB, 4.18, 4.93),
            (32 * KIB, 4.73, 5.63),
            (64 * KIB, 8.95, 6.24),
            (128 * KIB, 14.84, 7.11),
        ];
        // Measured at the same factor over this model as over the H100's (the model of one
        // H200 is not the H100's; the factors are what the run found).
        let model = |choice: Choice, bytes: u64| {
            ranked(&request(&t, 8, bytes))
                .into_iter()
                .find(|(e, _)| e.choice == choice)
                .unwrap()
                .0
                .us
        };
        let h100_model: [(u64, f64, f64); 4] = [
            (16 * KIB, 4.26, 5.99),
            (32 * KIB, 5.00, 6.18),
            (64 * KIB, 6.47, 6.54),
            (128 * KIB, 9.40, 7.28),
        ];
        let mut probes = Vec::new();
        for ((bytes, one, two), (_, one_model, two_model)) in measured.into_iter().zip(h100_model) {
            for (choice, us, h100) in [(one_shot, one, one_model), (two_shot, two, two_model)] {
                let modelled_us = model(choice, bytes);
                probes.push(Probe {
                    bytes,
                    choice,
                    measured_us: us / h100 * modelled_us,
                    modelled_us,
                });
            }
        }
        let table = first_use_table(&t, probes);
        // Sizes between the probes and what ran faster there (one-shot / two-shot p50, us):
        // 24 KiB 4.38 / 5.26, 42 KiB 6.35 / 6.30, 48 KiB 6.96 / 6.27, 96 KiB 13.18 / 7.12.
        for (bytes, faster) in [
            (24 * KIB, one_shot),
            (42 * KIB, two_shot),
            (48 * KIB, two_shot),
            (96 * KIB, two_shot),
        ] {
            let d = decide(&Request {
                tuning: Some(&table),
                ..request(&t, 8, bytes)
            })
            .unwrap();
            assert_eq!(d.choice, faster, "{bytes} bytes: {}", d.reason);
            assert!(d.reason.contains(", interpolated)"), "{}", d.reason);
        }
    }

    #[test]
    fn timing_its_rivals_slower_than_modelled_does_not_make_an_untimed_choice_win() {
        // The first use timed the model's two closest choices at a size, both slower than
        // modelled by the same factor (what a replay's fixed costs, counted per call, did on
        // one H100 in session 17): a third choice, not timed, must not win by that alone.
        let t = fixture("8x-h200-nvswitch");
        let req = request(&t, 8, 16 * KIB);
        let model = ranked(&req);
        let (a, b) = (model[0].0.clone(), model[1].0.clone());
        let c = model
            .iter()
            .map(|(e, _)| e.clone())
            .find(|e| e.choice != Choice::Nccl && e.us > b.us)
            .expect("a third choice");
        let slower = 2.0 * c.us / a.us;
        let probe = |e: &Estimate| Probe {
            bytes: 16 * KIB,
            choice: e.choice,
            measured_us: slower * e.us,
            modelled_us: e.us,
        };
        let table = first_use_table(&t, vec![probe(&a), probe(&b)]);
        let measured = Request {
            tuning: Some(&table),
            ..req
        };
        let d = decide(&measured).unwrap();
        assert_eq!(d.choice, a.choice, "{}", d.reason);
        assert!(
            d.reason.contains("corrected by the first-use measurement"),
            "{}",
            d.reason
        );
        let scaled = ranked(&measured)
            .into_iter()
            .find(|(e, _)| e.choice == c.choice)
            .unwrap();
        assert_eq!(scaled.1, Some(Measured::Scaled(slower)));
        assert!((scaled.0.us - slower * c.us).abs() < 1e-9);
        // Where the first use timed nothing near a size, the reason says so (not "no table").
        let far = decide(&Request {
            tuning: Some(&table),
            ..request(&t, 8, 16 * MIB)
        })
        .unwrap();
        if far.choice != Choice::Nccl {
            assert!(
                far.reason.contains("timed nothing near this size"),
                "{}",
                far.reason
            );
        }
    }

    #[test]
    fn a_path_that_failed_its_check_is_never_chosen_and_the_decision_says_so() {
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
    fn a_probe_that_saw_writes_collapse_keeps_writes_from_fanning_out() {
        let pro = fixture("8x-rtx-pro-6000-pcie-2switch");
        let findings = Findings {
            push_gbps: Some(4.0),
            pull_gbps: Some(50.0),
            ..Findings::default()
        };
        let fabric = Fabric::new(&pro, 8, Some(&findings));
        assert!(fabric.collapse().collapses && fabric.collapse().by_peer);
        // Every GPU writing to every peer at once collapsed here: one-shot and two-shot, which
        // do that, are modelled as collapsing and never chosen.
        for algorithm in [Algorithm::OneShot, Algorithm::TwoShot] {
            let e = fabric
                .estimate(Choice::Tpar(algorithm), DType::Bf16, 16 * KIB)
                .unwrap();
            assert!(e.collapses, "{e:?}");
        }
        for bytes in sweep() {
            let req = Request {
                findings: Some(&findings),
                ..request(&pro, 8, bytes)
            };
            let d = decide(&req).unwrap();
            let e = fabric.estimate(d.choice, DType::Bf16, bytes).unwrap();
            assert!(!e.collapses, "{bytes}: {d:?}");
        }
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
            kernels: String::new(),
            world_size: 8,
            dtype: DType::Bf16,
            entries: vec![TuningEntry {
                max_bytes: 8 * KIB,
                choice: Choice::Tpar(Algorithm::TwoShot),
                p50_us: 3.0,
            }],
            probes: Vec::new(),
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
