//! The fabric model held against every published table of PCIe measurements
//! (`crates/tpar/fixtures/published/`, copied from pcie-published.md with their sources): each
//! figure within 35%, the same winner per size in the latency tables, and in the bandwidth
//! tables the same side (writes or reads) ahead wherever the published figures differ by more
//! than that. `cargo test -p tpar published -- --nocapture` prints every row.

use serde_json::Value;

use super::Fabric;
use crate::algorithm::Choice;
use crate::dtype::DType;
use crate::protocol::schedule::{Access, Transfer};
use crate::topology::Topology;

const TABLES: [(&str, &str); 6] = [
    (
        "a-collapse",
        include_str!("../../../fixtures/published/a-collapse.json"),
    ),
    (
        "b-l40s",
        include_str!("../../../fixtures/published/b-l40s.json"),
    ),
    (
        "b-sm120",
        include_str!("../../../fixtures/published/b-sm120.json"),
    ),
    (
        "c-rootcomplex",
        include_str!("../../../fixtures/published/c-rootcomplex.json"),
    ),
    (
        "d-2socket",
        include_str!("../../../fixtures/published/d-2socket.json"),
    ),
    (
        "e-v100",
        include_str!("../../../fixtures/published/e-v100.json"),
    ),
];

/// How far a modelled figure may be from the published one.
const TOLERANCE: f64 = 0.35;

fn topology(name: &str) -> Topology {
    Topology::fixture(name).unwrap_or_else(|| panic!("no topology fixture {name}"))
}

/// The flows of a bandwidth row: `flows` as given, or every ordered pair of `all_to_all`.
fn flows(row: &Value) -> Vec<(usize, usize)> {
    let pair = |v: &Value| {
        let p = v.as_array().unwrap();
        (
            p[0].as_u64().unwrap() as usize,
            p[1].as_u64().unwrap() as usize,
        )
    };
    if let Some(f) = row.get("flows") {
        return f.as_array().unwrap().iter().map(pair).collect();
    }
    let gpus: Vec<usize> = row["all_to_all"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g.as_u64().unwrap() as usize)
        .collect();
    gpus.iter()
        .flat_map(|&a| gpus.iter().map(move |&b| (a, b)))
        .filter(|(a, b)| a != b)
        .collect()
}

/// (modelled, published, description) of every figure of a bandwidth table; and each
/// pattern's modelled writes against reads where both are published.
fn bandwidth_rows(table: &Value, t: &Topology) -> Vec<(f64, f64, String)> {
    let n = t.gpus.len();
    let fabric = Fabric::for_gpus(t, &(0..n).collect::<Vec<_>>(), None);
    let mut out = Vec::new();
    for row in table["rows"].as_array().unwrap() {
        let access = match row["access"].as_str().unwrap() {
            "write" => Access::Write,
            _ => Access::Read,
        };
        let flows = flows(row);
        let transfers: Vec<Transfer> = flows
            .iter()
            .map(|&(from, to)| Transfer {
                from,
                to,
                bytes: 64 << 20,
                access,
                via_host: !t.p2p(from, to),
            })
            .collect();
        let (total, _) = fabric.concurrent_gbps(&transfers);
        let modelled = match row["per"].as_str().unwrap() {
            "flow" => total / flows.len() as f64,
            "gpu" => {
                let mut sources: Vec<usize> = flows.iter().map(|f| f.0).collect();
                sources.sort_unstable();
                sources.dedup();
                total / sources.len() as f64
            }
            _ => total,
        };
        out.push((
            modelled,
            row["gbps"].as_f64().unwrap(),
            format!(
                "{} ({}) GB/s",
                row["pattern"].as_str().unwrap(),
                row["access"].as_str().unwrap()
            ),
        ));
    }
    out
}

#[test]
fn the_model_holds_every_published_table_within_35_percent_with_the_same_winners() {
    let mut failures = Vec::new();
    for (file, text) in TABLES {
        let table: Value = serde_json::from_str(text).unwrap();
        let t = topology(table["fixture"].as_str().unwrap());
        println!(
            "table {} ({}), fixture {}:",
            table["table"].as_str().unwrap(),
            table["machine"].as_str().unwrap(),
            table["fixture"].as_str().unwrap()
        );
        let check = |modelled: f64, published: f64, what: &str| -> Option<String> {
            let off = modelled / published - 1.0;
            let ok = off.abs() <= TOLERANCE;
            println!(
                "  {what}: published {published}, modelled {modelled:.2} ({:+.0}%){}",
                100.0 * off,
                if ok { "" } else { "  <-- outside 35%" }
            );
            (!ok).then(|| format!("{file}: {what}: published {published}, modelled {modelled:.2}"))
        };
        match table["kind"].as_str().unwrap() {
            "bandwidth" => {
                let rows = bandwidth_rows(&table, &t);
                for (modelled, published, what) in &rows {
                    failures.extend(check(*modelled, *published, what));
                }
                // Where a pattern's writes and reads differ by more than the tolerance, the
                // model must put the same one ahead.
                let json_rows = table["rows"].as_array().unwrap();
                for (i, a) in json_rows.iter().enumerate() {
                    for (j, b) in json_rows.iter().enumerate().skip(i + 1) {
                        if a["pattern"] != b["pattern"] || a["access"] == b["access"] {
                            continue;
                        }
                        let (pa, pb) = (rows[i].1, rows[j].1);
                        if pa.max(pb) / pa.min(pb) < 1.0 + TOLERANCE {
                            continue;
                        }
                        if (pa > pb) != (rows[i].0 > rows[j].0) {
                            failures.push(format!(
                                "{file}: {}: published {} ahead, the model the other",
                                a["pattern"], a["access"]
                            ));
                        }
                    }
                }
            }
            _ => {
                let n = table["world_size"].as_u64().unwrap() as usize;
                let fabric = Fabric::new(&t, n, None);
                for row in table["rows"].as_array().unwrap() {
                    let bytes = row["bytes"].as_u64().unwrap();
                    let mut published: Vec<(&str, f64)> = Vec::new();
                    let mut modelled: Vec<(&str, f64)> = Vec::new();
                    for (column, us) in row["us"].as_object().unwrap() {
                        let us = us.as_f64().unwrap();
                        let model = match column.as_str() {
                            "nccl" => {
                                fabric
                                    .estimate(Choice::Nccl, DType::Bf16, bytes)
                                    .unwrap()
                                    .us
                            }
                            "flat-push" => fabric.flat_push(bytes).us,
                            other => panic!("{file}: unknown column {other}"),
                        };
                        failures.extend(check(model, us, &format!("{column} at {bytes} B, us")));
                        published.push((column, us));
                        modelled.push((column, model));
                    }
                    let fastest = |v: &[(&str, f64)]| {
                        v.iter()
                            .min_by(|a, b| a.1.total_cmp(&b.1))
                            .map(|x| x.0.to_owned())
                            .unwrap()
                    };
                    let (want, got) = (fastest(&published), fastest(&modelled));
                    println!("  at {bytes} B: published winner {want}, modelled {got}");
                    if want != got {
                        failures.push(format!(
                            "{file}: at {bytes} B the published winner is {want}, the model's {got}"
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_published_table_names_a_source_a_machine_and_a_shipped_fixture() {
    for (file, text) in TABLES {
        let table: Value = serde_json::from_str(text).unwrap();
        for key in ["table", "source", "machine", "fixture", "kind"] {
            assert!(
                table[key].as_str().is_some_and(|s| !s.is_empty()),
                "{file}: {key}"
            );
        }
        topology(table["fixture"].as_str().unwrap());
        assert!(!table["rows"].as_array().unwrap().is_empty(), "{file}");
    }
}
