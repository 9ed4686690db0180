//! The plain text table every report prints, and the cell formats the tables share: message
//! sizes, rank counts, rows that did not run, a selection with what it ran.

/// "1 rank", "8 ranks": for the headers that say how many ranks ran.
pub fn ranks(n: usize) -> String {
    if n == 1 {
        "1 rank".to_owned()
    } else {
        format!("{n} ranks")
    }
}

/// A table row for a configuration that did not run: its leading `cells`, "-" in the figure
/// columns, and the reason in the last of `columns`.
pub fn skipped_row(mut cells: Vec<String>, columns: usize, why: &str) -> Vec<String> {
    cells.resize(columns - 1, "-".into());
    cells.push(format!("skipped: {why}"));
    cells
}

/// `auto (one-shot)`: a selection's name with what it ran, where that is known.
pub fn name_with_runs(name: &str, runs: Option<&str>) -> String {
    match runs {
        Some(choice) => format!("{name} ({choice})"),
        None => name.to_owned(),
    }
}

/// A plain text table with right-aligned columns after the first `left` ones (and, where
/// [`Table::text_last`], a last column of free text left-aligned).
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    left: usize,
    text_last: bool,
}

impl Table {
    pub fn new(header: &[&str], left: usize) -> Table {
        Table {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
            left,
            text_last: false,
        }
    }

    /// The last column is free text (a note, a reason): left-aligned, so that one long cell
    /// does not pad every other row out to its width.
    pub fn text_last(mut self) -> Table {
        self.text_last = true;
        self
    }

    pub fn push(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    pub fn render(&self) -> String {
        let widths: Vec<usize> = (0..self.header.len())
            .map(|c| {
                self.rows
                    .iter()
                    .map(|r| r[c].chars().count())
                    .chain([self.header[c].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: &[String]| {
            cells
                .iter()
                .enumerate()
                .map(|(c, v)| {
                    if c < self.left || (self.text_last && c + 1 == self.header.len()) {
                        format!("{v:<w$}", w = widths[c])
                    } else {
                        format!("{v:>w$}", w = widths[c])
                    }
                })
                .collect::<Vec<_>>()
                .join("  ")
                .trim_end()
                .to_owned()
        };
        let mut out = line(&self.header);
        for r in &self.rows {
            out.push('\n');
            out.push_str(&line(r));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn rank_counts_read_as_english() {
        assert_eq!(ranks(1), "1 rank");
        assert_eq!(ranks(8), "8 ranks");
    }

    #[test]
    fn a_skipped_row_fills_the_figures_and_ends_with_the_reason() {
        let row = skipped_row(vec!["4 KiB".into(), "nccl".into()], 5, "no NCCL");
        assert_eq!(row, ["4 KiB", "nccl", "-", "-", "skipped: no NCCL"]);
        assert_eq!(name_with_runs("auto", Some("one-shot")), "auto (one-shot)");
        assert_eq!(name_with_runs("nccl", None), "nccl");
    }

    use super::*;

    #[test]
    fn table_aligns_columns() {
        let mut t = Table::new(&["name", "value"], 1);
        t.push(vec!["a".into(), "1".into()]);
        t.push(vec!["longer".into(), "12345".into()]);
        assert_eq!(t.render(), "name    value\na           1\nlonger  12345");
        let mut t = Table::new(&["term", "GiB", "what"], 1).text_last();
        t.push(vec!["a".into(), "+1.00".into(), "short".into()]);
        t.push(vec!["b".into(), "-0.50".into(), "a longer note".into()]);
        assert_eq!(
            t.render(),
            "term    GiB  what\na     +1.00  short\nb     -0.50  a longer note"
        );
    }
}

/// A message size as the user would type it back: whole KiB, MiB or GiB where it is one
/// ("42 KiB"), else exact bytes ("3145738 B", never a rounded "3.0 MiB").
pub fn size(bytes: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        let one = 1u64 << shift;
        if bytes >= one && bytes % one == 0 {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod size_tests {
    #[test]
    fn sizes_are_exact_unless_whole_units() {
        assert_eq!(super::size(3145738), "3145738 B");
        assert_eq!(super::size(3 << 20), "3 MiB");
        assert_eq!(super::size(43008), "42 KiB");
        assert_eq!(super::size(1536), "1536 B");
        assert_eq!(super::size(0), "0 B");
        assert_eq!(super::size(u64::MAX - 1), "18446744073709551614 B");
    }
}
