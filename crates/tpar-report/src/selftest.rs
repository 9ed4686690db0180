//! The text of `tpar selftest`: a row per case, each checked bitwise against the exact sum,
//! and the count of rows passed and failed.

use tpar_harness::selftest_row::SelftestRow;

use crate::Table;

/// The rows as a table; `with_mode` adds the column saying how each ran (CUDA: eager or
/// replayed from a graph).
pub fn table(rows: &[SelftestRow], with_mode: bool) -> String {
    let header: &[&str] = if with_mode {
        &["case", "dtype", "elements", "placement", "mode", "result"]
    } else {
        &["case", "dtype", "elements", "placement", "result"]
    };
    let mut table = Table::new(header, header.len() - 1);
    for row in rows {
        let mut cells = row.cells.clone();
        cells.push(row.result.clone());
        table.push(cells);
    }
    table.render()
}

/// The rows that failed on any rank.
pub fn failed(rows: &[SelftestRow]) -> usize {
    rows.iter().filter(|r| r.bad > 0).count()
}

/// `selftest: 9 passed, 0 failed`.
pub fn summary(rows: &[SelftestRow]) -> String {
    let failed = failed(rows);
    format!("selftest: {} passed, {failed} failed", rows.len() - failed)
}
