//! This process among the replicas of one index.
//!
//! Replicas of kvindex are independent processes, each with its own data dir, that read the
//! same topic or stream and each index all of it ("HA mode": any replica answers any lookup,
//! and a lookup's answer says how far its replica has applied each source partition, so a
//! router can prefer the freshest). What keeps them from disturbing one another is that
//! each consumes under a name of its own: [`replica_id`] gives every data dir a stable id,
//! which the default consumer group (`kvindex-{replica_id}`, offset commits only) and
//! JetStream durable consumer (`kvindex-{replica_id}`) are named after.

mod replica_id;

pub use replica_id::{REPLICA_ID_FILE, replica_id, resolve_replica_id};
