//! Storage tiers: where an engine holds a block (GPU, CPU, disk), and the set of tiers one
//! engine holds one block on. vLLM's CPU offloading keeps the GPU copy of a block until the
//! GPU evicts it, and LMCache adds disk, so one (block, engine) may sit on several tiers; a
//! removal names the medium it leaves. A lookup may weigh the tiers ([`TierWeights`]) to rank
//! engines by a weighted prefix score.

use std::fmt;

/// Where a block lives on its engine. An engine may hold one block on several tiers at once
/// (see [`TierSet`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    #[default]
    Gpu = 0,
    Cpu = 1,
    Disk = 2,
}

impl Tier {
    /// Every tier, in storage-speed order.
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Disk];

    /// The name used in JSON and the HTTP API (`"GPU"`, `"CPU"`, `"DISK"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Gpu => "GPU",
            Tier::Cpu => "CPU",
            Tier::Disk => "DISK",
        }
    }

    /// Parses a tier name (case-insensitive): `GPU`, `CPU` (SGLang's host memory is
    /// `CPU_PINNED`), `DISK` (vLLM 0.3x says `STORAGE`; SGLang's `EXTERNAL` is a storage
    /// backend beyond the host). `None` for anything else.
    pub fn parse(name: &str) -> Option<Tier> {
        match name.to_ascii_uppercase().as_str() {
            "GPU" => Some(Tier::Gpu),
            "CPU" | "CPU_PINNED" => Some(Tier::Cpu),
            "DISK" | "STORAGE" | "EXTERNAL" => Some(Tier::Disk),
            _ => None,
        }
    }

    /// The tier an event's medium names: `None` when it names none (absent, empty,
    /// `TIER_UNSPECIFIED`); an unknown name is GPU, as an unknown proto value is.
    pub fn from_medium(name: Option<&str>) -> Option<Tier> {
        match name {
            None => None,
            Some(n) if n.is_empty() || n.eq_ignore_ascii_case("TIER_UNSPECIFIED") => None,
            Some(n) => Some(Tier::parse(n).unwrap_or_default()),
        }
    }

    pub fn from_bits(bits: u32) -> Tier {
        match bits & 3 {
            1 => Tier::Cpu,
            2 => Tier::Disk,
            _ => Tier::Gpu,
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The tiers one engine holds one block on: a non-empty set of GPU, CPU and disk, one bit each
/// (bit `Tier as u8`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TierSet(u8);

impl TierSet {
    pub const EMPTY: TierSet = TierSet(0);
    /// Every tier.
    pub const ALL: TierSet = TierSet(0b111);

    #[inline]
    pub const fn of(tier: Tier) -> TierSet {
        TierSet(1 << tier as u8)
    }
    /// From the low three bits of `bits` (anything above is ignored).
    #[inline]
    pub const fn from_bits(bits: u8) -> TierSet {
        TierSet(bits & 0b111)
    }
    #[inline]
    pub const fn bits(self) -> u8 {
        self.0
    }
    #[inline]
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
    #[inline]
    pub const fn contains(self, tier: Tier) -> bool {
        self.0 & (1 << tier as u8) != 0
    }
    #[inline]
    pub const fn with(self, tier: Tier) -> TierSet {
        TierSet(self.0 | 1 << tier as u8)
    }
    #[inline]
    pub const fn without(self, other: TierSet) -> TierSet {
        TierSet(self.0 & !other.0)
    }
    #[inline]
    pub const fn intersect(self, other: TierSet) -> TierSet {
        TierSet(self.0 & other.0)
    }
    /// The fastest tier of the set (GPU before CPU before disk); GPU for an empty set.
    #[inline]
    pub fn fastest(self) -> Tier {
        match self.0.trailing_zeros() {
            1 => Tier::Cpu,
            2 => Tier::Disk,
            _ => Tier::Gpu,
        }
    }
    /// The tiers of the set, fastest first.
    pub fn iter(self) -> impl Iterator<Item = Tier> {
        Tier::ALL.into_iter().filter(move |t| self.contains(*t))
    }
}

impl From<Tier> for TierSet {
    fn from(tier: Tier) -> TierSet {
        TierSet::of(tier)
    }
}

/// What a block held on each tier is worth to a router, for ranking by a weighted prefix
/// score (e.g. GPU 1.0, CPU 0.8, disk 0.5). A tier left out weighs 1, like every block in the
/// default ranking.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierWeights(pub [f64; 3]);

impl Default for TierWeights {
    fn default() -> Self {
        TierWeights([1.0; 3])
    }
}

impl TierWeights {
    pub fn of(&self, tier: Tier) -> f64 {
        self.0[tier as usize]
    }
    /// The highest weight among `tiers` (0 for none).
    pub fn best(&self, tiers: TierSet) -> f64 {
        tiers.iter().map(|t| self.of(t)).fold(0.0, f64::max)
    }
}
