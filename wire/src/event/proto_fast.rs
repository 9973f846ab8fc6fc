//! The protobuf hot path: a hand-written reader that turns one `CacheEvent` (or a
//! `CacheEventBatch` of them) straight into [`Event`]s.
//!
//! prost decodes into owned intermediate messages (a copy of the payload, a `Vec` grown one
//! token at a time through its generic field merge) which [`from_pb`](super::proto::from_pb)
//! then converts; at 256 token ids per event that dominated the decode bench. This reader
//! borrows strings and bytes from the payload, decodes packed `token_ids` in one tight loop into
//! an exactly sized vector, and shares the final mapping
//! ([`EventFields::into_event`]) with the prost path.
//!
//! # Same behaviour as prost
//!
//! It accepts only what prost accepts and reads it to the same values (last occurrence wins for
//! singular fields, repeated fields append, `token_ids` packed or not, integers truncated like
//! prost's `as` casts, unknown fields skipped). It does not try to *reject* anything itself:
//! whatever is unusual (a malformed or truncated field, a wrong wire type, a group, invalid
//! UTF-8, a field-number-0 key, an event that fails conversion) makes it return `None`, and
//! [`decode`](super::proto::decode) decodes the body again with prost, so every error keeps its
//! exact kind and message.

use super::Event;
use super::proto::EventFields;

/// `CacheEventBatch.events`.
const BATCH_EVENTS: u32 = 1;

/// Protobuf wire types this reader handles (3 and 4, the deprecated groups, are left to prost).
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

/// Reads a `CacheEventBatch` body; `None` means "let prost decide".
pub(super) fn decode_batch(buf: &[u8]) -> Option<Vec<Event>> {
    let mut events = Vec::with_capacity(count_batch_events(buf)?);
    let mut w = Wire::new(buf);
    while !w.is_empty() {
        match w.key()? {
            (BATCH_EVENTS, LEN) => events.push(decode_event(w.len_delimited()?)?),
            (BATCH_EVENTS, _) => return None,
            (_, wire_type) => w.skip(wire_type)?,
        }
    }
    Some(events)
}

/// How many `events` a batch body holds (a cheap pass over the keys, so the result vector is
/// allocated once).
fn count_batch_events(buf: &[u8]) -> Option<usize> {
    let mut w = Wire::new(buf);
    let mut n = 0;
    while !w.is_empty() {
        let (field, wire_type) = w.key()?;
        n += usize::from(field == BATCH_EVENTS);
        w.skip(wire_type)?;
    }
    Some(n)
}

/// Reads one `CacheEvent` message body and converts it; `None` means "let prost decide".
pub(super) fn decode_event(buf: &[u8]) -> Option<Event> {
    let mut f = EventFields::<&str>::default();
    let mut w = Wire::new(buf);
    while !w.is_empty() {
        let (field, wire_type) = w.key()?;
        read_field(&mut w, &mut f, field, wire_type)?;
    }
    f.into_event().ok()
}

/// Reads one field of a `CacheEvent` (its key already read) into `f`. The integer casts are
/// prost's: enums and `int64` reinterpret the varint's bits, `uint32` keeps its low 32 bits.
#[allow(clippy::cast_possible_truncation)]
fn read_field<'a>(
    w: &mut Wire<'a>,
    f: &mut EventFields<'a, &'a str>,
    field: u32,
    wire_type: u8,
) -> Option<()> {
    match (field, wire_type) {
        (1, VARINT) => f.r#type = w.varint()? as i32,
        (2, LEN) => f.replica_id = w.utf8()?,
        (3, LEN) => f.model_id = w.utf8()?,
        (4, LEN) => f.tenant_id = w.utf8()?,
        (5, LEN) => f.prefix_hash = w.len_delimited()?,
        (6, VARINT) => f.timestamp_us = w.varint()? as i64,
        (7, LEN) => f.adapter_id = w.utf8()?,
        (8, VARINT) => f.adapter_scoped = w.varint()? != 0,
        (9, LEN) => f.block_hashes.push(w.len_delimited()?),
        (10, LEN) => f.parent_hash = w.len_delimited()?,
        (11, LEN) => packed_u32(w.len_delimited()?, &mut f.token_ids)?,
        (11, VARINT) => f.token_ids.push(w.varint()? as u32),
        (12, VARINT) => f.block_size = w.varint()? as u32,
        (13, VARINT) => f.tier = w.varint()? as i32,
        (14, VARINT) => f.seq = w.varint()?,
        (15, VARINT) => f.dp_rank = w.varint()? as u32,
        // Per-block extra keys are rare: prost reads them. A known field with the wrong wire
        // type is prost's error.
        (1..=16, _) => return None,
        (_, wire_type) => w.skip(wire_type)?,
    }
    Some(())
}

/// Appends the packed varints of `data` to `out`, each truncated to 32 bits as prost does.
///
/// Every varint ends in exactly one byte below 0x80, so counting those bytes sizes `out`
/// exactly; the decode loop then fills pre-sized slots (no capacity check per token).
#[allow(clippy::cast_possible_truncation)]
fn packed_u32(data: &[u8], out: &mut Vec<u32>) -> Option<()> {
    if data.last().is_some_and(|&b| b >= 0x80) {
        return None; // The last varint runs past the field: prost's error.
    }
    let start = out.len();
    out.resize(start.checked_add(count_varints(data))?, 0);
    let rest = fill_u32(data, out.get_mut(start..)?)?;
    rest.is_empty().then_some(())
}

/// Decodes one varint per slot from the front of `data`, each truncated to 32 bits; returns
/// the bytes left over.
///
/// Token ids are 1 to 3 bytes (vocabularies below 2^21), decoded by explicit cases on one
/// 8-byte load; longer values go through [`u32_in_word`], and the last few varints of the
/// field (fewer than 8 bytes left) through the byte-at-a-time [`varint_at`]. The branches are
/// deliberate: a fully branch-free decode chains every token's position on the previous
/// token's length (load → mask → count → add, ~10 cycles a token) and measured half as fast,
/// even on payloads of random token ids where the length branches do mispredict.
#[allow(clippy::cast_possible_truncation)]
fn fill_u32<'a>(data: &'a [u8], slots: &mut [u32]) -> Option<&'a [u8]> {
    let mut pos = 0;
    let mut filled = 0;
    for slot in slots.iter_mut() {
        let Some(word) = data.get(pos..).and_then(|rest| rest.first_chunk::<8>()) else {
            break;
        };
        let (value, len) = match *word {
            [b0, ..] if b0 < 0x80 => (u32::from(b0), 1),
            [b0, b1, ..] if b1 < 0x80 => (u32::from(b0 & 0x7f) | u32::from(b1) << 7, 2),
            [b0, b1, b2, ..] if b2 < 0x80 => (
                u32::from(b0 & 0x7f) | u32::from(b1 & 0x7f) << 7 | u32::from(b2) << 14,
                3,
            ),
            _ => match u32_in_word(u64::from_le_bytes(*word)) {
                Some(decoded) => decoded,
                None => break, // Longer than 8 bytes: leave it to `varint_at`.
            },
        };
        *slot = value;
        pos += len;
        filled += 1;
    }
    for slot in slots.get_mut(filled..)? {
        let (value, len) = varint_at(data.get(pos..)?)?;
        *slot = value as u32;
        pos += len;
    }
    data.get(pos..)
}

/// [`varint_in_word`] for a `uint32` field: the low 32 bits of the value (prost's truncation)
/// need only the first five 7-bit groups, which saves most of the bit shuffling.
#[inline(always)]
#[allow(clippy::cast_possible_truncation)]
fn u32_in_word(word: u64) -> Option<(u32, usize)> {
    let stops = !word & 0x8080_8080_8080_8080;
    if stops == 0 {
        return None;
    }
    let len = (stops.trailing_zeros() / 8 + 1) as usize;
    let x = word & (stops ^ (stops - 1)) & 0x7f_7f7f_7f7f;
    let value = (x & 0x7f)
        | (x >> 1 & 0x3f80)
        | (x >> 2 & 0x1f_c000)
        | (x >> 3 & 0xfe0_0000)
        | (x >> 4 & 0x7_f000_0000);
    Some((value as u32, len))
}

/// How many varints `data` holds: one per byte below 0x80. Counts in `u8` lanes over chunks
/// of at most 255 bytes (no lane can overflow), a loop the compiler vectorizes.
fn count_varints(data: &[u8]) -> usize {
    data.chunks(255)
        .map(|chunk| usize::from(chunk.iter().fold(0u8, |n, &b| n + (!b >> 7))))
        .sum()
}

/// Decodes the varint at the start of `word` (the next 8 payload bytes, little-endian):
/// its value and length, or `None` if it is longer than 8 bytes. Branch-free, so a mix of 2-
/// and 3-byte token ids costs no mispredictions.
#[inline(always)]
fn varint_in_word(word: u64) -> Option<(u64, usize)> {
    let stops = !word & 0x8080_8080_8080_8080;
    if stops == 0 {
        return None;
    }
    let len = (stops.trailing_zeros() / 8 + 1) as usize;
    // The varint's bytes (up to and including the lowest stop bit), payload bits only.
    let mut x = word & (stops ^ (stops - 1)) & 0x7f7f_7f7f_7f7f_7f7f;
    // Squeeze out the gaps: 7-bit groups → 14 → 28 → 56 contiguous bits.
    x = (x & 0x007f_007f_007f_007f) | ((x & 0x7f00_7f00_7f00_7f00) >> 1);
    x = (x & 0x0000_3fff_0000_3fff) | ((x & 0x3fff_0000_3fff_0000) >> 2);
    x = (x & 0x0000_0000_0fff_ffff) | ((x & 0x0fff_ffff_0000_0000) >> 4);
    Some((x, len))
}

/// Any varint at the front of `bytes`, as prost reads it: at most 10 bytes, the 10th holding
/// only bit 63 (0 or 1). Returns the value and its length.
#[cold]
#[inline(never)]
fn varint_at(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut value = 0u64;
    for (i, &b) in bytes.iter().take(10).enumerate() {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b < 0x80 {
            return (i < 9 || b <= 1).then_some((value, i + 1));
        }
    }
    None
}

/// A cursor over protobuf wire data. Every read is bounds-checked and returns `None` on
/// anything prost would reject.
struct Wire<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Wire<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Wire { buf, pos: 0 }
    }

    fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    /// A varint: one-byte values directly, up to 8 bytes from one word load, longer ones (and
    /// the last few bytes of the buffer) in [`varint_at`].
    #[inline(always)]
    fn varint(&mut self) -> Option<u64> {
        let rest = self.buf.get(self.pos..)?;
        if let Some(&b) = rest.first()
            && b < 0x80
        {
            self.pos += 1;
            return Some(u64::from(b));
        }
        let (value, len) = rest
            .first_chunk::<8>()
            .and_then(|word| varint_in_word(u64::from_le_bytes(*word)))
            .or_else(|| varint_at(rest))?;
        self.pos += len;
        Some(value)
    }

    /// A field key as prost's `decode_key` accepts it: fits in 32 bits, field number ≥ 1.
    fn key(&mut self) -> Option<(u32, u8)> {
        let key = u32::try_from(self.varint()?).ok()?;
        let field = key >> 3;
        (field != 0).then_some((field, (key & 7) as u8))
    }

    /// A length-delimited field's bytes.
    fn len_delimited(&mut self) -> Option<&'a [u8]> {
        let len = usize::try_from(self.varint()?).ok()?;
        self.advance(len)
    }

    /// A `string` field (prost rejects invalid UTF-8).
    fn utf8(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.len_delimited()?).ok()
    }

    /// The next `n` bytes.
    fn advance(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let out = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(out)
    }

    /// Skips an unknown field's value (groups are left to prost).
    fn skip(&mut self, wire_type: u8) -> Option<()> {
        match wire_type {
            VARINT => self.varint().map(drop),
            FIXED64 => self.advance(8).map(drop),
            LEN => self.len_delimited().map(drop),
            FIXED32 => self.advance(4).map(drop),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Encodes `v` as a canonical varint.
    fn encode(mut v: u64) -> Vec<u8> {
        let mut out = Vec::new();
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
        out
    }

    fn sample_values() -> Vec<u64> {
        let mut vals = vec![
            0,
            1,
            127,
            128,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ];
        vals.extend((0..64).map(|b| 1u64 << b));
        vals.extend((1..64).map(|b| (1u64 << b) - 1));
        vals
    }

    #[test]
    fn varint_at_follows_prost_limits() {
        for v in sample_values() {
            let bytes = encode(v);
            assert_eq!(varint_at(&bytes), Some((v, bytes.len())), "{v}");
        }
        let mut ten = vec![0xff; 9];
        ten.push(0x01);
        assert_eq!(varint_at(&ten), Some((u64::MAX, 10)));
        *ten.last_mut().unwrap() = 0x02;
        assert_eq!(varint_at(&ten), None, "10th byte may only hold bit 63");
        assert_eq!(varint_at(&[0x80; 11]), None, "more than 10 bytes");
        assert_eq!(varint_at(&[0x80, 0x80]), None, "cut short");
        assert_eq!(
            varint_at(&[0x80, 0x00]),
            Some((0, 2)),
            "non-canonical is fine"
        );
    }

    #[test]
    fn word_decoders_agree_with_varint_at() {
        for v in sample_values() {
            let mut bytes = encode(v);
            bytes.resize(bytes.len().max(8), 0x55);
            let word = u64::from_le_bytes(*bytes.first_chunk::<8>().unwrap());
            let reference = varint_at(&bytes);
            let len = reference.unwrap().1;
            let expect = (len <= 8).then_some(reference).flatten();
            assert_eq!(varint_in_word(word), expect, "{v}");
            assert_eq!(u32_in_word(word), expect.map(|(v, n)| (v as u32, n)), "{v}");
        }
    }

    #[test]
    fn packed_u32_truncates_and_checks_the_end() {
        let values = [0u64, 300, 2_000_000, u64::from(u32::MAX) + 5, u64::MAX, 7];
        let packed: Vec<u8> = values.iter().flat_map(|&v| encode(v)).collect();
        let mut out = vec![9];
        assert_eq!(packed_u32(&packed, &mut out), Some(()));
        let want: Vec<u32> = std::iter::once(9)
            .chain(values.iter().map(|&v| v as u32))
            .collect();
        assert_eq!(out, want);
        assert_eq!(count_varints(&packed), values.len());
        assert_eq!(packed_u32(&[0x01, 0x81], &mut Vec::new()), None);
        let long: Vec<u8> = (0..1000).flat_map(|i| encode(i * 977)).collect();
        assert_eq!(count_varints(&long), 1000);
    }
}
