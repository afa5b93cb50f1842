//! Content hashes of full blocks: each block's hash chains its parent's, so equal hashes
//! mean equal token prefixes (under the same salt and extra keys).
//!
//! Keyed BLAKE3 with a random per-pool key: without the key nobody outside the process can
//! predict a hash, so nobody can forge a block that collides with another tenant's prefix.

use std::borrow::Cow;

use crate::error::CoreError;

/// 256 bits of keyed BLAKE3: collisions are out of reach, so a map hit is a content match.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for byte in &self.0[..8] {
            write!(f, "{byte:02x}")?;
        }
        f.write_str("..")
    }
}

/// Hashes the chain of one pool. The key never leaves this struct.
pub struct BlockHasher {
    key: [u8; 32],
}

/// Domain tag of the roots (block hashes are keyed by their parent, not the pool key).
const ROOT_TAG: &[u8] = b"kvpool.prefix_cache.root.v1";

impl BlockHasher {
    /// A hasher with a fresh key from the operating system's random source.
    pub fn new_random() -> Result<Self, CoreError> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| {
            CoreError::InvalidArgument(format!("no random source for the prefix-cache key: {e}"))
        })?;
        Ok(BlockHasher { key })
    }

    /// A hasher with a fixed key (tests that need hashes to repeat).
    pub fn with_key(key: [u8; 32]) -> Self {
        BlockHasher { key }
    }

    /// Where one request's chain starts. Everything besides the tokens that decides the KV
    /// goes in here, so every block of the request depends on it: the tenant's `cache_salt`
    /// (a request never hits a block cached under another salt, or under none), the LoRA
    /// adapter and the extra key bytes (multimodal input hashes, anything else). Lengths are
    /// hashed too, so no two different inputs share a byte stream.
    pub fn root(
        &self,
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
        extra_keys: &[u8],
    ) -> BlockHash {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(ROOT_TAG);
        match cache_salt {
            None => {
                h.update(&[0]);
            }
            Some(salt) => {
                h.update(&[1]);
                h.update(&(salt.len() as u64).to_le_bytes());
                h.update(salt);
            }
        }
        match lora_id {
            None => h.update(&[0]),
            Some(id) => h.update(&[1]).update(&id.to_le_bytes()),
        };
        h.update(&(extra_keys.len() as u64).to_le_bytes());
        h.update(extra_keys);
        BlockHash(*h.finalize().as_bytes())
    }

    /// The hash of a full block of `tokens` whose predecessor hashed to `parent` (the root
    /// for a request's first block): BLAKE3 keyed by the parent hash, over the tokens'
    /// little-endian bytes. The chain stays secret-keyed (it starts at a root only the pool
    /// key can make), and 16 tokens are one 64-byte compression.
    pub fn block(&self, parent: &BlockHash, tokens: &[u32]) -> BlockHash {
        BlockHash(*blake3::keyed_hash(&parent.0, &le_bytes(tokens)).as_bytes())
    }

    /// Hashes of the full blocks of `tokens` (a trailing partial block is left out), chained
    /// from `parent`.
    pub fn chain(&self, parent: &BlockHash, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
        let mut hashes = Vec::with_capacity(tokens.len() / block_size);
        let mut parent = *parent;
        for block in tokens.chunks_exact(block_size) {
            parent = self.block(&parent, block);
            hashes.push(parent);
        }
        hashes
    }
}

/// The tokens' little-endian bytes, read in place (no copy: the hash of a 4096-token prompt
/// is on the hot path of every add).
#[cfg(target_endian = "little")]
fn le_bytes(tokens: &[u32]) -> Cow<'_, [u8]> {
    // SAFETY: u32 has no padding bytes, so all `4 * len` bytes behind the pointer are
    // initialised; u8 needs no alignment; the slice borrows `tokens` for its lifetime. On a
    // little-endian target these bytes are exactly each token's `to_le_bytes()`.
    Cow::Borrowed(unsafe {
        std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens))
    })
}

#[cfg(target_endian = "big")]
fn le_bytes(tokens: &[u32]) -> Cow<'_, [u8]> {
    Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_every_input() {
        let h = BlockHasher::with_key([7; 32]);
        let root = h.root(None, None, b"");
        let tokens: Vec<u32> = (0..8).collect();
        let base = h.chain(&root, &tokens, 4);
        assert_eq!(base.len(), 2);
        assert_eq!(base, h.chain(&root, &tokens[..], 4), "deterministic for one key");
        // A changed token changes its block and every block after it, not those before.
        let mut other = tokens.clone();
        other[5] = 99;
        let changed = h.chain(&root, &other, 4);
        assert_eq!(changed[0], base[0]);
        assert_ne!(changed[1], base[1]);
        // Salt, extra keys and key each isolate.
        for root2 in [
            h.root(Some(b"a"), None, b""),
            h.root(Some(b""), None, b""),
            h.root(None, Some(0), b""),
            h.root(None, None, b"x"),
        ] {
            assert_ne!(root2, root);
            assert_ne!(h.chain(&root2, &tokens, 4)[0], base[0]);
        }
        assert_ne!(
            h.root(Some(b"a"), None, b"b"),
            h.root(Some(b"ab"), None, b""),
            "lengths separate salt from extra keys"
        );
        let h2 = BlockHasher::with_key([8; 32]);
        assert_ne!(h2.chain(&h2.root(None, None, b""), &tokens, 4), base);
        // A trailing partial block is not hashed.
        assert_eq!(h.chain(&root, &tokens[..7], 4).len(), 1);
    }

    #[test]
    fn block_hashes_the_tokens_little_endian_bytes() {
        let h = BlockHasher::with_key([3; 32]);
        let parent = h.root(None, None, b"");
        let tokens = [1u32, 0x0102_0304, u32::MAX, 7];
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(h.block(&parent, &tokens).0, *blake3::keyed_hash(&parent.0, &bytes).as_bytes());
    }

    #[test]
    fn random_keys_differ() {
        let a = BlockHasher::new_random().unwrap();
        let b = BlockHasher::new_random().unwrap();
        assert_ne!(a.root(None, None, b""), b.root(None, None, b""));
    }
}
