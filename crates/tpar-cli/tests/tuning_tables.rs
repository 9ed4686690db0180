//! A tuning table is read only by the build whose kernels it timed: `tpar doctor` over a
//! fixture, with tpar's cache in a fresh folder, passes over a table of other kernels (and
//! says so, naming the file and both builds) and follows one of its own.

use std::path::{Path, PathBuf};

use serde_json::Value;

mod common;

const FIXTURE: &str = "8x-h200-nvswitch.json";

fn fixture() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tpar/fixtures/topologies"
    ))
    .join(FIXTURE)
}

/// `tpar doctor --topology FIXTURE` with the cache in `cache`: its JSON report and its text.
fn doctor(cache: &Path) -> (Value, String) {
    let out = common::output_of_success(
        common::tpar_command()
            .args(["doctor", "--topology"])
            .arg(fixture())
            .arg("--json")
            .env("TPAR_CACHE_DIR", cache),
    );
    (
        serde_json::from_slice(&out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A `tpar tune` table for the fixture's 8 ranks in bf16 that runs two-shot at every size
/// (the model runs one-shot at 4 KiB there), as timed by the kernels `kernels`.
fn write_table(cache: &Path, kernels: &str) -> PathBuf {
    let topology = tpar::topology::Topology::load(&fixture()).unwrap();
    let table = tpar::dispatch::TuningTable {
        fingerprint: topology.fingerprint(),
        kernels: kernels.into(),
        world_size: 8,
        dtype: tpar::DType::Bf16,
        entries: vec![tpar::dispatch::TuningEntry {
            max_bytes: u64::MAX,
            choice: tpar::dispatch::Choice::Tpar(tpar::Algorithm::TwoShot),
            p50_us: 5.0,
        }],
        probes: Vec::new(),
    };
    let path = tpar::dispatch::TuningTable::path(&table.fingerprint, 8, tpar::DType::Bf16);
    assert!(path.starts_with(cache), "{}", path.display());
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, serde_json::to_vec(&table).unwrap()).unwrap();
    path
}

fn runs_at_4k(report: &Value) -> String {
    let row = report["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["bytes"] == 4096)
        .unwrap_or_else(|| panic!("no 4 KiB decision: {report}"));
    row["choice"].as_str().unwrap_or_default().to_owned()
}

#[test]
fn a_table_of_other_kernels_is_passed_over_and_named_and_one_of_this_build_decides() {
    let cache = std::env::temp_dir().join(format!("tpar-tuning-tables-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    // TuningTable::path reads the cache folder of this process's environment.
    std::env::set_var("TPAR_CACHE_DIR", &cache);

    let (before, _) = doctor(&cache);
    assert!(before.get("ignored_tuning_table").is_none(), "{before}");
    assert_eq!(runs_at_4k(&before), "one-shot", "{before}");

    let stale = write_table(&cache, "0.0.0+0123456789abcdef");
    let (report, text) = doctor(&cache);
    let ignored = &report["ignored_tuning_table"];
    assert_eq!(ignored["path"], stale.display().to_string(), "{report}");
    assert_eq!(ignored["kernels"], "0.0.0+0123456789abcdef");
    let this_build = ignored["this_build"].as_str().unwrap().to_owned();
    assert!(
        this_build.starts_with(env!("CARGO_PKG_VERSION")) && this_build != "0.0.0+0123456789abcdef",
        "{report}"
    );
    assert!(report["tuning_table"].is_null(), "{report}");
    assert_eq!(runs_at_4k(&report), "one-shot", "{report}");
    assert!(
        text.contains("not read: it timed other kernels, 0.0.0+0123456789abcdef")
            && text.contains("`tpar tune` measures this build"),
        "{text}"
    );

    let own = write_table(&cache, &this_build);
    let (report, text) = doctor(&cache);
    assert!(report.get("ignored_tuning_table").is_none(), "{report}");
    assert_eq!(
        report["tuning_table"],
        own.display().to_string(),
        "{report}"
    );
    assert_eq!(runs_at_4k(&report), "two-shot", "{report}");
    assert!(!text.contains("not read"), "{text}");
    std::fs::remove_dir_all(&cache).unwrap();
}
