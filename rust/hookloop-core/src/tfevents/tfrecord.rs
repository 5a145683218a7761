//! TFRecord framing: each record is its length, a masked CRC32C of the length, the data and
//! a masked CRC32C of the data.

/// TFRecord's masked CRC32C: the checksum rotated right by 15 bits plus a constant, so
/// that a CRC of data that itself holds CRCs stays well distributed.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Appends one TFRecord to `out`: u64 LE length, u32 LE masked CRC of those 8 bytes,
/// `data`, u32 LE masked CRC of `data`.
pub fn append_record(out: &mut Vec<u8>, data: &[u8]) {
    // usize is at most 64 bits on every target Rust supports, so this never truncates.
    let len = (data.len() as u64).to_le_bytes();
    out.reserve(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
}
