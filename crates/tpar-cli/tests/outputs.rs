//! Where `tpar` writes, as real files and pipes: a closed stdout (`| head -1` in a real
//! shell) ends quietly with SIGPIPE's status, a full one is one line; `--json` and `--plot`
//! targets are checked before any rank starts (exit 2 naming the path), regular files are
//! replaced whole, devices, FIFOs and symlinks' targets are written in place and stay what
//! they were, `--plot -` is stdout. Each test works in its own temporary folder.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

mod common;

/// A fresh folder for one test, removed by the test when it passes.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tpar-outputs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A short 2-rank CPU bench with `extra` arguments.
fn bench(extra: &[&str]) -> Command {
    bench_on(2, extra)
}

/// A short CPU bench of `ranks` ranks with `extra` arguments.
fn bench_on(ranks: usize, extra: &[&str]) -> Command {
    let mut cmd = common::tpar_command();
    cmd.args([
        "bench",
        "--backend",
        "cpu",
        "-n",
        &ranks.to_string(),
        "--sizes",
        "4K,64K",
        "--iters",
        "3",
    ])
    .args(extra)
    .env_remove("RUST_BACKTRACE");
    cmd
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Non-empty stderr lines that are not progress lines (`[1/4] 4 KiB one-shot`).
fn messages(out: &Output) -> Vec<String> {
    text(&out.stderr)
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('['))
        .map(str::to_owned)
        .collect()
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn a_closed_pipe_ends_quietly_with_sigpipes_status() {
    // --json - puts the JSON on stdout: 300 sizes x 2 algorithms is well over a pipe's 64 KiB,
    // so the write is still going when `head -1` has read its line and exited.
    let sizes: Vec<String> = (1..=300).map(|i| (4 * i).to_string()).collect();
    let script = format!(
        "\"$TPAR\" bench --backend cpu -n 2 --sizes {} --iters 1 --warmup 0 --json - 2>\"$ERR\" | head -1; echo \"status ${{PIPESTATUS[0]}}\"",
        sizes.join(",")
    );
    let dir = scratch("pipe");
    let err_file = dir.join("stderr.txt");
    let out = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .env("TPAR", env!("CARGO_BIN_EXE_tpar"))
        .env("ERR", &err_file)
        .env_remove("RUST_BACKTRACE")
        .env_remove("TPAR_RENDEZVOUS")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    let stderr = std::fs::read_to_string(&err_file).unwrap();
    assert_eq!(stdout, "{\nstatus 141\n", "stderr:\n{stderr}");
    // The table went to stderr (--json -); nothing else may follow it: no panic, no failed rank.
    for line in stderr.lines() {
        assert!(
            !line.starts_with("tpar") || line.starts_with("tpar bench: cpu backend"),
            "{line}\n{stderr}"
        );
        assert!(!line.contains("panicked"), "{stderr}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_full_stdout_is_one_line_and_exit_1() {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full");
    for cmd in [bench(&[]), {
        let mut plan = common::tpar_command();
        plan.args([
            "plan",
            "memory",
            "--config",
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../tpar-harness/fixtures/models/llama-3.1-70b.json"
            ),
            "-n",
            "8",
            "--gpu-gb",
            "80",
        ]);
        plan
    }] {
        let mut cmd = cmd;
        let out = cmd.stdout(full.try_clone().unwrap()).output().unwrap();
        let lines = messages(&out);
        assert_eq!(out.status.code(), Some(1), "{lines:?}");
        assert_eq!(
            lines,
            ["tpar: error: cannot write to standard output: No space left on device (os error 28)"]
        );
    }
}

#[test]
fn an_output_path_that_cannot_be_written_is_refused_before_any_rank_starts() {
    let dir = scratch("refused");
    let ro = dir.join("read-only");
    std::fs::create_dir(&ro).unwrap();
    let cases = [
        (
            "json",
            "/proc/x.json".to_owned(),
            "cannot create a file in /proc",
        ),
        (
            "plot",
            format!("{}/missing/x.svg", dir.display()),
            "does not exist",
        ),
        ("json", dir.display().to_string(), "is a folder"),
    ];
    for (flag, path, says) in cases {
        let out = bench(&[&format!("--{flag}"), &path]).output().unwrap();
        let lines = messages(&out);
        assert_eq!(out.status.code(), Some(2), "{path}: {lines:?}");
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].starts_with(&format!("tpar: error: --{flag} {path}: "))
                && lines[0].contains(says),
            "{lines:?}"
        );
        assert!(!text(&out.stderr).contains("[1/"), "a rank started");
    }
    let out = bench(&["--json", "-", "--plot", "-"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(messages(&out)[0].contains("both write to standard output"));
    std::fs::remove_dir_all(dir).unwrap();
}

/// The bench's JSON at `path`, parsed.
fn json_at(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn files_are_replaced_whole_and_symlinks_are_followed() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch("files");
    let target = dir.join("results.json");
    std::fs::write(&target, "old").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
    let link = dir.join("latest.json");
    std::os::unix::fs::symlink("results.json", &link).unwrap();
    let svg_link = dir.join("plot.svg");
    std::os::unix::fs::symlink(dir.join("real.svg"), &svg_link).unwrap(); // dangling
    let out = bench(&[
        "--json",
        link.to_str().unwrap(),
        "--plot",
        svg_link.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let meta = std::fs::symlink_metadata(&link).unwrap();
    assert!(meta.file_type().is_symlink(), "the link was replaced");
    assert_eq!(json_at(&target)["world_size"], 2);
    assert_eq!(
        std::fs::metadata(&target).unwrap().permissions().mode() & 0o777,
        0o600,
        "the file's permissions were not kept"
    );
    assert!(std::fs::symlink_metadata(&svg_link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(std::fs::read_to_string(dir.join("real.svg"))
        .unwrap()
        .starts_with("<svg"));
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["latest.json", "plot.svg", "real.svg", "results.json"],
        "nothing else left in the folder"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_fifo_is_written_in_place() {
    let dir = scratch("fifo");
    let fifo = dir.join("results.fifo");
    let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo reads the NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).unwrap())
    };
    let out = bench(&["--json", fifo.to_str().unwrap()]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let read: serde_json::Value = serde_json::from_slice(&reader.join().unwrap()).unwrap();
    assert_eq!(read["backend"], "cpu");
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn devices_stay_devices() {
    if !is_root() {
        eprintln!("SKIPPED devices_stay_devices: not root, so a replaced /dev/null or /dev/full could not be the bug this checks (only root may replace them)");
        return;
    }
    use std::os::unix::fs::FileTypeExt;
    let out = bench(&["--json", "/dev/null", "--plot", "/dev/null"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "one file for both is refused");
    let out = bench(&["--json", "/dev/null"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = bench(&["--json", "/dev/full"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr)
            .contains("cannot write --json /dev/full: No space left on device (os error 28)"),
        "{}",
        text(&out.stderr)
    );
    let out = bench(&["--plot", "/dev/full"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    for device in ["/dev/null", "/dev/full"] {
        let meta = std::fs::metadata(device).unwrap();
        assert!(meta.file_type().is_char_device(), "{device} was replaced");
    }
}

#[test]
fn dev_stdout_is_written_in_place() {
    let out = bench(&["--json", "/dev/stdout"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let json_start = stdout.find("\n{\n").expect("the JSON after the table");
    let v: serde_json::Value = serde_json::from_str(&stdout[json_start..]).unwrap();
    assert_eq!(v["world_size"], 2);
}

#[test]
fn plot_dash_is_stdout_and_the_table_goes_to_stderr() {
    let out = bench(&["--plot", "-"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("<svg") && stdout.trim_end().ends_with("</svg>"));
    assert!(text(&out.stderr).contains("4 KiB  one-shot"));
    assert!(!Path::new("-").exists(), "a file named - was written");
}

/// Runs `cmd` on one core (its affinity, which is what tpar counts), so that 3 ranks outnumber
/// the cores on any machine.
fn on_one_core(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and only calls
    // sched_setaffinity on itself with a set built on its own stack (async-signal-safe).
    unsafe {
        cmd.pre_exec(|| {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(0, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

#[test]
fn the_cores_warning_is_said_once_and_not_by_selftest() {
    let warned = |out: &Output| text(&out.stderr).matches("3 ranks on 1 core:").count();
    let out = on_one_core(&mut bench_on(3, &[])).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(warned(&out), 1, "{}", text(&out.stderr));
    let mut selftest = common::tpar_command();
    selftest
        .args(["selftest", "--backend", "cpu", "-n", "3", "--counts", "7"])
        .args(["--dtypes", "f32", "--no-timeout-case"]);
    let out = on_one_core(&mut selftest).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(warned(&out), 0, "{}", text(&out.stderr));
    assert!(
        !text(&out.stderr).contains("ranks on"),
        "{}",
        text(&out.stderr)
    );
}
