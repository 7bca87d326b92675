//! Random operation sequences over the core (pool, window, slides, precompute plans, free);
//! see `../interp.rs` for the program format and the invariants asserted.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../interp.rs"]
mod interp;

fuzz_target!(|data: &[u8]| {
    interp::run(data);
});
