//! Records the git commit the binary was built from, for benchmark results.

use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=TPAR_GIT_COMMIT={commit}");
    // Rebuild when HEAD moves (new commit or checkout), the index changes, or a source file
    // does (the dirty state: an edit changes no file under .git, and a binary built from an
    // edited tree once said it was the clean commit; cargo scans a directory recursively).
    for path in [
        "../../.git/HEAD",
        "../../.git/index",
        "../../crates",
        "../../Cargo.lock",
    ] {
        println!("cargo:rerun-if-changed={path}");
    }
    if let Ok(head) = std::fs::read_to_string("../../.git/HEAD") {
        if let Some(reference) = head.strip_prefix("ref: ") {
            println!("cargo:rerun-if-changed=../../.git/{}", reference.trim());
        }
    }
}
