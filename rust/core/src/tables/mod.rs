//! `BlockTables`: each request's logical-to-physical block map, grown token by token,
//! shared by fork with copy-on-write, and uploaded to the GPU (`upload.rs`, design in `upload.md`).
//!
//! Requests live in dense rows `0..len` (a persistent batch, as vLLM v1 keeps it): the
//! kernel's table is the first `len` rows of one `[max_seqs, max_blocks_per_seq]` int32
//! array, unused entries -1. Freeing a request moves the last row into its hole, so only
//! that row changes. Every row change bumps the row's version, which is all the upload
//! needs to send only what changed.
//!
//! Every mutating call validates everything, then takes all the blocks it needs in one
//! all-or-nothing allocation, then commits with nothing left that can fail.
//!
//! A request added with its token ids (`prefix.rs`) takes part in prefix caching: it starts
//! from the cached blocks of its longest cached prefix, and each block it fills is cached.

mod prefix;

pub use prefix::{AddResult, PromptKey};

// FxHash: request ids are trusted integers from the scheduler, and SipHash's DoS resistance
// would cost a third of a 256-request decode step.
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::CoreError;
use crate::pool::{Owner, Pool, RefHolder};

#[cfg(feature = "cuda")]
mod upload;
#[cfg(feature = "cuda")]
pub use upload::DeviceBatch;

/// Entry of an unused table slot.
pub const NULL_BLOCK: i32 = -1;

/// One request's bookkeeping; its blocks are `table[row * max_blocks_per_seq..][..num_blocks]`.
#[derive(Debug, Clone, Copy)]
struct Row {
    request_id: u64,
    num_tokens: usize,
}

/// A copy-on-write block copy that must run before the new tokens are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: u32,
    pub dst: u32,
}

/// What an append produced: the slot of every new token (in order) and the copies to run.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AppendResult {
    pub slot_mapping: Vec<i64>,
    pub copies: Vec<BlockCopy>,
}

/// A batch's table in CSR form: the blocks of request `i` are
/// `indices[indptr[i]..indptr[i + 1]]`; its last block holds `last_page_len[i]` tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Csr {
    pub indptr: Vec<i32>,
    pub indices: Vec<i32>,
    pub last_page_len: Vec<i32>,
}

/// The mutable part of `BlockTables`, behind its lock.
pub struct TablesState {
    rows: Vec<Row>,
    row_of: FxHashMap<u64, usize>,
    /// `[max_seqs][max_blocks_per_seq]`, the canonical host copy of the table.
    pub(crate) table: Vec<i32>,
    /// `row_version[r]` changes whenever row `r`'s table entries change.
    pub(crate) row_version: Vec<u64>,
    next_version: u64,
    /// Requests a host tier holds (swapped out): their ids stay taken, and calls that need a
    /// row say where they are instead of not knowing them.
    swapped_out: FxHashSet<u64>,
    /// Parallel to `rows`: the hash state of requests whose token ids are known.
    hashes: Vec<Option<prefix::RowHashes>>,
    /// `[max_seqs][block_size]` (prefix-caching pools only): row r's tokens of its partly
    /// filled last block, `num_tokens % block_size` of them, at `r * block_size`.
    pending_tokens: Vec<u32>,
}

pub struct BlockTables {
    pool: Arc<Pool>,
    max_seqs: usize,
    max_blocks_per_seq: usize,
    state: Mutex<TablesState>,
    /// Device copy and staging buffers per device, each made on the first `sync` to it: the
    /// pool's device, and under tensor parallelism every mirror pool's (`sync_mirror_on`).
    #[cfg(feature = "cuda")]
    uploaders: Mutex<Vec<upload::Uploader>>,
}

fn blocks_for(num_tokens: usize, block_size: usize) -> usize {
    num_tokens.div_ceil(block_size)
}

/// An empty vector with room for `len` items, or `OutOfMemory`: outputs sized by the
/// caller's numbers (token counts, batch lengths) must fail as an error, not abort.
fn vec_with_capacity<T>(len: usize) -> Result<Vec<T>, CoreError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| CoreError::OutOfMemory {
        requested_bytes: len.saturating_mul(std::mem::size_of::<T>()),
        device: "host".into(),
    })?;
    Ok(v)
}

/// A batch's table as the host sees it: the host twin of a device sync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostBatch {
    /// `[num_seqs, max_blocks_per_seq]` int32, row-major, -1 padded.
    pub block_table: Vec<i32>,
    /// `[num_seqs]`.
    pub seq_lens: Vec<i32>,
    pub request_ids: Vec<u64>,
    pub num_seqs: usize,
    pub max_blocks_per_seq: usize,
}

impl BlockTables {
    pub fn new(
        pool: Arc<Pool>,
        max_seqs: usize,
        max_blocks_per_seq: usize,
    ) -> Result<Arc<Self>, CoreError> {
        // Block tables count tokens in a layout's blocks: a pool of hybrid pages has none.
        let block_size = pool.layout()?.block_size();
        if max_seqs == 0 || max_blocks_per_seq == 0 {
            return Err(CoreError::InvalidArgument(format!(
                "max_seqs and max_blocks_per_seq must be positive, got {max_seqs} and {max_blocks_per_seq}"
            )));
        }
        let entries = max_seqs
            .checked_mul(max_blocks_per_seq)
            .filter(|&e| e <= i32::MAX as usize)
            .ok_or_else(|| {
                CoreError::InvalidArgument(format!(
                    "a {max_seqs} x {max_blocks_per_seq} table is too large"
                ))
            })?;
        // Sized from the caller's numbers: a failed allocation must be an error, not an abort.
        let out_of_memory =
            |_| CoreError::OutOfMemory { requested_bytes: entries * 4, device: "host".into() };
        let mut table = Vec::new();
        table.try_reserve_exact(entries).map_err(out_of_memory)?;
        table.resize(entries, NULL_BLOCK);
        let mut row_version = Vec::new();
        row_version.try_reserve_exact(max_seqs).map_err(out_of_memory)?;
        row_version.resize(max_seqs, 0);
        let mut rows = Vec::new();
        rows.try_reserve_exact(max_seqs).map_err(out_of_memory)?;
        let mut hashes = Vec::new();
        hashes.try_reserve_exact(max_seqs).map_err(out_of_memory)?;
        let mut pending_tokens = Vec::new();
        if pool.prefix_cache().is_some() {
            let len = max_seqs.saturating_mul(block_size);
            pending_tokens.try_reserve_exact(len).map_err(|_| CoreError::OutOfMemory {
                requested_bytes: len.saturating_mul(4),
                device: "host".into(),
            })?;
            pending_tokens.resize(len, 0);
        }
        let mut row_of = FxHashMap::default();
        row_of.try_reserve(max_seqs).map_err(out_of_memory)?;
        let tables = Arc::new(BlockTables {
            pool: pool.clone(),
            max_seqs,
            max_blocks_per_seq,
            state: Mutex::new(TablesState {
                rows,
                row_of,
                table,
                row_version,
                next_version: 1,
                hashes,
                pending_tokens,
                swapped_out: FxHashSet::default(),
            }),
            #[cfg(feature = "cuda")]
            uploaders: Mutex::new(Vec::new()),
        });
        let holder: Arc<dyn RefHolder> = tables.clone();
        pool.register_ref_holder(Arc::downgrade(&holder));
        Ok(tables)
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }
    pub fn max_seqs(&self) -> usize {
        self.max_seqs
    }
    pub fn max_blocks_per_seq(&self) -> usize {
        self.max_blocks_per_seq
    }
    fn block_size(&self) -> usize {
        self.pool.layout().expect("checked by BlockTables::new").block_size()
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, TablesState> {
        // A panic while holding the lock is a bug we never expect; the state is still
        // consistent at every await-free point, so keep serving rather than poison forever.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks that `num_tokens` tokens of `request_id` need, if they fit a row (and the token
    /// count fits the kernels' int32 seq_lens).
    pub(crate) fn check_blocks_fit(
        &self,
        request_id: u64,
        num_tokens: usize,
    ) -> Result<usize, CoreError> {
        if num_tokens > i32::MAX as usize {
            return Err(CoreError::CapacityExceeded {
                what: format!("tokens of request {request_id}"),
                requested: num_tokens,
                limit: i32::MAX as usize,
            });
        }
        let needed = blocks_for(num_tokens, self.block_size());
        if needed > self.max_blocks_per_seq {
            return Err(CoreError::CapacityExceeded {
                what: format!("blocks of request {request_id} (max_blocks_per_seq)"),
                requested: needed,
                limit: self.max_blocks_per_seq,
            });
        }
        Ok(needed)
    }

    pub(crate) fn check_row_free(
        &self,
        st: &TablesState,
        request_id: u64,
    ) -> Result<(), CoreError> {
        if st.rows.len() == self.max_seqs {
            return Err(CoreError::CapacityExceeded {
                what: format!("sequences (max_seqs) when adding request {request_id}"),
                requested: self.max_seqs + 1,
                limit: self.max_seqs,
            });
        }
        Ok(())
    }

    /// Adds a request holding `num_tokens` tokens; returns their slot mapping.
    pub fn add(&self, request_id: u64, num_tokens: usize) -> Result<Vec<i64>, CoreError> {
        let mut st = self.lock();
        if st.holds(request_id) {
            return Err(CoreError::DuplicateRequest { request_id });
        }
        self.check_row_free(&st, request_id)?;
        let num_blocks = self.check_blocks_fit(request_id, num_tokens)?;
        let mut slots = vec_with_capacity(num_tokens)?;
        let mut ids = vec![0u32; num_blocks];
        self.pool.alloc_into_for(&mut ids, Owner::Tables)?;
        let row = self.push_row(&mut st, request_id, num_tokens, &ids);
        self.extend_slots(&mut slots, &st, row, 0, num_tokens);
        Ok(slots)
    }

    /// Commits a new row holding `ids`; returns its index.
    fn push_row(
        &self,
        st: &mut TablesState,
        request_id: u64,
        num_tokens: usize,
        ids: &[u32],
    ) -> usize {
        let row = st.rows.len();
        st.rows.push(Row { request_id, num_tokens });
        st.hashes.push(None);
        st.row_of.insert(request_id, row);
        let entries = self.row_entries_mut(st, row);
        for (entry, &id) in entries.iter_mut().zip(ids) {
            *entry = id as i32;
        }
        st.touch(row);
        row
    }

    /// Appends `count` tokens to one request. See [`append_tokens_many`](Self::append_tokens_many).
    pub fn append_tokens(&self, request_id: u64, count: usize) -> Result<AppendResult, CoreError> {
        self.append_tokens_many(&[request_id], &[count])
    }

    /// Appends `counts[i]` tokens to `request_ids[i]` for every i, or to none of them.
    /// A request whose partly filled last block is shared (after a fork) gets a fresh copy
    /// of it first: the returned copies must run before the new tokens are written.
    pub fn append_tokens_many(
        &self,
        request_ids: &[u64],
        counts: &[usize],
    ) -> Result<AppendResult, CoreError> {
        self.append_tokens_many_with_ids(request_ids, counts, None)
    }

    /// [`append_tokens_many`](Self::append_tokens_many) with the new tokens' ids, all
    /// requests' concatenated in call order (`sum(counts)` of them), so that the blocks
    /// they fill are hashed and cached. Without ids a request's later blocks are not cached.
    pub fn append_tokens_many_with_ids(
        &self,
        request_ids: &[u64],
        counts: &[usize],
        token_ids: Option<&[u32]>,
    ) -> Result<AppendResult, CoreError> {
        if request_ids.len() != counts.len() {
            return Err(CoreError::InvalidArgument(format!(
                "{} request ids but {} counts",
                request_ids.len(),
                counts.len()
            )));
        }
        if let Some(ids) = token_ids {
            let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c));
            if total != Some(ids.len()) {
                return Err(CoreError::InvalidArgument(format!(
                    "{} token ids for {} new tokens",
                    ids.len(),
                    counts.iter().fold(0u128, |a, &c| a + c as u128)
                )));
            }
        }
        let block_size = self.block_size();
        let pool = &self.pool;
        let mut st = self.lock();

        // 1. Validate and plan: rows, capacity, and how many blocks each request takes. A
        //    shared partial block is copied only while someone else still holds it: if a
        //    parent and its fork both append in one call, the second keeps the original.
        let mut plan = Vec::with_capacity(request_ids.len());
        let mut pending_unshares: FxHashMap<u32, u32> = FxHashMap::default();
        let mut in_call = vec![false; st.rows.len()];
        let mut total_new = 0usize;
        for (&request_id, &count) in request_ids.iter().zip(counts) {
            let row = st.row(request_id)?;
            if std::mem::replace(&mut in_call[row], true) {
                return Err(CoreError::InvalidArgument(format!(
                    "request id {request_id} appears twice in one call"
                )));
            }
            let num_tokens = st.rows[row].num_tokens;
            let old_blocks = blocks_for(num_tokens, block_size);
            let new_blocks =
                self.check_blocks_fit(request_id, num_tokens.saturating_add(count))? - old_blocks;
            let mut copy_last = false;
            if count > 0 && num_tokens % block_size != 0 {
                let last = st.table[row * self.max_blocks_per_seq + old_blocks - 1] as u32;
                let ref_cnt = pool.ref_cnt(last)?;
                // The map is touched only for shared blocks (rare), not on every decode step.
                if ref_cnt > 1 {
                    let unshared = pending_unshares.entry(last).or_insert(0);
                    if ref_cnt - *unshared > 1 {
                        copy_last = true;
                        *unshared += 1;
                    }
                }
            }
            total_new += new_blocks + copy_last as usize;
            plan.push((row, count, new_blocks, copy_last));
        }

        // Every count fits a row (checked above), so their sum is at most
        // max_seqs * max_blocks_per_seq * block_size; only the buffer may still not fit.
        let total_tokens: usize = counts.iter().sum();
        let slot_mapping = vec_with_capacity(total_tokens)?;

        // 2. Take every block at once (all or nothing).
        let mut fresh = vec![0u32; total_new];
        self.pool.alloc_into_for(&mut fresh, Owner::Tables)?; // grows a growable pool

        // 3. Commit: nothing below can fail.
        let mut fresh = fresh.into_iter();
        let mut result = AppendResult { slot_mapping, copies: Vec::new() };
        let mut released = Vec::new();
        for &(row, count, new_blocks, copy_last) in &plan {
            let num_tokens = st.rows[row].num_tokens;
            let old_blocks = blocks_for(num_tokens, block_size);
            let entries = self.row_entries_mut(&mut st, row);
            if copy_last {
                let dst = fresh.next().expect("planned block");
                let src = std::mem::replace(&mut entries[old_blocks - 1], dst as i32) as u32;
                result.copies.push(BlockCopy { src, dst });
                released.push(src);
            }
            for entry in &mut entries[old_blocks..old_blocks + new_blocks] {
                *entry = fresh.next().expect("planned block") as i32;
            }
            st.rows[row].num_tokens += count;
            if copy_last || new_blocks > 0 {
                st.touch(row);
            }
            self.extend_slots(&mut result.slot_mapping, &st, row, num_tokens, num_tokens + count);
        }
        // Each released source is still held by another request, so this only decrements. It
        // can fail only if the caller freed a table's block behind the tables' back (misuse);
        // then that reference is gone already and there is nothing left to drop.
        for src in released {
            let _ = pool.free_many_for(&[src], Owner::Tables);
        }
        if let Some(cache) = self.pool.prefix_cache() {
            self.hash_appended(
                &mut st,
                cache,
                plan.iter().map(|&(row, count, ..)| (row, count)),
                token_ids,
            );
        }
        Ok(result)
    }

    /// Adds `child_id` sharing all of `parent_id`'s blocks (reference counts go up).
    pub fn fork(&self, parent_id: u64, child_id: u64) -> Result<(), CoreError> {
        let mut st = self.lock();
        let parent = st.row(parent_id)?;
        if st.holds(child_id) {
            return Err(CoreError::DuplicateRequest { request_id: child_id });
        }
        self.check_row_free(&st, child_id)?;
        let num_tokens = st.rows[parent].num_tokens;
        let blocks: Vec<u32> = self.row_blocks(&st, parent).iter().map(|&b| b as u32).collect();
        self.pool.share_many_for(&blocks, Owner::Tables)?;
        let child = st.rows.len();
        st.rows.push(Row { request_id: child_id, num_tokens });
        let hashes = st.hashes[parent].clone();
        st.hashes.push(hashes);
        self.move_pending(&mut st, parent, child);
        st.row_of.insert(child_id, child);
        let width = self.max_blocks_per_seq;
        st.table.copy_within(parent * width..parent * width + blocks.len(), child * width);
        st.touch(child);
        Ok(())
    }

    /// Removes a request, dropping its references; blocks nobody else holds become free.
    pub fn free(&self, request_id: u64) -> Result<(), CoreError> {
        let mut st = self.lock();
        let row = st.row(request_id)?;
        let blocks: Vec<u32> = self.row_blocks(&st, row).iter().map(|&b| b as u32).collect();
        // Fails (changing nothing) only if the caller freed one of these blocks directly
        // through the pool: the request then stays, and the error names the block.
        self.pool.free_many_for(&blocks, Owner::Tables)?;
        self.remove_row(&mut st, row);
        Ok(())
    }

    /// The number of tokens and the blocks of `request_id`, if it has a row.
    pub(crate) fn row_of_request(
        &self,
        st: &TablesState,
        request_id: u64,
    ) -> Option<(usize, Vec<u32>)> {
        let row = *st.row_of.get(&request_id)?;
        Some((
            st.rows[row].num_tokens,
            self.row_blocks(st, row).iter().map(|&b| b as u32).collect(),
        ))
    }

    /// Removes `request_id`'s row and hands its block references to the caller (a host tier
    /// moving the request off the device), who frees them later. `None` if it has no row.
    pub(crate) fn take_row(
        &self,
        st: &mut TablesState,
        request_id: u64,
    ) -> Option<(usize, Vec<u32>)> {
        let taken = self.row_of_request(st, request_id)?;
        let row = st.row_of[&request_id];
        self.remove_row(st, row);
        st.swapped_out.insert(request_id);
        Some(taken)
    }

    /// Forgets a request a host tier dropped (its id is free again).
    pub(crate) fn forget_swapped(&self, request_id: u64) {
        self.lock().swapped_out.remove(&request_id);
    }

    /// Adds a row for `request_id` holding `blocks` (allocated with `Owner::Tables`; the caller
    /// hands their references over). The caller has checked with [`check_row_free`] and
    /// [`check_blocks_fit`] that it fits, and that `request_id` has no row.
    ///
    /// [`check_row_free`]: Self::check_row_free
    /// [`check_blocks_fit`]: Self::check_blocks_fit
    pub(crate) fn insert_row(
        &self,
        st: &mut TablesState,
        request_id: u64,
        num_tokens: usize,
        blocks: &[u32],
    ) {
        debug_assert!(!st.row_of.contains_key(&request_id) && st.rows.len() < self.max_seqs);
        debug_assert_eq!(blocks.len(), blocks_for(num_tokens, self.block_size()));
        st.swapped_out.remove(&request_id);
        // No hash state: the blocks it fills from now on are not cached for prefix reuse.
        self.push_row(st, request_id, num_tokens, blocks);
    }

    /// Drops row `row` (its references already dealt with): the last row moves into its hole.
    fn remove_row(&self, st: &mut TablesState, row: usize) {
        let request_id = st.rows[row].request_id;
        let width = self.max_blocks_per_seq;
        let last = st.rows.len() - 1;
        if row != last {
            st.table.copy_within(last * width..(last + 1) * width, row * width);
            let moved = st.rows[last];
            st.rows[row] = moved;
            st.row_of.insert(moved.request_id, row);
            self.move_pending(st, last, row);
        }
        st.table[last * width..(last + 1) * width].fill(NULL_BLOCK);
        st.rows.pop();
        st.hashes.swap_remove(row);
        st.row_of.remove(&request_id);
        st.touch(row);
        st.touch(last);
    }

    /// Copies row `from`'s pending tokens to row `to` (a fork, or a row moving into a hole).
    fn move_pending(&self, st: &mut TablesState, from: usize, to: usize) {
        if !st.pending_tokens.is_empty() {
            let bs = self.block_size();
            st.pending_tokens.copy_within(from * bs..(from + 1) * bs, to * bs);
        }
    }

    pub fn len(&self) -> usize {
        self.lock().rows.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn contains(&self, request_id: u64) -> bool {
        self.lock().row_of.contains_key(&request_id)
    }
    /// Request ids in row order (the order of `sync`'s table and seq_lens).
    pub fn request_ids(&self) -> Vec<u64> {
        self.lock().rows.iter().map(|r| r.request_id).collect()
    }
    pub fn num_tokens(&self, request_id: u64) -> Result<usize, CoreError> {
        let st = self.lock();
        let row = st.row(request_id)?;
        Ok(st.rows[row].num_tokens)
    }
    pub fn blocks(&self, request_id: u64) -> Result<Vec<i32>, CoreError> {
        let st = self.lock();
        let row = st.row(request_id)?;
        Ok(self.row_blocks(&st, row).to_vec())
    }

    /// seq_lens and the dense `[n, max_blocks_per_seq]` table (-1 padded) of a batch.
    pub fn gather(&self, request_ids: &[u64]) -> Result<(Vec<i32>, Vec<i32>), CoreError> {
        let st = self.lock();
        let width = self.max_blocks_per_seq;
        let mut seq_lens = vec_with_capacity(request_ids.len())?;
        let mut table = vec_with_capacity(request_ids.len().saturating_mul(width))?;
        for &request_id in request_ids {
            let row = st.row(request_id)?;
            seq_lens.push(st.rows[row].num_tokens as i32);
            table.extend_from_slice(&st.table[row * width..(row + 1) * width]);
        }
        Ok((seq_lens, table))
    }

    /// seq_lens of a batch of requests.
    pub fn seq_lens(&self, request_ids: &[u64]) -> Result<Vec<i32>, CoreError> {
        let st = self.lock();
        let mut seq_lens = vec_with_capacity(request_ids.len())?;
        for &request_id in request_ids {
            let row = st.row(request_id)?;
            seq_lens.push(st.rows[row].num_tokens as i32);
        }
        Ok(seq_lens)
    }

    /// The table and seq_lens of rows `0..len`, read under one lock (the host twin of
    /// [`sync`](Self::sync)): no other thread's change can fall between them.
    pub fn host_batch(&self) -> Result<HostBatch, CoreError> {
        let st = self.lock();
        let (num_seqs, width) = (st.num_rows(), self.max_blocks_per_seq);
        let mut block_table = vec_with_capacity(num_seqs * width)?;
        block_table.extend_from_slice(&st.table[..num_seqs * width]);
        let mut seq_lens = vec_with_capacity(num_seqs)?;
        seq_lens.extend(st.seq_lens());
        let mut request_ids = vec_with_capacity(num_seqs)?;
        request_ids.extend(st.rows.iter().map(|r| r.request_id));
        Ok(HostBatch { block_table, seq_lens, request_ids, num_seqs, max_blocks_per_seq: width })
    }

    /// The batch in CSR form (FlashInfer's paged_kv_indptr / indices / last_page_len).
    pub fn csr(&self, request_ids: &[u64]) -> Result<Csr, CoreError> {
        let st = self.lock();
        let block_size = self.block_size();
        let mut indptr = vec_with_capacity(request_ids.len().saturating_add(1))?;
        indptr.push(0i32);
        let mut last_page_len = vec_with_capacity(request_ids.len())?;
        let mut num_indices = 0usize;
        for &request_id in request_ids {
            let row = st.row(request_id)?;
            num_indices = num_indices.saturating_add(self.row_blocks(&st, row).len());
        }
        let mut indices = vec_with_capacity(num_indices)?;
        for &request_id in request_ids {
            let row = st.row_of[&request_id];
            indices.extend_from_slice(self.row_blocks(&st, row));
            indptr.push(indices.len() as i32);
            let n = st.rows[row].num_tokens;
            last_page_len.push(if n == 0 { 0 } else { ((n - 1) % block_size + 1) as i32 });
        }
        Ok(Csr { indptr, indices, last_page_len })
    }

    /// Uploads the table and seq_lens of rows `0..len` to the device on the pool's stream.
    #[cfg(feature = "cuda")]
    pub fn sync(&self) -> Result<upload::DeviceBatch, CoreError> {
        let stream = self.pool.stream_handle().ok_or_else(not_cuda)?;
        // SAFETY: the pool's own stream lives as long as the pool, which `self` holds.
        unsafe { self.sync_on(stream) }
    }

    /// Like [`sync`](Self::sync), ordered on a caller's stream.
    ///
    /// # Safety
    /// `stream` must be a live CUDA stream of the pool's device context.
    #[cfg(feature = "cuda")]
    pub unsafe fn sync_on(&self, stream: u64) -> Result<upload::DeviceBatch, CoreError> {
        let ctx = self.pool.device_context().ok_or_else(not_cuda)?.context();
        // SAFETY: the caller guarantees `stream` is a live stream handle.
        unsafe { self.sync_in(ctx, stream) }
    }

    /// Uploads the same table to a mirror pool's device, on `stream` or the mirror's own
    /// stream: under tensor parallelism one set of tables drives every rank's shard, and each
    /// rank's kernels read the table from their own device. The mirror must hold as many
    /// blocks as the tables' pool (the block ids are the same on every rank).
    ///
    /// # Safety
    /// `stream`, when given, must be a live CUDA stream handle.
    #[cfg(feature = "cuda")]
    pub unsafe fn sync_mirror_on(
        &self,
        mirror: &Pool,
        stream: Option<u64>,
    ) -> Result<upload::DeviceBatch, CoreError> {
        if mirror.num_blocks() != self.pool.num_blocks()
            || mirror.is_growable()
            || self.pool.is_growable()
        {
            return Err(CoreError::InvalidArgument(format!(
                "a mirror pool must be fixed and hold the tables' pool's {} blocks, it holds {}{}",
                self.pool.num_blocks(),
                mirror.num_blocks(),
                if mirror.is_growable() || self.pool.is_growable() {
                    " (growable pools cannot be mirrored)"
                } else {
                    ""
                }
            )));
        }
        let device_context = mirror.device_context().ok_or_else(not_cuda)?;
        let stream = stream.unwrap_or(device_context.stream().raw() as u64);
        // SAFETY: the mirror's own stream lives as long as the mirror, which the caller holds;
        // a given stream is live by the caller's guarantee.
        unsafe { self.sync_in(device_context.context(), stream) }
    }

    /// Uploads to the device of `ctx` on `stream`, through that device's uploader.
    ///
    /// # Safety
    /// `stream` must be a live CUDA stream handle.
    #[cfg(feature = "cuda")]
    unsafe fn sync_in(
        &self,
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        stream: u64,
    ) -> Result<upload::DeviceBatch, CoreError> {
        // SAFETY: the caller guarantees `stream` is a live stream handle.
        unsafe {
            crate::driver::check_stream_context(ctx, stream as cudarc::driver::sys::CUstream)
        }?;
        let st = self.lock();
        let mut uploaders = self.uploaders.lock().unwrap_or_else(|p| p.into_inner());
        let index = match uploaders.iter().position(|u| u.ordinal() == ctx.ordinal()) {
            Some(index) => index,
            None => {
                uploaders.push(upload::Uploader::new(ctx, self.max_seqs, self.max_blocks_per_seq)?);
                uploaders.len() - 1
            }
        };
        // SAFETY: the stream is live and, checked above, in this uploader's context.
        unsafe { uploaders[index].sync(&st, stream as cudarc::driver::sys::CUstream) }
    }

    fn row_blocks<'s>(&self, st: &'s TablesState, row: usize) -> &'s [i32] {
        let n = blocks_for(st.rows[row].num_tokens, self.block_size());
        &st.table[row * self.max_blocks_per_seq..][..n]
    }
    fn row_entries_mut<'s>(&self, st: &'s mut TablesState, row: usize) -> &'s mut [i32] {
        &mut st.table[row * self.max_blocks_per_seq..][..self.max_blocks_per_seq]
    }
    /// Appends the slots of token positions `from..to` of `row` (slot = block_id * block_size + offset).
    fn extend_slots(
        &self,
        out: &mut Vec<i64>,
        st: &TablesState,
        row: usize,
        from: usize,
        to: usize,
    ) {
        let bs = self.block_size();
        let entries = &st.table[row * self.max_blocks_per_seq..];
        out.extend((from..to).map(|p| entries[p / bs] as i64 * bs as i64 + (p % bs) as i64));
    }

    /// Checks, with the tables locked for the whole check (so a concurrent append or free
    /// cannot show a half-made change), the rows' invariants and that every block the rows
    /// hold is tagged as the tables' and has at least as many references as the rows hold
    /// (other tables on the same pool may hold more):
    ///
    /// - `num_blocks(row) == ceil(num_tokens(row) / block_size)`, entries past it are -1;
    /// - `sum over rows of refs(b) <= ref_cnt(b)` and `owner(b) == Tables` for every held `b`.
    ///
    /// Exact while other threads use the same pool (the plain pool API, other tables): no
    /// one else can drop a reference these rows hold or retag their blocks. The pool's own
    /// counts are not checked here: [`Pool::check_invariants`] does, exact only while
    /// nothing else uses the pool.
    pub fn check_invariants(&self) -> Result<(), String> {
        let st = self.lock();
        self.check_rows(&st)?;
        let mut held: FxHashMap<u32, u32> = FxHashMap::default();
        for row in 0..st.num_rows() {
            for &b in self.row_blocks(&st, row) {
                *held.entry(b as u32).or_insert(0) += 1;
            }
        }
        for (&b, &refs) in &held {
            let rc = self.pool.ref_cnt(b).map_err(|e| e.to_string())?;
            if refs > rc {
                return Err(format!(
                    "block {b}: the tables hold {refs} references, its ref_cnt is {rc}"
                ));
            }
            if self.pool.owner(b) != Owner::Tables {
                return Err(format!(
                    "block {b} is held by the tables but tagged {:?}",
                    self.pool.owner(b)
                ));
            }
        }
        Ok(())
    }

    /// The rows' invariants: each row covers exactly ceil(num_tokens / block_size) blocks,
    /// the rest is -1, no block repeats within a row, the index matches the rows.
    fn check_rows(&self, st: &TablesState) -> Result<(), String> {
        let width = self.max_blocks_per_seq;
        if st.row_of.len() != st.rows.len() {
            return Err(format!("{} index entries for {} rows", st.row_of.len(), st.rows.len()));
        }
        if let Some(id) = st.swapped_out.iter().find(|id| st.row_of.contains_key(id)) {
            return Err(format!("request {id} has a row but is swapped out"));
        }
        for (row, r) in st.rows.iter().enumerate() {
            if st.row_of.get(&r.request_id) != Some(&row) {
                return Err(format!("request {} is not indexed at row {row}", r.request_id));
            }
            let n = blocks_for(r.num_tokens, self.block_size());
            let entries = &st.table[row * width..(row + 1) * width];
            if let Some(bad) =
                entries[..n].iter().find(|&&b| b < 0 || b as usize >= self.pool.num_blocks())
            {
                return Err(format!("request {} holds invalid block {bad}", r.request_id));
            }
            if entries[n..].iter().any(|&b| b != NULL_BLOCK) {
                return Err(format!("request {} has entries past its {n} blocks", r.request_id));
            }
            let mut sorted = entries[..n].to_vec();
            sorted.sort_unstable();
            if sorted.windows(2).any(|w| w[0] == w[1]) {
                return Err(format!("request {} holds a block twice", r.request_id));
            }
        }
        if st.table[st.rows.len() * width..].iter().any(|&b| b != NULL_BLOCK) {
            return Err("an unused row holds blocks".into());
        }
        self.check_hash_states(st)
    }
}

#[cfg(feature = "cuda")]
fn not_cuda() -> CoreError {
    CoreError::InvalidArgument("sync uploads to a GPU: the pool must be on a CUDA device".into())
}

impl TablesState {
    /// Rows in use: requests `0..num_rows` of the table.
    pub(crate) fn num_rows(&self) -> usize {
        self.rows.len()
    }
    /// seq_lens of rows `0..num_rows`, in row order.
    pub(crate) fn seq_lens(&self) -> impl Iterator<Item = i32> + '_ {
        self.rows.iter().map(|r| r.num_tokens as i32)
    }
    /// The row of `request_id`; `WrongTier` if a host tier holds it, else `UnknownRequest`.
    fn row(&self, request_id: u64) -> Result<usize, CoreError> {
        match self.row_of.get(&request_id) {
            Some(&row) => Ok(row),
            None if self.swapped_out.contains(&request_id) => Err(CoreError::WrongTier {
                request_id,
                tier: "host",
                operation: "use in the block tables",
            }),
            None => Err(CoreError::UnknownRequest { request_id }),
        }
    }
    /// Whether the id is taken: by a row, or by a request swapped out to a host tier.
    fn holds(&self, request_id: u64) -> bool {
        self.row_of.contains_key(&request_id) || self.swapped_out.contains(&request_id)
    }
    fn touch(&mut self, row: usize) {
        self.row_version[row] = self.next_version;
        self.next_version += 1;
    }
}

/// Dropping the tables drops every reference they hold: blocks held by no one else return to
/// the pool, so a scheduler that discards its tables leaks nothing.
impl Drop for BlockTables {
    fn drop(&mut self) {
        let block_size = self.block_size();
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let width = self.max_blocks_per_seq;
        for (row, r) in st.rows.iter().enumerate() {
            let n = blocks_for(r.num_tokens, block_size);
            let blocks: Vec<u32> = st.table[row * width..][..n].iter().map(|&b| b as u32).collect();
            // Cannot fail: a row's blocks are distinct and each holds our reference.
            let _ = self.pool.free_many_for(&blocks, Owner::Tables);
        }
    }
}

impl RefHolder for BlockTables {
    fn count_refs(&self, counts: &mut [u32]) {
        let st = self.lock();
        for row in 0..st.rows.len() {
            for &b in self.row_blocks(&st, row) {
                // A block past the end (freed behind the tables' back, then shrunk away) is
                // left out here; `check_invariants` reports it.
                if let Some(count) = counts.get_mut(b as usize) {
                    *count += 1;
                }
            }
        }
    }
}
