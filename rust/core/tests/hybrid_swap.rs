//! A hybrid model's pool and host tier on host pools: the pool made from the spec's page
//! bytes (fixed and growable; no layout, so layout views, block tables and prefix caching
//! refuse it), the hybrid tables' pages refused by the plain pool API, a request's pages
//! listed across groups, and swaps moving every group's bytes out and back exactly, with
//! both pools conserved and every failed call changing nothing.

use std::sync::Arc;

use kvpool_core::block_copy::CopyMethod;
use kvpool_core::hybrid::{HybridHostTier, HybridTables, ModelKvSpec, RequestPage};
use kvpool_core::pool::{PoolGeometry, PoolSize};
use kvpool_core::tables::BlockTables;
use kvpool_core::tier::SwapStats;
use kvpool_core::{CoreError, Device, GrowableSize, Pool};

#[path = "common/hybrid.rs"]
mod hybrid_common;

use hybrid_common::PAGE_BYTES;

const WINDOW: usize = 1;
const STATE: usize = 2;
const WINDOW_SIZE: usize = 6;
const CHUNK: usize = 10;

fn mixed_spec() -> ModelKvSpec {
    hybrid_common::mixed_spec(WINDOW_SIZE, CHUNK)
}

/// Hybrid tables over a host pool of `num_pages` pages made from the spec.
fn setup(num_pages: usize) -> HybridTables {
    let spec = mixed_spec();
    let pool = Arc::new(Pool::new(&spec, PoolSize::NumBlocks(num_pages), Device::Host).unwrap());
    HybridTables::new(pool, spec).unwrap()
}

fn host_tier(tables: &HybridTables, num_pages: usize) -> HybridHostTier {
    HybridHostTier::new(tables, PoolSize::NumBlocks(num_pages), CopyMethod::Auto).unwrap()
}

/// `tier.swap_out` with no stream (a CUDA pool's copies are then ordered on its own).
fn swap_out(
    tier: &mut HybridHostTier,
    t: &mut HybridTables,
    ids: &[u64],
) -> Result<SwapStats, CoreError> {
    // SAFETY: no stream is given, so there is none that must be live.
    unsafe { tier.swap_out(t, ids, None) }
}

/// `tier.swap_in` with no stream, as `swap_out`.
fn swap_in(
    tier: &mut HybridHostTier,
    t: &mut HybridTables,
    ids: &[u64],
) -> Result<SwapStats, CoreError> {
    // SAFETY: no stream is given, so there is none that must be live.
    unsafe { tier.swap_in(t, ids, None) }
}

/// A page's bytes, through the host slab.
fn page_bytes(pool: &Pool, page: u32) -> Vec<u8> {
    let address = pool.block_ptr(page).unwrap() as usize;
    // SAFETY: a host pool's slab holds `num_blocks * block_bytes` mapped bytes while the pool
    // lives; `page` is in range (block_ptr checked it); no other thread touches the pool.
    unsafe { std::slice::from_raw_parts(address as *const u8, pool.block_bytes()) }.to_vec()
}

/// Fills a page with bytes that depend on `seed` and the offset.
fn fill_page(pool: &Pool, page: u32, seed: u32) {
    let address = pool.block_ptr(page).unwrap() as usize;
    // SAFETY: as in `page_bytes`, and the slice is the only reference to these bytes.
    let bytes = unsafe { std::slice::from_raw_parts_mut(address as *mut u8, pool.block_bytes()) };
    for (offset, byte) in bytes.iter_mut().enumerate() {
        *byte = (seed.wrapping_mul(2_654_435_761).wrapping_add(offset as u32 * 40_503) >> 13) as u8;
    }
}

/// The bytes of every page of a request, in `request_pages` order.
fn request_bytes(t: &HybridTables, request_id: u64) -> Vec<Vec<u8>> {
    let pages = t.request_pages(request_id).unwrap();
    pages.iter().map(|p| page_bytes(t.pool(), p.page_id)).collect()
}

/// Each page's group and index: a request's tables without their ids.
fn shape(pages: &[RequestPage]) -> Vec<(usize, usize)> {
    pages.iter().map(|p| (p.group, p.page_index)).collect()
}

/// Everything a call could change: both pools' counts and ref counts, every table of the
/// given requests, and the tier's requests.
fn snapshot(t: &HybridTables, tier: &HybridHostTier, ids: &[u64]) -> Vec<String> {
    let mut out = Vec::new();
    for pool in [t.pool(), tier.host_pool()] {
        out.push(format!("free {} used {}", pool.num_free(), pool.num_used()));
        for page in 0..pool.num_blocks() as u32 {
            out.push(format!("ref {page} {}", pool.ref_cnt(page).unwrap()));
        }
    }
    for &id in ids {
        out.push(format!("{id}: {:?} {:?}", t.request_pages(id).ok(), t.num_tokens(id).ok()));
        out.push(format!("{id} swapped: {:?}", tier.swapped(id).ok()));
    }
    out.push(format!("pending {:?}", tier.num_pending()));
    out
}

#[test]
fn a_pool_made_from_a_spec_has_its_page_bytes_and_no_layout() {
    let spec = mixed_spec();
    let pool = Pool::new(&spec, PoolSize::NumBlocks(8), Device::Host).unwrap();
    assert_eq!(pool.block_bytes(), PAGE_BYTES);
    assert!(pool.geometry().is_pages());
    assert_eq!(pool.stats().unwrap().block_bytes, PAGE_BYTES);
    assert_eq!(pool.block_ptr(3).unwrap() - pool.base_ptr(), 3 * PAGE_BYTES as u64);
    let err = pool.layout().err().unwrap();
    assert!(matches!(&err, CoreError::InvalidLayout(m) if m.contains("ModelKvSpec")), "{err}");
    let by_bytes = Pool::new(&spec, PoolSize::MemoryBytes(4 * PAGE_BYTES + 1), Device::Host);
    assert_eq!(by_bytes.unwrap().num_blocks(), 4);
    // What needs a layout refuses a pool of pages, naming why.
    let pool = Arc::new(pool);
    let err = BlockTables::new(pool.clone(), 4, 4).err().unwrap();
    assert!(matches!(err, CoreError::InvalidLayout(m) if m.contains("pages of a hybrid model")));
    let cached = Pool::new(&spec, PoolSize::NumBlocks(8), Device::Host).unwrap();
    assert!(matches!(cached.with_prefix_caching(), Err(CoreError::InvalidLayout(_))));
    // Raw page sizes are checked as a spec's are.
    assert_eq!(PoolGeometry::pages(512).unwrap().block_bytes(), 512);
    for bad in [0, 100, 1000] {
        assert!(matches!(PoolGeometry::pages(bad), Err(CoreError::InvalidLayout(_))), "{bad}");
    }
    let raw = Pool::new(PoolGeometry::pages(2048).unwrap(), PoolSize::NumBlocks(2), Device::Host);
    assert_eq!(raw.unwrap().block_bytes(), 2048);
}

#[test]
fn a_growable_pool_of_pages_grows_under_hybrid_tables_and_swaps() {
    let spec = mixed_spec();
    let size = GrowableSize { max_num_blocks: 256, initial_num_blocks: 0, chunk_bytes: None };
    let pool = Arc::new(Pool::new_growable(&spec, size, Device::Host).unwrap());
    assert!(pool.geometry().is_pages());
    let mut t = HybridTables::new(pool.clone(), spec).unwrap();
    t.add(1, 40).unwrap();
    t.add(2, 3).unwrap();
    assert!(pool.num_blocks() > 0);
    t.check_invariants().unwrap();
    for p in t.request_pages(1).unwrap() {
        fill_page(&pool, p.page_id, p.page_id + 7);
    }
    let before = request_bytes(&t, 1);
    let shape_before = shape(&t.request_pages(1).unwrap());
    let mut tier = host_tier(&t, 64);
    swap_out(&mut tier, &mut t, &[1]).unwrap();
    tier.check_invariants(&t).unwrap();
    swap_in(&mut tier, &mut t, &[1]).unwrap();
    tier.check_invariants(&t).unwrap();
    assert_eq!(shape(&t.request_pages(1).unwrap()), shape_before);
    assert!(request_bytes(&t, 1) == before, "other bytes after the swap");
}

#[test]
fn the_plain_pool_api_refuses_a_hybrid_tables_page() {
    let mut t = setup(64);
    t.add(1, 9).unwrap();
    t.add(2, 1).unwrap();
    let before = snapshot_tables(&t);
    for p in t.request_pages(1).unwrap() {
        let pool = t.pool();
        for result in
            [pool.free(p.page_id), pool.free_many(&[p.page_id]), pool.share_many(&[p.page_id])]
        {
            let err = result.err().unwrap();
            assert!(
                matches!(&err, CoreError::InvalidBlock { reason, .. } if reason.contains("hybrid tables")),
                "{err}"
            );
        }
    }
    // A mixed batch (one pool page, one table page) is refused whole.
    let own = t.pool().alloc().unwrap();
    let table_page = t.request_pages(2).unwrap()[0].page_id;
    assert!(t.pool().free_many(&[own, table_page]).is_err());
    assert_eq!(t.pool().ref_cnt(own).unwrap(), 1);
    t.pool().free(own).unwrap();
    assert_eq!(snapshot_tables(&t), before);
    t.check_invariants().unwrap();
    // The tables' own calls go through: append, fork, free.
    t.append(1, 5).unwrap();
    t.fork(1, 3).unwrap();
    t.free(1).unwrap();
    t.free(3).unwrap();
    t.check_invariants().unwrap();
}

fn snapshot_tables(t: &HybridTables) -> Vec<String> {
    let mut out = vec![format!("free {}", t.pool().num_free())];
    for page in 0..t.pool().num_blocks() as u32 {
        out.push(format!("ref {page} {}", t.pool().ref_cnt(page).unwrap()));
    }
    out
}

#[test]
fn request_pages_lists_every_group_in_group_then_page_order() {
    let mut t = setup(64);
    t.add(1, 9).unwrap();
    // The window group releases what leaves the window: its table starts past page 0.
    t.append(1, 12).unwrap();
    assert!(t.table(1, WINDOW).unwrap().first_page > 0);
    let pages = t.request_pages(1).unwrap();
    let mut sorted = pages.clone();
    sorted.sort();
    assert_eq!(pages, sorted, "ordered by group, then page index");
    let mut expected = Vec::new();
    for group in 0..t.spec().num_groups() {
        let table = t.table(1, group).unwrap();
        for (i, &page_id) in table.page_ids.iter().enumerate() {
            expected.push(RequestPage { group, page_index: table.first_page + i, page_id });
        }
    }
    assert_eq!(pages, expected);
    let state: Vec<usize> =
        pages.iter().filter(|p| p.group == STATE).map(|p| p.page_index).collect();
    assert_eq!(state, [0, 1], "a state slot's pages are 0, 1, ...");
    assert_eq!(t.next_query(1).unwrap(), 9);
    assert!(matches!(t.request_pages(7), Err(CoreError::UnknownRequest { request_id: 7 })));
}

#[test]
fn a_swap_moves_every_groups_bytes_out_and_back_exactly() {
    let mut t = setup(160);
    t.add(1, 9).unwrap();
    t.append(1, 14).unwrap(); // window and chunk tables start past page 0
    t.fork(1, 2).unwrap();
    t.append(2, 3).unwrap(); // shares 1's pages but its copies of the last page and slot
    t.add(3, 30).unwrap();
    // Distinct bytes in every page anyone holds (a shared page once, by its id).
    let mut held: Vec<u32> =
        [1, 2, 3].iter().flat_map(|&r| t.request_pages(r).unwrap()).map(|p| p.page_id).collect();
    held.sort_unstable();
    held.dedup();
    for &page in &held {
        fill_page(t.pool(), page, page * 31 + 5);
    }
    let bytes: Vec<_> = [1, 2, 3].iter().map(|&r| request_bytes(&t, r)).collect();
    let before: Vec<_> = [1, 2, 3].iter().map(|&r| t.request_pages(r).unwrap()).collect();
    let positions: Vec<_> =
        [1, 2, 3].iter().map(|&r| (t.num_tokens(r).unwrap(), t.next_query(r).unwrap())).collect();
    let mut tier = host_tier(&t, 96);
    tier.check_invariants(&t).unwrap();

    let (device_free, device_used) = (t.pool().num_free(), t.pool().num_used());
    let moved: usize = before[0].len() + before[2].len();
    // Pages 1 holds alone (2 keeps its reference to the shared ones) and all of 3's.
    let shared_with_2 = before[0].iter().filter(|p| before[1].contains(p)).count();
    let stats = swap_out(&mut tier, &mut t, &[1, 3]).unwrap();
    assert_eq!((stats.num_requests, stats.num_blocks), (2, moved));
    // One copy per run of consecutive source pages (the host pool was empty, so its
    // destinations are consecutive).
    let mut sources: Vec<u32> = before[0].iter().chain(&before[2]).map(|p| p.page_id).collect();
    sources.sort_unstable();
    let runs = 1 + sources.windows(2).filter(|w| w[1] != w[0] + 1).count();
    assert_eq!(stats.num_copies, runs);
    assert!(!t.contains(1) && !t.contains(3) && t.contains(2));
    assert_eq!(tier.request_ids(), [1, 3]);
    // Conservation on both pools.
    assert_eq!(t.pool().num_free(), device_free + moved - shared_with_2);
    assert_eq!(t.pool().num_used(), device_used - moved + shared_with_2);
    assert_eq!(t.pool().num_free() + t.pool().num_used(), t.pool().num_blocks());
    assert_eq!(tier.host_pool().num_used(), moved);
    assert_eq!(tier.num_pending(), (0, 0), "host copies complete at once");
    tier.check_invariants(&t).unwrap();
    // The host pages hold the bytes, in the same order, under the same page indices.
    for (k, &r) in [1u64, 3].iter().enumerate() {
        let swapped = tier.swapped(r).unwrap();
        let i = [0, 2][k];
        assert_eq!(shape(&swapped.pages), shape(&before[i]));
        assert_eq!((swapped.num_tokens, swapped.next_query), positions[i]);
        let host: Vec<_> =
            swapped.pages.iter().map(|p| page_bytes(tier.host_pool(), p.page_id)).collect();
        assert!(host == bytes[i], "request {r}: the host pages hold other bytes");
    }

    // Overwrite every device page 2 does not hold, then let another request take some.
    let keep: Vec<u32> = t.request_pages(2).unwrap().iter().map(|p| p.page_id).collect();
    for page in 0..t.pool().num_blocks() as u32 {
        if !keep.contains(&page) {
            fill_page(t.pool(), page, 0xdead_beef ^ page);
        }
    }
    t.add(4, 13).unwrap();
    tier.check_invariants(&t).unwrap();

    let stats = swap_in(&mut tier, &mut t, &[3, 1]).unwrap();
    assert_eq!((stats.num_requests, stats.num_blocks), (2, moved));
    assert!(tier.is_empty() && t.contains(1) && t.contains(3));
    assert_eq!(tier.host_pool().num_used(), 0);
    tier.check_invariants(&t).unwrap();
    for (i, &r) in [1u64, 2, 3].iter().enumerate() {
        let after = t.request_pages(r).unwrap();
        assert_eq!(shape(&after), shape(&before[i]), "request {r}: same first pages");
        assert_eq!((t.num_tokens(r).unwrap(), t.next_query(r).unwrap()), positions[i]);
        assert!(request_bytes(&t, r) == bytes[i], "request {r}: other bytes after the swap");
    }
    // Back in, the requests carry on as before: 1 no longer shares with 2.
    t.append(1, 4).unwrap();
    t.append(2, 4).unwrap();
    t.free(1).unwrap();
    t.free(2).unwrap();
    t.free(3).unwrap();
    t.free(4).unwrap();
    tier.check_invariants(&t).unwrap();
    assert_eq!(t.pool().num_used(), 0);
}

#[test]
fn a_failed_swap_changes_nothing() {
    let mut t = setup(64);
    t.add(1, 20).unwrap();
    t.add(2, 5).unwrap();
    let pages_of_1 = t.request_pages(1).unwrap().len();
    // Host tier too small for request 1.
    let mut small = host_tier(&t, pages_of_1 - 1);
    let before = snapshot(&t, &small, &[1, 2]);
    let err = swap_out(&mut small, &mut t, &[2, 1]).err().unwrap();
    assert!(matches!(err, CoreError::HostTierFull { .. }), "{err}");
    assert_eq!(snapshot(&t, &small, &[1, 2]), before);
    small.check_invariants(&t).unwrap();
    drop(small);

    let mut tier = host_tier(&t, 64);
    swap_out(&mut tier, &mut t, &[1]).unwrap();
    let ids = [1, 2, 3, 5];
    let before = snapshot(&t, &tier, &ids);
    let refusals: Vec<(&str, Result<_, CoreError>)> = vec![
        ("swap out a swapped request", swap_out(&mut tier, &mut t, &[2, 1])),
        ("swap out an unknown request", swap_out(&mut tier, &mut t, &[2, 5])),
        ("swap out twice in a call", swap_out(&mut tier, &mut t, &[2, 2])),
        ("swap in a device request", swap_in(&mut tier, &mut t, &[1, 2])),
        ("swap in an unknown request", swap_in(&mut tier, &mut t, &[5])),
        ("swap in twice in a call", swap_in(&mut tier, &mut t, &[1, 1])),
        // SAFETY: the stream is refused before anything uses it (a host pool takes none).
        ("a stream on a host pool", unsafe { tier.swap_in(&mut t, &[1], Some(1)) }),
    ];
    for (what, result) in refusals {
        assert!(result.is_err(), "{what}");
        assert_eq!(snapshot(&t, &tier, &ids), before, "{what}");
    }
    assert!(matches!(
        swap_in(&mut tier, &mut t, &[2]),
        Err(CoreError::WrongTier { request_id: 2, tier: "device", .. })
    ));
    assert!(matches!(
        swap_out(&mut tier, &mut t, &[1]),
        Err(CoreError::WrongTier { request_id: 1, tier: "host", .. })
    ));
    assert!(matches!(tier.free(&t, 2), Err(CoreError::WrongTier { .. })));
    assert!(matches!(tier.free(&t, 5), Err(CoreError::UnknownRequest { .. })));

    // Tables over another pool (or of another model) are refused.
    let mut other = setup(64);
    other.add(1, 3).unwrap();
    let err = swap_in(&mut tier, &mut other, &[1]).err().unwrap();
    assert!(matches!(err, CoreError::InvalidArgument(m) if m.contains("not the ones")));

    // The id added again while swapped out: its swap-in is refused.
    t.add(1, 2).unwrap();
    let before = snapshot(&t, &tier, &ids);
    let err = swap_in(&mut tier, &mut t, &[1]).err().unwrap();
    assert!(matches!(err, CoreError::DuplicateRequest { request_id: 1 }), "{err}");
    assert_eq!(snapshot(&t, &tier, &ids), before);
    t.free(1).unwrap();

    // Device pool too full to take the request back.
    let free_now = t.pool().num_free();
    let mut filler = 10;
    while t.pool().num_free() >= pages_of_1 || t.pool().num_free() == free_now {
        if t.add(filler, 1).is_err() {
            break;
        }
        filler += 1;
    }
    assert!(t.pool().num_free() < pages_of_1);
    let ids: Vec<u64> = (1..filler).collect();
    let before = snapshot(&t, &tier, &ids);
    let err = swap_in(&mut tier, &mut t, &[1]).err().unwrap();
    assert!(matches!(err, CoreError::OutOfBlocks { .. }), "{err}");
    assert_eq!(snapshot(&t, &tier, &ids), before);
    tier.check_invariants(&t).unwrap();
}

#[test]
fn freeing_or_dropping_the_tier_returns_every_host_page() {
    let mut t = setup(64);
    t.add(1, 9).unwrap();
    t.add(2, 17).unwrap();
    t.add(3, 2).unwrap();
    let mut tier = host_tier(&t, 64);
    swap_out(&mut tier, &mut t, &[1, 2]).unwrap();
    let host_pool = tier.host_pool().clone();
    let pages_of_1 = tier.swapped(1).unwrap().pages.len();
    let used = host_pool.num_used();
    tier.free(&t, 1).unwrap();
    assert_eq!(host_pool.num_used(), used - pages_of_1);
    assert_eq!(tier.location(&t, 1), None);
    assert_eq!(tier.location(&t, 2), Some(kvpool_core::tier::Tier::Host));
    assert_eq!(tier.location(&t, 3), Some(kvpool_core::tier::Tier::Device));
    tier.check_invariants(&t).unwrap();
    // The host pool's pages are the tier's: the plain API refuses them.
    let host_page = tier.swapped(2).unwrap().pages[0].page_id;
    assert!(host_pool.free(host_page).is_err());
    assert!(host_pool.alloc().is_err());
    drop(tier);
    assert_eq!(host_pool.num_used(), 0);
    host_pool.check_invariants().unwrap();
    t.check_invariants().unwrap();
    t.free(3).unwrap();
    assert_eq!(t.pool().num_used(), 0);
}

/// The same round trip on a CUDA device pool (pinned host tier, copies on the tier's copy
/// stream): ignored without a GPU; on one,
/// `cargo test -p kvpool-core --test hybrid_swap -- --ignored`.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn a_swap_on_a_cuda_pool_moves_every_groups_bytes_out_and_back_exactly() {
    use cudarc::driver::result::{memcpy_dtoh_sync, memcpy_htod_sync};

    let spec = mixed_spec();
    let pool = Arc::new(Pool::new(&spec, PoolSize::NumBlocks(160), Device::Cuda(0)).unwrap());
    kvpool_core::driver::bind(pool.device_context().unwrap().context()).unwrap();
    let mut t = HybridTables::new(pool.clone(), spec).unwrap();
    t.add(1, 9).unwrap();
    t.append(1, 14).unwrap();
    t.add(2, 30).unwrap();
    let device_page = |page: u32| {
        let mut bytes = vec![0u8; PAGE_BYTES];
        // SAFETY: `page` is in range (block_ptr checked it): PAGE_BYTES of the pool's slab.
        unsafe { memcpy_dtoh_sync(&mut bytes, pool.block_ptr(page).unwrap()) }.unwrap();
        bytes
    };
    let write_device_page = |page: u32, seed: u32| {
        let bytes: Vec<u8> =
            (0..PAGE_BYTES as u32).map(|o| (seed.wrapping_mul(2_654_435_761) ^ o) as u8).collect();
        // SAFETY: as in `device_page`; no copy of the tier touches this page meanwhile.
        unsafe { memcpy_htod_sync(pool.block_ptr(page).unwrap(), &bytes) }.unwrap();
    };
    for r in [1, 2] {
        for p in t.request_pages(r).unwrap() {
            write_device_page(p.page_id, p.page_id * 31 + 5);
        }
    }
    let before: Vec<_> = [1, 2].iter().map(|&r| t.request_pages(r).unwrap()).collect();
    let bytes: Vec<Vec<Vec<u8>>> =
        before.iter().map(|pages| pages.iter().map(|p| device_page(p.page_id)).collect()).collect();
    let mut tier = host_tier(&t, 160);
    swap_out(&mut tier, &mut t, &[1, 2]).unwrap();
    tier.wait().unwrap();
    assert_eq!(tier.num_pending(), (0, 0));
    tier.check_invariants(&t).unwrap();
    for (i, &r) in [1u64, 2].iter().enumerate() {
        let host: Vec<_> = tier
            .swapped(r)
            .unwrap()
            .pages
            .iter()
            .map(|p| page_bytes(tier.host_pool(), p.page_id))
            .collect();
        assert!(host == bytes[i], "request {r}: the host pages hold other bytes");
    }
    for page in 0..pool.num_blocks() as u32 {
        write_device_page(page, 0xdead_beef ^ page);
    }
    swap_in(&mut tier, &mut t, &[2, 1]).unwrap();
    tier.wait().unwrap();
    tier.check_invariants(&t).unwrap();
    for (i, &r) in [1u64, 2].iter().enumerate() {
        let after = t.request_pages(r).unwrap();
        assert_eq!(shape(&after), shape(&before[i]));
        let device: Vec<_> = after.iter().map(|p| device_page(p.page_id)).collect();
        assert!(device == bytes[i], "request {r}: other bytes after the swap");
    }
}
