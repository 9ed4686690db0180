//! The printers on reports built by the library from fixtures and hand-made rows: each text
//! holds the figures and verdicts of its report, and rows that failed or did not run say so.

use std::path::PathBuf;

use tpar::DType;
use tpar_harness::cpu_bench::CpuRow;
use tpar_harness::cuda_bench::CudaRow;
use tpar_harness::doctor::{examine, DoctorOptions};
use tpar_harness::planner::capacity::{memory_report, MemoryRequest};
use tpar_harness::planner::memory::EngineRule;
use tpar_harness::reports::TuneReport;
use tpar_harness::selftest_row::SelftestRow;

/// A fixture of `crate` (`tpar`: topologies, `tpar-harness`: models).
fn fixture(crate_dir: &str, path: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .join(crate_dir)
        .join("fixtures")
        .join(path)
}

fn cuda_row(bytes: u64, algo: &str, p50_us: f64) -> CudaRow {
    CudaRow {
        bytes,
        algo: algo.into(),
        p50_us,
        p99_us: p50_us,
        busbw_gbps: 1.0,
        correct: true,
        graph_single_us: 0.0,
        wire_floor_us: 0.0,
        chain: 50,
        replays: 50,
        runs: None,
        why: None,
        launch: None,
        skipped: None,
    }
}

#[test]
fn a_selftest_table_counts_failed_rows_and_shows_the_mode_column_only_on_cuda() {
    let row = |bad| {
        SelftestRow::tallied(
            vec![
                "one-shot".into(),
                "f32".into(),
                "7".into(),
                "in place".into(),
            ],
            bad,
            String::new(),
        )
    };
    let rows = vec![row(0), row(2)];
    let cpu = tpar_report::selftest::table(&rows, false);
    assert!(cpu.starts_with("case") && !cpu.contains("mode"), "{cpu}");
    assert!(cpu.contains("FAIL on 2 rank(s)"), "{cpu}");
    assert_eq!(
        tpar_report::selftest::summary(&rows),
        "selftest: 1 passed, 1 failed"
    );
    let mut with_mode = vec![row(0)];
    with_mode[0].cells.push("graph".into());
    assert!(tpar_report::selftest::table(&with_mode, true)
        .lines()
        .next()
        .unwrap()
        .contains("mode"));
}

#[test]
fn a_cpu_table_marks_wrong_results() {
    let row = |algo: &str, correct| CpuRow {
        bytes: 4096,
        algo: algo.into(),
        p50_us: 9.5,
        p99_us: 20.0,
        busbw_gbps: 0.43,
        correct,
    };
    let text = tpar_report::bench::cpu_table(&[row("one-shot", true), row("two-shot", false)]);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[1].starts_with("4 KiB  one-shot") && lines[1].ends_with("yes"),
        "{text}"
    );
    assert!(lines[2].ends_with("NO"), "{text}");
}

#[test]
fn the_tune_text_names_the_fastest_the_runner_up_and_what_was_not_measured() {
    let mut nccl = cuda_row(4096, "nccl", 0.0);
    nccl.skipped = Some("no NCCL library".into());
    let rows = vec![
        cuda_row(4096, "one-shot", 4.0),
        cuda_row(4096, "two-shot", 5.0),
        nccl,
    ];
    let table = tpar_harness::tune::table_from(&rows, "fp".into(), 2, DType::Bf16).unwrap();
    let fused_rows = vec![
        fused_row(64, "allreduce + norm", 19.18),
        fused_row(64, "fused", 21.51),
    ];
    let report = TuneReport {
        provenance: tpar_harness::provenance::Provenance::collect("cuda: test".into(), "abc123"),
        table,
        written_to: "/tmp/t.json".into(),
        measurements: rows,
        fused: Some(tpar_harness::tune::FusedTuned {
            table: tpar_harness::tune::fused_table_from(
                &fused_rows,
                "fp".into(),
                2,
                DType::Bf16,
                8192,
            ),
            written_to: None,
            rows: fused_rows,
            not_measured: vec!["host-staged: no host inboxes".into()],
        }),
    };
    let text = tpar_report::tune::tune(&report, "2 ranks, bf16 on a test machine", &[(4096, 2048)]);
    assert!(
        text.starts_with("tpar tune: 2 ranks, bf16 on a test machine\n"),
        "{text}"
    );
    assert!(
        text.contains("4 KiB  one-shot    4.00   two-shot    5.00"),
        "{text}"
    );
    assert!(
        text.contains("not measured: nccl: no NCCL library\n"),
        "{text}"
    );
    assert!(text.contains("wrote /tmp/t.json\n"), "{text}");
    assert!(
        text.contains("one-shot   64         21.51                19.18  separate")
            && text.contains("not measured: host-staged: no host inboxes")
            && text.ends_with("no fused table written"),
        "{text}"
    );
}

#[test]
fn the_memory_plan_shows_its_terms_and_says_when_it_does_not_fit() {
    let request = |gpu_gb| MemoryRequest {
        compute_capability: None,
        config: fixture("tpar-harness", "models/llama-3.1-70b.json"),
        tp: 8,
        gpu_gb: Some(gpu_gb),
        free_after_load_gb: None,
        weights_gb: None,
        rule: EngineRule::Sglang {
            mem_fraction_static: 0.88,
        },
        nccl: tpar::communicator::NcclMode::None,
        kv_bytes: None,
        cuda_graph_gb: 1.0,
        draft_gb: 0.0,
        draft_config: None,
        runtime_gb: 1.5,
        activation_gb: 2.0,
        context: 4096,
    };
    let fits = tpar_report::plan::memory(&memory_report(&request(80.0)).unwrap(), "SGLang");
    assert!(
        fits.starts_with("tpar plan memory: llama-3.1-70b ("),
        "{fits}"
    );
    assert!(
        fits.contains("SGLang GPU of 80") && fits.contains("KV budget"),
        "{fits}"
    );
    assert!(!fits.contains("DOES NOT FIT"), "{fits}");
    let small = tpar_report::plan::memory(&memory_report(&request(16.0)).unwrap(), "SGLang");
    assert!(small.contains("DOES NOT FIT"), "{small}");
}

fn fused_row(
    tokens: usize,
    variant: &'static str,
    p50_us: f64,
) -> tpar_harness::fused_bench::FusedBenchRow {
    tpar_harness::fused_bench::FusedBenchRow {
        algorithm: "one-shot",
        world_size: 2,
        tokens,
        hidden: 8192,
        bytes: tokens * 8192 * 2,
        variant,
        p50_us,
        p99_us: p50_us,
        correct: Some(true),
        launch: (variant == "fused").then_some(tpar::backend::cuda::LaunchShape {
            kernel: tpar::backend::cuda::KernelId::FusedOneShotClusters(tpar::DType::Bf16),
            grid: 4,
            block: 512,
            cluster: 4,
            pdl: true,
        }),
    }
}

#[test]
fn the_doctor_text_of_a_described_machine_has_every_section() {
    let report = examine(&DoctorOptions {
        topology: Some(fixture(
            "tpar",
            "topologies/8x-rtx-pro-6000-pcie-2switch.json",
        )),
        world_size: Some(4),
        dtype: DType::Bf16,
        forced: None,
    })
    .unwrap();
    let text = tpar_report::doctor::doctor(&report);
    for section in [
        "tpar doctor: 8x NVIDIA RTX PRO 6000",
        "Links (path; P2P r = reads, w = writes):",
        "GPU0       X  PIX rw",
        "Memory tpar reserves per rank with 4 ranks:",
        "Machine class: one-switch (PCIe, every GPU under one switch); islands: one",
        "What runs, 4 ranks, bf16 (PCIe, every GPU under one switch",
    ] {
        assert!(text.contains(section), "{section}: {text}");
    }
    assert!(!text.contains("cannot work as asked"), "{text}");
}

#[test]
fn the_fused_bench_text_names_the_fused_kernels_launch_and_each_difference() {
    let rows = tpar_harness::fused_bench::VARIANTS
        .iter()
        .zip([0.6, 2.0, 3.4, 5.5, 4.3])
        .map(|(&variant, us)| fused_row(1, variant, us))
        .collect();
    let bench = tpar_harness::fused_bench::FusedBench {
        algorithm: tpar::Algorithm::OneShot,
        device: "a test GPU".into(),
        driver_version: 13000,
        hidden: 8192,
        rows,
        errors: vec![],
    };
    let text = tpar_report::bench::fused(&bench, 50, 100);
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("2 "))
        .unwrap_or_else(|| panic!("no row for 2 ranks in\n{text}"));
    for cell in ["4.30", "+2.30", "+1.20", "4x512 c4 pdl", "yes"] {
        assert!(row.contains(cell), "{cell} missing from {row:?} in\n{text}");
    }
}

#[test]
fn the_cuda_bench_text_says_why_auto_ran_what_it_ran_at_each_size() {
    use tpar_harness::cuda_bench::Floors;
    use tpar_harness::provenance::Provenance;
    use tpar_harness::reports::CudaBenchReport;
    let auto = |bytes, runs: &str, why: &str| CudaRow {
        runs: Some(runs.into()),
        why: Some(why.into()),
        ..cuda_row(bytes, "auto", 3.0)
    };
    let mut report = CudaBenchReport {
        backend: "cuda",
        world_size: 8,
        mode: "threads",
        dtype: DType::Bf16,
        provenance: Provenance::collect("a GPU".into(), "0000000"),
        replays: 50,
        warmup: 5,
        chain: 50,
        timing: "events",
        memory_per_rank_bytes: 1 << 20,
        max_blocks_per_rank: 16,
        floors: Floors {
            empty_chain_us: 1.0,
            empty_single_us: 2.0,
            device_copy_gbps: 1000.0,
            device_to_host_gbps: 50.0,
        },
        first_use: None,
        results: vec![
            cuda_row(65536, "one-shot", 9.1),
            auto(
                4096,
                "one-shot",
                "one-shot: fastest in the fabric model: 3.0 us modelled",
            ),
            auto(
                65536,
                "two-shot",
                "two-shot: corrected by the first-use measurement",
            ),
        ],
    };
    let text = tpar_report::bench::cuda_bench(&report);
    assert!(text.contains("auto at each size, and why:"), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    let at = |needle: &str| lines.iter().position(|l| l.contains(needle));
    let reason_4k = at("fastest in the fabric model: 3.0 us modelled").expect("4 KiB's reason");
    let reason_64k = at("corrected by the first-use measurement").expect("64 KiB's reason");
    assert!(lines[reason_4k].contains("4 KiB") && lines[reason_64k].contains("64 KiB"));
    assert!(
        !text.contains("first-use measurement, as an engine"),
        "{text}"
    );

    report.first_use = Some("2 candidates timed in 40 ms (budget 200 ms)".into());
    let text = tpar_report::bench::cuda_bench(&report);
    assert!(text.contains("2 candidates timed in 40 ms"), "{text}");
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(
        json["first_use"],
        "2 candidates timed in 40 ms (budget 200 ms)"
    );
    assert_eq!(
        json["results"][2]["why"],
        "two-shot: corrected by the first-use measurement"
    );
    assert!(json["results"][0].get("why").is_none());

    // No auto row, no reasons.
    report.results.truncate(1);
    let text = tpar_report::bench::cuda_bench(&report);
    assert!(!text.contains("and why"), "{text}");
}
