//! Tables for people (comfy-table): text from the database is sanitised cell by cell, and the table fits the terminal
//! when there is one.

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{Cell, CellAlignment, ContentArrangement, Table};

use crate::sanitize;

/// A table with these column headers; columns after the first are right-aligned (they hold figures).
pub fn new(headers: &[&str]) -> Table {
    let mut table = Table::new();
    table
        .load_style(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(headers.iter().map(Cell::new));
    for index in 1..headers.len() {
        if let Some(column) = table.column_mut(index) {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    table
}

/// Aligns a column of text (names, reasons) to the left.
pub fn align_left(table: &mut Table, column: usize) {
    if let Some(c) = table.column_mut(column) {
        c.set_cell_alignment(CellAlignment::Left);
    }
}

/// A cell for text that came from outside (a consumer_type, a reason): control characters shown escaped.
pub fn text(s: &str) -> Cell {
    Cell::new(sanitize::text(s))
}
