//! One row of a self-test, whichever backend ran it (the CPU and CUDA sweeps, the fused
//! op's checks): what was checked, on how many ranks it failed, and the result as printed.

/// One row of a self-test: what was checked (case, dtype, elements, placement and, on CUDA,
/// mode), on how many ranks it failed (0: passed everywhere), and the result column.
pub struct SelftestRow {
    pub cells: Vec<String>,
    pub bad: u64,
    pub result: String,
}

impl SelftestRow {
    /// A row whose result is `pass` or `FAIL on N rank(s)`, followed by `detail`.
    pub fn tallied(cells: Vec<String>, bad: u64, detail: String) -> SelftestRow {
        let result = if bad == 0 {
            format!("pass{detail}")
        } else {
            format!("FAIL on {bad} rank(s){detail}")
        };
        SelftestRow { cells, bad, result }
    }
}
