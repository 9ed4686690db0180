//! The tuning table: what was measured on one machine, kept in tpar's cache under the
//! machine's fingerprint, where the dispatcher of every later job on that machine reads it.
//! Two kinds: `tpar tune`'s (the fastest choice per size, every choice measured: its entries
//! decide) and the first-use measurement's (a few candidates the fabric model ranked closest,
//! timed when a communicator was first created on a machine with no table: its probes correct
//! the model's estimates). A `tpar tune` table, where one exists, is the one read. A table
//! names the kernels it timed (`backend::cuda::kernels::build_id`); one measured with other
//! kernels is not read (an upgrade of tpar measures again), and `tpar doctor` says so.

use serde::{Deserialize, Serialize};

use crate::algorithm::Choice;
use crate::dtype::DType;
use crate::error::Result;
use crate::topology::Topology;

/// What was measured on one machine for one world size and dtype.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TuningTable {
    /// Of the GPUs, driver and topology the table was measured on.
    pub fingerprint: String,
    /// The kernels it timed (`backend::cuda::kernels::build_id`; empty in tables written
    /// before tables named them, which are not read).
    #[serde(default)]
    pub kernels: String,
    pub world_size: usize,
    pub dtype: DType,
    /// `tpar tune`'s fastest choice per size: ascending `max_bytes`; a message takes the first
    /// entry it fits. Empty in a first-use table.
    pub entries: Vec<TuningEntry>,
    /// Single measurements of one choice at one size beside the model's estimate of it (the
    /// first-use measurement), which the dispatcher uses to correct the model's estimates.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub probes: Vec<Probe>,
}

/// One choice timed at one size on this machine, and what the fabric model said of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    pub bytes: u64,
    pub choice: Choice,
    /// The slowest rank's median, us per call.
    pub measured_us: f64,
    pub modelled_us: f64,
}

impl TuningTable {
    /// Where `tpar tune`'s table for this machine, world size and dtype lives: `tuning/` in
    /// tpar's cache (`TPAR_CACHE_DIR`, else `~/.cache/tpar`).
    pub fn path(fingerprint: &str, world_size: usize, dtype: DType) -> std::path::PathBuf {
        crate::cache::cache_root()
            .join("tuning")
            .join(format!("{fingerprint}-n{world_size}-{dtype}.json"))
    }

    /// Where the first-use measurement's table lives, beside `tpar tune`'s.
    pub fn first_use_path(
        fingerprint: &str,
        world_size: usize,
        dtype: DType,
    ) -> std::path::PathBuf {
        crate::cache::cache_root().join("tuning").join(format!(
            "{fingerprint}-n{world_size}-{dtype}-first-use.json"
        ))
    }

    /// Where this table is kept: `tpar tune`'s path, or the first-use path.
    pub fn kept_at(&self) -> std::path::PathBuf {
        if self.is_first_use() {
            Self::first_use_path(&self.fingerprint, self.world_size, self.dtype)
        } else {
            Self::path(&self.fingerprint, self.world_size, self.dtype)
        }
    }

    /// Whether this is a first-use table (probes, no entries).
    pub fn is_first_use(&self) -> bool {
        self.entries.is_empty()
    }

    /// The table measured on `topology`'s machine with the kernels `kernels` (the build's
    /// `backend::cuda::kernels::build_id`): `tpar tune`'s if it wrote one, else the first-use
    /// measurement's. A table of other kernels is passed over ([`TuningTable::read_for`]).
    pub fn load_for(
        topology: &Topology,
        world_size: usize,
        dtype: DType,
        kernels: &str,
    ) -> Option<TuningTable> {
        Self::on_disk(topology, world_size, dtype).find(|t| t.kernels == kernels)
    }

    /// What [`TuningTable::load_for`] reads, and the table for this machine it passes over
    /// because it timed other kernels (`tpar tune`'s first), from one reading of the files:
    /// what `tpar doctor` and a new communicator report, so that a user whose table stopped
    /// deciding knows why and what to run.
    pub fn read_for(
        topology: &Topology,
        world_size: usize,
        dtype: DType,
        kernels: &str,
    ) -> (Option<TuningTable>, Option<TuningTable>) {
        let (read, passed_over): (Vec<_>, Vec<_>) =
            Self::on_disk(topology, world_size, dtype).partition(|t| t.kernels == kernels);
        (read.into_iter().next(), passed_over.into_iter().next())
    }

    /// Of what [`TuningTable::read_for`] gives, the `tpar tune` table that no longer decides
    /// because it timed other kernels, where no `tpar tune` table of this build replaces it. A
    /// first-use table of this build does not: it was measured unasked, and a user who tuned
    /// should hear, at every creation until they tune again, that their table stopped deciding
    /// (before, the warning stopped once the first use had written a table).
    pub fn stale_tune_table<'a>(
        read: Option<&TuningTable>,
        passed_over: Option<&'a TuningTable>,
    ) -> Option<&'a TuningTable> {
        passed_over.filter(|t| !t.is_first_use() && read.is_none_or(TuningTable::is_first_use))
    }

    /// The tables on disk for this machine, world size and dtype: `tpar tune`'s first.
    fn on_disk(
        topology: &Topology,
        world_size: usize,
        dtype: DType,
    ) -> impl Iterator<Item = TuningTable> {
        let fingerprint = topology.fingerprint();
        [
            Self::path(&fingerprint, world_size, dtype),
            Self::first_use_path(&fingerprint, world_size, dtype),
        ]
        .into_iter()
        .filter_map(|path| serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok())
    }

    /// Writes the table where [`TuningTable::load_for`] looks (atomically): `tpar tune`'s
    /// path, or the first-use path for a table without entries.
    pub fn save(&self) -> Result<std::path::PathBuf> {
        let path = self.kept_at();
        let text = serde_json::to_vec_pretty(self).expect("tables serialise");
        crate::sys::write_file_atomically(&path, &text, "cannot write the tuning table")?;
        Ok(path)
    }

    /// What the first-use probes of `choice` say of its time at `bytes`: their measured over
    /// modelled time, from the probes within a factor of 4 in size. Between a probe below
    /// `bytes` and one above (the nearest each side) the factor is interpolated in log size;
    /// with a probe on one side only, or at `bytes` itself, it is that probe's. The model's
    /// error is not one number across sizes: one H100 with 8 ranks as streams, 2026-12-07
    /// (bench/results/2026-12-07-s24, call 4), one-shot measured x0.94 of its model at 32 KiB
    /// and x1.40 at 64 KiB (its launch leaves PDL between them), so at 42 KiB the nearest
    /// probe alone costed one-shot under two-shot and auto ran one-shot at 6.46 us against
    /// two-shot's 6.30; interpolated, one-shot x1.12 and two-shot x0.93, and two-shot runs.
    pub fn correction(&self, choice: Choice, bytes: u64) -> Option<Correction<'_>> {
        let bytes = bytes.max(1);
        let log_ratio = |p: &Probe| (p.bytes.max(1) as f64 / bytes as f64).ln();
        let near: Vec<&Probe> = self
            .probes
            .iter()
            .filter(|p| p.choice == choice && p.modelled_us > 0.0 && p.measured_us > 0.0)
            .filter(|p| log_ratio(p).abs() <= 4f64.ln() + 1e-9)
            .collect();
        let nearest = |side: &dyn Fn(&Probe) -> bool| {
            near.iter()
                .copied()
                .filter(|p| side(p))
                .min_by(|a, b| log_ratio(a).abs().total_cmp(&log_ratio(b).abs()))
        };
        let factor = |p: &Probe| p.measured_us / p.modelled_us;
        if let Some(at) = nearest(&|p| p.bytes.max(1) == bytes) {
            return Some(Correction {
                factor: factor(at),
                probes: vec![at],
            });
        }
        match (
            nearest(&|p| p.bytes.max(1) < bytes),
            nearest(&|p| p.bytes.max(1) > bytes),
        ) {
            (Some(below), Some(above)) => {
                let t = -log_ratio(below) / (log_ratio(above) - log_ratio(below));
                Some(Correction {
                    factor: factor(below) + t * (factor(above) - factor(below)),
                    probes: vec![below, above],
                })
            }
            (Some(one), None) | (None, Some(one)) => Some(Correction {
                factor: factor(one),
                probes: vec![one],
            }),
            (None, None) => None,
        }
    }
}

/// [`TuningTable::correction`]: the factor to scale a choice's modelled time by, and the probes
/// it comes from (one, or the two around the size, in size order).
#[derive(Clone, Debug, PartialEq)]
pub struct Correction<'a> {
    pub factor: f64,
    pub probes: Vec<&'a Probe>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TuningEntry {
    pub max_bytes: u64,
    pub choice: Choice,
    pub p50_us: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Algorithm;

    #[test]
    fn probes_correct_their_choice_near_their_sizes_interpolated_between_them() {
        let table = TuningTable {
            fingerprint: "fp".into(),
            kernels: String::new(),
            world_size: 8,
            dtype: DType::Bf16,
            entries: Vec::new(),
            probes: vec![
                Probe {
                    bytes: 16 << 10,
                    choice: Choice::Tpar(Algorithm::Staged),
                    measured_us: 12.0,
                    modelled_us: 8.0,
                },
                Probe {
                    bytes: 256 << 10,
                    choice: Choice::Tpar(Algorithm::Staged),
                    measured_us: 30.0,
                    modelled_us: 30.0,
                },
            ],
        };
        let staged = Choice::Tpar(Algorithm::Staged);
        let factor = |bytes: u64| table.correction(staged, bytes).unwrap().factor;
        assert_eq!(factor(16 << 10), 1.5);
        assert_eq!(factor(1 << 20), 1.0);
        // Between the two probes (16 KiB x1.5, 256 KiB x1.0), in log size: 64 KiB is half way.
        assert!(
            (factor(64 << 10) - 1.25).abs() < 1e-12,
            "{}",
            factor(64 << 10)
        );
        // 32 KiB: the 256 KiB probe is more than 4x away, so 16 KiB's alone; 128 KiB the other way.
        assert_eq!(factor(32 << 10), 1.5);
        assert_eq!(factor(128 << 10), 1.0);
        assert_eq!(table.correction(staged, 64 << 10).unwrap().probes.len(), 2);
        // A probe on one side only: its own factor, within a factor of 4.
        assert_eq!(factor(8 << 10), 1.5);
        assert!(table.correction(staged, 2 << 10).is_none());
        assert!(table.correction(staged, 4 << 20).is_none());
        assert!(table
            .correction(Choice::Tpar(Algorithm::Ring), 16 << 10)
            .is_none());
        assert!(table.is_first_use());
        // A table written before probes existed still reads.
        let old = r#"{"fingerprint":"x","world_size":2,"dtype":"bf16","entries":[{"max_bytes":4096,"choice":"one-shot","p50_us":3.0}]}"#;
        let t: TuningTable = serde_json::from_str(old).unwrap();
        assert!(t.probes.is_empty() && !t.is_first_use());
    }

    #[test]
    fn a_tune_table_of_other_kernels_is_named_until_a_tune_table_of_this_build_replaces_it() {
        let table = |kernels: &str, tuned: bool| TuningTable {
            fingerprint: "fp".into(),
            kernels: kernels.into(),
            world_size: 2,
            dtype: DType::Bf16,
            entries: if tuned {
                vec![TuningEntry {
                    max_bytes: 4096,
                    choice: Choice::Tpar(Algorithm::OneShot),
                    p50_us: 3.0,
                }]
            } else {
                Vec::new()
            },
            probes: Vec::new(),
        };
        let (old_tune, old_first_use) = (table("old", true), table("old", false));
        let (new_tune, new_first_use) = (table("new", true), table("new", false));
        let stale = TuningTable::stale_tune_table;
        // Nothing of this build, or only a first-use table of it: the old tune table is named.
        assert!(stale(None, Some(&old_tune)).is_some());
        assert!(stale(Some(&new_first_use), Some(&old_tune)).is_some());
        // A tune table of this build replaces it; a passed-over first-use table is measured
        // again, unasked, and named by nobody.
        assert!(stale(Some(&new_tune), Some(&old_tune)).is_none());
        assert!(stale(None, Some(&old_first_use)).is_none());
        assert!(stale(Some(&new_first_use), None).is_none());
    }
}
