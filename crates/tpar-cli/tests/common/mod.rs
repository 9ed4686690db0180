//! What the integration tests share: the `tpar` binary with no rank environment, forced
//! algorithm or islands inherited from whatever runs the tests, ranks started as an outside
//! launcher would, and a job's leftover shared memory.

use std::path::Path;
use std::process::{Child, Command, Stdio};

/// The `tpar` binary, with standard input closed and none of the launcher's variables, job
/// token or `TPAR_ALGO` of the environment the tests run in.
pub fn tpar_command() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tpar"));
    for key in [
        "TPAR_RENDEZVOUS",
        "TPAR_JOB_TOKEN",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "TPAR_ALGO",
        "TPAR_ISLANDS",
    ] {
        cmd.env_remove(key);
    }
    cmd.stdin(Stdio::null());
    cmd
}

/// Runs `cmd` to its end and asserts that it succeeded (its standard error in the message).
#[allow(dead_code)] // not every test file runs a command that must succeed
pub fn output_of_success(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The /dev/shm segments of the job with `token` that are still there.
#[allow(dead_code)] // not every test file looks at shared memory
pub fn job_segments(token: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("tpar-{token}-")))
        .collect()
}

/// Starts `ranks` of a job of `world_size` as an outside launcher would.
#[allow(dead_code)] // not every test file starts ranks itself
pub fn spawn_external(
    dir: &Path,
    token: &str,
    world_size: usize,
    ranks: &[usize],
    args: &[&str],
) -> Vec<(usize, Child)> {
    ranks
        .iter()
        .map(|&rank| {
            let child = tpar_command()
                .args(args)
                .env("TPAR_RENDEZVOUS", dir)
                .env("TPAR_JOB_TOKEN", token)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world_size.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            (rank, child)
        })
        .collect()
}

/// Standard output or error as text.
#[allow(dead_code)]
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A job token of its own for one test run: the tag, this process and the clock.
#[allow(dead_code)]
pub fn token(tag: &str) -> String {
    format!(
        "test-{tag}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}
