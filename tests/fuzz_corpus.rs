//! The fuzz targets' corpus (`fuzz/corpus/<target>/`) replayed through the checks the targets run
//! (`fuzz/checks.rs`): every input a fuzzing campaign kept — and every crash it found, once fixed — is checked again
//! at every run of the suite, without a fuzzer.

use crate::fuzz_checks as checks;

fn replay(target: &str, check: fn(&[u8])) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut inputs = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let checked = std::panic::catch_unwind(|| check(&data));
        assert!(checked.is_ok(), "{} fails its check", path.display());
        inputs += 1;
    }
    assert!(inputs > 0, "no corpus in {}", dir.display());
}

#[test]
fn envelope() {
    replay("envelope", checks::envelope);
}

#[test]
fn header_table() {
    replay("header_table", checks::header_table);
}

#[test]
fn dead_letter_copy() {
    replay("dead_letter_copy", checks::dead_letter_copy);
}

#[test]
fn replay_failure() {
    replay("replay_failure", checks::replay_failure);
}

#[test]
fn address() {
    replay("address", checks::address);
}
