//! Progress of a long run on stderr: a bar where stderr is a terminal, one plain line per step
//! where it is not (logs, CI), nothing on ranks other than the leader.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

pub struct Progress {
    bar: Option<ProgressBar>,
    plain: bool,
    total: usize,
    done: usize,
}

impl Progress {
    pub fn new(shown: bool, total: usize) -> Progress {
        let plain = shown && !std::io::stderr().is_terminal();
        let bar = (shown && !plain).then(|| {
            let bar = ProgressBar::new(total as u64);
            bar.set_style(
                ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
                    .expect("valid template")
                    .progress_chars("=> "),
            );
            bar
        });
        Progress {
            bar,
            plain,
            total,
            done: 0,
        }
    }

    /// Starts the step named `what` (the previous one is done).
    fn step(&mut self, what: String) {
        if let Some(bar) = &self.bar {
            bar.set_position(self.done as u64);
            bar.set_message(what);
        } else if self.plain {
            tpar_report::print_err(&format!("[{}/{}] {what}", self.done + 1, self.total));
        }
        self.done += 1;
    }

    /// Starts the step of `algo` at a message of `bytes`.
    pub fn step_at(&mut self, bytes: u64, algo: impl std::fmt::Display) {
        self.step(format!("{} {algo}", tpar_report::size(bytes)));
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
