//! Fuzzes the rank file parser (the safetensors header, the part metadata and the tensor
//! bytes): any bytes give a state or a typed error, never a panic; a parsed state encodes
//! and parses back to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(state) = kiln_ckpt::decode_rank_file(data) {
        let bytes = kiln_ckpt::encode_rank_file(&state).expect("a parsed state encodes");
        let back = kiln_ckpt::decode_rank_file(&bytes).expect("and parses back");
        assert_eq!(back, state);
    }
});
