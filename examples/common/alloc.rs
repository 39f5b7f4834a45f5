//! The global allocator of kiln's examples and binaries: mimalloc, told never to hand freed
//! memory back to the kernel.
//!
//! A training step frees and re-allocates the same activation-sized blocks every step. glibc
//! returns large blocks to the kernel (`munmap`) and mimalloc purges freed memory after a
//! delay; either way the next step page-faults the memory back in and the kernel zero-fills
//! it (`clear_page` was 9-12% of a `small_cpu` step's samples under mimalloc's default purge
//! delay). With purging off, a step reuses the blocks the previous one freed.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::Once;

/// mimalloc's `mi_option_purge_delay` (`mimalloc.h`, the stable option enum).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

static CONFIGURE: Once = Once::new();

/// mimalloc with purging turned off at the first allocation.
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
