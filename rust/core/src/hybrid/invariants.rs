//! `HybridTables::check_invariants`: the tables' and the slab's bookkeeping as equations.

use rustc_hash::FxHashMap;

use crate::hybrid::tables::HybridTables;

impl HybridTables {
    /// Checks, with `refs(b)` the references all tables of all requests hold to page `b`
    /// and `live(r, g)` the pages request `r` keeps for group `g`
    /// ([`ModelKvSpec::live_pages`](crate::hybrid::ModelKvSpec::live_pages)):
    ///
    /// ```text
    /// row_of[ids[r]] == r                          the request map's rows (`request_map.rs`)
    /// table(r, g) covers exactly live(r, g)        first page and length, every group
    /// refs(b) == ref_cnt(b)                        for every page b of the slab
    /// a page is held by one group only, at most once per table
    /// num_free + num_evictable + num_used == num_blocks   and the pool's own invariants
    /// num_used == #{b : refs(b) > 0}
    /// quiet_until(r) is 0, <= num_tokens(r), or <= what r's pages allow now
    /// ```
    ///
    /// and with prefix caching (`prefix.rs`):
    ///
    /// ```text
    /// a cached page held by a table is cached for that table's group
    /// a cached page no table holds has ref_cnt 0 (evictable); the pool caches exactly them
    /// a cached page is tagged Owner::HybridTables (held or evictable)
    /// every key maps to a page that lists it, and back
    /// num_free + sum over groups (used_g + evictable_g) == num_blocks
    /// ```
    ///
    /// Exact while the tables are the pool's only user and no other thread uses it.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.requests.check()?;
        let pool = self.pool();
        pool.check_invariants()?;
        let num_blocks = pool.num_blocks();
        if pool.num_free() + pool.num_evictable() + pool.num_used() != num_blocks {
            return Err(format!(
                "num_free {} + num_evictable {} + num_used {} != num_blocks {num_blocks}",
                pool.num_free(),
                pool.num_evictable(),
                pool.num_used()
            ));
        }
        let mut refs = vec![0u32; num_blocks];
        let mut group_of: FxHashMap<u32, usize> = FxHashMap::default();
        for (request_id, num_tokens, next_query) in self.positions() {
            for group in 0..self.spec().num_groups() {
                let table = self.table(request_id, group).map_err(|e| e.to_string())?;
                let live = self
                    .spec()
                    .live_pages(group, num_tokens, next_query)
                    .map_err(|e| e.to_string())?;
                if table.first_page != live.start || table.page_ids.len() != live.len() {
                    return Err(format!(
                        "request {request_id} group {group}: the table holds pages {}..{}, its \
                         live tokens need {live:?}",
                        table.first_page,
                        table.first_page + table.page_ids.len()
                    ));
                }
                for &page in table.page_ids {
                    let count = refs.get_mut(page as usize).ok_or_else(|| {
                        format!("request {request_id} group {group}: page {page} is out of range")
                    })?;
                    *count += 1;
                    if let Some(other) = group_of.insert(page, group) {
                        if other != group {
                            return Err(format!(
                                "page {page} is held by groups {other} and {group}"
                            ));
                        }
                    }
                }
                let mut sorted = table.page_ids.to_vec();
                sorted.sort_unstable();
                if sorted.windows(2).any(|w| w[0] == w[1]) {
                    return Err(format!(
                        "request {request_id} group {group}: a page appears twice"
                    ));
                }
            }
        }
        let mut held = 0;
        for (page, &count) in refs.iter().enumerate() {
            let ref_cnt = pool.ref_cnt(page as u32).map_err(|e| e.to_string())?;
            if count != ref_cnt {
                return Err(format!(
                    "page {page}: tables hold {count} references, ref_cnt {ref_cnt}"
                ));
            }
            held += (count > 0) as usize;
        }
        if held != pool.num_used() {
            return Err(format!("tables hold {held} pages, the pool has {} used", pool.num_used()));
        }
        self.check_quiet_until()?;
        self.check_prefix_invariants(&group_of)
    }
}
