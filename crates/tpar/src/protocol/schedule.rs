//! What every algorithm moves, step by step: the one definition of each schedule that the
//! backends implement (the CPU backend in Rust, the GPU kernels in `kernels/*.cu`) and that the
//! fabric model costs. A message is cut into *units* of [`UNIT_BYTES`] (the payload of one
//! 16-byte LL line on the GPU), so shares, ring chunks and island ranges fall at the same
//! places on every backend.
//!
//! A *message* is one exchange: a call larger than a backend's chunk is cut into chunks (each
//! one launch on a GPU, one round on the CPU), and each chunk follows the schedule on its own,
//! with `U` its units. Only the ring's order depends on where an element sits in its message
//! (its chunk c), so ring results agree bit for bit between backends only where they cut
//! calls at the same places; every other algorithm's order does not depend on it.
//!
//! # The algorithms
//!
//! `n` ranks, each with an input `x_r`; `share(U, m, i)` is [`share`]. Sums are taken in f32
//! and rounded to the dtype once, at the end, in the order given here, so every rank gets the
//! same bits and every backend the same bits for the same algorithm.
//!
//! - **one-shot** (and **host-staged**, the same through pinned host memory): each rank writes
//!   its whole input to every peer; each rank sums `x_0 + x_1 + ... + x_{n-1}` (rank order).
//! - **two-shot**: reduce-scatter (rank r writes `share(U, n, q)` of its input to each owner
//!   q; q sums its share in rank order) then all-gather (q writes its rounded share to every
//!   rank).
//! - **one-shot-pull**: each rank publishes its input; each rank reads every peer's, sums in
//!   rank order.
//! - **staged**: steps s = 1..n-1; in step s rank r writes its whole input to rank
//!   `(r + s) % n` and, before its next write, waits until rank `(r - s) % n`'s input has
//!   arrived, so each rank has one outbound and one inbound stream at a time. Sum in rank order.
//! - **staged-pull**: each rank publishes its input; in step s rank r reads rank
//!   `(r - s) % n`'s. Sum in rank order.
//! - **islands**: with islands `I_0..I_{k-1}` ([`Islands`], numbered by lowest rank):
//!   1. inside: each rank writes its input to every member of its island; each member sums its
//!      island's inputs in rank order into the island partial `P_I` (f32, not rounded);
//!   2. across: island J splits the units among its members, `R_J(q) = share(U, |J|, q)` for
//!      the member at position q; for every other island I, the member of I at position
//!      `q % |I|` writes `P_I` over `R_J(q)` (as f32) to J's member q. That member then holds
//!      every island's partial over its range and sums them in island order:
//!      `final = round(P_{I_0} + P_{I_1} + ...)`;
//!   3. inside: each member writes its rounded range to every member of its island.
//!
//!   With one island this is one-shot's sum, in one-shot's order.
//!
//!   Small calls may take the *all-units* form of step 2 ([`islands_all_units`]): the member
//!   of I at position `q % |I|` writes `P_I` of every unit to J's member q, so every rank holds
//!   every island's partial of every unit, sums them in island order itself, and step 3 goes:
//!   one step fewer, at |J| times the bytes between islands. The sum, and so the bits, are the
//!   same.
//! - **islands-pull**: the same three steps, each read instead of written: members read their
//!   island peers' inputs, then the partner's published partial over their range, then their
//!   island peers' published finals.
//! - **ring**: chunk c is `share(U, n, c)`. Reduce-scatter, steps s = 0..n-2: rank r writes its
//!   f32 partial of chunk `(r - s - 1) % n` to rank `(r + 1) % n` (at s = 0 its own input of
//!   that chunk); the receiver adds its own input. So chunk c is summed in the order
//!   `x_{c+1}, x_{c+2}, ..., x_{c+n-1}, x_c` (indices mod n) and finished at rank c, which
//!   rounds it. All-gather, steps s = 0..n-2: rank r writes the rounded chunk `(r - s) % n` to
//!   rank `(r + 1) % n`.
//!
//! Partials that cross ranks (islands, ring) travel as f32, so the sum is rounded once as for
//! every other algorithm.

use std::ops::Range;

use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::islands::Islands;

/// Payload bytes of one unit: the data of one 16-byte LL line (two 4-byte words, each beside
/// its own copy of the tag).
pub const UNIT_BYTES: usize = 8;

/// Units of a message of `bytes` (the last one zero-padded).
pub fn units_for_bytes(bytes: usize) -> usize {
    bytes.div_ceil(UNIT_BYTES)
}

/// Bytes of `dtype` data whose f32 partials fit where a slot carries `slot_bytes` of data: a
/// partial is f32 whatever the dtype, so 16-bit data fits half as much. It bounds every launch
/// (CUDA) and round (CPU) of the islands and ring algorithms, and the islands' all-units form.
pub fn partials_fitting(slot_bytes: usize, dtype: DType) -> usize {
    slot_bytes * dtype.size() / 4
}

/// Units of `dtype` whose f32 partials fit a slot of `slot_units` units: an islands range or
/// a ring chunk of one launch, and the islands' all-units form's largest launch.
pub fn partial_slot_units(dtype: DType, slot_units: usize) -> usize {
    partials_fitting(slot_units * UNIT_BYTES, dtype) / UNIT_BYTES
}

/// Units one launch of `algorithm` carries on the GPU (one message of the schedule) where a
/// slot carries `slot_units` units: a whole slot, except where f32 partials must fit a slot.
/// The islands' exchange puts a range of the smallest island's split there, so a launch is
/// that island's size times a slot of partials (at most a slot). The ring gives every step's
/// chunk a slot of its own (kernels/ring.cu), so a launch is n chunks of a slot of partials:
/// up to n slots. The CUDA communicator cuts calls by it and the fabric model costs its
/// launches by it.
pub fn launch_units(
    algorithm: Algorithm,
    islands: &Islands,
    dtype: DType,
    slot_units: usize,
) -> usize {
    let partial_slot = partial_slot_units(dtype, slot_units);
    let units = match algorithm {
        Algorithm::Islands => {
            let smallest = (0..islands.count())
                .map(|i| islands.size(i))
                .min()
                .unwrap_or(1);
            (smallest * partial_slot).min(slot_units)
        }
        Algorithm::Ring => islands.world_size().max(1) * partial_slot,
        _ => slot_units,
    };
    units.max(1)
}

/// The part of `units` that member `i` of `m` owns: contiguous, in order, sizes differing by at
/// most one (the first `units % m` members take one more).
pub fn share(units: usize, m: usize, i: usize) -> Range<usize> {
    debug_assert!(i < m);
    let base = units / m;
    let extra = units % m;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// In the islands algorithms, the rank of island `from` that sends island `from`'s partial over
/// `to_member`'s range (step 2): the member of `from` at position `position(to_member) %
/// size(from)`.
pub fn island_sender(islands: &Islands, from: usize, to_member: usize) -> usize {
    let position = islands.position(to_member) % islands.size(from);
    islands.member(from, position)
}

/// The ring's neighbours of `rank`: (the one it receives from, the one it sends to).
pub fn ring_neighbours(rank: usize, n: usize) -> (usize, usize) {
    ((rank + n - 1) % n, (rank + 1) % n)
}

/// The chunk rank r sends in reduce-scatter step s of the ring.
pub fn ring_reduce_chunk(rank: usize, n: usize, step: usize) -> usize {
    (rank + 2 * n - step - 1) % n
}

/// The chunk rank r sends in all-gather step s of the ring.
pub fn ring_gather_chunk(rank: usize, n: usize, step: usize) -> usize {
    (rank + n - step) % n
}

/// How a transfer moves data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// `from` writes into `to`'s memory (posted writes).
    Write,
    /// `to` reads from `from`'s memory (non-posted reads).
    Read,
}

/// One movement of data between two ranks in a step: `bytes` on the wire (LL lines count their
/// tags) from `from`'s data to `to`. `via_host`: staged through pinned host memory (written to
/// the host over `from`'s link, read back over `to`'s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub from: usize,
    pub to: usize,
    pub bytes: u64,
    pub access: Access,
    pub via_host: bool,
}

impl Transfer {
    fn new(from: usize, to: usize, bytes: u64, access: Access, via_host: bool) -> Transfer {
        Transfer {
            from,
            to,
            bytes,
            access,
            via_host,
        }
    }
}

/// The transfers that run at once; a step begins when the one before it has ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    pub transfers: Vec<Transfer>,
}

/// Wire bytes of `units` sent as LL lines (16 bytes carry 8 of payload).
fn ll_bytes(units: usize) -> u64 {
    2 * (units * UNIT_BYTES) as u64
}

/// Wire bytes of `units` of data sent as f32 partials in LL lines (16-bit dtypes double).
fn ll_partial_bytes(units: usize, dtype: DType) -> u64 {
    ll_bytes(units) * 4 / dtype.size() as u64
}

/// Plain bytes of `units` (pull reads).
fn plain_bytes(units: usize) -> u64 {
    (units * UNIT_BYTES) as u64
}

/// Plain bytes of `units` read as f32 partials.
fn plain_partial_bytes(units: usize, dtype: DType) -> u64 {
    plain_bytes(units) * 4 / dtype.size() as u64
}

/// The steps `algorithm` takes for one call of `bytes` of `dtype` over `islands` (which also
/// gives the world size; only the islands algorithms use its partition). `cross_via_host`: the
/// islands' exchange goes through host memory (no P2P between islands). Host-staged's every
/// transfer is via the host. Ranks with no data to move (an empty share) move nothing.
pub fn steps(
    algorithm: Algorithm,
    islands: &Islands,
    dtype: DType,
    bytes: usize,
    cross_via_host: bool,
) -> Vec<Step> {
    let n = islands.world_size();
    let units = units_for_bytes(bytes);
    let t = Transfer::new;
    let all_pairs = |bytes: &dyn Fn(usize, usize) -> u64, access, via_host| Step {
        transfers: (0..n)
            .flat_map(|from| (0..n).map(move |to| (from, to)))
            .filter(|&(from, to)| from != to)
            .map(|(from, to)| t(from, to, bytes(from, to), access, via_host))
            .filter(|x| x.bytes > 0)
            .collect(),
    };
    let mut steps = match algorithm {
        Algorithm::OneShot => vec![all_pairs(&|_, _| ll_bytes(units), Access::Write, false)],
        Algorithm::HostStaged => vec![all_pairs(&|_, _| ll_bytes(units), Access::Write, true)],
        Algorithm::OneShotPull => vec![all_pairs(&|_, _| plain_bytes(units), Access::Read, false)],
        Algorithm::TwoShot => vec![
            all_pairs(
                &|_, to| ll_bytes(share(units, n, to).len()),
                Access::Write,
                false,
            ),
            all_pairs(
                &|from, _| ll_bytes(share(units, n, from).len()),
                Access::Write,
                false,
            ),
        ],
        Algorithm::Staged | Algorithm::StagedPull => (1..n)
            .map(|s| {
                let pull = algorithm == Algorithm::StagedPull;
                Step {
                    transfers: (0..n)
                        .map(|r| {
                            let (bytes, access) = if pull {
                                (plain_bytes(units), Access::Read)
                            } else {
                                (ll_bytes(units), Access::Write)
                            };
                            t(r, (r + s) % n, bytes, access, false)
                        })
                        .filter(|x| x.bytes > 0)
                        .collect(),
                }
            })
            .collect(),
        Algorithm::Islands | Algorithm::IslandsPull => islands_steps(
            islands,
            dtype,
            units,
            cross_via_host,
            algorithm == Algorithm::IslandsPull,
            false,
        ),
        Algorithm::Ring => {
            let reduce = (0..n.saturating_sub(1)).map(|s| Step {
                transfers: (0..n)
                    .map(|r| {
                        let chunk = share(units, n, ring_reduce_chunk(r, n, s)).len();
                        t(
                            r,
                            (r + 1) % n,
                            ll_partial_bytes(chunk, dtype),
                            Access::Write,
                            false,
                        )
                    })
                    .filter(|x| x.bytes > 0)
                    .collect(),
            });
            let gather = (0..n.saturating_sub(1)).map(|s| Step {
                transfers: (0..n)
                    .map(|r| {
                        let chunk = share(units, n, ring_gather_chunk(r, n, s)).len();
                        t(r, (r + 1) % n, ll_bytes(chunk), Access::Write, false)
                    })
                    .filter(|x| x.bytes > 0)
                    .collect(),
            });
            reduce.chain(gather).collect()
        }
    };
    steps.retain(|s| !s.transfers.is_empty());
    steps
}

/// The islands algorithm's steps in its all-units form (see the module's doc): inside, then
/// each island's partial of every unit from its sender to every member of every other island;
/// no third step.
pub fn islands_all_units(
    islands: &Islands,
    dtype: DType,
    bytes: usize,
    cross_via_host: bool,
) -> Vec<Step> {
    let mut steps = islands_steps(
        islands,
        dtype,
        units_for_bytes(bytes),
        cross_via_host,
        false,
        true,
    );
    steps.retain(|s| !s.transfers.is_empty());
    steps
}

/// The islands algorithms' steps over `units`: written or, `pull`, read; in the three-step
/// form, or `all_units` (each partial over every unit, no gather inside the islands).
fn islands_steps(
    islands: &Islands,
    dtype: DType,
    units: usize,
    cross_via_host: bool,
    pull: bool,
    all_units: bool,
) -> Vec<Step> {
    let n = islands.world_size();
    let t = Transfer::new;
    let access = if pull { Access::Read } else { Access::Write };
    let same_island = |a: usize, b: usize| islands.island_of(a) == islands.island_of(b);
    let range = |q: usize| {
        if all_units {
            return units;
        }
        let island = islands.island_of(q);
        share(units, islands.size(island), islands.position(q)).len()
    };
    let inside = |bytes: &dyn Fn(usize) -> u64| Step {
        transfers: (0..n)
            .flat_map(|from| (0..n).map(move |to| (from, to)))
            .filter(|&(from, to)| from != to && same_island(from, to))
            .map(|(from, to)| t(from, to, bytes(from), access, false))
            .filter(|x| x.bytes > 0)
            .collect(),
    };
    let across = Step {
        transfers: (0..n)
            .flat_map(|to| {
                (0..islands.count())
                    .filter(move |&i| i != islands.island_of(to))
                    .map(move |i| (island_sender(islands, i, to), to))
            })
            .map(|(from, to)| {
                let bytes = if pull {
                    plain_partial_bytes(range(to), dtype)
                } else {
                    ll_partial_bytes(range(to), dtype)
                };
                t(from, to, bytes, access, cross_via_host)
            })
            .filter(|x| x.bytes > 0)
            .collect(),
    };
    let input = |_| {
        if pull {
            plain_bytes(units)
        } else {
            ll_bytes(units)
        }
    };
    let finals = |from: usize| {
        if pull {
            plain_bytes(range(from))
        } else {
            ll_bytes(range(from))
        }
    };
    if all_units {
        vec![inside(&input), across]
    } else {
        vec![inside(&input), across, inside(&finals)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sums of units each rank ends with, by following the steps as data flow: every rank must
    /// end with every rank's contribution to every unit exactly once.
    #[test]
    fn shares_cover_every_unit_once_in_order() {
        for units in [0, 1, 7, 8, 9, 1000] {
            for m in 1..=16 {
                let mut next = 0;
                for i in 0..m {
                    let r = share(units, m, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == units / m || r.len() == units / m + 1);
                    next = r.end;
                }
                assert_eq!(next, units);
            }
        }
    }

    #[test]
    fn the_ring_sums_each_chunk_once_from_every_rank_and_finishes_it_at_its_own_rank() {
        for n in 2..=16 {
            for c in 0..n {
                // Follow chunk c through the reduce-scatter: who sends it at each step.
                let mut holders = Vec::new();
                for s in 0..n - 1 {
                    let senders: Vec<usize> = (0..n)
                        .filter(|&r| ring_reduce_chunk(r, n, s) == c)
                        .collect();
                    assert_eq!(senders.len(), 1, "n {n} chunk {c} step {s}");
                    holders.push(senders[0]);
                }
                let order: Vec<usize> = (1..n).map(|k| (c + k) % n).collect();
                assert_eq!(holders, order, "n {n} chunk {c}: summed in ring order");
                // The last sender's successor is the chunk's owner.
                assert_eq!((holders[n - 2] + 1) % n, c);
                // All-gather: chunk c leaves c at step 0 and reaches every rank once.
                let mut reached = vec![c];
                for s in 0..n - 1 {
                    let sender = (0..n).find(|&r| ring_gather_chunk(r, n, s) == c).unwrap();
                    assert_eq!(sender, *reached.last().unwrap());
                    reached.push((sender + 1) % n);
                }
                reached.sort_unstable();
                assert_eq!(reached, (0..n).collect::<Vec<_>>());
            }
        }
    }

    /// `to` receives, among `transfers`, exactly one from each island but its own.
    fn assert_from_every_other_island(
        islands: &Islands,
        transfers: &[Transfer],
        to: usize,
        text: &str,
    ) {
        let mut from_islands: Vec<usize> = transfers
            .iter()
            .filter(|t| t.to == to)
            .map(|t| islands.island_of(t.from))
            .collect();
        from_islands.sort_unstable();
        let want: Vec<usize> = (0..islands.count())
            .filter(|&i| i != islands.island_of(to))
            .collect();
        assert_eq!(from_islands, want, "{text}: rank {to}");
    }

    #[test]
    fn every_member_gets_every_other_islands_partial_over_its_range_from_one_sender() {
        for (text, n) in [
            ("4+4", 8),
            ("3+5", 8),
            ("2+2+4", 8),
            ("1+7", 8),
            ("8", 8),
            ("0,2,4,6:1,3,5,7", 8),
            ("1+1", 2),
        ] {
            let islands = Islands::parse(text, n).unwrap();
            let steps = steps(Algorithm::Islands, &islands, DType::Bf16, 8 * 1000, false);
            let across: Vec<Transfer> = steps
                .iter()
                .flat_map(|s| s.transfers.iter().copied())
                .filter(|t| islands.island_of(t.from) != islands.island_of(t.to))
                .collect();
            for to in 0..n {
                assert_from_every_other_island(&islands, &across, to, text);
            }
        }
    }

    #[test]
    fn the_all_units_form_gives_every_rank_every_other_islands_whole_partial_in_two_steps() {
        let units = 1000;
        let bytes = 8 * units;
        for (text, n) in [
            ("4+4", 8),
            ("3+5", 8),
            ("2+2+4", 8),
            ("1+7", 8),
            ("0,2,4,6:1,3,5,7", 8),
        ] {
            let islands = Islands::parse(text, n).unwrap();
            let all = islands_all_units(&islands, DType::Bf16, bytes, false);
            let ranges = steps(Algorithm::Islands, &islands, DType::Bf16, bytes, false);
            assert_eq!(all.len(), 2, "{text}: inside and across only");
            assert_eq!(all[0], ranges[0], "{text}: the same first step");
            for t in &all[1].transfers {
                // Every unit's partial: f32 in LL lines, four times the bf16 data.
                assert_eq!(t.bytes, 4 * bytes as u64, "{text}: {t:?}");
            }
            for to in 0..n {
                assert_from_every_other_island(&islands, &all[1].transfers, to, text);
            }
        }
    }

    #[test]
    fn staged_steps_give_each_rank_one_outbound_and_one_inbound_stream() {
        let islands = Islands::single(8);
        for algorithm in [Algorithm::Staged, Algorithm::StagedPull] {
            let steps = steps(algorithm, &islands, DType::Bf16, 4096, false);
            assert_eq!(steps.len(), 7);
            for step in &steps {
                for r in 0..8 {
                    assert_eq!(step.transfers.iter().filter(|t| t.from == r).count(), 1);
                    assert_eq!(step.transfers.iter().filter(|t| t.to == r).count(), 1);
                }
            }
        }
    }

    #[test]
    fn wire_bytes_follow_the_protocol() {
        let islands = Islands::single(4);
        let one = steps(Algorithm::OneShot, &islands, DType::Bf16, 4096, false);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].transfers.len(), 12);
        assert!(one[0].transfers.iter().all(|t| t.bytes == 8192));
        let pull = steps(Algorithm::OneShotPull, &islands, DType::Bf16, 4096, false);
        assert!(pull[0]
            .transfers
            .iter()
            .all(|t| t.bytes == 4096 && t.access == Access::Read));
        let ring = steps(Algorithm::Ring, &islands, DType::Bf16, 4096, false);
        assert_eq!(ring.len(), 6);
        // Reduce-scatter carries f32 partials of bf16: four times the payload of a chunk.
        assert!(ring[0].transfers.iter().all(|t| t.bytes == 4 * 1024));
        assert!(ring[5].transfers.iter().all(|t| t.bytes == 2 * 1024));
        let host = steps(Algorithm::HostStaged, &islands, DType::F32, 64, false);
        assert!(host[0].transfers.iter().all(|t| t.via_host));
        assert!(steps(
            Algorithm::OneShot,
            &Islands::single(1),
            DType::F32,
            64,
            false
        )
        .is_empty());
    }
}
