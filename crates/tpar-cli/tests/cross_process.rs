//! Cross-process tests of the `tpar` binary on the CPU backend: real rank processes started by
//! tpar's launcher or by the test acting as an outside launcher, with faults injected (a
//! mismatched call, a rank killed with SIGKILL, a rank that stops calling, a rank that never
//! arrives). Each checks the exit status, the error text every surviving rank prints, the
//! time it took, and that nothing of the job is left in /dev/shm.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;
use common::{
    job_segments as leftover_segments, spawn_external, text, token, tpar_command as tpar,
};

fn run(cmd: &mut Command) -> (Output, Duration) {
    let start = Instant::now();
    let out = cmd.output().expect("tpar runs");
    (out, start.elapsed())
}

#[test]
fn selftest_passes_for_world_sizes_1_to_8() {
    for n in 1..=8 {
        let (out, took) = run(tpar().args([
            "selftest",
            "--backend",
            "cpu",
            "--world-size",
            &n.to_string(),
            "--counts",
            "0,1,7,1023,1048579",
        ]));
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "world size {n}:\n{stdout}\n{}",
            text(&out.stderr)
        );
        // 3 dtypes x 5 counts x 2 placements for each algorithm, the islands algorithms once
        // per island partition; with n > 1 also a timeout case and a mismatch case for each
        // algorithm.
        let algorithms = tpar::CpuCommunicator::ALGORITHMS;
        let islands = [tpar::Algorithm::Islands, tpar::Algorithm::IslandsPull];
        let runs: usize = algorithms
            .iter()
            .map(|a| {
                if islands.contains(a) {
                    tpar_harness::cpu_selftest::island_partitions(n).len()
                } else {
                    1
                }
            })
            .sum();
        let rows = 30 * runs + if n > 1 { 2 * algorithms.len() } else { 0 };
        assert!(
            stdout.contains(&format!("selftest: {rows} passed, 0 failed")),
            "world size {n}:\n{stdout}"
        );
        eprintln!("selftest with {n} ranks took {took:.1?}");
    }
}

#[test]
fn bench_writes_json_with_every_row_correct() {
    let (out, _) = run(tpar().args([
        "bench",
        "--backend",
        "cpu",
        "--world-size",
        "4",
        "--sizes",
        "4K,256K",
        "--json",
        "-",
    ]));
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is JSON alone");
    assert_eq!(json["backend"], "cpu");
    assert_eq!(json["world_size"], 4);
    assert_eq!(json["dtype"], "bf16");
    for key in ["host", "commit", "date", "device", "command"] {
        assert!(
            json[key].as_str().is_some_and(|s| !s.is_empty()),
            "{key} missing"
        );
    }
    let rows = json["results"].as_array().unwrap();
    // Every algorithm of the CPU backend at each size.
    let algorithms = tpar::CpuCommunicator::ALGORITHMS;
    assert_eq!(rows.len(), 2 * algorithms.len());
    let sizes: Vec<u64> = rows.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
    let want: Vec<u64> = [4096u64, 262144]
        .iter()
        .flat_map(|&s| std::iter::repeat_n(s, algorithms.len()))
        .collect();
    assert_eq!(sizes, want);
    for row in rows {
        assert_eq!(row["correct"], true, "{row}");
        assert!(row["p50_us"].as_f64().unwrap() > 0.0);
        assert!(row["p99_us"].as_f64().unwrap() >= row["p50_us"].as_f64().unwrap());
        assert!(row["busbw_gbps"].as_f64().unwrap() > 0.0);
    }
    // The table went to stderr.
    assert!(
        stderr.contains("one-shot") && stderr.contains("256 KiB"),
        "{stderr}"
    );
}

#[test]
fn bench_auto_falls_back_to_cpu_with_a_reason_and_cuda_is_a_clear_error() {
    let (out, _) = run(tpar().args(["bench", "-n", "1", "--sizes", "1K", "--iters", "3"]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    if !Path::new("/proc/driver/nvidia/gpus").exists() {
        assert!(
            stderr.contains("no usable GPU") && stderr.contains("CPU backend"),
            "{stderr}"
        );
    }
    let (out, _) = run(tpar().args(["bench", "--backend", "cuda", "-n", "1"]));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--backend cpu"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn bad_arguments_are_refused_before_any_rank_starts() {
    for (args, expect) in [
        (vec!["bench", "--sizes", "3X"], "unknown suffix"),
        (
            vec!["bench", "--sizes", "1001", "--dtype", "f16"],
            "multiple of 2",
        ),
        (vec!["bench", "--algos", "three-shot"], "unknown algorithm"),
        (vec!["bench", "--timeout", "0"], "positive"),
        (vec!["bench", "--world-size", "0"], "must be >= 1"),
        (vec!["bench", "--iters", "0"], "must be >= 1"),
    ] {
        let (out, took) = run(tpar().args(&args));
        assert_eq!(out.status.code(), Some(2), "{args:?}: a usage error");
        let stderr = text(&out.stderr);
        assert!(stderr.contains(expect), "{args:?}: {stderr}");
        assert!(took < Duration::from_secs(5));
    }
}

#[test]
fn a_rank_environment_without_a_token_is_refused_with_the_fix() {
    let dir = std::env::temp_dir().join(token("notoken"));
    let (out, _) = run(tpar()
        .args(["bench", "--backend", "cpu"])
        .env("TPAR_RENDEZVOUS", &dir)
        .env("RANK", "0")
        .env("WORLD_SIZE", "1"));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("TPAR_JOB_TOKEN"),
        "{}",
        text(&out.stderr)
    );
}

fn assert_every_rank_reports(
    stderr: &str,
    ranks: impl IntoIterator<Item = usize>,
    needles: &[&str],
) {
    for rank in ranks {
        let line = stderr
            .lines()
            .find(|l| l.starts_with(&format!("tpar[rank {rank}]: error:")))
            .unwrap_or_else(|| panic!("rank {rank} printed no error:\n{stderr}"));
        for needle in needles {
            assert!(
                line.contains(needle),
                "rank {rank}: '{needle}' missing in: {line}"
            );
        }
    }
}

#[test]
fn mismatched_sizes_fail_on_every_rank_naming_both() {
    let (out, took) = run(tpar().args([
        "debug-rank",
        "-n",
        "3",
        "--count",
        "1024",
        "--count-on",
        "2=2048",
        "--timeout",
        "10",
    ]));
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert_every_rank_reports(
        &stderr,
        0..3,
        &["mismatched", "1024 elements of f32", "2048 elements of f32"],
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
}

#[test]
fn mismatched_dtypes_fail_on_every_rank_naming_both() {
    let (out, _) = run(tpar().args([
        "debug-rank",
        "-n",
        "2",
        "--dtype-on",
        "1=bf16",
        "--timeout",
        "10",
    ]));
    assert!(!out.status.success());
    assert_every_rank_reports(&text(&out.stderr), 0..2, &["of f32", "of bf16"]);
}

#[test]
fn a_rank_killed_mid_run_fails_the_others_in_time_and_leaves_no_segment() {
    let token = token("kill-launcher");
    let timeout = 5;
    let (out, took) = run(tpar()
        .args([
            "debug-rank",
            "-n",
            "4",
            "--calls",
            "200",
            "--die-on",
            "1@50",
            "--timeout",
            &timeout.to_string(),
        ])
        .env("TPAR_JOB_TOKEN", &token));
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert_every_rank_reports(&stderr, [0, 2, 3], &["rank 1"]);
    assert!(
        stderr.contains("rank 1 (pid") && stderr.contains("SIGKILL"),
        "{stderr}"
    );
    assert!(took < Duration::from_secs(timeout + 1), "{took:?}");
    assert_eq!(leftover_segments(&token), Vec::<String>::new());
}

/// Nothing of an outside-launched job stays in /dev/shm; then its directory is removed.
fn assert_job_left_nothing(token: &str, dir: &Path) {
    assert_eq!(leftover_segments(token), Vec::<String>::new());
    std::fs::remove_dir_all(dir).unwrap();
}

fn private_dir(token: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tpar-ext-{token}"))
}

#[test]
fn sigkill_under_an_outside_launcher_fails_survivors_within_deadline() {
    let token = token("kill-ext");
    let dir = private_dir(&token);
    let timeout = 5u64;
    let args = [
        "debug-rank",
        "--calls",
        "100000000",
        "--count",
        "4096",
        "--timeout",
        "5",
    ];
    let mut ranks = spawn_external(&dir, &token, 4, &[0, 1, 2, 3], &args);
    std::thread::sleep(Duration::from_millis(1500)); // well into the run
    ranks[2].1.kill().unwrap(); // SIGKILL; not reaped yet, so it is a zombie for a while
    let killed_at = Instant::now();
    for (rank, child) in ranks {
        let out = child.wait_with_output().unwrap();
        if rank == 2 {
            continue;
        }
        assert!(!out.status.success(), "rank {rank} should fail");
        let stderr = text(&out.stderr);
        assert!(stderr.contains("rank 2"), "rank {rank}: {stderr}");
    }
    assert!(
        killed_at.elapsed() < Duration::from_secs(timeout + 1),
        "{:?}",
        killed_at.elapsed()
    );
    assert_job_left_nothing(&token, &dir);
}

#[test]
fn a_rank_that_never_arrives_is_named_by_the_others() {
    let token = token("absent");
    let dir = private_dir(&token);
    let start = Instant::now();
    let ranks = spawn_external(
        &dir,
        &token,
        4,
        &[0, 1, 2],
        &["debug-rank", "--timeout", "2"],
    );
    for (rank, child) in ranks {
        let out = child.wait_with_output().unwrap();
        assert!(!out.status.success());
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("rank(s) [3] did not arrive"),
            "rank {rank}: {stderr}"
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(3 + 2),
        "{:?}",
        start.elapsed()
    );
    assert_job_left_nothing(&token, &dir);
}

#[test]
fn a_rank_that_stops_calling_times_out_the_others_naming_it() {
    let token = token("stall");
    let (out, took) = run(tpar()
        .args([
            "debug-rank",
            "-n",
            "3",
            "--calls",
            "20",
            "--stall-on",
            "2@5",
            "--timeout",
            "2",
        ])
        .env("TPAR_JOB_TOKEN", &token));
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert_every_rank_reports(&stderr, [0, 1], &["timed out", "rank 2"]);
    // Ranks fail at ~2 s; the launcher then kills the stalled rank after its grace period
    // (deadline + 5 s), so the whole job ends by about 9 s.
    assert!(
        stderr.contains("rank 2 (pid") && stderr.contains("by the launcher"),
        "{stderr}"
    );
    assert!(took < Duration::from_secs(2 + 7 + 5), "{took:?}");
    assert_eq!(leftover_segments(&token), Vec::<String>::new());
}

#[test]
fn debug_rank_succeeds_when_nothing_is_injected() {
    let (out, _) = run(tpar().args([
        "debug-rank",
        "-n",
        "3",
        "--calls",
        "10",
        "--algo",
        "two-shot",
        "--dtype",
        "bf16",
        "--count",
        "5000",
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("10 call(s) of 5000 bf16 (two-shot) correct on 3 rank(s)"));
}

fn fixture(name: &str) -> String {
    format!(
        "{}/../tpar/fixtures/topologies/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn doctor_explains_a_described_machine_at_every_size() {
    let (out, _) = run(tpar().args([
        "doctor",
        "--topology",
        &fixture("8x-rtx-pro-6000-pcie-2switch"),
    ]));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    for size in [
        "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "64 MiB", "256 MiB",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{size} ")))
            .unwrap_or_else(|| panic!("no decision line for {size}:\n{stdout}"));
        assert!(line.contains(" because") || line.contains(": "), "{line}");
    }
    assert!(
        stdout.contains("GPU0") && stdout.contains("PIX rw") && stdout.contains("SYS rw"),
        "{stdout}"
    );
    assert!(stdout.contains("Memory tpar reserves per rank"), "{stdout}");
}

#[test]
fn doctor_json_parses_and_every_size_has_a_runnable_decision() {
    for name in [
        "8x-rtx-pro-6000-pcie-2switch",
        "4x-rtx-4090-no-p2p",
        "8x-h200-nvswitch",
        "8x-l40s-2numa",
        "8x-a800-2islands",
    ] {
        let (out, _) = run(tpar().args(["doctor", "--json", "--topology", &fixture(name)]));
        assert!(out.status.success(), "{name}: {}", text(&out.stderr));
        let json: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("doctor --json prints JSON");
        assert_eq!(json["ok"], true);
        let decisions = json["decisions"].as_array().unwrap();
        assert_eq!(decisions.len(), 9, "4 KiB to 256 MiB in steps of 4");
        for d in decisions {
            assert!(
                d["choice"].is_string() && !d["reason"].as_str().unwrap().is_empty(),
                "{name}: {d}"
            );
            // A described machine also gets the model's latency for what runs there.
            assert!(
                d["model_us"].as_f64().is_some_and(|us| us > 0.0),
                "{name}: {d}"
            );
        }
        if name == "4x-rtx-4090-no-p2p" {
            assert_eq!(decisions[0]["choice"], "host-staged");
        }
    }
}

#[test]
fn doctor_refuses_a_forced_algorithm_that_cannot_run_and_exits_non_zero() {
    let (out, _) = run(tpar().args([
        "doctor",
        "--topology",
        &fixture("4x-rtx-4090-no-p2p"),
        "--algo",
        "one-shot",
    ]));
    assert!(!out.status.success());
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("NONE") && stdout.contains("no peer-to-peer writes"),
        "{stdout}"
    );
}

#[test]
fn doctor_on_a_machine_without_a_gpu_says_so_and_what_to_do() {
    if Path::new("/proc/driver/nvidia/gpus").exists() {
        eprintln!("SKIPPED doctor_on_a_machine_without_a_gpu: this machine has a GPU");
        return;
    }
    let (out, _) = run(tpar().args(["doctor"]));
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("no GPU") && stderr.contains("--topology"),
        "{stderr}"
    );
}

fn model(name: &str) -> String {
    format!(
        "{}/../tpar-harness/fixtures/models/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// `tpar plan memory` on the reported machine (96 GiB card, 72.3 GiB of weights, 21.7 GiB free
/// after loading) with SGLang's `mem_fraction_static` and any further arguments.
fn plan_reported_case(mem_fraction_static: &str, extra: &[&str]) -> Output {
    let config = model("deepseek-v3");
    let mut args = vec![
        "plan",
        "memory",
        "--config",
        &config,
        "--tp",
        "8",
        "--gpu-gb",
        "96",
        "--free-after-load-gb",
        "21.7",
        "--weights-gb",
        "72.3",
        "--mem-fraction-static",
        mem_fraction_static,
    ];
    args.extend_from_slice(extra);
    run(tpar().args(&args)).0
}

#[test]
fn plan_memory_diagnoses_the_reported_case_with_the_setting_that_works() {
    let out = plan_reported_case("0.55", &[]);
    assert!(!out.status.success());
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("KV budget -21.5 GiB")
            && stdout.contains("mem_fraction_static to at least 0.78"),
        "{stdout}"
    );
    let out = plan_reported_case("0.78", &["--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(json["plan"]["kv_tokens"].as_u64().unwrap() >= 4096);
}

#[test]
fn plan_memory_counts_a_dense_model_from_its_config() {
    let (out, _) = run(tpar().args([
        "plan",
        "memory",
        "--config",
        &model("llama-3.1-70b"),
        "--tp",
        "8",
        "--gpu-gb",
        "140",
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("70.6B parameters") && stdout.contains("tokens of 40960 bytes each"),
        "{stdout}"
    );
    assert!(stdout.contains("tpar buffers"), "{stdout}");
}

#[test]
fn plan_spec_decode_shows_the_reported_loss_and_where_it_breaks_even() {
    let (out, _) = run(tpar().args([
        "plan",
        "spec-decode",
        "--config",
        &model("deepseek-v3"),
        "--tp",
        "8",
        "--tokens",
        "3",
        "--acceptance",
        "2",
        "--latency-us",
        "200",
        "--plain-latency-us",
        "25",
        "--plain-ms",
        "8",
        "--verify-ms",
        "10",
        "--draft-ms",
        "5",
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("122 of 43008 B") && stdout.contains("24.40 ms per verify pass"),
        "{stdout}"
    );
    assert!(
        stdout.contains("speculation LOSES") && stdout.contains("under 58.2 us"),
        "{stdout}"
    );
    let (out, _) = run(tpar().args([
        "plan",
        "spec-decode",
        "--config",
        &model("deepseek-v3"),
        "--tp",
        "8",
        "--tokens",
        "3",
        "--acceptance",
        "4",
        "--latency-us",
        "10",
    ]));
    assert!(!out.status.success() && text(&out.stderr).contains("exceeds --tokens"));
}

#[test]
fn bench_step_checks_its_input_and_says_what_it_needs() {
    let config = model("llama-3.1-70b");
    let (out, _) = run(tpar().args([
        "bench", "step", "--config", &config, "--tp", "8", "--layers", "81",
    ]));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("the model has 80 layers"),
        "{}",
        text(&out.stderr)
    );
    let (out, _) = run(tpar().args([
        "bench",
        "step",
        "--config",
        "/nonexistent.json",
        "--tp",
        "2",
    ]));
    assert!(
        text(&out.stderr).contains("cannot read --config /nonexistent.json"),
        "{}",
        text(&out.stderr)
    );
    let (out, _) = run(tpar().args([
        "bench", "step", "--config", &config, "--tp", "2", "--algos", "rings",
    ]));
    assert!(text(&out.stderr).contains("rings"), "{}", text(&out.stderr));
    let (out, _) = run(tpar().args([
        "bench",
        "step",
        "--config",
        &config,
        "--tp",
        "2",
        "--norms",
        "separate,both",
    ]));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("unknown norm mode 'both'; give separate or fused"),
        "{}",
        text(&out.stderr)
    );
    // Where no GPU can be used, it says so (and where one can, it runs: see bench/results).
    let (out, _) = run(tpar().args([
        "bench",
        "step",
        "--config",
        &config,
        "--tp",
        "2",
        "--layers",
        "1",
        "--replays",
        "2",
    ]));
    let stderr = text(&out.stderr);
    assert!(
        out.status.success() || stderr.contains("runs the pass on GPUs"),
        "{stderr}"
    );
}

#[test]
fn plan_spec_decode_predicts_from_a_topology_file() {
    let topology = |name: &str| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tpar/fixtures/topologies")
            .join(format!("{name}.json"))
            .display()
            .to_string()
    };
    let args = |t: &str, tp: &'static str| {
        vec![
            "plan".to_owned(),
            "spec-decode".into(),
            "--config".into(),
            model("deepseek-v3"),
            "--tp".into(),
            tp.into(),
            "--tokens".into(),
            "3".into(),
            "--acceptance".into(),
            "2".into(),
            "--latency-topology".into(),
            topology(t),
        ]
    };
    let (out, _) = run(tpar().args(args("8x-rtx-pro-6000-pcie-2switch", "8")));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        stdout.contains("modelled for")
            && stdout.contains("PCIe across CPU sockets, P2P between every pair"),
        "{stdout}"
    );
    let (out, _) = run(tpar().args(args("4x-rtx-4090-no-p2p", "8")));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("at most 4"),
        "{}",
        text(&out.stderr)
    );
}
