//! The tuning table: the fastest choice per message size, measured on one machine by
//! `tpar tune` and kept in tpar's cache under the machine's fingerprint, where the dispatcher
//! of every later job on that machine reads it.

use serde::{Deserialize, Serialize};

use crate::algorithm::Choice;
use crate::dtype::DType;
use crate::error::Result;
use crate::topology::Topology;

/// The fastest choice per size, measured by `tpar tune` on one machine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TuningTable {
    /// Of the GPUs, driver and topology the table was measured on.
    pub fingerprint: String,
    pub world_size: usize,
    pub dtype: DType,
    /// Ascending `max_bytes`; a message takes the first entry it fits.
    pub entries: Vec<TuningEntry>,
}

impl TuningTable {
    /// Where the table for this machine, world size and dtype lives: `tuning/` in tpar's cache
    /// (`TPAR_CACHE_DIR`, else `~/.cache/tpar`).
    pub fn path(fingerprint: &str, world_size: usize, dtype: DType) -> std::path::PathBuf {
        crate::cache::cache_root()
            .join("tuning")
            .join(format!("{fingerprint}-n{world_size}-{dtype}.json"))
    }

    /// The table measured on `topology`'s machine, if `tpar tune` wrote one.
    pub fn load_for(topology: &Topology, world_size: usize, dtype: DType) -> Option<TuningTable> {
        let text =
            std::fs::read_to_string(Self::path(&topology.fingerprint(), world_size, dtype)).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Writes the table where [`TuningTable::load_for`] looks (atomically).
    pub fn save(&self) -> Result<std::path::PathBuf> {
        let path = Self::path(&self.fingerprint, self.world_size, self.dtype);
        let text = serde_json::to_vec_pretty(self).expect("tables serialise");
        crate::sys::write_file_atomically(&path, &text, "cannot write the tuning table")?;
        Ok(path)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TuningEntry {
    pub max_bytes: u64,
    pub choice: Choice,
    pub p50_us: f64,
}
