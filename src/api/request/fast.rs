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
//! the serde parser would (`tests/lookup_body.rs` holds the two together on random bodies).

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
            let v = self.uint()?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(text: &str) -> (Option<u64>, usize) {
        let mut s = Scanner {
            b: text.as_bytes(),
            i: 0,
        };
        (s.uint(), s.i)
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
}
