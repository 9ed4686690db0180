//! Cleanup under signals: the launcher of `tpar bench` killed at random moments of its first
//! 200 ms (SIGINT, SIGTERM, SIGHUP, SIGKILL in turn, 50 tries), each started with SIGINT's
//! default action whatever this test inherited (a background job ignores SIGINT). After each try no rank of the job
//! may be left in the process table; after a caught signal nothing of the job may be left in
//! /dev/shm or the temporary folder; what a SIGKILL left is swept by the next launch, which
//! says so. Each try uses its own job token and the test its own TMPDIR, so concurrent tests
//! and other users' jobs are never looked at. And what an interrupted bench prints: the rows
//! it has, where the finished table would have gone.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::job_segments as segments_of;

fn tpar(tmp: &Path, token: &str) -> Command {
    let mut cmd = common::tpar_command();
    cmd.env("TMPDIR", tmp)
        .env("TPAR_JOB_TOKEN", token)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // A test command started from a background job (as a CI runner may start it) inherits
    // SIGINT ignored; the launcher is tried as a terminal starts it, with the default action.
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and only calls signal(), which
    // is async-signal-safe, on its own disposition of SIGINT.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    cmd
}

/// A 3-rank CPU bench of job `token` with `iters` calls per size, started, not awaited.
fn start_bench(tmp: &Path, token: &str, iters: u32) -> std::process::Child {
    tpar(tmp, token)
        .args([
            "bench",
            "--backend",
            "cpu",
            "-n",
            "3",
            "--sizes",
            "4K,64K",
            "--iters",
        ])
        .arg(iters.to_string())
        .spawn()
        .unwrap()
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect()
}

/// Pids of live processes (not zombies) whose environment carries the job's token.
fn processes_of(token: &str) -> Vec<u32> {
    let needle = format!("TPAR_JOB_TOKEN={token}");
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        let state = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = state
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
        if !zombie && environ.split(|&b| b == 0).any(|v| v == needle.as_bytes()) {
            pids.push(pid);
        }
    }
    pids
}

fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    done()
}

#[test]
fn killing_the_launcher_at_random_moments_leaves_nothing_behind() {
    let tmp = std::env::temp_dir().join(format!("tpar-signal-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).unwrap();
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("seed {seed}");
    let signals = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGKILL];
    let mut killed_tokens = Vec::new();
    let mut interrupted = 0;
    for attempt in 0..50 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let delay = Duration::from_millis(seed % 201);
        let sig = signals[attempt % signals.len()];
        // The first 8 characters name the launcher's directory: distinct per try.
        let token = format!("t{attempt:02}x{:08}", std::process::id());
        let mut child = start_bench(&tmp, &token, 300);
        std::thread::sleep(delay);
        // SAFETY: signalling the child this test started.
        unsafe { libc::kill(child.id() as libc::pid_t, sig) };
        let status = child.wait().unwrap();
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        let what = format!("try {attempt}: signal {sig} after {delay:?}: {status:?}\n{stderr}");
        assert!(!stderr.contains("panicked"), "{what}");
        assert!(
            wait_until(Duration::from_secs(5), || processes_of(&token).is_empty()),
            "{what}: ranks still running: {:?}",
            processes_of(&token)
        );
        if sig == libc::SIGKILL {
            killed_tokens.push(token);
            continue;
        }
        // Caught: 128 + signal with the line saying so; before the handler was installed the
        // default action (killed by the signal, nothing created yet); or the run had finished.
        match status.code() {
            Some(code) if code == 128 + sig => {
                interrupted += 1;
                assert!(stderr.contains("tpar: interrupted by"), "{what}");
            }
            Some(0) => {}
            None => assert_eq!(status.signal(), Some(sig), "{what}"),
            Some(_) => panic!("{what}"),
        }
        assert_eq!(segments_of(&token), Vec::<String>::new(), "{what}");
        let own_dir = tmp.join(format!("tpar-{}-{}", &token[..8], child.id()));
        assert!(!own_dir.exists(), "{what}: {} left", own_dir.display());
    }
    eprintln!(
        "{interrupted} tries interrupted inside the launcher; {} SIGKILLed",
        killed_tokens.len()
    );
    assert!(
        interrupted > 0,
        "no try was interrupted inside the launcher"
    );

    // One more SIGKILL once the job is surely set up: its directory is left behind (nothing
    // can clean up after SIGKILL) and its ranks die with it.
    let token = format!("killlast{:08}", std::process::id());
    let mut child = start_bench(&tmp, &token, 3000);
    std::thread::sleep(Duration::from_millis(400));
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(wait_until(Duration::from_secs(5), || processes_of(&token).is_empty()));
    assert!(
        !entries(&tmp).is_empty(),
        "a SIGKILLed launcher left nothing to sweep"
    );
    killed_tokens.push(token);

    // The next launch sweeps what the SIGKILLed launchers left, and says so.
    let left_before = !entries(&tmp).is_empty();
    let out = tpar(&tmp, "sigtestsweeper")
        .args([
            "bench",
            "--backend",
            "cpu",
            "-n",
            "1",
            "--sizes",
            "4K",
            "--iters",
            "5",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    if left_before {
        assert!(
            stderr.contains("removed leftovers of a dead job"),
            "{stderr}"
        );
    }
    assert_eq!(entries(&tmp), Vec::<PathBuf>::new());
    for token in &killed_tokens {
        assert_eq!(segments_of(token), Vec::<String>::new(), "{token}");
        assert_eq!(processes_of(token), Vec::<u32>::new(), "{token}");
    }
    std::fs::remove_dir(&tmp).unwrap();
}

/// Starts a 2-rank CPU bench of four sizes (`--json -` where `json_on_stdout`; the last two
/// sizes take seconds, time enough to interrupt), lets it finish two rows (its progress line
/// for the third), interrupts it with SIGINT and gives its exit status, standard output and
/// standard error.
fn interrupted_bench(
    tmp: &Path,
    token: &str,
    json_on_stdout: bool,
) -> (Option<i32>, String, String) {
    use std::io::BufRead;
    let mut cmd = tpar(tmp, token);
    let bench = "bench --backend cpu -n 2 --sizes 4K,8K,128K,256K --algos one-shot --iters 50000";
    cmd.stdout(Stdio::piped()).args(bench.split(' '));
    if json_on_stdout {
        cmd.args(["--json", "-"]);
    }
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let stdout = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::BufReader::new(stdout), &mut text).unwrap();
        text
    });
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut said = String::new();
    let mut line = String::new();
    while stderr.read_line(&mut line).unwrap() > 0 {
        said.push_str(&line);
        if line.starts_with("[3/4]") {
            // SAFETY: signalling the child this test started.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
        }
        line.clear();
    }
    let status = child.wait().unwrap();
    assert!(
        said.contains("[3/4]"),
        "the bench ended before its third row:\n{said}"
    );
    (status.code(), stdout.join().unwrap(), said)
}

#[test]
fn an_interrupted_bench_prints_its_rows_so_far_where_its_table_goes() {
    let tmp = std::env::temp_dir().join(format!("tpar-partial-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).unwrap();
    for json_on_stdout in [false, true] {
        let token = format!("p{}x{:08}", u8::from(json_on_stdout), std::process::id());
        let (code, stdout, stderr) = interrupted_bench(&tmp, &token, json_on_stdout);
        let what = format!(
            "--json - {json_on_stdout}: status {code:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
        assert_eq!(code, Some(128 + libc::SIGINT), "{what}");
        assert!(stderr.contains("tpar: interrupted by SIGINT"), "{what}");
        // The rows so far: the two finished sizes, and not the one it was timing.
        let (rows, other) = if json_on_stdout {
            (&stderr, &stdout)
        } else {
            (&stdout, &stderr)
        };
        assert!(rows.contains("tpar bench (partial)"), "{what}");
        for size in ["4 KiB", "8 KiB"] {
            assert!(
                rows.lines()
                    .any(|l| l.starts_with(size) && l.contains("one-shot")),
                "{what}"
            );
        }
        assert!(!rows.lines().any(|l| l.starts_with("128 KiB")), "{what}");
        assert!(!other.contains("(partial)"), "{what}");
        if json_on_stdout {
            // A reader of the JSON gets nothing rather than a text table.
            assert_eq!(stdout, "", "{what}");
        }
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}
