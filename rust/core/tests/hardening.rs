//! Edge cases of the pool's construction and limits: metadata that grows with the mapped
//! blocks, chunk sizes past the reservation, limits named in their errors, a tier's private
//! pool, and the tables' checks while other threads use the pool.
#![cfg(unix)]

use std::sync::{Arc, Barrier};
use std::thread;

use kvpool_core::pool::PoolSize;
use kvpool_core::tables::BlockTables;
use kvpool_core::tier::{CopyMethod, HostTier};
use kvpool_core::{CoreError, DType, Device, GrowableSize, KvLayout, Pool, MAX_NUM_BLOCKS};

fn layout() -> KvLayout {
    KvLayout::new(1, 1, 64, 4, DType::Float16).unwrap()
}

fn growable(max_num_blocks: usize, initial_num_blocks: usize, chunk_bytes: Option<usize>) -> Pool {
    let size = GrowableSize { max_num_blocks, initial_num_blocks, chunk_bytes };
    Pool::new_growable(layout(), size, Device::Host).unwrap()
}

fn message(e: CoreError) -> String {
    e.to_string()
}

#[test]
fn prefix_cache_metadata_covers_the_mapped_blocks_and_grows_with_them() {
    // Ten million blocks of capacity, none mapped: the index covers nothing yet.
    let pool = growable(10_000_000, 0, None).with_prefix_caching().unwrap();
    let cache = pool.prefix_cache().unwrap();
    assert_eq!(cache.num_ids(), 0);
    let ids = pool.alloc_many(100).unwrap();
    assert!(cache.num_ids() >= pool.num_blocks() && pool.num_blocks() >= 100);
    assert!(cache.num_ids() < 10_000, "grown with the mapped chunks, not to the capacity");
    pool.check_invariants().unwrap();
    pool.free_many(&ids).unwrap();
    pool.check_invariants().unwrap();
}

#[test]
fn a_huge_growable_prefix_caching_pool_costs_no_memory_until_mapped() {
    // Before the cache's metadata grew with the pool, this reserved ~42 bytes per block of
    // capacity up front and wrote them: 45 GB here, an abort where it could not be had.
    let pool = growable(1 << 30, 0, None).with_prefix_caching().unwrap();
    assert_eq!(pool.prefix_cache().unwrap().num_ids(), 0);
    let id = pool.alloc().unwrap();
    pool.free(id).unwrap();
}

#[test]
fn chunk_bytes_past_the_reservation_is_capped_and_zero_refused() {
    // 64 blocks of 1 KiB: a 64 KiB reservation; a 2 GiB chunk maps 64 KiB, not 2 GiB.
    let pool = growable(64, 1, Some(1 << 31));
    assert_eq!(pool.mapped_bytes(), 64 * 1024);
    assert_eq!(pool.stats().unwrap().chunk_bytes, 64 * 1024);
    pool.check_invariants().unwrap();
    let size = GrowableSize { max_num_blocks: 64, initial_num_blocks: 0, chunk_bytes: Some(0) };
    let err = Pool::new_growable(layout(), size, Device::Host).err().unwrap();
    assert!(
        matches!(&err, CoreError::InvalidArgument(m) if m.contains("chunk_bytes must be at least 1")),
        "{err}"
    );
}

#[test]
fn max_num_blocks_past_the_limit_is_invalid_however_large() {
    for max in [MAX_NUM_BLOCKS + 1, 1 << 40, usize::MAX / 1024] {
        let size = GrowableSize { max_num_blocks: max, initial_num_blocks: 0, chunk_bytes: None };
        let err = Pool::new_growable(layout(), size, Device::Host).err().unwrap();
        let expected =
            format!("max_num_blocks must be in 1..={MAX_NUM_BLOCKS} (MAX_NUM_BLOCKS), got {max}");
        assert!(matches!(&err, CoreError::InvalidArgument(m) if *m == expected), "{err}");
    }
    let err = Pool::new(layout(), PoolSize::NumBlocks(1 << 40), Device::Host).err().unwrap();
    assert!(message(err).contains("(MAX_NUM_BLOCKS)"));
}

#[test]
fn a_growable_pools_refusal_names_the_blocks_needed_not_the_shortfall() {
    for caching in [false, true] {
        let pool = growable(64, 8, Some(4096));
        let pool = if caching { pool.with_prefix_caching().unwrap() } else { pool };
        let held = pool.alloc_many(40).unwrap();
        let free = pool.num_free();
        let err = pool.alloc_many(30).unwrap_err();
        let room = 64 - pool.num_blocks();
        let expected_reason = format!(
            "{} more blocks are needed, max_num_blocks leaves room for {room} more ({} mapped)",
            30 - free,
            pool.num_blocks()
        );
        assert!(
            matches!(&err, CoreError::CannotGrow { requested: 30, max_num_blocks: 64, reason, .. }
                if *reason == expected_reason),
            "caching={caching}: {err:?}"
        );
        pool.check_invariants().unwrap();
        pool.free_many(&held).unwrap();
    }
}

#[test]
fn a_prefix_cache_host_tier_of_zero_blocks_names_its_argument() {
    let pool = Pool::new(layout(), PoolSize::NumBlocks(8), Device::Host).unwrap();
    let err = pool.with_prefix_caching().unwrap().with_prefix_host_tier(0).err().unwrap();
    assert!(message(err).starts_with("invalid argument: prefix_cache_host_blocks must be in 1..="));
}

#[test]
fn a_host_tiers_pool_refuses_the_plain_block_api() {
    let pool = Arc::new(Pool::new(layout(), PoolSize::NumBlocks(8), Device::Host).unwrap());
    let tables = BlockTables::new(pool, 4, 4).unwrap();
    let tier = HostTier::new(tables.clone(), PoolSize::NumBlocks(4), CopyMethod::Auto).unwrap();
    let host = tier.host_pool();
    for err in [host.alloc().err(), host.alloc_many(2).err(), host.alloc_into(&mut [0; 1]).err()] {
        assert!(
            matches!(&err, Some(CoreError::InvalidArgument(m)) if m.contains("host tier's")),
            "{err:?}"
        );
    }
    assert_eq!(host.num_free(), 4);
    tier.check_invariants().unwrap();
}

#[test]
fn dropping_a_host_tier_frees_its_swapped_out_requests_in_the_tables() {
    let pool = Arc::new(Pool::new(layout(), PoolSize::NumBlocks(8), Device::Host).unwrap());
    let tables = BlockTables::new(pool.clone(), 4, 4).unwrap();
    tables.add(7, 5).unwrap();
    let tier = HostTier::new(tables.clone(), PoolSize::NumBlocks(4), CopyMethod::Auto).unwrap();
    // SAFETY: no stream: a host pool.
    unsafe { tier.swap_out(&[7], None) }.unwrap();
    assert!(matches!(tables.add(7, 1), Err(CoreError::DuplicateRequest { .. })));
    drop(tier);
    assert!(matches!(tables.free(7), Err(CoreError::UnknownRequest { request_id: 7 })));
    tables.add(7, 5).unwrap();
    tables.check_invariants().unwrap();
    pool.check_invariants_with(true).unwrap();
}

#[test]
fn tables_check_invariants_holds_while_other_threads_use_the_pool() {
    const ROUNDS: usize = 2_000;
    let pool = Arc::new(Pool::new(layout(), PoolSize::NumBlocks(256), Device::Host).unwrap());
    let checked = BlockTables::new(pool.clone(), 8, 8).unwrap();
    let other = BlockTables::new(pool.clone(), 8, 8).unwrap();
    for r in 0..4 {
        checked.add(r, 9 + r as usize).unwrap();
    }
    let start = Arc::new(Barrier::new(3));
    let raw = {
        let (pool, start) = (pool.clone(), start.clone());
        thread::spawn(move || {
            start.wait();
            for n in 0..ROUNDS {
                let ids = pool.alloc_many(1 + n % 7).unwrap();
                pool.free_many(&ids).unwrap();
            }
        })
    };
    let tables_user = {
        let (other, start) = (other.clone(), start.clone());
        thread::spawn(move || {
            start.wait();
            for n in 0..ROUNDS as u64 {
                other.add(n, 1 + (n % 13) as usize).unwrap();
                other.free(n).unwrap();
            }
        })
    };
    start.wait();
    let mut false_alarms = Vec::new();
    for _ in 0..ROUNDS {
        if let Err(m) = checked.check_invariants() {
            false_alarms.push(m);
        }
    }
    raw.join().unwrap();
    tables_user.join().unwrap();
    assert!(
        false_alarms.is_empty(),
        "{} false alarms, first: {}",
        false_alarms.len(),
        false_alarms[0]
    );
    pool.check_invariants_with(true).unwrap();
}
