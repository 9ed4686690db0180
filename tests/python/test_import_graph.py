"""scripts/import_graph.py finds what it is for: a cycle between two files, an upward edge
between layers, a sideways edge between the isolated policy and transport components, an edge
from a lower crate to a higher one and a top-level module in no layer, each in a made-up
workspace; and the real one has none (what CI checks)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "import_graph.py"


def check(root: Path | None = None) -> tuple[int, str]:
    args = [sys.executable, str(SCRIPT), "--quiet"] + (["--root", str(root)] if root else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def workspace(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


CORE = {
    "crates/tpar/Cargo.toml": '[package]\nname = "tpar"\n',
    "crates/tpar/src/lib.rs": """
        pub mod backend;
        pub mod dispatch;
        pub mod dtype;
        pub mod protocol;
        pub use dtype::DType;
    """,
    "crates/tpar/src/dtype.rs": "pub enum DType { F32 }\n",
    "crates/tpar/src/protocol/mod.rs": "pub mod line;\n",
    "crates/tpar/src/protocol/line.rs": "use crate::DType;\npub fn lines(_: DType) {}\n",
    "crates/tpar/src/dispatch/mod.rs": "pub fn decide() { crate::protocol::line::lines(crate::DType::F32) }\n",
    "crates/tpar/src/backend/mod.rs": """
        pub mod cuda;
        pub use cuda::driver::Device;
    """,
    "crates/tpar/src/backend/cuda/mod.rs": "pub mod driver;\npub mod span;\n",
    "crates/tpar/src/backend/cuda/driver.rs": "pub struct Device;\n",
    "crates/tpar/src/backend/cuda/span.rs": """
        use super::driver::Device;
        pub struct Span(Device);
        #[cfg(test)]
        mod tests {
            use crate::dispatch::decide; // test code may use anything
        }
    """,
}


def test_a_clean_workspace_passes(tmp_path):
    code, out = check(workspace(tmp_path, CORE))
    assert code == 0, out
    assert "# file-level cycles: 0" in out and "# edges against the layers: 0" in out


def test_a_cycle_between_two_files_is_found(tmp_path):
    files = dict(CORE)
    files["crates/tpar/src/backend/cuda/driver.rs"] = "use super::span::Span;\npub struct Device;\n"
    code, out = check(workspace(tmp_path, files))
    assert code == 1
    assert "# file-level cycles: 1" in out, out
    assert "tpar::backend::cuda::driver <-> tpar::backend::cuda::span" in out, out


def test_an_upward_and_a_sideways_edge_are_found(tmp_path):
    files = dict(CORE)
    files["crates/tpar/src/protocol/line.rs"] = "pub fn lines() { crate::dispatch::decide() }\n"
    # Through the facade `backend::Device`: the edge is to the file that defines it.
    files["crates/tpar/src/dispatch/mod.rs"] = "use crate::backend::Device;\npub fn decide() {}\n"
    code, out = check(workspace(tmp_path, files))
    assert code == 1
    assert "tpar::protocol::line -> tpar::dispatch  (upward" in out, out
    assert "tpar::dispatch -> tpar::backend::cuda::driver  (sideways" in out, out


def test_a_lower_crate_using_a_higher_one_and_an_unplaced_module_are_found(tmp_path):
    files = dict(CORE)
    files["crates/tpar-harness/Cargo.toml"] = '[package]\nname = "tpar-harness"\n'
    files["crates/tpar-harness/src/lib.rs"] = "pub mod bench;\n"
    files["crates/tpar-harness/src/bench.rs"] = "pub fn run() { tpar::dispatch::decide() }\n"
    files["crates/tpar/src/lib.rs"] = CORE["crates/tpar/src/lib.rs"] + "pub mod gadget;\n"
    files["crates/tpar/src/gadget.rs"] = "pub fn g() { tpar_harness::bench::run() }\n"
    code, out = check(workspace(tmp_path, files))
    assert code == 1
    assert (
        "tpar::gadget -> tpar_harness::bench  (upward: crate tpar -> crate tpar_harness)" in out
    ), out
    assert "tpar::gadget (add its crate to CRATES, its top-level module to LAYERS" in out, out
    assert "tpar_harness::bench ->" not in out, out  # downward across crates is fine


def test_the_repository_has_no_cycle_and_no_edge_against_the_layers():
    code, out = check()
    assert code == 0, out
