//! `steady_host_allocator` in a process of its own: glibc's thresholds are process-wide, and a
//! test beside others would see their allocations.

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
#[test]
fn fixed_thresholds_serve_blocks_under_32_mib_from_the_heap() {
    use braid_runtime::device::{HostAllocator, MMAP_THRESHOLD, steady_host_allocator};

    /// Blocks glibc serves with mappings of their own, now.
    fn mapped_blocks() -> usize {
        // SAFETY: `mallinfo2` only reads the allocator's counters.
        unsafe { libc::mallinfo2() }.hblks
    }
    /// Whether an allocation of `bytes` got a mapping of its own (the block is touched, so
    /// that it is not optimised away, and freed before returning).
    fn mapped(bytes: usize) -> bool {
        let before = mapped_blocks();
        let block = std::hint::black_box(vec![1u8; bytes]);
        let during = mapped_blocks();
        drop(block);
        during > before
    }

    // A user's own setting is left alone (`device::tests` covers which); this test is about
    // Braid's.
    let user = [
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TRIM_THRESHOLD_",
        "GLIBC_TUNABLES",
        "BRAID_MALLOC_THRESHOLDS",
    ]
    .into_iter()
    .find(|v| std::env::var_os(v).is_some());
    if let Some(var) = user {
        eprintln!("{var} is set: the default thresholds are not tested");
        return;
    }
    // glibc's default: 1 MiB is over its starting threshold (128 KiB).
    assert!(
        mapped(1 << 20),
        "glibc's default threshold should map 1 MiB"
    );
    assert_eq!(steady_host_allocator(), Ok(HostAllocator::Fixed));
    // Freeing a mapped 8 MiB block would have raised glibc's own threshold to 8 MiB only;
    // fixed, 16 MiB comes from the heap too, and the cap still maps what is larger.
    assert!(!mapped(8 << 20));
    assert!(!mapped(16 << 20));
    assert!(!mapped(MMAP_THRESHOLD - 4096));
    assert!(mapped(MMAP_THRESHOLD + (1 << 20)));
}
