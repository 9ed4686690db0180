//! What this build of `tpar` records with every result it writes: the commit it was built
//! from (`build.rs`: `git describe`) in the harness's provenance record.

use tpar_harness::provenance::Provenance;

/// The commit this build of `tpar` was made from, recorded with its results.
pub const COMMIT: &str = env!("TPAR_GIT_COMMIT");

/// The provenance record of a result measured now on `device` by this build of `tpar`.
pub fn provenance(device: String) -> Provenance {
    Provenance::collect(device, COMMIT)
}
