//! Simulated producers: a synthetic engine fleet ([`fleet`]) that publishes KV-cache events
//! the way a vLLM deployment does, for `kvindex produce`, `kvindex demo`, the benches and the
//! tests, and the seeded [`Rng`] everything random in the crate draws from.

pub mod fleet;
pub mod rng;

pub use fleet::{Fleet, FleetSettings, FleetStats};
pub use rng::Rng;
