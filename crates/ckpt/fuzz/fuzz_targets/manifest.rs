//! Fuzzes the manifest parser: any bytes give a manifest or a typed error, never a panic; a
//! parsed manifest serializes and parses back to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = kiln_ckpt::Manifest::from_json(data) {
        let again = m.to_json().expect("a parsed manifest serializes");
        let back = kiln_ckpt::Manifest::from_json(&again).expect("and parses back");
        assert_eq!(back, m);
        // the global view of every tensor never panics either
        for name in m.tensor_names() {
            let _ = m.global_tensor(&name);
        }
    }
});
