//! Parsing and validation of the `POST /v1/lookup` body into a [`LookupRequest`].
//!
//! The body is deserialized in one streaming pass straight into typed fields (no intermediate
//! `serde_json::Value`, which would cost an allocation per token of a long prompt). Each field's
//! deserializer never fails on a wrong type: it consumes the value and records that it was
//! wrong, so the error can name the field (`token_ids: expected an array of unsigned 32-bit
//! integers`) rather than echo serde's positional text. Only JSON syntax errors fail the parse.
//! Unknown fields are ignored (forward compatibility); `null` counts as absent.

use crate::event::extra::MmInput;
use crate::event::{EngineHash, PartitionKey, Tier, TierWeights};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;
use std::marker::PhantomData;

/// Most token ids one lookup may carry.
pub const MAX_QUERY_TOKENS: usize = 1_000_000;
/// Most block hashes one lookup may carry.
pub const MAX_QUERY_HASHES: usize = 100_000;
/// Most multimodal inputs one lookup may name.
pub const MAX_MM_INPUTS: usize = 10_000;

/// 2^64 as a float: integral numbers below it (and ≥ 0) fit a `u64`.
const TWO_POW_64: f64 = 18_446_744_073_709_551_616.0;

/// A lookup body that is not valid JSON or not a valid lookup; the message names the field
/// and is what the API answers in its 400.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadRequest(pub String);

impl BadRequest {
    pub fn new(msg: impl Into<String>) -> BadRequest {
        BadRequest(msg.into())
    }
}

/// A validated lookup request.
#[derive(Clone, Debug, PartialEq)]
pub struct LookupRequest {
    pub partition: PartitionKey,
    pub query: Query,
    /// `block_size` as the request gave it.
    pub block_size: Option<u32>,
    /// At most this many engines in the answer (the best ones); `None`: all of them.
    pub limit: Option<usize>,
    /// Only engines kvindex applied an event of within this many seconds (its own clock);
    /// `None`: every engine.
    pub max_idle_s: Option<u64>,
    /// The request's cache salt (empty: none); token lookups only.
    pub cache_salt: String,
    /// The request's multimodal inputs; token lookups only.
    pub mm_inputs: Vec<MmInput>,
    /// Rank by the weighted prefix score with these weights; `None`: by prefix length.
    pub tier_weights: Option<TierWeights>,
}

/// The blocks a lookup asks about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Query {
    Tokens(Vec<u32>),
    Hashes(Vec<EngineHash>),
}

mod fast;

/// Parses and validates a lookup body: the usual body through the fast path
/// ([`parse_lookup_fast`]), anything else through [`parse_lookup_general`].
pub fn parse_lookup(body: &[u8]) -> Result<LookupRequest, BadRequest> {
    parse_lookup_fast(body).unwrap_or_else(|| parse_lookup_general(body))
}

/// The fast path alone (`lookup/fast.rs`): `None` when the body is outside the subset of JSON
/// it reads; otherwise exactly what [`parse_lookup_general`] answers.
pub fn parse_lookup_fast(body: &[u8]) -> Option<Result<LookupRequest, BadRequest>> {
    fast::parse(body).map(RawLookup::validate)
}

/// The complete parser (serde), for every body the fast path does not read; it owns every
/// error message. Public so tests and benches can hold the fast path against it.
pub fn parse_lookup_general(body: &[u8]) -> Result<LookupRequest, BadRequest> {
    // serde would also accept a JSON array as a positional struct: insist on an object.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(match serde_json::from_slice::<IgnoredAny>(body) {
            Err(e) => BadRequest::new(format!("invalid JSON: {e}")),
            Ok(_) => BadRequest::new("request body must be a JSON object"),
        });
    }
    let raw: RawLookup =
        serde_json::from_slice(body).map_err(|e| BadRequest::new(format!("invalid JSON: {e}")))?;
    raw.validate()
}

#[derive(serde::Deserialize, Default)]
struct RawLookup {
    #[serde(default)]
    model: Scalar<String>,
    #[serde(default)]
    tenant: Scalar<String>,
    #[serde(default)]
    adapter: Scalar<String>,
    #[serde(default)]
    token_ids: List<u32, MAX_QUERY_TOKENS>,
    #[serde(default)]
    block_hashes: List<EngineHash, MAX_QUERY_HASHES>,
    #[serde(default)]
    block_size: Scalar<BlockSize>,
    #[serde(default)]
    limit: Scalar<Limit>,
    #[serde(default)]
    max_idle_s: Scalar<Seconds>,
    #[serde(default)]
    cache_salt: Scalar<String>,
    /// Read as a value and checked by [`mm_inputs`]: a short list, never a hot path.
    #[serde(default)]
    mm_inputs: Option<serde_json::Value>,
    /// Read as a value and checked by [`tier_weights`].
    #[serde(default)]
    tier_weights: Option<serde_json::Value>,
}

const TOKEN_IDS_TYPE: &str = "token_ids: expected an array of unsigned 32-bit integers";
const BLOCK_HASHES_TYPE: &str =
    "block_hashes: expected an array of hex strings (hash bytes) or 64-bit integers";

impl RawLookup {
    fn validate(self) -> Result<LookupRequest, BadRequest> {
        let model = match self.model.0 {
            Field::Valid(m) if !m.is_empty() => m,
            Field::Absent => {
                return Err(BadRequest::new("model: required (a non-empty string)"));
            }
            _ => return Err(BadRequest::new("model: expected a non-empty string")),
        };
        let tenant = optional_string(self.tenant.0, "tenant")?;
        let adapter = optional_string(self.adapter.0, "adapter")?;
        let block_size = match self.block_size.0 {
            Field::Absent => None,
            Field::Valid(BlockSize(n)) => Some(n),
            _ => {
                return Err(BadRequest::new(
                    "block_size: expected an integer from 1 to 4294967295",
                ));
            }
        };
        let limit = match self.limit.0 {
            Field::Absent => None,
            Field::Valid(Limit(n)) => Some(n),
            _ => {
                return Err(BadRequest::new(
                    "limit: expected a positive integer (most engines to answer with)",
                ));
            }
        };
        let max_idle_s = match self.max_idle_s.0 {
            Field::Absent => None,
            Field::Valid(Seconds(n)) => Some(n),
            _ => {
                return Err(BadRequest::new(
                    "max_idle_s: expected a positive integer (seconds since an engine's last event)",
                ));
            }
        };
        let query = match (self.token_ids.0, self.block_hashes.0) {
            (Field::Absent, Field::Absent) => {
                return Err(BadRequest::new(
                    "one of token_ids or block_hashes is required",
                ));
            }
            (Field::Absent, hashes) => Query::Hashes(list(
                hashes,
                BLOCK_HASHES_TYPE,
                "block_hashes",
                "hashes",
                MAX_QUERY_HASHES,
            )?),
            (tokens, Field::Absent) => Query::Tokens(list(
                tokens,
                TOKEN_IDS_TYPE,
                "token_ids",
                "tokens",
                MAX_QUERY_TOKENS,
            )?),
            _ => {
                return Err(BadRequest::new(
                    "token_ids and block_hashes are mutually exclusive: give exactly one",
                ));
            }
        };
        let cache_salt = optional_string(self.cache_salt.0, "cache_salt")?;
        let mm_inputs = mm_inputs(self.mm_inputs)?;
        let tier_weights = tier_weights(self.tier_weights)?;
        if matches!(query, Query::Hashes(_)) && (!cache_salt.is_empty() || !mm_inputs.is_empty()) {
            return Err(BadRequest::new(
                "cache_salt and mm_inputs apply to token_ids lookups only (block_hashes already carry them)",
            ));
        }
        Ok(LookupRequest {
            partition: PartitionKey {
                tenant,
                model,
                adapter,
            },
            query,
            block_size,
            limit,
            max_idle_s,
            cache_salt,
            mm_inputs,
            tier_weights,
        })
    }
}

/// `tier_weights`: absent/`null`, or an object from tier names (`GPU`, `CPU`, `DISK`, any
/// case) to finite weights ≥ 0; a tier left out weighs 1.
fn tier_weights(value: Option<serde_json::Value>) -> Result<Option<TierWeights>, BadRequest> {
    const TYPE: &str = "tier_weights: expected an object of tier name (GPU, CPU, DISK) to a number ≥ 0, e.g. {\"GPU\": 1.0, \"CPU\": 0.8, \"DISK\": 0.5}";
    let entries = match value {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(serde_json::Value::Object(entries)) => entries,
        Some(_) => return Err(BadRequest::new(TYPE)),
    };
    let mut weights = TierWeights::default();
    for (name, weight) in &entries {
        let tier = Tier::parse(name)
            .ok_or_else(|| BadRequest::new(format!("{TYPE} (`{name}` is not a tier)")))?;
        let w = weight
            .as_f64()
            .filter(|w| w.is_finite() && *w >= 0.0)
            .ok_or_else(|| BadRequest::new(format!("{TYPE} (`{name}` is not)")))?;
        weights.0[tier as usize] = w;
    }
    Ok(Some(weights))
}

/// A non-negative integer, also written with a zero fraction (`5.0`), as JSON Schema counts
/// integers.
fn integer(v: &serde_json::Value) -> Option<u64> {
    v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|f| f.fract() == 0.0 && (0.0..TWO_POW_64).contains(f))
            .map(|f| f as u64)
    })
}

/// `mm_inputs`: absent/`null`, or an array of `{"hash": non-empty string, "offset": u64,
/// "length": u64 ≥ 1}` (placeholder token range of each input, counted from the first token).
fn mm_inputs(value: Option<serde_json::Value>) -> Result<Vec<MmInput>, BadRequest> {
    const TYPE: &str = "mm_inputs: expected an array of {\"hash\": string, \"offset\": integer ≥ 0, \"length\": integer ≥ 1}";
    let items = match value {
        None | Some(serde_json::Value::Null) => return Ok(Vec::new()),
        Some(serde_json::Value::Array(items)) => items,
        Some(_) => return Err(BadRequest::new(TYPE)),
    };
    if items.len() > MAX_MM_INPUTS {
        return Err(BadRequest::new(format!(
            "mm_inputs: more than {MAX_MM_INPUTS} inputs"
        )));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let hash = item
                .get("hash")
                .and_then(|h| h.as_str())
                .filter(|h| !h.is_empty());
            let offset = item.get("offset").and_then(integer);
            let length = item.get("length").and_then(integer).filter(|&l| l > 0);
            match (hash, offset, length) {
                (Some(hash), Some(offset), Some(length)) => Ok(MmInput {
                    hash: hash.to_string(),
                    offset,
                    length,
                }),
                _ => Err(BadRequest::new(format!("{TYPE} (element {i} is not)"))),
            }
        })
        .collect()
}

fn optional_string(f: Field<String>, name: &str) -> Result<String, BadRequest> {
    match f {
        Field::Absent => Ok(String::new()),
        Field::Valid(s) => Ok(s),
        _ => Err(BadRequest::new(format!("{name}: expected a string"))),
    }
}

fn list<T>(
    f: Field<Vec<T>>,
    type_msg: &str,
    name: &str,
    unit: &str,
    max: usize,
) -> Result<Vec<T>, BadRequest> {
    match f {
        Field::Valid(v) => Ok(v),
        Field::Absent | Field::Invalid(None) => Err(BadRequest::new(type_msg)),
        Field::Invalid(Some(i)) => Err(BadRequest::new(format!("{type_msg} (element {i} is not)"))),
        Field::TooLong => Err(BadRequest::new(format!("{name}: more than {max} {unit}"))),
    }
}

/// One field as the body gave it.
#[derive(Debug)]
enum Field<T> {
    /// Absent or `null`.
    Absent,
    Valid(T),
    /// Of the wrong type; for arrays, the index of the first bad element if that was the problem.
    Invalid(Option<usize>),
    /// An array longer than allowed.
    TooLong,
}

/// A JSON scalar that [`Scalar`] and [`List`] elements can be read as. Each `from_*` returns
/// `None` when the value is of the right JSON type but out of range or otherwise invalid.
trait FromJson: Sized {
    const EXPECTING: &'static str;
    fn from_u64(_: u64) -> Option<Self> {
        None
    }
    fn from_i64(_: i64) -> Option<Self> {
        None
    }
    fn from_str(_: &str) -> Option<Self> {
        None
    }
}

impl FromJson for String {
    const EXPECTING: &'static str = "a string";
    fn from_str(s: &str) -> Option<Self> {
        Some(s.to_string())
    }
}

impl FromJson for u32 {
    const EXPECTING: &'static str = "an unsigned 32-bit integer";
    fn from_u64(v: u64) -> Option<Self> {
        u32::try_from(v).ok()
    }
}

/// `block_size`: 1..=u32::MAX.
struct BlockSize(u32);

impl FromJson for BlockSize {
    const EXPECTING: &'static str = "a positive 32-bit integer";
    fn from_u64(v: u64) -> Option<Self> {
        u32::try_from(v).ok().filter(|&n| n > 0).map(BlockSize)
    }
}

/// `limit`: at least 1 (larger than any fleet is fine: it only caps).
struct Limit(usize);

impl FromJson for Limit {
    const EXPECTING: &'static str = "a positive integer";
    fn from_u64(v: u64) -> Option<Self> {
        usize::try_from(v).ok().filter(|&n| n > 0).map(Limit)
    }
}

/// `max_idle_s`: at least 1.
struct Seconds(u64);

impl FromJson for Seconds {
    const EXPECTING: &'static str = "a positive integer";
    fn from_u64(v: u64) -> Option<Self> {
        (v > 0).then_some(Seconds(v))
    }
}

impl FromJson for EngineHash {
    const EXPECTING: &'static str = "a hex string or an integer";
    fn from_u64(v: u64) -> Option<Self> {
        Some(EngineHash(v))
    }
    /// Negative integers are accepted like the event decoders accept them (vLLM emits Python's
    /// signed hashes): the same 64 bits.
    fn from_i64(v: i64) -> Option<Self> {
        Some(EngineHash::from_i64(v))
    }
    fn from_str(s: &str) -> Option<Self> {
        match hex::decode(s) {
            Ok(bytes) if !bytes.is_empty() => Some(EngineHash::from_bytes(&bytes)),
            _ => None,
        }
    }
}

/// What one JSON value turned out to be.
enum Seen<T> {
    Null,
    Valid(T),
    Wrong,
}

/// Visits any JSON value, reading it as `T` or consuming it as wrong.
struct ValueVisitor<T>(PhantomData<T>);

impl<'de, T: FromJson> Visitor<'de> for ValueVisitor<T> {
    type Value = Seen<T>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(T::EXPECTING)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Seen<T>, E> {
        Ok(Seen::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Seen<T>, E> {
        Ok(Seen::Null)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Seen<T>, E> {
        Ok(Seen::Wrong)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seen<T>, E> {
        Ok(T::from_u64(v).map_or(Seen::Wrong, Seen::Valid))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seen<T>, E> {
        match u64::try_from(v) {
            Ok(u) => self.visit_u64(u),
            Err(_) => Ok(T::from_i64(v).map_or(Seen::Wrong, Seen::Valid)),
        }
    }
    /// A number with a zero fraction (`5.0`, `1e3`) is an integer, as JSON Schema counts it.
    ///
    /// An integer literal outside `i64::MIN..=u64::MAX` also arrives here, rounded to the
    /// nearest float: below −2^63 it rounds to −2^63 itself, above 2^64 − 1 to 2^64 or more.
    /// Both bounds are therefore exclusive (the literals `-9223372036854775808` and
    /// `18446744073709551615` arrive as integers, not here); only a float spelling of exactly
    /// −2^63 is refused with them, as no float tells it apart from its out-of-range neighbours.
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Seen<T>, E> {
        const MINUS_TWO_POW_63: f64 = -9_223_372_036_854_775_808.0;
        if v.fract() != 0.0 {
            Ok(Seen::Wrong)
        } else if (0.0..TWO_POW_64).contains(&v) {
            self.visit_u64(v as u64)
        } else if v > MINUS_TWO_POW_63 && v < 0.0 {
            self.visit_i64(v as i64)
        } else {
            Ok(Seen::Wrong)
        }
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Seen<T>, E> {
        Ok(T::from_str(v).map_or(Seen::Wrong, Seen::Valid))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Seen<T>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Seen::Wrong)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Seen<T>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Seen::Wrong)
    }
}

struct Element<T>(Seen<T>);

impl<'de, T: FromJson> de::Deserialize<'de> for Element<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor(PhantomData)).map(Element)
    }
}

/// A scalar field.
struct Scalar<T>(Field<T>);

impl<T> Default for Scalar<T> {
    fn default() -> Self {
        Scalar(Field::Absent)
    }
}

impl<'de, T: FromJson> de::Deserialize<'de> for Scalar<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Scalar(
            match d.deserialize_any(ValueVisitor::<T>(PhantomData))? {
                Seen::Null => Field::Absent,
                Seen::Valid(v) => Field::Valid(v),
                Seen::Wrong => Field::Invalid(None),
            },
        ))
    }
}

/// An array field of at most `MAX` elements.
struct List<T, const MAX: usize>(Field<Vec<T>>);

impl<T, const MAX: usize> Default for List<T, MAX> {
    fn default() -> Self {
        List(Field::Absent)
    }
}

struct ListVisitor<T, const MAX: usize>(PhantomData<T>);

impl<'de, T: FromJson, const MAX: usize> Visitor<'de> for ListVisitor<T, MAX> {
    type Value = Field<Vec<T>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "an array of {}", T::EXPECTING)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Field::Absent)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Field::Invalid(None))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Field::Invalid(None))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Field::Invalid(None))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Field::Invalid(None))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Field::Invalid(None))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Field::Invalid(None))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        let mut outcome = None;
        while let Some(Element(seen)) = seq.next_element::<Element<T>>()? {
            match seen {
                Seen::Valid(v) if out.len() < MAX => out.push(v),
                Seen::Valid(_) => {
                    outcome = Some(Field::TooLong);
                    break;
                }
                Seen::Null | Seen::Wrong => {
                    outcome = Some(Field::Invalid(Some(out.len())));
                    break;
                }
            }
        }
        if let Some(bad) = outcome {
            // Drop what we have and consume the rest of the array unread.
            drop(out);
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            return Ok(bad);
        }
        Ok(Field::Valid(out))
    }
}

impl<'de, T: FromJson, const MAX: usize> de::Deserialize<'de> for List<T, MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ListVisitor::<T, MAX>(PhantomData))
            .map(List)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> String {
        match parse_lookup(body.as_bytes()) {
            Err(e) => e.to_string(),
            Ok(r) => panic!("{body} parsed: {r:?}"),
        }
    }

    #[test]
    fn parses_tokens_and_hashes() {
        let r =
            parse_lookup(br#"{"model":"m","token_ids":[1,2,3],"x":{"y":[1]},"block_size":null}"#)
                .unwrap();
        assert_eq!(r.partition, PartitionKey::new("", "m", ""));
        assert_eq!(r.query, Query::Tokens(vec![1, 2, 3]));
        assert_eq!(r.block_size, None);
        let r = parse_lookup(
            br#"{"model":"m","tenant":"t","adapter":"a","block_hashes":["00000000000000ff",7,-1],"block_size":16}"#,
        )
        .unwrap();
        assert_eq!(r.partition, PartitionKey::new("t", "m", "a"));
        assert_eq!(
            r.query,
            Query::Hashes(vec![EngineHash(255), EngineHash(7), EngineHash(u64::MAX)])
        );
        assert_eq!(r.block_size, Some(16));
        assert_eq!(r.limit, None);
        let r = parse_lookup(br#"{"model":"m","token_ids":[1],"limit":8}"#).unwrap();
        assert_eq!(r.limit, Some(8));
        let r = parse_lookup(br#"{"model":"m","token_ids":[1],"limit":null}"#).unwrap();
        assert_eq!(r.limit, None);
    }

    #[test]
    fn max_idle_s_is_a_positive_number_of_seconds() {
        let r = parse_lookup(br#"{"model":"m","token_ids":[1],"max_idle_s":30}"#).unwrap();
        assert_eq!(r.max_idle_s, Some(30));
        assert_eq!(
            parse_lookup(br#"{"model":"m","token_ids":[1]}"#)
                .unwrap()
                .max_idle_s,
            None
        );
        for bad in ["0", "-1", "1.5", "\"30\""] {
            assert_eq!(
                err(&format!(
                    r#"{{"model":"m","token_ids":[1],"max_idle_s":{bad}}}"#
                )),
                "max_idle_s: expected a positive integer (seconds since an engine's last event)",
                "max_idle_s {bad}"
            );
        }
    }

    #[test]
    fn limit_must_be_a_positive_integer() {
        for bad in ["0", "-1", "1.5", "\"8\"", "[8]", "true"] {
            assert_eq!(
                err(&format!(r#"{{"model":"m","token_ids":[1],"limit":{bad}}}"#)),
                "limit: expected a positive integer (most engines to answer with)",
                "limit {bad}"
            );
        }
    }

    /// JSON Schema (and so the OpenAPI document) counts `4.0` and `1e1` as integers, and
    /// schemathesis sends them: they read as integers; a fraction is still an error.
    #[test]
    fn integers_may_have_a_zero_fraction() {
        let r = parse_lookup(
            br#"{"model":"m","token_ids":[1.0,2e0],"block_size":4.0,"limit":1e1,
                 "mm_inputs":[{"hash":"h","offset":0.0,"length":2.0}],"tier_weights":null}"#,
        )
        .unwrap();
        assert_eq!(r.query, Query::Tokens(vec![1, 2]));
        assert_eq!((r.block_size, r.limit), (Some(4), Some(10)));
        assert_eq!((r.mm_inputs[0].offset, r.mm_inputs[0].length), (0, 2));
        let hashes = parse_lookup(br#"{"model":"m","block_hashes":[-61.0]}"#).unwrap();
        assert_eq!(hashes.query, Query::Hashes(vec![EngineHash::from_i64(-61)]));
        // The ends of the range, as integer literals; past them, whatever float they round to.
        let ends = parse_lookup(
            br#"{"model":"m","block_hashes":[-9223372036854775808,18446744073709551615]}"#,
        )
        .unwrap();
        assert_eq!(
            ends.query,
            Query::Hashes(vec![EngineHash::from_i64(i64::MIN), EngineHash(u64::MAX)])
        );
        for outside in [
            "-9223372036854775809",
            "-9223372036854775900",
            "18446744073709551616",
            "-1e19",
        ] {
            let body = format!(r#"{{"model":"m","block_hashes":[{outside}]}}"#);
            assert!(err(&body).starts_with("block_hashes: "), "{outside}");
        }
        assert!(err(r#"{"model":"m","token_ids":[1.5]}"#).starts_with("token_ids: "));
        assert!(
            err(r#"{"model":"m","token_ids":[1],"block_size":2.5}"#).starts_with("block_size: ")
        );
    }

    #[test]
    fn names_the_bad_field() {
        assert!(err("{").starts_with("invalid JSON: "));
        assert!(err("").starts_with("invalid JSON: "));
        assert_eq!(err("[1]"), "request body must be a JSON object");
        assert_eq!(
            err(r#"{"token_ids":[]}"#),
            "model: required (a non-empty string)"
        );
        assert_eq!(
            err(r#"{"model":"","token_ids":[]}"#),
            "model: expected a non-empty string"
        );
        assert_eq!(
            err(r#"{"model":5,"token_ids":[]}"#),
            "model: expected a non-empty string"
        );
        assert_eq!(
            err(r#"{"model":"m","tenant":[],"token_ids":[]}"#),
            "tenant: expected a string"
        );
        assert_eq!(err(r#"{"model":"m","token_ids":"abc"}"#), TOKEN_IDS_TYPE);
        assert_eq!(
            err(r#"{"model":"m","token_ids":[1,-1]}"#),
            format!("{TOKEN_IDS_TYPE} (element 1 is not)")
        );
        assert_eq!(
            err(r#"{"model":"m","token_ids":[4294967296]}"#),
            format!("{TOKEN_IDS_TYPE} (element 0 is not)")
        );
        assert_eq!(
            err(r#"{"model":"m","token_ids":[1.5]}"#),
            format!("{TOKEN_IDS_TYPE} (element 0 is not)")
        );
        assert_eq!(
            err(r#"{"model":"m","block_hashes":[{}]}"#),
            format!("{BLOCK_HASHES_TYPE} (element 0 is not)")
        );
        assert_eq!(
            err(r#"{"model":"m","block_hashes":["abc"]}"#),
            format!("{BLOCK_HASHES_TYPE} (element 0 is not)")
        );
        assert_eq!(
            err(r#"{"model":"m","block_hashes":[""]}"#),
            format!("{BLOCK_HASHES_TYPE} (element 0 is not)")
        );
        assert!(err(r#"{"model":"m","token_ids":[],"block_size":0}"#).starts_with("block_size: "));
        assert!(
            err(r#"{"model":"m","token_ids":[],"block_size":"4"}"#).starts_with("block_size: ")
        );
        assert!(err(r#"{"model":"m"}"#).contains("token_ids or block_hashes"));
        assert!(
            err(r#"{"model":"m","token_ids":[],"block_hashes":[]}"#)
                .contains("token_ids and block_hashes")
        );
        assert!(
            err(r#"{"model":"m","token_ids":[],"model":"n"}"#)
                .starts_with("invalid JSON: duplicate field")
        );
    }

    #[test]
    fn caps_query_length() {
        let body = format!(
            r#"{{"model":"m","block_hashes":[{}]}}"#,
            vec!["1"; MAX_QUERY_HASHES + 1].join(",")
        );
        assert_eq!(
            err(&body),
            format!("block_hashes: more than {MAX_QUERY_HASHES} hashes")
        );
        let body = format!(
            r#"{{"model":"m","block_hashes":[{}]}}"#,
            vec!["1"; MAX_QUERY_HASHES].join(",")
        );
        assert!(parse_lookup(body.as_bytes()).is_ok());
    }
}
