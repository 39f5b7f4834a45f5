//! Two small functions every kiln crate needs one copy of.

/// SplitMix64's output function (Steele, Lea and Flood 2014): a bijective 64-bit mixer with
/// good avalanche. kiln derives every deterministic stream from it (initialisation keys in
/// kiln-model, data order in kiln-data), so a resumed or resharded run re-derives the same
/// streams from the seed alone.
///
/// ```
/// assert_eq!(kiln_state::splitmix64(0), 0xE220_A839_7B1D_CDAF);
/// ```
#[inline]
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The message of a caught panic's payload (`&str` or `String`), for turning a worker thread's
/// panic into an error that says what happened.
///
/// ```
/// // what `std::thread::JoinHandle::join` returns for a thread that failed with the message
/// // "rank 3 fell over"
/// let payload: Box<dyn std::any::Any + Send> = Box::new(format!("rank {} fell over", 3));
/// assert_eq!(kiln_state::panic_message(payload.as_ref()), "rank 3 fell over");
/// let literal: Box<dyn std::any::Any + Send> = Box::new("stalled");
/// assert_eq!(kiln_state::panic_message(literal.as_ref()), "stalled");
/// ```
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}
