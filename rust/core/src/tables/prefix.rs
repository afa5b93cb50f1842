//! Prefix caching in the block tables.
//!
//! `add_request` hashes the prompt's full blocks, starts the request from the cached blocks
//! of its longest cached prefix (never the block of its last token: that token's logits
//! must be computed) and caches the other full blocks at once, as vLLM does: their KV is
//! written by the same forward pass that reads it, before any later step can. Appends that
//! carry token ids hash each block as it fills. Only full blocks are ever cached, so a
//! writer never writes into a cached block, and copy-on-write (which copies only a shared
//! partial block) never copies one.

use crate::error::CoreError;
use crate::prefix_cache::{BlockHash, FilledBlock, PrefixCache};
use crate::tables::{BlockTables, TablesState};

/// What besides the tokens decides a request's KV, and whose cache it may use.
#[derive(Debug, Clone, Copy, Default)]
pub struct PromptKey<'a> {
    /// Tenant isolation: a request hits only blocks cached under the same salt (or none).
    pub cache_salt: Option<&'a [u8]>,
    /// The LoRA adapter, if any (reported in KV events).
    pub lora_id: Option<u64>,
    /// Anything else the KV depends on (multimodal input hashes, ...), for every block.
    pub extra_keys: &'a [u8],
}

/// What `add_request` found and allocated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddResult {
    /// Prompt tokens whose KV is cached already (a multiple of block_size).
    pub num_cached_tokens: usize,
    /// Slots of the tokens still to compute, positions `num_cached_tokens..len`.
    pub slot_mapping: Vec<i64>,
}

/// The hash state of a request whose token ids are known: enough to hash its next block.
/// The tokens of its partly filled last block (`num_tokens % block_size` of them) are in
/// the tables' `pending_tokens`, at the row's slot.
#[derive(Debug, Clone)]
pub(crate) struct RowHashes {
    root: BlockHash,
    /// Hash of the last full block; `None` before the first.
    last: Option<BlockHash>,
    lora_id: Option<u64>,
}

impl BlockTables {
    /// Adds a request with its prompt's token ids. With prefix caching on the pool, the
    /// request starts from the cached blocks of its longest cached prefix and its other full
    /// blocks are cached; without, this is `add` with ids (later blocks are not hashed).
    pub fn add_request(
        &self,
        request_id: u64,
        token_ids: &[u32],
        key: &PromptKey<'_>,
    ) -> Result<AddResult, CoreError> {
        let num_tokens = token_ids.len();
        let Some(cache) = self.pool.prefix_cache() else {
            let slot_mapping = self.add(request_id, num_tokens)?;
            return Ok(AddResult { num_cached_tokens: 0, slot_mapping });
        };
        let bs = self.block_size();
        let mut st = self.lock();
        if st.holds(request_id) {
            return Err(CoreError::DuplicateRequest { request_id });
        }
        self.check_row_free(&st, request_id)?;
        let num_blocks = self.check_blocks_fit(request_id, num_tokens)?;
        let root = cache.hasher().root(key.cache_salt, key.lora_id, key.extra_keys);
        let hashes = cache.hasher().chain(&root, token_ids, bs);
        let max_hits = (num_tokens.saturating_sub(1) / bs).min(hashes.len());
        let alloc =
            self.pool.alloc_with_prefix(cache, &hashes[..max_hits], num_blocks, num_tokens)?;

        // Commit: nothing below can fail. Blocks swapped in from the host tier count as hits
        // (their KV is there) and are cached again like the fresh ones.
        let num_hits = alloc.hits.len();
        let num_cached = num_hits + alloc.swapped_in;
        let ids: Vec<u32> = alloc.hits.into_iter().chain(alloc.fresh).collect();
        let row = self.push_row(&mut st, request_id, num_tokens, &ids);
        let filled: Vec<FilledBlock> = (num_hits..hashes.len())
            .map(|i| FilledBlock {
                block_id: ids[i],
                hash: hashes[i],
                parent: i.checked_sub(1).map(|p| hashes[p]),
                tokens_at: i * bs,
                lora_id: key.lora_id,
            })
            .collect();
        cache.store(&filled, token_ids);
        let tail = &token_ids[hashes.len() * bs..];
        st.pending_tokens[row * bs..][..tail.len()].copy_from_slice(tail);
        st.hashes[row] =
            Some(RowHashes { root, last: hashes.last().copied(), lora_id: key.lora_id });
        let mut slot_mapping = Vec::with_capacity(num_tokens - num_cached * bs);
        self.extend_slots(&mut slot_mapping, &st, row, num_cached * bs, num_tokens);
        Ok(AddResult { num_cached_tokens: num_cached * bs, slot_mapping })
    }

    /// After an append committed (and copy-on-write released its sources, so each block
    /// being filled has one holder): hashes the blocks that the new tokens filled and caches
    /// them all under one acquisition of the cache's lock. `appended` is `(row, count)` in
    /// call order; `token_ids` all requests' new ids.
    pub(super) fn hash_appended(
        &self,
        st: &mut TablesState,
        cache: &PrefixCache,
        appended: impl Iterator<Item = (usize, usize)>,
        token_ids: Option<&[u32]>,
    ) {
        let bs = self.block_size();
        let width = self.max_blocks_per_seq;
        let mut filled = Vec::new();
        // The tokens of the filled blocks, `bs` per block in `filled`'s order.
        let mut filled_tokens = Vec::new();
        let mut offset = 0;
        for (row, count) in appended {
            let new_ids = token_ids.map(|ids| &ids[offset..offset + count]);
            offset += count;
            let Some(h) = st.hashes[row].as_mut() else { continue };
            let Some(new_ids) = new_ids else {
                // Tokens of unknown content: nothing after them can be hashed.
                if count > 0 {
                    st.hashes[row] = None;
                }
                continue;
            };
            // The row's partial block, in place: a decode step writes one token here and
            // hashes only when the block fills.
            let pending = &mut st.pending_tokens[row * bs..(row + 1) * bs];
            let mut pos = st.rows[row].num_tokens - count;
            let mut new_ids = new_ids;
            while !new_ids.is_empty() {
                let (at, take) = (pos % bs, (bs - pos % bs).min(new_ids.len()));
                pending[at..at + take].copy_from_slice(&new_ids[..take]);
                new_ids = &new_ids[take..];
                pos += take;
                if pos % bs != 0 {
                    break;
                }
                let parent = h.last;
                let hash = cache.hasher().block(&parent.unwrap_or(h.root), pending);
                h.last = Some(hash);
                let block_id = st.table[row * width + pos / bs - 1] as u32;
                filled.push(FilledBlock {
                    block_id,
                    hash,
                    parent,
                    tokens_at: filled_tokens.len(),
                    lora_id: h.lora_id,
                });
                filled_tokens.extend_from_slice(pending);
            }
        }
        if !filled.is_empty() {
            cache.store(&filled, &filled_tokens);
        }
    }

    /// Every row has a hash slot; a tracked row's state matches its token count.
    pub(super) fn check_hash_states(&self, st: &TablesState) -> Result<(), String> {
        if st.hashes.len() != st.rows.len() {
            return Err(format!("{} hash states for {} rows", st.hashes.len(), st.rows.len()));
        }
        let bs = self.block_size();
        for (r, h) in st.rows.iter().zip(&st.hashes) {
            let Some(h) = h else { continue };
            if h.last.is_some() != (r.num_tokens >= bs) {
                return Err(format!(
                    "request {}: last hash {:?} for {} tokens",
                    r.request_id, h.last, r.num_tokens
                ));
            }
        }
        Ok(())
    }
}
