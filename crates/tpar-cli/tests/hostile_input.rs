//! Hostile input: every subcommand of the `tpar` binary fed a generated matrix of bad values
//! (NaN, inf, negative, zero, u64 max, empty, duplicates, absurdly large, not a number) for each
//! of its value flags. Each must exit 2 with a one-line `tpar: error:` and no panic, before any
//! rank starts (so the whole matrix runs in seconds).

use std::process::Command;

const MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tpar-harness/fixtures/models/llama-3.1-70b.json"
);

mod common;

fn tpar(args: &[String]) -> Command {
    let mut cmd = common::tpar_command();
    // A panic must show as one, whatever the environment asks of backtraces.
    cmd.env_remove("RUST_BACKTRACE").args(args);
    cmd
}

/// Asserts the command is refused as a usage error: status 2, one line on stderr, no panic.
fn assert_refused(args: &[String], env: &[(&str, &str)]) -> String {
    let mut cmd = tpar(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("tpar runs");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let shown = format!("{env:?} tpar {}", args.join(" "));
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{shown} panicked:\n{err}"
    );
    assert_eq!(out.status.code(), Some(2), "{shown}: stderr\n{err}");
    let lines: Vec<_> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{shown}: not one line:\n{err}");
    assert!(lines[0].starts_with("tpar: error: "), "{shown}: {err}");
    lines[0].to_owned()
}

const NOT_NUMBERS: [&str; 4] = ["", "x", "nan", "1e"];
const NON_FINITE: [&str; 3] = ["nan", "inf", "-inf"];

/// Bad values for a whole-number flag that must be >= 1.
fn bad_counts() -> Vec<&'static str> {
    let mut v = vec![
        "0",
        "-1",
        "-5",
        "18446744073709551615",
        "99999999999999999999999",
        "1e30",
        "1.5",
    ];
    v.extend(NOT_NUMBERS);
    v.extend(NON_FINITE);
    v
}

/// Bad values for a positive real flag.
fn bad_positive_reals() -> Vec<&'static str> {
    let mut v = vec!["0", "-1", "-0.5"];
    v.extend(NOT_NUMBERS);
    v.extend(NON_FINITE);
    v
}

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_owned).collect()
}

fn with(base: &str, flag: &str, value: &str) -> Vec<String> {
    let mut args = words(base);
    args.push(format!("--{flag}={value}"));
    args
}

#[test]
fn every_subcommand_refuses_a_matrix_of_bad_values() {
    let bench = "bench --backend cpu";
    let selftest = "selftest --backend cpu";
    let memory = format!("plan memory --config {MODEL} --tp 8 --gpu-gb 80");
    let spec = format!(
        "plan spec-decode --config {MODEL} --tp 8 --tokens 3 --acceptance 2 --latency-us 200"
    );
    let mut cases: Vec<Vec<String>> = Vec::new();
    for v in bad_counts() {
        for base in [bench, selftest, "doctor", "tune", "debug-rank"] {
            cases.push(with(base, "world-size", v));
        }
        cases.push(with(bench, "iters", v));
        cases.push(with(bench, "chain", v));
        cases.push(with(selftest, "replays", v));
        cases.push(with("tune", "iters", v));
        cases.push(with(
            &format!("plan memory --config {MODEL} --gpu-gb 80"),
            "tp",
            v,
        ));
        cases.push(with(
            &format!(
                "plan spec-decode --config {MODEL} --tokens 3 --acceptance 2 --latency-us 200"
            ),
            "tp",
            v,
        ));
        cases.push(with(
            &format!("plan spec-decode --config {MODEL} --tp 8 --acceptance 1 --latency-us 200"),
            "tokens",
            v,
        ));
        cases.push(with(&memory, "context", v));
        cases.push(with(&memory, "kv-bytes", v));
    }
    for v in ["-1", "nan", "inf", "18446744073709551615", "x", ""] {
        cases.push(with(bench, "warmup", v));
    }
    for v in bad_positive_reals().into_iter().chain(["1e30", "86401"]) {
        for base in [bench, selftest, "tune", "debug-rank"] {
            cases.push(with(base, "timeout", v));
        }
        for flag in ["gpu-gb", "free-after-load-gb"] {
            cases.push(with(&memory, flag, v));
        }
    }
    for v in bad_positive_reals() {
        for flag in ["latency-us", "tflops", "hbm-gbps", "plain-ms", "verify-ms"] {
            cases.push(with(&spec, flag, v));
        }
        cases.push(with(
            &format!("plan spec-decode --config {MODEL} --tp 8 --tokens 3 --latency-us 200"),
            "acceptance",
            v,
        ));
    }
    for v in ["0", "1.5", "2", "-0.1", "nan", "inf", "x", ""] {
        cases.push(with(&memory, "mem-fraction-static", v));
        cases.push(with(
            &format!("{memory} --engine vllm"),
            "gpu-memory-utilization",
            v,
        ));
    }
    for v in ["-1", "nan", "inf", "x"] {
        for flag in [
            "cuda-graph-gb",
            "draft-gb",
            "runtime-gb",
            "activation-gb",
            "weights-gb",
        ] {
            cases.push(with(&memory, flag, v));
        }
    }
    // Size and name lists: empty, empty items, duplicates, negative, absurdly large.
    for v in [
        "",
        ",",
        "4K,,8K",
        "4K,4K",
        "4096,4K",
        "-1",
        "nan",
        "4X",
        "K",
        "18446744073709551614",
        "18446744073709551615",
        "99999999999999999999",
        "16E",
        "1024G",
    ] {
        cases.push(with(bench, "sizes", v));
    }
    for v in [
        "",
        "0,,1",
        "7,7",
        "-1",
        "nan",
        "18446744073709551615",
        "1099511627777",
    ] {
        cases.push(with(selftest, "counts", v));
    }
    for v in [
        "",
        "bogus",
        "one-shot,one-shot",
        "one-shot,,two-shot",
        "nccl",
        "host-staged",
    ] {
        cases.push(with(bench, "algos", v));
        cases.push(with(selftest, "algos", v));
    }
    for v in ["", "f64", "bf16,bf16", "nan"] {
        cases.push(with(selftest, "dtypes", v));
    }
    for v in ["", "f64", "-1"] {
        cases.push(with(bench, "dtype", v));
    }
    for v in ["/nonexistent/dir/x.json", "/", ""] {
        cases.push(with(bench, "json", v));
        cases.push(with(bench, "plot", v));
    }
    cases.push(words("bench --backend cpu --processes"));
    cases.push(words("selftest --backend cpu --processes"));
    cases.push(words("bench --backend cpu -n 4096"));
    cases.push(words("bench --backend cpu --sizes 1024G -n 2"));
    assert!(cases.len() > 300, "matrix of {} cases", cases.len());
    for args in &cases {
        assert_refused(args, &[]);
    }
}

#[test]
fn bad_environment_is_refused_not_ignored() {
    let line = assert_refused(&words("bench --backend cpu"), &[("TPAR_ALGO", "bogus")]);
    assert!(line.contains("TPAR_ALGO=bogus"), "{line}");
    // Refused before any rank starts, as --islands 9+9 is, and said once.
    let line = assert_refused(
        &words("bench --backend cpu -n 2 --algos islands --sizes 4K"),
        &[("TPAR_ISLANDS", "9+9")],
    );
    assert!(
        line.contains("TPAR_ISLANDS=9+9: islands '9+9'")
            && line.matches("invalid argument").count() == 1,
        "{line}"
    );
    let line = assert_refused(
        &words("bench --backend cpu"),
        &[("RANK", "1"), ("WORLD_SIZE", "4")],
    );
    assert!(line.contains("TPAR_RENDEZVOUS"), "{line}");
    let line = assert_refused(
        &words("bench --backend cpu"),
        &[
            ("LOCAL_RANK", "3"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("WORLD_SIZE", "1"),
        ],
    );
    assert!(line.contains("LOCAL_RANK"), "{line}");
}

#[test]
fn more_ranks_than_tpar_serves_are_a_usage_error_not_a_panic() {
    // Every rank of 17 once panicked in the CPU backend (a partition of 1 to 16 ranks).
    for command in [
        "bench --backend cpu --sizes 4K -n 17",
        "selftest --backend cpu -n 17",
        "tune -n 17",
        "doctor -n 17",
        "plan memory --config crates/tpar-harness/fixtures/models/llama-3.1-70b.json -n 64",
    ] {
        let line = assert_refused(&words(command), &[]);
        assert!(line.contains("serves 1 to 16 ranks"), "{command}: {line}");
    }
    // Rank 0 of a launcher's job of `world_size` ranks.
    let launched = |rendezvous, world_size| {
        [
            ("TPAR_RENDEZVOUS", rendezvous),
            ("TPAR_JOB_TOKEN", "0123456789abcdef0123456789abcdef"),
            ("RANK", "0"),
            ("WORLD_SIZE", world_size),
        ]
    };
    let line = assert_refused(
        &words("bench --backend cpu --sizes 4K"),
        &launched("/tmp/tpar-hostile-17", "17"),
    );
    assert!(line.contains("WORLD_SIZE=17"), "{line}");
    // A flag that disagrees with the launcher is refused before anything runs.
    let line = assert_refused(
        &words("bench --backend cpu --sizes 4K -n 4"),
        &launched("/tmp/tpar-hostile-mismatch", "1"),
    );
    assert!(line.contains("WORLD_SIZE=1"), "{line}");
}

#[test]
fn a_usage_error_keeps_what_clap_lists_and_names_the_subcommands_help() {
    let line = assert_refused(&words("plan spec-decode --config x.json"), &[]);
    assert!(
        line.contains("not provided: --world-size <N> --tokens <TOKENS>")
            && line.ends_with("(see `tpar plan spec-decode --help`)"),
        "{line}"
    );
    let line = assert_refused(&words("bench --backend gpu"), &[]);
    assert!(
        line.contains("[possible values: auto, cpu, cuda]")
            && line.ends_with("(see `tpar bench --help`)"),
        "{line}"
    );
    let line = assert_refused(&words("bench --sizs 4K"), &[]);
    assert!(line.contains("'--sizes'"), "{line}");
    let line = assert_refused(&words("bench step --tokens 0"), &[]);
    assert!(line.ends_with("(see `tpar bench step --help`)"), "{line}");
}

#[test]
fn negative_numbers_get_a_bound_not_unexpected_argument() {
    let line = assert_refused(&words("bench --backend cpu -n -1"), &[]);
    assert!(line.contains("must be >= 1"), "{line}");
    let line = assert_refused(&words("bench --backend cpu --timeout -5"), &[]);
    assert!(line.contains("must be positive"), "{line}");
}

#[test]
fn help_is_not_an_error() {
    let out = tpar(&words("bench --help")).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("--world-size"));
}

#[test]
fn bench_fused_takes_one_algorithm_and_tokens_in_range() {
    // Refused before any GPU is touched: these hold on a machine without one.
    let line = assert_refused(&words("bench --fused --algos one-shot,two-shot"), &[]);
    assert!(line.contains("one-shot, two-shot, host-staged"), "{line}");
    assert!(line.contains("one algorithm at a time"), "{line}");
    let line = assert_refused(&words("bench --fused --algos one-shot-pull"), &[]);
    assert!(line.contains("one-shot-pull has no fused kernel"), "{line}");
    let line = assert_refused(&words("bench --fused --algos rings"), &[]);
    assert!(line.contains("unknown algorithm 'rings'"), "{line}");
    for bad in ["0", "513", "x", "4,,8", "4,4"] {
        let line = assert_refused(&words(&format!("bench --fused --tokens {bad}")), &[]);
        assert!(line.contains("--tokens"), "{bad}: {line}");
    }
    let line = assert_refused(&words("bench --backend cpu --tokens 4"), &[]);
    assert!(line.contains("--tokens is for --fused"), "{line}");
}

#[test]
fn gpu_only_and_engine_only_flags_are_refused_where_they_do_nothing() {
    let line = assert_refused(&words("bench --backend cpu --fused"), &[]);
    assert!(
        line.contains("--fused times CUDA kernels and has no CPU form"),
        "{line}"
    );
    let line = assert_refused(&words("bench --backend cpu --anatomy"), &[]);
    assert!(line.contains("--anatomy"), "{line}");
    for ignored in ["--sizes 4K", "--plot x.svg", "--processes", "--warmup 3"] {
        let line = assert_refused(&words(&format!("bench --fused {ignored}")), &[]);
        assert!(line.contains("cannot be used with"), "{ignored}: {line}");
    }
    let memory = format!("plan memory --config {MODEL} -n 8 --gpu-gb 80");
    let line = assert_refused(
        &words(&format!("{memory} --engine vllm --mem-fraction-static 0.5")),
        &[],
    );
    assert!(
        line.contains("--mem-fraction-static belongs to --engine sglang's rule"),
        "{line}"
    );
    let line = assert_refused(
        &words(&format!("{memory} --gpu-memory-utilization 0.5")),
        &[],
    );
    assert!(line.contains("add --engine vllm"), "{line}");
}

#[test]
fn counts_and_sizes_say_what_is_wrong_with_the_value() {
    let line = assert_refused(&words("bench --backend cpu --sizes -4K"), &[]);
    assert!(line.contains("size '-4K' is negative"), "{line}");
    let plot = std::env::temp_dir().join(format!("tpar-hostile-{}.svg", std::process::id()));
    let args = format!("bench --backend cpu --sizes 0 --plot {}", plot.display());
    let line = assert_refused(&words(&args), &[]);
    assert!(line.contains("--plot draws sizes above 0 bytes"), "{line}");
    assert!(!plot.exists());
    let line = assert_refused(
        &words(&format!("bench step --config {MODEL} -n 2 --tokens 0")),
        &[],
    );
    assert!(line.contains("'--tokens <TOKENS>': must be >= 1"), "{line}");
    let line = assert_refused(
        &words(&format!("bench step --config {MODEL} -n 2 --layers 81")),
        &[],
    );
    assert!(line.contains("the model has 80 layers"), "{line}");
}

#[test]
fn an_error_says_the_systems_reason_once() {
    for args in [
        "doctor --topology /nonexistent/topology.json".to_owned(),
        format!("plan spec-decode --config {MODEL} -n 8 --tokens 3 --acceptance 2 --latency-topology /nonexistent/t.json"),
        "plan memory --config /nonexistent/config.json -n 8 --gpu-gb 80".to_owned(),
        "bench step --config /nonexistent/config.json -n 2".to_owned(),
    ] {
        let line = assert_refused(&words(&args), &[]);
        assert_eq!(line.matches("(os error 2)").count(), 1, "{args}: {line}");
        assert!(line.contains("/nonexistent/"), "{args}: {line}");
    }
}

/// A copy of the llama fixture with `change` applied, in a file of its own.
fn config_with(name: &str, change: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(MODEL).unwrap()).unwrap();
    change(&mut v);
    let path =
        std::env::temp_dir().join(format!("tpar-hostile-{name}-{}.json", std::process::id()));
    std::fs::write(&path, v.to_string()).unwrap();
    path.display().to_string()
}

#[test]
fn plan_inputs_are_refused_with_the_reason_or_read() {
    let plan = |config: &str| {
        common::tpar_command()
            .args([
                "plan", "memory", "--config", config, "-n", "8", "--gpu-gb", "80", "--json",
            ])
            .output()
            .unwrap()
    };
    let banana = config_with("banana", |v| v["torch_dtype"] = "banana".into());
    let line = assert_refused(
        &words(&format!("plan memory --config {banana} -n 8 --gpu-gb 80")),
        &[],
    );
    assert!(line.contains("`torch_dtype` is 'banana'"), "{line}");
    let negative = config_with("negative", |v| v["hidden_size"] = (-8192).into());
    let line = assert_refused(
        &words(&format!("plan memory --config {negative} -n 8 --gpu-gb 80")),
        &[],
    );
    assert!(line.contains("`hidden_size` is -8192"), "{line}");
    // fp8 and int8 weights take one byte each: half the bf16 model's weights per rank.
    let weights = |config: &str| {
        let out = plan(config);
        assert!(
            out.status.code() == Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["inputs"]["weights_bytes"].as_f64().unwrap()
    };
    let bf16 = weights(MODEL);
    for dtype in ["float8_e4m3fn", "int8"] {
        let path = config_with(dtype, |v| v["torch_dtype"] = dtype.into());
        assert_eq!(weights(&path), bf16 / 2.0, "{dtype}");
        std::fs::remove_file(path).unwrap();
    }
    let llava = config_with("llava", |v| {
        let text = v.take();
        *v = serde_json::json!({"model_type": "llava", "text_config": text, "vision_config": {}});
    });
    assert_eq!(weights(&llava), bf16);
    for path in [banana, negative, llava] {
        std::fs::remove_file(path).unwrap();
    }
}

#[test]
fn a_latency_file_of_another_machine_is_refused_naming_both() {
    let path = std::env::temp_dir().join(format!("tpar-hostile-bench-{}.json", std::process::id()));
    std::fs::write(
        &path,
        r#"{"backend": "cpu", "world_size": 2, "results": [{"bytes": 4096, "algo": "one-shot", "p50_us": 30.0, "correct": true}]}"#,
    )
    .unwrap();
    let args = format!(
        "plan spec-decode --config {MODEL} -n 8 --tokens 3 --acceptance 2 --latency-json {}",
        path.display()
    );
    let line = assert_refused(&words(&args), &[]);
    assert!(
        line.contains("2 rank(s) on the cpu backend") && line.contains("8 rank(s) on GPUs"),
        "{line}"
    );
    std::fs::remove_file(path).unwrap();
}
