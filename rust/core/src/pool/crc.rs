//! The CRC-32C function itself, apart from the pool so that the eviction stage
//! (`evicted.rs`) can checksum what it copies without importing the pool (the core's module
//! graph stays acyclic: `pool -> evicted -> crc`). Why CRC-32C and why `crc-fast`:
//! `checksum.rs`.

/// The CRC-32C (Castagnoli, the iSCSI CRC: reflected, initial value and final XOR all ones)
/// of `bytes`.
pub(crate) fn crc32c(bytes: &[u8]) -> u32 {
    // CRC-32/ISCSI is 32 bits wide: the crate returns it in the low half of a u64.
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, bytes) as u32
}

#[cfg(test)]
mod tests {
    use super::crc32c;

    #[test]
    fn crc32c_matches_the_check_values() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283); // RFC 3720's check value
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c(&[0; 32]), 0x8A91_36AA); // RFC 3720 B.4: 32 bytes of zeros
        assert_eq!(crc32c(&[0xFF; 32]), 0x62A8_AB43); // and of ones
    }
}
