//! The fast path of the lookup body parser: a hand-written scanner for the body every router
//! sends (`{"model": "..", "tenant": "..", "adapter": "..", "token_ids": [..], "limit": 8}`).
//!
//! A long prompt's `token_ids` is most of a lookup body, and reading it through serde costs a
//! trait call per element (a third of the server's CPU under `kvindex bench http`). This
//! scanner reads the array in one tight loop instead.
//!
//! It is an *accelerator*, not a second parser with its own rules: it accepts only a strict
//! subset of JSON (known fields, plain strings without escapes, non-negative integers, `null`)
//! and gives up (`None`) on anything else: an escape, an unknown or repeated field, a number
//! out of range, a float, a syntax error. The caller then parses the body with the complete
//! serde parser, which owns every error message. Where it does answer, it answers exactly what
//! the serde parser would (the service's `tests/decode/lookup_body.rs` holds the two together
//! on random bodies, and the `lookup_body` fuzz target on fuzzed ones).

use super::{BlockSize, Field, FromJson, Limit, List, MAX_QUERY_TOKENS, RawLookup, Scalar};

/// Reads `body` as a [`RawLookup`], or `None` when it is not in the subset this path reads.
pub(super) fn parse(body: &[u8]) -> Option<RawLookup> {
    let mut s = Scanner { b: body, i: 0 };
    let mut raw = RawLookup::default();
    let mut seen = 0u8;
    s.skip_ws();
    s.eat(b'{')?;
    s.skip_ws();
    if s.peek() == Some(b'}') {
        s.i += 1;
    } else {
        loop {
            let key = s.plain_str()?;
            s.skip_ws();
            s.eat(b':')?;
            s.skip_ws();
            let bit = match key {
                "model" => {
                    raw.model = Scalar(s.string_or_null()?);
                    1
                }
                "tenant" => {
                    raw.tenant = Scalar(s.string_or_null()?);
                    2
                }
                "adapter" => {
                    raw.adapter = Scalar(s.string_or_null()?);
                    4
                }
                "token_ids" => {
                    raw.token_ids = List(s.tokens_or_null()?);
                    8
                }
                "block_size" => {
                    raw.block_size = Scalar(s.uint_or_null::<BlockSize>()?);
                    16
                }
                "limit" => {
                    raw.limit = Scalar(s.uint_or_null::<Limit>()?);
                    32
                }
                _ => return None,
            };
            if seen & bit != 0 {
                return None; // a repeated field is serde's error to word
            }
            seen |= bit;
            s.skip_ws();
            match s.next()? {
                b',' => s.skip_ws(),
                b'}' => break,
                _ => return None,
            }
        }
    }
    s.skip_ws();
    (s.i == body.len()).then_some(raw)
}

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }

    /// JSON's insignificant whitespace (exactly these four bytes).
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    /// `null`, consumed.
    fn null(&mut self) -> bool {
        let is_null = self.b[self.i..].starts_with(b"null");
        if is_null {
            self.i += 4;
        }
        is_null
    }

    /// A string without escapes or control characters, valid UTF-8.
    fn plain_str(&mut self) -> Option<&'a str> {
        self.eat(b'"')?;
        let rest = &self.b[self.i..];
        let len = rest
            .iter()
            .position(|&c| c == b'"' || c == b'\\' || c < 0x20)?;
        if rest[len] != b'"' {
            return None;
        }
        let s = std::str::from_utf8(&rest[..len]).ok()?;
        self.i += len + 1;
        Some(s)
    }

    fn string_or_null(&mut self) -> Option<Field<String>> {
        if self.null() {
            return Some(Field::Absent);
        }
        self.plain_str().map(|s| Field::Valid(s.to_string()))
    }

    /// A non-negative integer of at most 19 digits, without sign, fraction or exponent (callers
    /// then expect a separator, so `1.5` or `1e3` fails at its `.` or `e`).
    fn uint(&mut self) -> Option<u64> {
        let (b, start) = (self.b, self.i);
        let mut i = start;
        let mut v = 0u64;
        while let Some(&c) = b.get(i) {
            let digit = c.wrapping_sub(b'0');
            if digit > 9 {
                break;
            }
            v = v.wrapping_mul(10).wrapping_add(u64::from(digit));
            i += 1;
        }
        let digits = i - start;
        // No digits, a leading zero (`01` is not JSON), or more than a u64 surely holds (no
        // count, size or token id has that many: the general parser words the error).
        if digits == 0 || digits > 19 || (digits > 1 && b[start] == b'0') {
            return None;
        }
        self.i = i;
        Some(v)
    }

    /// [`Scanner::uint`], reading a number of at most 7 digits as one 8-byte word (SWAR: the
    /// digit test and the decimal conversion of all 8 bytes at once, no loop). Numbers of 8
    /// or more digits, a leading zero, no digit, and the body's last 7 bytes go through
    /// [`Scanner::uint`], so the answer is always exactly its answer.
    #[inline]
    fn uint_word(&mut self) -> Option<u64> {
        const HIGH_NIBBLES: u64 = 0xF0F0_F0F0_F0F0_F0F0;
        const ZEROS: u64 = 0x3030_3030_3030_3030; // b'0' in every byte
        let Some(word) = self.b.get(self.i..self.i + 8) else {
            return self.uint();
        };
        let w = u64::from_le_bytes(word.try_into().ok()?);
        // A byte is a digit iff its high nibble is 3, and still is after adding 6 (0x3a..=0x3f
        // become 0x40..). A carry out of a byte can only upset the bytes after the first
        // non-digit, and only the first non-digit is used.
        let not_digit = ((w & HIGH_NIBBLES) ^ ZEROS)
            | ((w.wrapping_add(0x0606_0606_0606_0606) & HIGH_NIBBLES) ^ ZEROS);
        let digits = (not_digit.trailing_zeros() / 8) as usize; // 8 when all eight are digits
        if digits == 0 || digits == 8 || (digits > 1 && word[0] == b'0') {
            return self.uint(); // it reads or rejects these (and reads on past 8 digits)
        }
        // Digit values into the top `digits` bytes (a borrow from a non-digit only reaches
        // the bytes after it, which the shift drops); the zero bytes below are leading zeros.
        let values = w.wrapping_sub(ZEROS) << (8 * (8 - digits));
        self.i += digits;
        Some(eight_digits(values))
    }

    fn uint_or_null<T: FromJson>(&mut self) -> Option<Field<T>> {
        if self.null() {
            return Some(Field::Absent);
        }
        let v = self.uint()?;
        Some(T::from_u64(v).map_or(Field::Invalid(None), Field::Valid))
    }

    /// `token_ids`: an array of `u32`, at most [`MAX_QUERY_TOKENS`] long, or `null`.
    fn tokens_or_null(&mut self) -> Option<Field<Vec<u32>>> {
        if self.null() {
            return Some(Field::Absent);
        }
        self.eat(b'[')?;
        self.skip_ws();
        let mut out = Vec::new();
        if self.peek() == Some(b']') {
            self.i += 1;
            return Some(Field::Valid(out));
        }
        // Each element takes at least two bytes (a digit and a separator).
        out.reserve((self.b.len() - self.i).min(2 * MAX_QUERY_TOKENS) / 2);
        loop {
            let v = self.uint_word()?;
            if out.len() == MAX_QUERY_TOKENS {
                return None;
            }
            out.push(u32::try_from(v).ok()?);
            self.skip_ws();
            match self.next()? {
                b',' => self.skip_ws(),
                b']' => break,
                _ => return None,
            }
        }
        Some(Field::Valid(out))
    }
}

/// The number spelled by 8 digit values, one per byte, the first (most significant) in the
/// lowest byte: pairs of digits, then both pairs of pairs, each step one multiply.
#[inline(always)]
fn eight_digits(values: u64) -> u64 {
    const LOW_BYTES: u64 = 0x0000_00FF_0000_00FF; // bytes 0 and 4
    // Every even byte: 10 × its digit + the next digit (a two-digit pair, at most 99).
    let pairs = values.wrapping_mul(10).wrapping_add(values >> 8);
    // Pairs p0..p3 sit in bytes 0, 2, 4, 6: the high half of the sum below is
    // p0·10⁶ + p2·10² (from bytes 0 and 4) + p1·10⁴ + p3 (from bytes 2 and 6).
    let outer = (pairs & LOW_BYTES).wrapping_mul(100 + (1_000_000 << 32));
    let inner = ((pairs >> 16) & LOW_BYTES).wrapping_mul(1 + (10_000 << 32));
    outer.wrapping_add(inner) >> 32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What [`Scanner::uint`] reads from `text` (value, bytes consumed), after checking that
    /// [`Scanner::uint_word`] reads exactly the same.
    fn scan(text: &str) -> (Option<u64>, usize) {
        scan_bytes(text.as_bytes())
    }

    fn scan_bytes(text: &[u8]) -> (Option<u64>, usize) {
        let read = |word: bool| {
            let mut s = Scanner { b: text, i: 0 };
            let v = if word { s.uint_word() } else { s.uint() };
            (v, if v.is_some() { s.i } else { 0 })
        };
        let scalar = read(false);
        assert_eq!(read(true), scalar, "uint_word against uint on {text:?}");
        scalar
    }

    #[test]
    fn reads_integers_up_to_ten_million_with_any_follower() {
        for n in (0..10_000_000u64)
            .step_by(7)
            .chain([9_999_999, 1_000_000, 10])
        {
            let digits = n.to_string();
            for follower in [",1,2,3,4,5,6,7", "]}", "", " ,", "\u{ff}x"] {
                assert_eq!(
                    scan(&format!("{digits}{follower}")),
                    (Some(n), digits.len()),
                    "{digits}{follower}"
                );
            }
        }
    }

    #[test]
    fn long_and_malformed_numbers() {
        assert_eq!(scan("12345678,").0, Some(12_345_678));
        assert_eq!(scan("4294967296]").0, Some(4_294_967_296));
        assert_eq!(
            scan("1234567890123456789,").0,
            Some(1_234_567_890_123_456_789)
        );
        assert_eq!(scan("12345678901234567890,").0, None);
        for bad in ["01,", "00", "0123456789", ",1", "-1,", "", "a1"] {
            assert_eq!(scan(bad).0, None, "{bad}");
        }
        assert_eq!(scan("0,00000000").0, Some(0));
        assert_eq!(scan("1.5,").0, Some(1));
    }

    #[test]
    fn the_word_reader_stops_at_every_non_digit_byte() {
        // Every byte value after 1 to 9 digits, with digits (or bytes that carry when 6 is
        // added) after it: the first non-digit ends the number, whatever follows.
        for digits in 1..=9 {
            let number: Vec<u8> = (1..=digits).map(|d| b'0' + (d % 10) as u8).collect();
            for stop in (0..=255u8).filter(|b| !b.is_ascii_digit()) {
                for tail in [
                    &b"9999999"[..],
                    &[0xff; 7],
                    &[0xfa, b'9', 0xfa, b'9', 0, 0, 0],
                ] {
                    let mut text = number.clone();
                    text.push(stop);
                    text.extend_from_slice(tail);
                    scan_bytes(&text);
                }
            }
        }
    }
}
