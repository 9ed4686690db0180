//! What can run an allreduce: tpar's algorithms ([`Algorithm`]) and, beside them, NCCL
//! ([`Choice`]), each named the way a caller asks for it.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The most ranks tpar's kernels address (`TPAR_MAX_RANKS` in the kernels' header mirrors it).
pub const MAX_RANKS: usize = 16;

/// What a group of more ranks than tpar serves is told, after `source` (whose count it is:
/// "17 ranks", "WORLD_SIZE=17", "world size 17").
pub fn too_many_ranks(source: &str) -> String {
    format!(
        "{source}: tpar serves 1 to {MAX_RANKS} ranks (the GPUs of one host); for larger groups use NCCL"
    )
}

/// One protocol for moving and reducing the data. Every transport implements the ones it can;
/// asking a transport for one it lacks is an error, never a silent substitute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Algorithm {
    /// Every rank pushes its whole input into every peer's inbox, then reduces all of them.
    /// One communication step; each rank moves (n-1) x bytes.
    OneShot,
    /// Reduce-scatter (each rank owns 1/n of the elements and reduces them) then all-gather of
    /// the reduced pieces. Two steps; each rank moves 2 (n-1)/n x bytes.
    TwoShot,
    /// Every rank stages its input in its own memory and raises a flag; every rank reads all
    /// peers' inputs (for machines where peer reads beat peer writes).
    OneShotPull,
    /// One-shot push through pinned host memory mapped into every GPU (GPU only: for machines
    /// with no peer-to-peer access at all).
    HostStaged,
    /// One-shot's data in n-1 paced steps: in step s rank r pushes its input to rank r+s and
    /// waits for rank r-s's before its next push, so each rank has one outbound and one
    /// inbound stream at a time (PCIe fabrics whose posted writes collapse under fan-out).
    Staged,
    /// The staged schedule read instead of written: in step s rank r reads rank r-s's
    /// published input (fabrics where writes collapse and reads hold).
    StagedPull,
    /// Hierarchical over islands of ranks (a PCIe switch, a root complex, a socket): a
    /// one-shot inside each island, an exchange of island partial sums between partner ranks of
    /// different islands (over P2P, or through pinned host memory where islands have no P2P
    /// between them), then an all-gather inside each island. See [`crate::protocol::schedule`].
    Islands,
    /// The islands schedule with every exchange read instead of written.
    IslandsPull,
    /// Ring reduce-scatter then ring all-gather, n-1 steps each, with LL lines: each rank talks
    /// to its two ring neighbours only (larger messages on PCIe fabrics).
    Ring,
}

impl Algorithm {
    pub const ALL: [Algorithm; 9] = [
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::OneShotPull,
        Algorithm::HostStaged,
        Algorithm::Staged,
        Algorithm::StagedPull,
        Algorithm::Islands,
        Algorithm::IslandsPull,
        Algorithm::Ring,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::OneShot => "one-shot",
            Algorithm::TwoShot => "two-shot",
            Algorithm::OneShotPull => "one-shot-pull",
            Algorithm::HostStaged => "host-staged",
            Algorithm::Staged => "staged",
            Algorithm::StagedPull => "staged-pull",
            Algorithm::Islands => "islands",
            Algorithm::IslandsPull => "islands-pull",
            Algorithm::Ring => "ring",
        }
    }

    /// The pull algorithms: peers read this rank's plain data and flags, block by block.
    pub fn is_pull(self) -> bool {
        matches!(
            self,
            Algorithm::OneShotPull | Algorithm::StagedPull | Algorithm::IslandsPull
        )
    }

    /// The code carried in a call header.
    pub fn code(self) -> u8 {
        match self {
            Algorithm::OneShot => 1,
            Algorithm::TwoShot => 2,
            Algorithm::OneShotPull => 3,
            Algorithm::HostStaged => 4,
            Algorithm::Staged => 5,
            Algorithm::StagedPull => 6,
            Algorithm::Islands => 7,
            Algorithm::IslandsPull => 8,
            Algorithm::Ring => 9,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Algorithm> {
        Algorithm::ALL.into_iter().find(|a| a.code() == code)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let wanted = s.trim().to_ascii_lowercase().replace('_', "-");
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == wanted || a.name().replace('-', "") == wanted)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown algorithm '{s}'; expected one of: {}",
                    Algorithm::ALL.map(Algorithm::name).join(", ")
                ))
            })
    }
}

/// What runs an allreduce: one of tpar's algorithms or NCCL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Choice {
    Tpar(Algorithm),
    Nccl,
}

impl Choice {
    pub const ALL: [Choice; 10] = [
        Choice::Tpar(Algorithm::ALL[0]),
        Choice::Tpar(Algorithm::ALL[1]),
        Choice::Tpar(Algorithm::ALL[2]),
        Choice::Tpar(Algorithm::ALL[3]),
        Choice::Tpar(Algorithm::ALL[4]),
        Choice::Tpar(Algorithm::ALL[5]),
        Choice::Tpar(Algorithm::ALL[6]),
        Choice::Tpar(Algorithm::ALL[7]),
        Choice::Tpar(Algorithm::ALL[8]),
        Choice::Nccl,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Choice::Tpar(a) => a.name(),
            Choice::Nccl => "nccl",
        }
    }

    /// tpar's algorithm, or None for NCCL.
    pub fn algorithm(self) -> Option<Algorithm> {
        match self {
            Choice::Tpar(a) => Some(a),
            Choice::Nccl => None,
        }
    }
}

impl fmt::Display for Choice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Choice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Choice> {
        if s.trim().eq_ignore_ascii_case("nccl") {
            return Ok(Choice::Nccl);
        }
        s.parse::<Algorithm>().map(Choice::Tpar).map_err(|_| {
            Error::InvalidArgument(format!(
                "unknown algorithm '{s}'; expected one of: {}, nccl",
                Algorithm::ALL.map(Algorithm::name).join(", ")
            ))
        })
    }
}

impl Serialize for Choice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Choice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Choice, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The variable that forces one choice for every call of a process's communicators.
pub const ENV_ALGO: &str = "TPAR_ALGO";

/// What a caller asks a call to run: whatever the dispatcher decides for its size, or one
/// forced choice (which runs or is refused with the reason, never substituted). The one parse
/// of `TPAR_ALGO`, `--algo`/`--algos` and Python's `algorithm=`: `auto` (or nothing) is
/// [`Selection::Auto`], any [`Choice`] name forces that choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Selection {
    #[default]
    Auto,
    Forced(Choice),
}

impl Selection {
    /// Every selection: `auto`, then every choice.
    pub const ALL: [Selection; 11] = [
        Selection::Auto,
        Selection::Forced(Choice::ALL[0]),
        Selection::Forced(Choice::ALL[1]),
        Selection::Forced(Choice::ALL[2]),
        Selection::Forced(Choice::ALL[3]),
        Selection::Forced(Choice::ALL[4]),
        Selection::Forced(Choice::ALL[5]),
        Selection::Forced(Choice::ALL[6]),
        Selection::Forced(Choice::ALL[7]),
        Selection::Forced(Choice::ALL[8]),
        Selection::Forced(Choice::ALL[9]),
    ];

    pub fn name(self) -> &'static str {
        match self {
            Selection::Auto => "auto",
            Selection::Forced(c) => c.name(),
        }
    }

    /// The forced choice, if any.
    pub fn forced(self) -> Option<Choice> {
        match self {
            Selection::Auto => None,
            Selection::Forced(c) => Some(c),
        }
    }

    /// `value` as given by `source` (a variable or argument name, e.g. `TPAR_ALGO`), which an
    /// error names: `TPAR_ALGO=ring: unknown algorithm 'ring'; ...`. Nothing or blank is auto.
    pub fn parse_from(source: &str, value: Option<&str>) -> Result<Selection> {
        match value {
            None => Ok(Selection::Auto),
            Some(v) => v.parse().map_err(|e| {
                // The parse error is itself an InvalidArgument: name it once.
                let why = match e {
                    Error::InvalidArgument(why) => why,
                    other => other.to_string(),
                };
                Error::InvalidArgument(format!("{source}={v}: {why}"))
            }),
        }
    }

    /// What `TPAR_ALGO` selects for this process (auto when unset); a name that is not a
    /// choice is an error, not ignored.
    pub fn from_env() -> Result<Selection> {
        Selection::parse_from(ENV_ALGO, std::env::var(ENV_ALGO).ok().as_deref())
    }
}

impl fmt::Display for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Selection {
    type Err = Error;
    fn from_str(s: &str) -> Result<Selection> {
        let s = s.trim();
        if s.is_empty() || s.eq_ignore_ascii_case("auto") {
            return Ok(Selection::Auto);
        }
        s.parse().map(Selection::Forced).map_err(|_| {
            Error::InvalidArgument(format!(
                "unknown algorithm '{s}'; expected one of: {}, nccl, auto",
                Algorithm::ALL.map(Algorithm::name).join(", ")
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_codes_are_distinct() {
        for a in Algorithm::ALL {
            assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
            assert_eq!(Algorithm::from_code(a.code()), Some(a));
        }
        assert_eq!("OneShot".parse::<Algorithm>().unwrap(), Algorithm::OneShot);
        assert!("three-shot".parse::<Algorithm>().is_err());
        assert_eq!(Algorithm::from_code(0), None);
    }

    #[test]
    fn one_parse_of_a_selection_auto_or_a_forced_choice() {
        for s in Selection::ALL {
            assert_eq!(s.name().parse::<Selection>().unwrap(), s);
        }
        assert_eq!(" AUTO ".parse::<Selection>().unwrap(), Selection::Auto);
        assert_eq!("".parse::<Selection>().unwrap(), Selection::Auto);
        assert_eq!(
            "OneShot".parse::<Selection>().unwrap(),
            Selection::Forced(Choice::Tpar(Algorithm::OneShot))
        );
        assert_eq!(Selection::parse_from("X", None).unwrap(), Selection::Auto);
        assert_eq!(
            Selection::parse_from("X", Some("nccl")).unwrap().forced(),
            Some(Choice::Nccl)
        );
        let err = Selection::parse_from("TPAR_ALGO", Some("rings"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("TPAR_ALGO=rings: ")
                && err.contains("unknown algorithm 'rings'")
                && err.contains("nccl"),
            "{err}"
        );
    }
}
