//! The first-use measurement's plan and outcome (pure): which few candidates the fabric model
//! ranks close enough at which sizes that timing them on this machine can change the choice,
//! how long to time them so that the whole measurement stays within [`BUDGET`], and the table
//! the slowest rank's times make. The communicator runs it when it is created on a machine
//! with no tuning table (`crate::communicator`'s `first_use`), every rank the same plan.

use std::time::Duration;

use super::fabric::Fabric;
use super::tuning::{Probe, TuningTable};
use crate::algorithm::Choice;
use crate::dtype::DType;
use crate::hash::fnv1a;

/// The variable that turns the first-use measurement off (`0`); set it the same on every rank,
/// as `TPAR_ALGO`.
pub const ENV_FIRST_USE: &str = "TPAR_FIRST_USE";

/// Whether `TPAR_FIRST_USE` leaves the first-use measurement on (anything but `0`, `off`,
/// `false`, `no`).
pub fn enabled(value: Option<&str>) -> bool {
    !matches!(
        value.map(|v| v.trim().to_ascii_lowercase()).as_deref(),
        Some("0" | "off" | "false" | "no")
    )
}

/// Whether `TPAR_FIRST_USE` is `force`: measure even where ranks of other processes share this
/// rank's GPU, which the measurement otherwise skips (the driver time-slices their contexts, so
/// what it times is the time slices, not the machine). For tests of an engine's path, one
/// process per rank, on one GPU; the table it makes is cached like any other, so point
/// `TPAR_CACHE_DIR` elsewhere.
pub fn forced(value: Option<&str>) -> bool {
    value.is_some_and(|v| v.trim().eq_ignore_ascii_case("force"))
}

/// The most the whole measurement may take, capture and synchronisation included.
pub const BUDGET: Duration = Duration::from_millis(200);

/// The share of [`BUDGET`] the modelled GPU time of the probes may fill: the rest is capture,
/// the rendezvous rounds and the model being wrong.
const GPU_SHARE: f64 = 0.4;

/// The sizes probed: small and mid-sized messages of decoding, where tpar's algorithms compete
/// (larger ones go to NCCL or are tuned by `tpar tune`). A size between probes takes a
/// correction interpolated between them ([`TuningTable::correction`]), which cannot follow a
/// jump inside the interval, so the probes stand where the model's error jumps: one-shot's
/// last launch with PDL (half the co-resident grid, one unit a thread) is 32 KiB at 8 ranks
/// sharing one 132-SM GPU and 128 KiB with a GPU per rank (`backend::cuda::communicator`'s test
/// holds both here). Without the 32 KiB probe, taking the nearest probe's correction, one H100
/// with 8 ranks as streams, 2026-12-07 (bench/results/2026-12-07-s24, call 3), took two-shot's
/// 16 KiB correction (4.76 us measured, 5.99 modelled: x0.79) to 32 KiB, where two-shot
/// measures x0.91 of its model (call 4's probe there), and auto ran two-shot at 5.67 us against
/// one-shot's 4.84.
pub const SIZES: [u64; 6] = [4 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10];

/// A candidate is probed when the model puts it within this factor of the best.
pub const CLOSE: f64 = 1.5;

/// At most this many candidates per size.
pub const PER_SIZE: usize = 3;

/// Calls per rank in the short graph, and graph replays (after [`ProbePlan::warmup`]).
const CHAIN: usize = 8;

/// The long graph holds this many times the short one's calls. A probe's time per call is the
/// difference of the two graphs' median replay times over the difference of their calls, so
/// what every replay pays once cancels: the graph's launch, the ranks' launches one after
/// another (threads) or at their own moments (processes), and the events around it. Timed as
/// one graph's replay over its calls, those costs were counted per call: 8 ranks sharing one
/// H100 measured one-shot at 16 KiB 10.4 us a call where `tpar bench` times it at 4.3, which
/// made the model's correction send auto to an algorithm it had not timed, twice as slow
/// (bench/results/2026-12-06-s17, call 1).
pub const LONG_CHAIN_FACTOR: usize = 4;
const REPLAYS: usize = 6;
const MIN_REPLAYS: usize = 3;

/// One choice to time at one size, with the model's estimate.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedProbe {
    pub bytes: u64,
    pub choice: Choice,
    pub modelled_us: f64,
}

/// What the first use times: the probes, each as two graphs per rank, of `chain` calls and of
/// [`LONG_CHAIN_FACTOR`] times as many, both replayed `warmup + replays` times.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbePlan {
    pub dtype: DType,
    pub probes: Vec<PlannedProbe>,
    pub chain: usize,
    pub warmup: usize,
    pub replays: usize,
}

impl ProbePlan {
    /// Calls of one probe on one rank: both graphs, every replay.
    fn calls_per_probe(&self) -> f64 {
        (self.chain * (1 + LONG_CHAIN_FACTOR) * (self.warmup + self.replays)) as f64
    }

    /// The GPU time the model expects the probes to take, ms.
    pub fn modelled_ms(&self) -> f64 {
        self.modelled_ms_of(&self.probes)
    }

    /// The GPU time the model expects `probes` (some of the plan's) to take, ms.
    fn modelled_ms_of(&self, probes: &[PlannedProbe]) -> f64 {
        probes
            .iter()
            .map(|p| p.modelled_us * self.calls_per_probe())
            .sum::<f64>()
            / 1e3
    }

    /// The probes of each size, in order: (start, end) ranges of `probes`, which `plan` orders
    /// by size.
    fn size_groups(&self) -> Vec<(usize, usize)> {
        let mut groups: Vec<(usize, usize)> = Vec::new();
        for (i, p) in self.probes.iter().enumerate() {
            match groups.last_mut() {
                Some(g) if self.probes[g.0].bytes == p.bytes => g.1 = i + 1,
                _ => groups.push((i, i + 1)),
            }
        }
        groups
    }

    /// The probes of the first size: timed before the ranks decide how many more fit.
    pub fn first_size_probes(&self) -> usize {
        self.size_groups().first().map_or(0, |g| g.1)
    }

    /// How many of the probes to time, in order, once those of the first size
    /// ([`ProbePlan::first_size_probes`]) took `first_ms` of wall time and `before_ms` went
    /// before them (planning, agreeing, capturing), both the slowest rank's: those, then each
    /// next size's while the model's estimate of them, scaled by how many times slower than
    /// modelled the first size ran (never by less than 1), still ends within [`BUDGET`]. A size
    /// is timed whole or not at all: timing some of its candidates and not the others would
    /// favour the untimed where the machine is slower than its model. Every rank computes it
    /// from the same agreed figures, so every rank times the same probes. A machine as fast as
    /// modelled times them all (the plan was sized to fit); one far slower (a collapse the
    /// model missed, ranks time-slicing a GPU) stops early instead of taking that many times
    /// the budget.
    pub fn probes_within_budget(&self, before_ms: f64, first_ms: f64) -> usize {
        let groups = self.size_groups();
        let Some(&(_, first_end)) = groups.first() else {
            return 0;
        };
        let modelled_ms =
            |(start, end): (usize, usize)| self.modelled_ms_of(&self.probes[start..end]);
        let slower = (first_ms / modelled_ms(groups[0])).max(1.0);
        let budget_ms = BUDGET.as_secs_f64() * 1e3;
        let mut spent = before_ms + first_ms;
        let mut keep = first_end;
        for &group in &groups[1..] {
            spent += modelled_ms(group) * slower;
            if spent > budget_ms {
                break;
            }
            keep = group.1;
        }
        keep
    }

    /// A short key of the plan, which every rank compares before timing (ranks that planned
    /// differently, from different views of the machine, must not start collective calls).
    pub fn key(&self) -> String {
        let text: String = self
            .probes
            .iter()
            .map(|p| format!("{}:{};", p.bytes, p.choice))
            .collect();
        format!(
            "{:016x}-{}-{}",
            fnv1a(text.bytes()),
            self.chain,
            self.replays
        )
    }

    /// The first-use table from each probe's time on the slowest rank (`measured_us`, one per
    /// probe, in order; a probe with no time is left out), of the machine `fingerprint` and the
    /// kernels `kernels` (`TuningTable::kernels`).
    pub fn table(
        &self,
        (fingerprint, kernels): (String, String),
        world_size: usize,
        measured_us: &[Option<f64>],
    ) -> TuningTable {
        TuningTable {
            fingerprint,
            kernels,
            world_size,
            dtype: self.dtype,
            entries: Vec::new(),
            probes: self
                .probes
                .iter()
                .zip(measured_us)
                .filter_map(|(p, m)| {
                    let us = m.filter(|us| us.is_finite() && *us > 0.0)?;
                    Some(Probe {
                        bytes: p.bytes,
                        choice: p.choice,
                        measured_us: us,
                        modelled_us: p.modelled_us,
                    })
                })
                .collect(),
        }
    }
}

/// The probes for `fabric`'s machine and ranks: at each of [`SIZES`], tpar's candidates that
/// can run here (`eligible`) within [`CLOSE`] of the best of them, at most [`PER_SIZE`]; sizes
/// with one candidate only are left out (nothing to decide). NCCL is never probed: creating it
/// costs seconds and half a GiB. Replays shrink, and then sizes go, until the modelled GPU time
/// fits its share of [`BUDGET`].
pub fn plan(fabric: &Fabric, dtype: DType, eligible: &dyn Fn(Choice) -> bool) -> ProbePlan {
    let mut probes = Vec::new();
    for bytes in SIZES {
        let candidates: Vec<PlannedProbe> = fabric
            .rank(dtype, bytes)
            .into_iter()
            .filter(|e| e.choice != Choice::Nccl && eligible(e.choice))
            .map(|e| PlannedProbe {
                bytes,
                choice: e.choice,
                modelled_us: e.us,
            })
            .collect();
        let Some(best) = candidates.first().map(|c| c.modelled_us) else {
            continue;
        };
        let close: Vec<PlannedProbe> = candidates
            .into_iter()
            .filter(|c| c.modelled_us <= CLOSE * best)
            .take(PER_SIZE)
            .collect();
        if close.len() >= 2 {
            probes.extend(close);
        }
    }
    let mut plan = ProbePlan {
        dtype,
        probes,
        chain: CHAIN,
        warmup: 2,
        replays: REPLAYS,
    };
    let share_ms = GPU_SHARE * BUDGET.as_secs_f64() * 1e3;
    while plan.modelled_ms() > share_ms && plan.replays > MIN_REPLAYS {
        plan.replays -= 1;
    }
    while plan.modelled_ms() > share_ms {
        let Some(largest) = plan.probes.iter().map(|p| p.bytes).max() else {
            break;
        };
        plan.probes.retain(|p| p.bytes != largest);
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Algorithm;
    use crate::topology::Topology;

    fn fixture(name: &str) -> Topology {
        Topology::fixture(name).unwrap()
    }

    #[test]
    fn close_candidates_are_probed_within_the_budget_and_far_ones_are_not() {
        let t = fixture("8x-rtx-pro-6000-pcie-2switch");
        let fabric = Fabric::new(&t, 8, None);
        let all = |_: Choice| true;
        let p = plan(&fabric, DType::Bf16, &all);
        assert!(!p.probes.is_empty());
        assert!(p.modelled_ms() <= GPU_SHARE * 200.0, "{}", p.modelled_ms());
        for size in SIZES {
            let here: Vec<&PlannedProbe> = p.probes.iter().filter(|x| x.bytes == size).collect();
            assert!(here.len() != 1 && here.len() <= PER_SIZE);
            if let Some(best) = here.first() {
                assert!(here
                    .iter()
                    .all(|x| x.modelled_us <= CLOSE * best.modelled_us));
            }
        }
        assert!(p.probes.iter().all(|x| x.choice != Choice::Nccl));
        // What cannot run here is never probed.
        let no_islands = |c: Choice| !matches!(c, Choice::Tpar(Algorithm::Islands));
        let q = plan(&fabric, DType::Bf16, &no_islands);
        assert!(q
            .probes
            .iter()
            .all(|x| x.choice != Choice::Tpar(Algorithm::Islands)));
        // The same machine plans the same probes: the key every rank compares.
        assert_eq!(plan(&fabric, DType::Bf16, &all).key(), p.key());
        assert_ne!(q.key(), p.key());
    }

    #[test]
    fn the_table_keeps_each_probe_with_its_slowest_rank_time_and_the_model() {
        let t = fixture("8x-h200-nvswitch");
        let p = ProbePlan {
            dtype: DType::Bf16,
            probes: vec![
                PlannedProbe {
                    bytes: 4096,
                    choice: Choice::Tpar(Algorithm::OneShot),
                    modelled_us: 3.9,
                },
                PlannedProbe {
                    bytes: 4096,
                    choice: Choice::Tpar(Algorithm::TwoShot),
                    modelled_us: 6.3,
                },
            ],
            chain: 8,
            warmup: 2,
            replays: 6,
        };
        let table = p.table((t.fingerprint(), "k".into()), 8, &[Some(4.4), None]);
        assert!(table.is_first_use());
        assert_eq!(table.probes.len(), 1);
        assert_eq!(
            (table.probes[0].measured_us, table.probes[0].modelled_us),
            (4.4, 3.9)
        );
        // Each probe: a graph of 8 calls and one of 32, 8 replays each.
        assert!((p.modelled_ms() - (3.9 + 6.3) * 320.0 / 1e3).abs() < 1e-9);
    }

    #[test]
    fn a_machine_slower_than_modelled_stops_timing_within_the_budget_at_a_size_boundary() {
        let probe = |bytes, algorithm, modelled_us| PlannedProbe {
            bytes,
            choice: Choice::Tpar(algorithm),
            modelled_us,
        };
        // 320 calls a probe: 4 KiB one-shot and two-shot modelled at 3.6 and 4.3 us take 1.15
        // and 1.38 ms of the GPU (2.53 for the size), 16 / 64 / 256 KiB one-shot and two-shot
        // 2.73 / 5.12 / 8.64 ms.
        let (one, two) = (Algorithm::OneShot, Algorithm::TwoShot);
        let p = ProbePlan {
            dtype: DType::Bf16,
            probes: vec![
                probe(4096, one, 3.6),
                probe(4096, two, 4.3),
                probe(16384, one, 4.1),
                probe(16384, two, 4.42),
                probe(65536, one, 8.9),
                probe(65536, two, 7.1),
                probe(262144, two, 11.0),
                probe(262144, one, 16.0),
            ],
            chain: 8,
            warmup: 2,
            replays: 6,
        };
        assert_eq!(p.first_size_probes(), 2);
        // As modelled, or faster: everything.
        assert_eq!(p.probes_within_budget(5.0, 2.6), 8);
        assert_eq!(p.probes_within_budget(5.0, 0.1), 8);
        // 12 times slower than modelled (30 ms for 4 KiB): 16 and 64 KiB fit in 200 ms (32.4
        // and 60.8 ms more: 128 ms in all), 256 KiB (102.5 ms more) does not; whole sizes.
        assert_eq!(p.probes_within_budget(5.0, 30.0), 6);
        // 10 times (25.3 ms): 195 ms in all, every size.
        assert_eq!(p.probes_within_budget(5.0, 25.3), 8);
        // Ranks time-slicing one GPU (two processes: 2.2 ms a call, 1.4 s for 4 KiB): 4 KiB
        // alone, both of its candidates.
        assert_eq!(p.probes_within_budget(5.0, 1400.0), 2);
        // What went before counts too.
        assert_eq!(p.probes_within_budget(198.0, 2.6), 2);
        let empty = ProbePlan {
            probes: Vec::new(),
            ..p
        };
        assert_eq!(empty.first_size_probes(), 0);
        assert_eq!(empty.probes_within_budget(0.0, 0.0), 0);
    }

    #[test]
    fn the_switch_reads_off_values() {
        assert!(enabled(None) && enabled(Some("1")) && enabled(Some("")));
        for off in ["0", "off", "FALSE", " no "] {
            assert!(!enabled(Some(off)), "{off}");
            assert!(!forced(Some(off)), "{off}");
        }
        assert!(enabled(Some("force")) && forced(Some("force")) && forced(Some(" Force ")));
        assert!(!forced(None) && !forced(Some("1")) && !forced(Some("forced")));
    }
}
