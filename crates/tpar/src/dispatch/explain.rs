//! The words of a decision: the machine's class and islands as a sentence, the fabric model's
//! ranking, size ranges of a table. Users read these in `tpar doctor`, in logs and in errors;
//! tests check them word for word.

use super::fabric::Fabric;
use super::rules::{distinct_pairs, Class};
use crate::algorithm::Choice;
use crate::memory::human_bytes;
use crate::topology::Topology;

/// The class in words, naming the first pair of GPUs without P2P where that decides, and the
/// islands where the class has more than one.
pub(super) fn describe_machine(topology: &Topology, world_size: usize, fabric: &Fabric) -> String {
    let class = fabric.class();
    let mut text = if class == Class::NoP2p {
        distinct_pairs(topology, world_size)
            .into_iter()
            .find_map(|(a, b)| {
                let l = topology.link(a, b)?;
                (!(l.p2p_read && l.p2p_write)).then(|| {
                    format!(
                        "GPUs {a} and {b} ({}) have no peer-to-peer access",
                        l.path.label()
                    )
                })
            })
            .unwrap_or_else(|| class.describe().to_owned())
    } else {
        class.describe().to_owned()
    };
    if let Some(islands) = fabric.islands().filter(|i| i.count() > 1) {
        text.push_str(&format!(
            "; islands {islands}{}",
            if fabric.cross_via_host() {
                ", across through host memory"
            } else {
                ""
            }
        ));
    }
    text
}

/// `one-shot up to 64 KiB, two-shot up to 1 MiB, nccl above` for (largest size, choice) pairs.
pub fn describe_ranges(ranges: impl Iterator<Item = (u64, Choice)>) -> String {
    ranges
        .map(|(max_bytes, choice)| {
            if max_bytes == u64::MAX {
                format!("{choice} above")
            } else {
                format!("{choice} up to {}", human_bytes(max_bytes))
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}
