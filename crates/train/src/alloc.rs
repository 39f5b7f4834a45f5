//! The global allocator kiln's published figures are measured with (feature `mimalloc`):
//! mimalloc, told never to hand freed memory back to the kernel. The `kiln` command, the
//! examples and the benchmarks install it with one line:
//!
//! ```
//! #[global_allocator]
//! static GLOBAL: kiln_train::alloc::KilnAlloc = kiln_train::alloc::KilnAlloc;
//!
//! fn main() {
//!     let blocks: Vec<Vec<f32>> = (0..4).map(|i| vec![i as f32; 1 << 20]).collect();
//!     assert_eq!(blocks[3][12345], 3.0);
//! }
//! ```
//!
//! A training step frees and re-allocates the same activation-sized blocks every step. glibc
//! returns large blocks to the kernel (`munmap`) and mimalloc purges freed memory after a
//! delay; either way the next step page-faults the memory back in and the kernel zero-fills
//! it (`clear_page` was 9-12% of a `small_cpu` step's samples under mimalloc's default purge
//! delay). With purging off, a step reuses the blocks the previous one freed. A library never
//! chooses the allocator: only a program's `#[global_allocator]` line does.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::Once;

/// mimalloc's `mi_option_purge_delay` (`mimalloc.h`, the stable option enum).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

static CONFIGURE: Once = Once::new();

/// mimalloc with purging turned off at the first allocation (`mi_option_purge_delay = -1`).
#[derive(Debug, Clone, Copy, Default)]
pub struct KilnAlloc;

impl KilnAlloc {
    #[inline]
    fn configure() {
        CONFIGURE.call_once(|| {
            // SAFETY: sets a process-wide option; allocates nothing, and no allocation has
            // been served yet
            unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) }
        });
    }
}

// SAFETY: every call is forwarded to mimalloc's allocator unchanged
unsafe impl GlobalAlloc for KilnAlloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::configure();
        // SAFETY: forwarded
        unsafe { mimalloc::MiMalloc.alloc(layout) }
    }
    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::configure();
        // SAFETY: forwarded
        unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
    }
    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }
    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded
        unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_allocation_turns_purging_off_and_blocks_round_trip() {
        let layout = Layout::from_size_align(3 << 20, 64).unwrap();
        // SAFETY: a non-zero layout; the block is written inside its bounds and freed once
        unsafe {
            let p = KilnAlloc.alloc_zeroed(layout);
            assert!(!p.is_null());
            assert_eq!(p as usize % 64, 0);
            assert_eq!(*p.add(layout.size() - 1), 0);
            *p.add(7) = 42;
            let q = KilnAlloc.realloc(p, layout, 4 << 20);
            assert_eq!(*q.add(7), 42);
            KilnAlloc.dealloc(q, Layout::from_size_align(4 << 20, 64).unwrap());
            // mimalloc's default purge delay is 10 ms; this allocator's is "never"
            assert_eq!(libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY), -1);
        }
    }
}
