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
