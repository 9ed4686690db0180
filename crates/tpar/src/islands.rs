//! Islands: a partition of a communicator's ranks into groups whose members reach each other
//! cheaply (one PCIe switch, one root complex, one CPU socket, peer access inside an island but
//! not across). The islands algorithms ([`crate::Algorithm::Islands`] and its pull form) reduce
//! inside each island, exchange island partial sums between partner ranks of different islands,
//! and broadcast inside each island again; [`crate::protocol::schedule`] says exactly how.
//!
//! Islands may be uneven (3+5, 2+2+4) and need not be contiguous in rank order. They are
//! numbered by their lowest rank, and a rank's *position* is its index among its island's
//! members in rank order, so every rank derives the same numbering from the same partition.
//!
//! Written as `4+4` (contiguous sizes in rank order) or `0-3:4-7` / `0,2,4,6:1,3,5,7`
//! (explicit members, islands separated by `:`); [`Islands::from_env`] reads
//! [`ENV_ISLANDS`]. Every rank of a communicator must use the same partition.

use std::fmt;

use crate::algorithm::MAX_RANKS;
use crate::error::{Error, Result};

/// The variable that sets the island partition of a process's communicators (`4+4`,
/// `0-3:4-7`), where the topology cannot say (the CPU backend, ranks sharing one GPU) or to
/// override it.
pub const ENV_ISLANDS: &str = "TPAR_ISLANDS";

/// A partition of `world_size` ranks into islands. Small and `Copy`: it travels in
/// [`crate::Config`] and in kernel arguments.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Islands {
    /// The island of each rank, islands numbered by their lowest rank.
    island_of: [u8; MAX_RANKS],
    world_size: u8,
    count: u8,
}

impl Islands {
    /// All `world_size` ranks in one island.
    ///
    /// # Panics
    /// Where `world_size` is not 1 to [`MAX_RANKS`]; the communicators refuse such groups first.
    pub fn single(world_size: usize) -> Islands {
        Islands::from_island_of(&vec![0; world_size]).expect("one island is a valid partition")
    }

    /// Contiguous islands of the given sizes in rank order: `[4, 4]` is ranks 0-3 and 4-7.
    pub fn from_sizes(sizes: &[usize]) -> Result<Islands> {
        if let Some(i) = sizes.iter().position(|&s| s == 0) {
            return Err(Error::InvalidArgument(format!(
                "island {i} of {sizes:?} is empty; every island needs at least one rank"
            )));
        }
        let island_of: Vec<usize> = sizes
            .iter()
            .enumerate()
            .flat_map(|(i, &s)| std::iter::repeat_n(i, s))
            .collect();
        Islands::from_island_of(&island_of)
    }

    /// The partition that puts rank r in island `island_of[r]` (any labels: islands are
    /// renumbered by their lowest rank).
    pub fn from_island_of(island_of: &[usize]) -> Result<Islands> {
        let n = island_of.len();
        if n == 0 || n > MAX_RANKS {
            return Err(Error::InvalidArgument(format!(
                "islands need 1 to {MAX_RANKS} ranks; {n} given"
            )));
        }
        let mut renumbered = [0u8; MAX_RANKS];
        let mut labels: Vec<usize> = Vec::new();
        for (rank, label) in island_of.iter().enumerate() {
            let index = match labels.iter().position(|l| l == label) {
                Some(i) => i,
                None => {
                    labels.push(*label);
                    labels.len() - 1
                }
            };
            renumbered[rank] = index as u8;
        }
        Ok(Islands {
            island_of: renumbered,
            world_size: n as u8,
            count: labels.len() as u8,
        })
    }

    /// `4+4`, `3+5`, `2+2+4` (contiguous sizes) or `0-3:4-7`, `0,2,4,6:1,3,5,7` (members,
    /// islands separated by `:`), for `world_size` ranks; every rank in exactly one island.
    pub fn parse(text: &str, world_size: usize) -> Result<Islands> {
        let text = text.trim();
        let bad = |why: String| {
            Error::InvalidArgument(format!(
                "islands '{text}': {why}; write sizes in rank order (4+4, 3+5, 2+2+4) or members \
                 with ':' between islands (0-3:4-7, 0,2,4,6:1,3,5,7)"
            ))
        };
        let number = |s: &str| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| bad(format!("'{}' is not a whole number", s.trim())))
        };
        let islands = if !text.contains(':')
            && !text.contains(',')
            && !text.contains('-')
            && !text.is_empty()
        {
            let sizes = text.split('+').map(number).collect::<Result<Vec<_>>>()?;
            let total: usize = sizes.iter().sum();
            if total != world_size {
                return Err(bad(format!(
                    "the sizes add up to {total} ranks, not the {world_size} of this group"
                )));
            }
            Islands::from_sizes(&sizes).map_err(|e| bad(e.to_string()))?
        } else {
            let mut island_of = vec![usize::MAX; world_size];
            for (island, members) in text.split(':').enumerate() {
                if members.trim().is_empty() {
                    return Err(bad(format!("island {island} is empty")));
                }
                for item in members.split(',') {
                    let (first, last) = match item.split_once('-') {
                        Some((a, b)) => (number(a)?, number(b)?),
                        None => (number(item)?, number(item)?),
                    };
                    if first > last {
                        return Err(bad(format!("the range {first}-{last} runs backwards")));
                    }
                    if last >= world_size {
                        return Err(bad(format!(
                            "rank {last} is not in a group of {world_size}"
                        )));
                    }
                    for (rank, slot) in island_of.iter_mut().enumerate().take(last + 1).skip(first)
                    {
                        if *slot != usize::MAX {
                            return Err(bad(format!("rank {rank} is in two islands")));
                        }
                        *slot = island;
                    }
                }
            }
            if let Some(rank) = island_of.iter().position(|&i| i == usize::MAX) {
                return Err(bad(format!("rank {rank} is in no island")));
            }
            Islands::from_island_of(&island_of).map_err(|e| bad(e.to_string()))?
        };
        Ok(islands)
    }

    /// The partition [`ENV_ISLANDS`] sets for `world_size` ranks: `None` when it is unset or
    /// blank; a value that does not describe `world_size` ranks is an error naming it.
    pub fn from_env(world_size: usize) -> Result<Option<Islands>> {
        match std::env::var(ENV_ISLANDS) {
            Ok(v) if !v.trim().is_empty() => {
                Islands::parse(&v, world_size).map(Some).map_err(|e| {
                    // The parse's own words, without a second "invalid argument: ".
                    let why = match e {
                        Error::InvalidArgument(why) => why,
                        other => other.to_string(),
                    };
                    Error::InvalidArgument(format!("{ENV_ISLANDS}={v}: {why}"))
                })
            }
            _ => Ok(None),
        }
    }

    pub fn world_size(&self) -> usize {
        usize::from(self.world_size)
    }

    /// How many islands.
    pub fn count(&self) -> usize {
        usize::from(self.count)
    }

    /// The island `rank` belongs to.
    pub fn island_of(&self, rank: usize) -> usize {
        debug_assert!(rank < self.world_size());
        usize::from(self.island_of[rank])
    }

    /// The ranks of `island`, in rank order.
    pub fn members(&self, island: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.world_size()).filter(move |&r| self.island_of(r) == island)
    }

    /// How many ranks `island` has.
    pub fn size(&self, island: usize) -> usize {
        self.members(island).count()
    }

    /// `rank`'s index among its island's members (rank order).
    pub fn position(&self, rank: usize) -> usize {
        let island = self.island_of(rank);
        (0..rank).filter(|&r| self.island_of(r) == island).count()
    }

    /// The member of `island` at `position`.
    pub fn member(&self, island: usize, position: usize) -> usize {
        self.members(island)
            .nth(position)
            .expect("position within the island")
    }

    /// The island of each rank, as the kernels take it.
    pub fn island_of_ranks(&self) -> [u8; MAX_RANKS] {
        self.island_of
    }

    /// The partitions a self-test sweeps the islands algorithms over for `world_size` ranks:
    /// one island, two halves (the larger second for an odd count), one rank and the rest, two
    /// and two and the rest, and every other rank (interleaved), each where it fits, without
    /// repeats.
    pub fn test_partitions(world_size: usize) -> Vec<Islands> {
        let n = world_size;
        let mut sizes: Vec<Vec<usize>> = vec![vec![n]];
        if n >= 2 {
            sizes.push(vec![n / 2, n - n / 2]);
            sizes.push(vec![1, n - 1]);
        }
        if n >= 5 {
            sizes.push(vec![2, 2, n - 4]);
        }
        let mut partitions: Vec<Islands> = sizes
            .iter()
            .filter_map(|s| Islands::from_sizes(s).ok())
            .collect();
        if n >= 4 {
            let interleaved: Vec<usize> = (0..n).map(|r| r % 2).collect();
            partitions.extend(Islands::from_island_of(&interleaved).ok());
        }
        let mut unique = Vec::new();
        for p in partitions {
            if !unique.contains(&p) {
                unique.push(p);
            }
        }
        unique
    }

    /// Whether the islands are contiguous in rank order (then [`fmt::Display`] writes sizes).
    fn contiguous(&self) -> bool {
        (1..self.world_size()).all(|r| {
            self.island_of(r) == self.island_of(r - 1)
                || self.island_of(r) == self.island_of(r - 1) + 1
        })
    }
}

/// The variable that says which form of the islands algorithm's exchange a process's
/// communicators run ([`IslandsExchange`]): `ranges`, `all`, or a size in bytes (`16384`, `16K`)
/// up to which calls take the all-units form. Every rank must give the same (a call whose ranks
/// differ is named as a mismatch).
pub const ENV_ISLANDS_EXCHANGE: &str = "TPAR_ISLANDS_EXCHANGE";

/// Which form the islands algorithm's exchange between islands takes (protocol::schedule):
/// *ranges*, where each member of an island receives the other islands' partials over its
/// range only and then gathers the other ranges from its island (three steps), or *all units*,
/// where each member receives every island's partial of every unit from its partner (two
/// steps, at the island's size times the traffic between islands). Both give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IslandsExchange {
    /// Calls of up to this many bytes take the all-units form.
    all_units_max_bytes: usize,
}

impl IslandsExchange {
    /// Without a setting and without a model of the machine: the all-units form wherever it
    /// fits one launch (one H200, 8 ranks sharing it, 4+4: faster at every size from 4 to 64
    /// KiB; bench/README.md, "Eighth session"). [`crate::Communicator`] replaces it with the
    /// fabric model's bound for the machine (`Fabric::islands_all_units_max_bytes`).
    pub const UNMODELLED: IslandsExchange = IslandsExchange {
        all_units_max_bytes: usize::MAX,
    };

    /// Calls of up to `bytes` bytes in the all-units form.
    pub const fn all_units_up_to(bytes: usize) -> IslandsExchange {
        IslandsExchange {
            all_units_max_bytes: bytes,
        }
    }

    /// From [`ENV_ISLANDS_EXCHANGE`]: `None` where it is unset or `auto` (the model decides).
    pub fn from_env() -> Result<Option<IslandsExchange>> {
        match std::env::var(ENV_ISLANDS_EXCHANGE) {
            Ok(text) => IslandsExchange::parse(&text),
            Err(_) => Ok(None),
        }
    }

    /// `ranges`, `all`, `auto` (`None`), or a size in bytes with an optional K or M suffix.
    pub fn parse(text: &str) -> Result<Option<IslandsExchange>> {
        let t = text.trim();
        let bytes = match t.to_ascii_lowercase().as_str() {
            "auto" => return Ok(None),
            "ranges" => Some(0),
            "all" => Some(usize::MAX),
            lower => {
                let (digits, scale) = match lower.strip_suffix('k') {
                    Some(d) => (d, 1 << 10),
                    None => match lower.strip_suffix('m') {
                        Some(d) => (d, 1 << 20),
                        None => (lower, 1),
                    },
                };
                digits
                    .parse::<usize>()
                    .ok()
                    .and_then(|n| n.checked_mul(scale))
            }
        };
        bytes.map(|b| Some(IslandsExchange::all_units_up_to(b))).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{ENV_ISLANDS_EXCHANGE}={text:?} is not a form of the islands exchange: give ranges, all, auto, or a size in bytes (16384, 16K) up to which calls exchange all units"
            ))
        })
    }

    /// Calls of up to this many bytes take the all-units form.
    pub fn all_units_max_bytes(&self) -> usize {
        self.all_units_max_bytes
    }

    /// Whether a call of `bytes` takes the all-units form (where it fits one launch).
    pub fn all_units_at(&self, bytes: usize) -> bool {
        bytes <= self.all_units_max_bytes
    }
}

impl fmt::Display for Islands {
    /// `4+4` where the islands are contiguous in rank order, else `0,2,4,6:1,3,5,7`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.contiguous() {
            let sizes: Vec<String> = (0..self.count())
                .map(|i| self.size(i).to_string())
                .collect();
            return f.write_str(&sizes.join("+"));
        }
        let islands: Vec<String> = (0..self.count())
            .map(|i| {
                self.members(i)
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .collect();
        f.write_str(&islands.join(":"))
    }
}

impl fmt::Debug for Islands {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Islands({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_members_describe_the_same_partitions() {
        let a = Islands::parse("4+4", 8).unwrap();
        let b = Islands::parse("0-3:4-7", 8).unwrap();
        assert_eq!(a, b);
        assert_eq!((a.count(), a.size(0), a.size(1)), (2, 4, 4));
        assert_eq!(a.to_string(), "4+4");
        let uneven = Islands::parse("3+5", 8).unwrap();
        assert_eq!(uneven.members(1).collect::<Vec<_>>(), vec![3, 4, 5, 6, 7]);
        assert_eq!((uneven.position(5), uneven.member(1, 2)), (2, 5));
        let three = Islands::parse("2+2+4", 8).unwrap();
        assert_eq!(three.island_of(4), 2);
        assert_eq!(three.to_string(), "2+2+4");
    }

    #[test]
    fn interleaved_islands_are_numbered_by_their_lowest_rank() {
        let i = Islands::parse("1,3,5,7:0,2,4,6", 8).unwrap();
        assert_eq!(i.island_of(0), 0);
        assert_eq!(i.island_of(1), 1);
        assert_eq!(i.members(0).collect::<Vec<_>>(), vec![0, 2, 4, 6]);
        assert_eq!(i.position(6), 3);
        assert_eq!(i.to_string(), "0,2,4,6:1,3,5,7");
        assert_eq!(Islands::parse(&i.to_string(), 8).unwrap(), i);
    }

    #[test]
    fn bad_partitions_say_what_is_wrong_and_how_to_write_one() {
        for (text, n, want) in [
            ("4+3", 8, "add up to 7"),
            ("4+0+4", 8, "empty"),
            ("0-3:3-7", 8, "rank 3 is in two islands"),
            ("0-2:4-7", 8, "rank 3 is in no island"),
            ("0-8", 8, "rank 8 is not in a group of 8"),
            ("x+4", 8, "'x' is not a whole number"),
            ("3-1:0", 4, "backwards"),
            ("0-3::4-7", 8, "island 1 is empty"),
        ] {
            let err = Islands::parse(text, n).unwrap_err().to_string();
            assert!(err.contains(want) && err.contains("4+4"), "{text}: {err}");
        }
        assert!(Islands::from_sizes(&[16, 1]).is_err());
    }

    #[test]
    fn self_tests_sweep_uneven_and_interleaved_partitions() {
        let eight: Vec<String> = Islands::test_partitions(8)
            .iter()
            .map(|p| p.to_string())
            .collect();
        assert_eq!(eight, ["8", "4+4", "1+7", "2+2+4", "0,2,4,6:1,3,5,7"]);
        let two: Vec<String> = Islands::test_partitions(2)
            .iter()
            .map(|p| p.to_string())
            .collect();
        assert_eq!(two, ["2", "1+1"]);
        // 3: one island, and 1+2 (the halves and one-and-the-rest coincide).
        assert_eq!(Islands::test_partitions(3).len(), 2);
        assert_eq!(Islands::test_partitions(1).len(), 1);
    }

    #[test]
    fn one_island_holds_every_rank() {
        let one = Islands::single(5);
        assert_eq!((one.count(), one.size(0), one.position(4)), (1, 5, 4));
        assert_eq!(one.to_string(), "5");
    }

    #[test]
    fn islands_exchange_reads_its_forms_and_refuses_others() {
        let form = |t| IslandsExchange::parse(t).unwrap().unwrap();
        assert!(!form("ranges").all_units_at(1));
        assert!(form("all").all_units_at(1 << 30));
        let k = form("16K");
        assert!(k.all_units_at(16384) && !k.all_units_at(16385));
        assert!(form("4096").all_units_at(4096));
        assert_eq!(IslandsExchange::parse("auto").unwrap(), None);
        for bad in ["", "many", "16Q", "-1"] {
            let err = IslandsExchange::parse(bad).unwrap_err().to_string();
            assert!(
                err.contains(ENV_ISLANDS_EXCHANGE) && err.contains("ranges"),
                "{err}"
            );
        }
    }
}
