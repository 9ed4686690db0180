//! The README's `tpar plan` examples print what the README says they print: every `tpar plan`
//! command in a `sh` block of README.md is run, and each `# ...` line under it is checked,
//! fragment by fragment (fragments are separated by `...`), against the command's output.

use std::process::Command;

/// (command words, expected fragments) of every `tpar plan` example in the README.
fn examples(readme: &str) -> Vec<(Vec<String>, Vec<String>)> {
    let mut out = Vec::new();
    let mut in_sh = false;
    let mut lines = readme.lines().peekable();
    while let Some(line) = lines.next() {
        if line.starts_with("```") {
            in_sh = line.trim() == "```sh" && !in_sh;
            continue;
        }
        if !in_sh || !line.starts_with("tpar plan") {
            continue;
        }
        let mut command = line.trim_end_matches('\\').to_owned();
        let mut continued = line.ends_with('\\');
        while continued {
            let next = lines.next().expect("a continued line");
            command.push(' ');
            command.push_str(next.trim().trim_end_matches('\\'));
            continued = next.ends_with('\\');
        }
        let mut expected = Vec::new();
        while let Some(next) = lines.peek().filter(|l| l.starts_with("# ")) {
            expected.extend(
                next[2..]
                    .split("...")
                    .map(str::trim)
                    .filter(|f| !f.is_empty())
                    .map(str::to_owned),
            );
            lines.next();
        }
        let words = command
            .split_whitespace()
            .skip(1)
            .map(str::to_owned)
            .collect();
        out.push((words, expected));
    }
    out
}

#[test]
fn readme_plan_examples_print_what_the_readme_says() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let examples = examples(&readme);
    assert!(examples.len() >= 2, "found {} examples", examples.len());
    for (args, expected) in examples {
        assert!(
            !expected.is_empty(),
            "{args:?} has no expected output in the README"
        );
        let out = Command::new(env!("CARGO_BIN_EXE_tpar"))
            .args(&args)
            .current_dir(root)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for fragment in expected {
            assert!(
                text.contains(&fragment),
                "tpar {}: README says '{fragment}', output is:\n{text}",
                args.join(" ")
            );
        }
    }
}

/// The repository paths a text names: words starting with a top-level folder of the checkout
/// (`crates/...`, `scripts/...`) or naming a Markdown file (`DESIGN.md`).
fn named_paths(text: &str) -> Vec<String> {
    const TOP: [&str; 5] = ["crates/", "scripts/", "bench/", "tests/", "examples/"];
    let mut out: Vec<String> = text
        .split(|c: char| c.is_whitespace() || "`()[],;:'\"".contains(c))
        .map(|w| w.trim_end_matches('.'))
        .filter(|w| {
            TOP.iter().any(|t| w.starts_with(t)) || (w.ends_with(".md") && !w.contains('/'))
        })
        .map(str::to_owned)
        .collect();
    out.sort();
    out.dedup();
    out
}

#[test]
fn every_file_and_folder_the_readme_names_exists() {
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let paths = named_paths(&readme);
    assert!(paths.contains(&"DESIGN.md".to_owned()), "{paths:?}");
    let missing: Vec<&String> = paths
        .iter()
        .filter(|p| {
            // `dist/tpar-*.whl`, `crates/tpar/kernels/*.cu`: the folder before the glob.
            let path = p.split('*').next().unwrap();
            let path = if p.contains('*') {
                path.rsplit_once('/').map_or(path, |(dir, _)| dir)
            } else {
                path
            };
            !root.join(path).exists()
        })
        .collect();
    assert!(
        missing.is_empty(),
        "README.md names missing paths: {missing:?}"
    );
}
