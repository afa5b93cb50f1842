//! Block tables on a host pool: growth, copy-on-write fork, failure atomicity, and a seeded
//! random run against a plain model.

use std::collections::HashMap;
use std::sync::Arc;

use kvpool_core::pool::PoolSize;
use kvpool_core::tables::{BlockCopy, BlockTables};
use kvpool_core::{CoreError, DType, Device, KvLayout, Pool};

mod common;
use common::XorShift;

const BLOCK_SIZE: usize = 4;

fn setup(num_blocks: usize, max_seqs: usize, max_blocks: usize) -> (Arc<Pool>, Arc<BlockTables>) {
    let layout = KvLayout::new(1, 1, 64, BLOCK_SIZE, DType::Float16).unwrap();
    let pool = Arc::new(Pool::new(layout, PoolSize::NumBlocks(num_blocks), Device::Host).unwrap());
    let tables = BlockTables::new(pool.clone(), max_seqs, max_blocks).unwrap();
    (pool, tables)
}

fn check(pool: &Pool, tables: &BlockTables) {
    tables.check_invariants().unwrap();
    pool.check_invariants_with(true).unwrap();
}

#[test]
fn add_and_append_take_blocks_only_when_the_last_fills() {
    let (pool, t) = setup(16, 4, 8);
    let slots = t.add(7, 5).unwrap();
    assert_eq!(t.blocks(7).unwrap().len(), 2);
    let b = t.blocks(7).unwrap();
    assert_eq!(
        slots,
        vec![
            b[0] as i64 * 4,
            b[0] as i64 * 4 + 1,
            b[0] as i64 * 4 + 2,
            b[0] as i64 * 4 + 3,
            b[1] as i64 * 4
        ]
    );
    let r = t.append_tokens(7, 3).unwrap();
    assert!(r.copies.is_empty());
    assert_eq!(t.blocks(7).unwrap().len(), 2);
    assert_eq!(r.slot_mapping, vec![b[1] as i64 * 4 + 1, b[1] as i64 * 4 + 2, b[1] as i64 * 4 + 3]);
    t.append_tokens(7, 1).unwrap();
    assert_eq!(t.blocks(7).unwrap().len(), 3);
    assert_eq!(pool.num_used(), 3);
    check(&pool, &t);
}

#[test]
fn fork_shares_then_copies_the_partial_last_block_on_write() {
    let (pool, t) = setup(16, 4, 8);
    t.add(1, 6).unwrap(); // 2 blocks, last half full
    t.fork(1, 2).unwrap();
    let shared = t.blocks(1).unwrap();
    assert_eq!(t.blocks(2).unwrap(), shared);
    for &b in &shared {
        assert_eq!(pool.ref_cnt(b as u32).unwrap(), 2);
    }
    check(&pool, &t);
    let r = t.append_tokens(2, 1).unwrap();
    let child = t.blocks(2).unwrap();
    assert_eq!(child[0], shared[0], "full blocks stay shared");
    assert_ne!(child[1], shared[1]);
    assert_eq!(r.copies, vec![BlockCopy { src: shared[1] as u32, dst: child[1] as u32 }]);
    assert_eq!(r.slot_mapping, vec![child[1] as i64 * 4 + 2]);
    assert_eq!(pool.ref_cnt(shared[1] as u32).unwrap(), 1);
    // The parent now owns its last block alone: no copy.
    assert!(t.append_tokens(1, 1).unwrap().copies.is_empty());
    check(&pool, &t);
    t.free(1).unwrap();
    t.free(2).unwrap();
    assert_eq!(pool.num_free(), 16);
    check(&pool, &t);
}

#[test]
fn parent_and_child_appending_together_copy_once() {
    let (pool, t) = setup(16, 4, 8);
    t.add(1, 3).unwrap();
    t.fork(1, 2).unwrap();
    let r = t.append_tokens_many(&[1, 2], &[1, 1]).unwrap();
    assert_eq!(r.copies.len(), 1);
    assert_ne!(t.blocks(1).unwrap(), t.blocks(2).unwrap());
    assert_eq!(pool.num_used(), 2);
    check(&pool, &t);
}

#[test]
fn failed_calls_change_nothing() {
    let (pool, t) = setup(4, 2, 3);
    t.add(1, 5).unwrap();
    let before = (t.request_ids(), t.blocks(1).unwrap(), t.num_tokens(1).unwrap(), pool.num_free());
    let state =
        || (t.request_ids(), t.blocks(1).unwrap(), t.num_tokens(1).unwrap(), pool.num_free());
    assert!(matches!(t.add(1, 1), Err(CoreError::DuplicateRequest { request_id: 1 })));
    assert!(matches!(t.add(2, 13), Err(CoreError::CapacityExceeded { .. })));
    assert!(matches!(t.append_tokens(1, 100), Err(CoreError::CapacityExceeded { .. })));
    assert!(matches!(t.append_tokens(9, 1), Err(CoreError::UnknownRequest { request_id: 9 })));
    t.add(2, 4).unwrap(); // 1 block left free
    let before2 = (t.blocks(2).unwrap(), pool.num_free());
    // Request 1 needs 1 more block, request 2 needs 1: only 1 is free, so neither grows.
    assert!(matches!(
        t.append_tokens_many(&[1, 2], &[4, 1]),
        Err(CoreError::OutOfBlocks { requested: 2, free: 1, .. })
    ));
    assert_eq!((t.blocks(2).unwrap(), pool.num_free()), before2);
    assert!(matches!(t.append_tokens_many(&[1, 1], &[1, 1]), Err(CoreError::InvalidArgument(_))));
    assert!(
        matches!(t.add(3, 0), Err(CoreError::CapacityExceeded { what, .. }) if what.contains("max_seqs"))
    );
    assert!(matches!(t.fork(1, 3), Err(CoreError::CapacityExceeded { .. })));
    t.free(2).unwrap();
    assert_eq!(state(), before);
    check(&pool, &t);
}

#[test]
fn free_moves_the_last_row_into_the_hole() {
    let (pool, t) = setup(16, 4, 4);
    for id in [10, 11, 12] {
        t.add(id, 2).unwrap();
    }
    let last = t.blocks(12).unwrap();
    t.free(10).unwrap();
    assert_eq!(t.request_ids(), vec![12, 11]);
    let (seq_lens, table) = t.gather(&[12]).unwrap();
    assert_eq!(seq_lens, vec![2]);
    assert_eq!(table, vec![last[0], -1, -1, -1]);
    let csr = t.csr(&[12, 11]).unwrap();
    assert_eq!(csr.indptr, vec![0, 1, 2]);
    assert_eq!(csr.indices.len(), 2);
    assert_eq!(csr.last_page_len, vec![2, 2]);
    check(&pool, &t);
}

#[test]
fn random_operations_match_a_plain_model() {
    let (pool, t) = setup(24, 6, 8);
    let mut model: HashMap<u64, usize> = HashMap::new(); // request -> num_tokens
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let mut next_id = 0u64;
    for _ in 0..3000 {
        let ids: Vec<u64> = {
            let mut v: Vec<u64> = model.keys().copied().collect();
            v.sort();
            v
        };
        let pick = |rng: &mut XorShift| ids[rng.below(ids.len())];
        match rng.below(5) {
            0 => {
                let n = rng.below(12);
                if t.add(next_id, n).is_ok() {
                    model.insert(next_id, n);
                }
                next_id += 1;
            }
            1 if !ids.is_empty() => {
                let id = pick(&mut rng);
                let n = rng.below(6);
                let free_before = pool.num_free();
                match t.append_tokens(id, n) {
                    Ok(_) => *model.get_mut(&id).unwrap() += n,
                    Err(_) => assert_eq!(pool.num_free(), free_before),
                }
            }
            2 if !ids.is_empty() => {
                let id = pick(&mut rng);
                if t.fork(id, next_id).is_ok() {
                    model.insert(next_id, model[&id]);
                }
                next_id += 1;
            }
            3 if !ids.is_empty() => {
                let batch: Vec<u64> = ids.iter().copied().filter(|_| rng.below(2) == 0).collect();
                let counts: Vec<usize> = batch.iter().map(|_| rng.below(3)).collect();
                if t.append_tokens_many(&batch, &counts).is_ok() {
                    for (id, n) in batch.iter().zip(&counts) {
                        *model.get_mut(id).unwrap() += n;
                    }
                }
            }
            4 if !ids.is_empty() => {
                let id = pick(&mut rng);
                t.free(id).unwrap();
                model.remove(&id);
            }
            _ => {}
        }
        for (&id, &n) in &model {
            assert_eq!(t.num_tokens(id).unwrap(), n);
            assert_eq!(t.blocks(id).unwrap().len(), n.div_ceil(BLOCK_SIZE));
        }
        check(&pool, &t);
    }
    for id in t.request_ids() {
        t.free(id).unwrap();
    }
    assert_eq!(pool.num_free(), pool.num_blocks());
    check(&pool, &t);
}

#[test]
fn dropping_the_tables_releases_their_references() {
    let (pool, t) = setup(16, 4, 8);
    t.add(1, 9).unwrap();
    t.fork(1, 2).unwrap();
    t.append_tokens(2, 4).unwrap();
    assert!(pool.num_used() > 0);
    drop(t);
    assert_eq!(pool.num_free(), pool.num_blocks());
    pool.check_invariants_with(true).unwrap();
}

#[test]
fn a_block_the_tables_hold_cannot_be_freed_or_shared_through_the_pool() {
    let (pool, t) = setup(16, 4, 8);
    t.add(1, 5).unwrap();
    let held = t.blocks(1).unwrap()[0] as u32;
    let before = (pool.num_free(), pool.ref_cnt(held).unwrap());
    let refused = |e: Result<(), CoreError>| matches!(&e, Err(CoreError::InvalidBlock { value, reason }) if *value == held.to_string() && reason.contains("block tables"));
    assert!(refused(pool.free(held)));
    assert!(refused(pool.free_many(&[held])));
    assert!(refused(pool.share_many(&[held])));
    assert_eq!(
        (pool.num_free(), pool.ref_cnt(held).unwrap()),
        before,
        "a refused call changes nothing"
    );
    t.check_invariants().unwrap();
    pool.check_invariants_with(true).unwrap();
    // Freed with its request, the block is the pool's to hand out again, and then the pool API's.
    t.free(1).unwrap();
    let all = pool.alloc_many(pool.num_free()).unwrap();
    assert!(all.contains(&held));
    pool.free_many(&all).unwrap();
    pool.check_invariants_with(true).unwrap();
}

#[test]
fn the_host_batch_is_the_table_and_seq_lens_of_every_row() {
    let (_pool, t) = setup(16, 4, 3);
    t.add(7, 5).unwrap();
    t.add(9, 1).unwrap();
    let batch = t.host_batch().unwrap();
    let (seq_lens, table) = t.gather(&[7, 9]).unwrap();
    assert_eq!((batch.request_ids, batch.num_seqs, batch.max_blocks_per_seq), (vec![7, 9], 2, 3));
    assert_eq!((batch.seq_lens, batch.block_table), (seq_lens, table));
}

#[test]
fn a_batch_too_large_to_gather_is_out_of_memory_not_an_abort() {
    // 2^22 repeated ids x a 2^16-wide row x 4 bytes: a 1 TiB dense table, more than any
    // machine lends one allocation, so sizing it must fail as an error.
    let (pool, t) = setup(16, 2, 1 << 16);
    t.add(1, 3).unwrap();
    let repeated = vec![1u64; 1 << 22];
    assert!(matches!(t.gather(&repeated), Err(CoreError::OutOfMemory { .. })));
    // CSR is sized by the blocks held (one per id here): it fits.
    assert_eq!(t.csr(&repeated).unwrap().indices.len(), 1 << 22);
    check(&pool, &t);
}
