//! Replays the committed `cargo fuzz` corpus (`fuzz/corpus/ops/`) through the same interpreter
//! the fuzz target runs, plus a fixed set of pseudo-random programs, so plain `cargo test`
//! exercises every invariant the fuzzer asserts without cargo-fuzz or nightly.

use std::fs;
use std::path::Path;

#[path = "../fuzz/interp.rs"]
mod interp;

#[test]
fn committed_corpus_replays_clean() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/ops");
    let mut files: Vec<_> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("dir entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(
        files.len() >= 10,
        "the committed corpus has only {} inputs",
        files.len()
    );
    let (mut ops, mut checks) = (0, 0);
    for file in &files {
        let data = fs::read(file).expect("corpus file");
        let stats = interp::run(&data);
        ops += stats.ops;
        checks += stats.checks;
    }
    println!(
        "fuzz corpus replay: {} inputs, {ops} operations, {checks} invariant checks",
        files.len()
    );
    assert!(ops > 0);
}

#[test]
fn pseudo_random_programs_replay_clean() {
    // xorshift64*: a fixed seed, so every run replays the same 2,000 programs.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let mut ops = 0;
    for _ in 0..2_000 {
        let len = usize::try_from(next() % 600).expect("small");
        let data: Vec<u8> = (0..len).map(|_| next().to_le_bytes()[7]).collect();
        ops += interp::run(&data).ops;
    }
    assert!(ops > 100_000, "only {ops} operations");
}
