//! The JSON of `tpar bench` against its schema, bench/schema/bench.schema.json, and every JSON
//! file kept in bench/results against the schema of its kind (bench/schema/*.schema.json), with
//! a small checker of the part of JSON Schema the files use (type, enum, required, properties,
//! items, minimum, allOf, if/then/else). A real CPU run must pass; the same output with a row
//! turned into the old lie (`skipped` beside `p50_us: 0.0, correct: true`) must fail.

use serde_json::Value;

mod common;

/// Every violation of `schema` by `value`, as "path: what".
fn violations(schema: &Value, value: &Value, path: &str, out: &mut Vec<String>) {
    if let Some(types) = schema.get("type") {
        let names: Vec<&str> = match types {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => panic!("bad type in schema at {path}"),
        };
        let fits = |t: &str| match t {
            "null" => value.is_null(),
            "boolean" => value.is_boolean(),
            "integer" => value.is_u64() || value.is_i64(),
            "number" => value.is_number(),
            "string" => value.is_string(),
            "array" => value.is_array(),
            "object" => value.is_object(),
            other => panic!("unknown type {other}"),
        };
        if !names.iter().any(|t| fits(t)) {
            out.push(format!("{path}: {value} is not {names:?}"));
            return;
        }
    }
    if let Some(Value::Array(options)) = schema.get("enum") {
        if !options.contains(value) {
            out.push(format!("{path}: {value} is not one of {options:?}"));
        }
    }
    if let (Some(min), Some(v)) = (
        schema.get("minimum").and_then(Value::as_f64),
        value.as_f64(),
    ) {
        if v < min {
            out.push(format!("{path}: {v} is below {min}"));
        }
    }
    if let (Some(Value::Array(required)), Some(object)) =
        (schema.get("required"), value.as_object())
    {
        for key in required.iter().filter_map(Value::as_str) {
            if !object.contains_key(key) {
                out.push(format!("{path}: no `{key}`"));
            }
        }
    }
    if let (Some(Value::Object(properties)), Some(object)) =
        (schema.get("properties"), value.as_object())
    {
        for (key, sub) in properties {
            if let Some(v) = object.get(key) {
                violations(sub, v, &format!("{path}.{key}"), out);
            }
        }
    }
    if let (Some(items), Some(array)) = (schema.get("items"), value.as_array()) {
        for (i, v) in array.iter().enumerate() {
            violations(items, v, &format!("{path}[{i}]"), out);
        }
    }
    if let Some(Value::Array(all)) = schema.get("allOf") {
        for sub in all {
            violations(sub, value, path, out);
        }
    }
    if let Some(condition) = schema.get("if") {
        let mut probe = Vec::new();
        violations(condition, value, path, &mut probe);
        let branch = if probe.is_empty() { "then" } else { "else" };
        if let Some(sub) = schema.get(branch) {
            violations(sub, value, path, out);
        }
    }
}

fn check(schema: &Value, value: &Value) -> Vec<String> {
    let mut out = Vec::new();
    violations(schema, value, "$", &mut out);
    out
}

/// The repository's bench/ folder.
fn bench_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench")
}

/// bench/schema/<kind>.schema.json.
fn schema_of(kind: &str) -> Value {
    let path = bench_dir().join(format!("schema/{kind}.schema.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

fn schema() -> Value {
    schema_of("bench")
}

/// Which command wrote a result file, from its fields: the kinds tpar writes, else `envelope`
/// (the Python and engine checks, scripts/gpu-check.sh), which only the common fields hold.
fn kind(value: &Value) -> &'static str {
    let has = |key: &str| value.get(key).is_some();
    let first_row = value.get("rows").and_then(|r| r.get(0));
    if first_row.is_some_and(|r| r.get("piece").is_some()) {
        "anatomy"
    } else if has("rows") && has("errors") && has("driver_version") {
        "fused"
    } else if has("model") && has("results") {
        "step"
    } else if has("backend") && has("results") && has("tpar_version") {
        "bench"
    } else if has("table") && has("measurements") {
        "tune"
    } else if has("checks") && (has("decisions") || has("plans")) {
        // `plans` is the key doctor wrote for its per-size decisions before it was `decisions`;
        // the files recorded then keep it.
        "doctor"
    } else {
        "envelope"
    }
}

/// Every file under `dir` whose name ends in `.json`, sorted.
fn json_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            found.extend(json_files(&path));
        } else if path.extension().is_some_and(|e| e == "json") {
            found.push(path);
        }
    }
    found.sort();
    found
}

#[test]
fn every_json_file_in_bench_results_follows_the_schema_of_its_kind() {
    let envelope = schema_of("envelope");
    let mut per_kind: std::collections::BTreeMap<&str, usize> = Default::default();
    let mut errors = Vec::new();
    let files = json_files(&bench_dir().join("results"));
    for path in &files {
        let text = std::fs::read_to_string(path).unwrap();
        let value: Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) => {
                errors.push(format!("{path:?}: not JSON: {e}"));
                continue;
            }
        };
        let kind = kind(&value);
        *per_kind.entry(kind).or_default() += 1;
        let mut found = check(&envelope, &value);
        if kind != "envelope" {
            found.extend(check(&schema_of(kind), &value));
        }
        errors.extend(found.iter().map(|e| format!("{path:?} ({kind}): {e}")));
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    // Each kind that tpar writes is kept and recognised (a classifier that sent every file to
    // the envelope alone would check almost nothing).
    for kind in [
        "bench", "fused", "anatomy", "step", "tune", "doctor", "envelope",
    ] {
        assert!(
            per_kind.get(kind).is_some_and(|&n| n > 0),
            "no {kind} file: {per_kind:?}"
        );
    }
    assert_eq!(per_kind.values().sum::<usize>(), files.len());
}

#[test]
fn a_result_without_its_provenance_is_refused() {
    let envelope = schema_of("envelope");
    let mut record = serde_json::json!({
        "command": "tpar bench", "device": "cpu", "date": "2026-12-02", "commit": "abc"
    });
    assert_eq!(check(&envelope, &record), Vec::<String>::new());
    record.as_object_mut().unwrap().remove("commit");
    assert_eq!(check(&envelope, &record), vec!["$: no `commit`".to_owned()]);
    // A step row that ran must carry its figures; a skipped one need not.
    let step = schema_of("step");
    let row = |extra: Value| {
        let mut r = serde_json::json!({"reduce": "auto"});
        r.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        r
    };
    let items = &step["properties"]["results"]["items"];
    assert!(!check(items, &row(serde_json::json!({}))).is_empty());
    assert_eq!(
        check(
            items,
            &row(serde_json::json!({"skipped": "NCCL needs one GPU per rank"}))
        ),
        Vec::<String>::new()
    );
}

#[test]
fn cpu_bench_json_follows_the_schema_and_a_lying_skipped_row_does_not() {
    let out = common::output_of_success(common::tpar_command().args([
        "bench",
        "--backend",
        "cpu",
        "-n",
        "2",
        "--sizes",
        "1K,4K",
        "--iters",
        "5",
        "--json",
        "-",
    ]));
    let mut report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let schema = schema();
    assert_eq!(check(&schema, &report), Vec::<String>::new());

    // A skipped row as tpar writes it now: valid.
    let row = &mut report["results"][0];
    row["skipped"] = "NCCL needs one GPU per rank".into();
    for key in ["p50_us", "p99_us", "busbw_gbps", "correct"] {
        row[key] = Value::Null;
    }
    assert_eq!(check(&schema, &report), Vec::<String>::new());
    // As it used to write it: refused, naming the field.
    report["results"][0]["p50_us"] = 0.0.into();
    report["results"][0]["correct"] = true.into();
    let errors = check(&schema, &report);
    assert!(
        errors.iter().any(|e| e.contains("results[0].p50_us")),
        "{errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("results[0].correct")),
        "{errors:?}"
    );
    // A timed row without figures: refused too.
    report["results"][1]["p50_us"] = Value::Null;
    assert!(check(&schema, &report)
        .iter()
        .any(|e| e.contains("results[1].p50_us")));
}

#[test]
fn doctor_json_names_its_run_loads_back_as_a_topology_and_follows_the_schema() {
    let fixture =
        bench_dir().join("../crates/tpar/fixtures/topologies/8x-rtx-pro-6000-pcie-2switch.json");
    let out = common::output_of_success(
        common::tpar_command()
            .args(["doctor", "--json", "--topology"])
            .arg(&fixture),
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(kind(&report), "doctor");
    assert_eq!(check(&schema_of("doctor"), &report), Vec::<String>::new());
    let device = report["device"].as_str().unwrap();
    assert!(
        device.starts_with("cuda: 8 x NVIDIA RTX PRO 6000")
            && device.contains(", driver 580.159.04, CUDA 13.0 (file ")
            && device.contains("8x-rtx-pro-6000-pcie-2switch.json"),
        "{device}"
    );
    assert!(report["command"]
        .as_str()
        .unwrap()
        .contains("doctor --json --topology"));
    // The report describes its machine again, as `tpar doctor --topology` and `tpar plan
    // --latency-topology` say they take it (before, its null `links` refused it).
    let kept = std::env::temp_dir().join(format!("tpar-doctor-{}.json", std::process::id()));
    std::fs::write(&kept, &out.stdout).unwrap();
    let again = common::output_of_success(
        common::tpar_command()
            .args(["doctor", "--json", "--topology"])
            .arg(&kept),
    );
    let again: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(again["topology"], report["topology"]);
    assert_eq!(again["decisions"], report["decisions"]);
    std::fs::remove_file(&kept).unwrap();
    // This machine: where it has no GPU (CI), the failed check and why, in the same schema
    // (before, nothing on stdout); where it has one, its report.
    let out = common::tpar_command()
        .args(["doctor", "--json"])
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", common::text(&out.stderr)));
    assert_eq!(check(&schema_of("doctor"), &report), Vec::<String>::new());
    let failed = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["ok"] == false);
    assert_eq!(report["ok"] == false, failed, "{report}");
    assert_eq!(out.status.success(), report["ok"] == true, "{report}");
    if report["checks"][0]["name"] == "GPU" && report["checks"][0]["ok"] == false {
        // No GPU: the record and the message on stderr both say what runs instead.
        let instead = "the CPU backend can (`tpar bench --backend cpu`)";
        let detail = report["checks"][0]["detail"].as_str().unwrap();
        assert!(detail.contains(instead), "{detail}");
        let stderr = common::text(&out.stderr);
        assert!(stderr.contains(instead), "{stderr}");
    }
}

#[test]
fn the_open_mpi_comparisons_in_bench_results_follow_the_schema() {
    // bench/cpu_vs_mpi.py's files: tpar's rows and Open MPI's (algo "mpi") side by side.
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/results");
    let schema = schema();
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !(name.contains("cpu-vs-mpi") && name.ends_with(".json")) {
            continue;
        }
        let report: Value =
            serde_json::from_str(&std::fs::read_to_string(entry.path()).unwrap()).unwrap();
        assert_eq!(check(&schema, &report), Vec::<String>::new(), "{name}");
        let algos: Vec<&str> = report["results"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|r| r["algo"].as_str())
            .collect();
        assert!(
            algos.contains(&"mpi") && algos.iter().any(|a| *a != "mpi"),
            "{name}: both peers"
        );
        seen += 1;
    }
    // With no file there is nothing to check (the script is run by hand, not by CI).
    eprintln!("{seen} comparison file(s) checked");
}

#[test]
fn a_cuda_row_names_its_launch_shape_as_the_schema_says() {
    let schema = schema();
    let items = &schema["properties"]["results"]["items"];
    let mut row = serde_json::to_value(tpar_harness::cuda_bench::CudaRow {
        bytes: 4096,
        algo: "one-shot".into(),
        p50_us: 3.2,
        p99_us: 3.3,
        busbw_gbps: 2.0,
        correct: true,
        graph_single_us: 9.0,
        wire_floor_us: 0.1,
        chain: 50,
        replays: 50,
        runs: None,
        why: None,
        launch: Some(tpar::backend::cuda::LaunchShape {
            kernel: tpar::backend::cuda::KernelId::OneShotPush(tpar::DType::Bf16),
            grid: 8,
            block: 64,
            cluster: 1,
            pdl: true,
        }),
        skipped: None,
    })
    .unwrap();
    assert_eq!(
        row["launch"],
        serde_json::json!({"kernel": "tpar_oneshot_push_bf16", "grid": 8, "block": 64, "cluster": 1, "pdl": true})
    );
    assert_eq!(check(items, &row), Vec::<String>::new());
    row["launch"].as_object_mut().unwrap().remove("pdl");
    assert_eq!(check(items, &row), vec!["$.launch: no `pdl`".to_owned()]);
    row["launch"]["grid"] = 0.into();
    assert_refused_at(items, &row, "$.launch.grid");
}

/// The schema `items` refuses `row`, naming `path`.
fn assert_refused_at(items: &Value, row: &Value, path: &str) {
    assert!(
        check(items, row).iter().any(|e| e.contains(path)),
        "{path}: {row}"
    );
}

#[test]
fn a_fused_row_names_its_launch_shape_as_the_schema_says() {
    let items = &schema_of("fused")["properties"]["rows"]["items"];
    let mut fused = tpar_harness::fused_bench::FusedBenchRow {
        algorithm: "one-shot",
        world_size: 2,
        tokens: 1,
        hidden: 8192,
        bytes: 16384,
        variant: "fused",
        p50_us: 4.3,
        p99_us: 4.4,
        correct: Some(true),
        launch: Some(tpar::backend::cuda::LaunchShape {
            kernel: tpar::backend::cuda::KernelId::FusedOneShotClusters(tpar::DType::Bf16),
            grid: 16,
            block: 512,
            cluster: 4,
            pdl: true,
        }),
    };
    let row = serde_json::to_value(&fused).unwrap();
    assert_eq!(
        row["launch"],
        serde_json::json!({"kernel": "tpar_fused_oneshot_clusters_bf16", "grid": 16, "block": 512, "cluster": 4, "pdl": true})
    );
    assert_eq!(check(items, &row), Vec::<String>::new());
    // Results written before launches named their clusters and kernels still hold; a cluster
    // of 0 or a kernel that is not a name does not.
    let mut older = row.clone();
    older["launch"].as_object_mut().unwrap().remove("cluster");
    older["launch"].as_object_mut().unwrap().remove("kernel");
    assert_eq!(check(items, &older), Vec::<String>::new());
    let mut unnamed = row.clone();
    unnamed["launch"]["kernel"] = 3.into();
    assert_refused_at(items, &unnamed, "$.launch.kernel");
    let mut zero = row.clone();
    zero["launch"]["cluster"] = 0.into();
    assert_refused_at(items, &zero, "$.launch.cluster");
    // A row without a launch (NCCL, nothing launched) leaves the field out.
    fused.launch = None;
    let row = serde_json::to_value(&fused).unwrap();
    assert!(row.get("launch").is_none(), "{row}");
    assert_eq!(check(items, &row), Vec::<String>::new());
}
