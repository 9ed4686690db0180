//! What the integration tests share: the `tpar` binary with no rank environment or forced
//! algorithm inherited from whatever runs the tests, and a job's leftover shared memory.

use std::process::{Command, Stdio};

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
    ] {
        cmd.env_remove(key);
    }
    cmd.stdin(Stdio::null());
    cmd
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
