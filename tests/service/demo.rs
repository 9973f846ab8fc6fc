//! The README's first command, `kvindex demo`: the service on its embedded broker with a
//! simulated fleet feeding it answers the lookup it suggests, with engines, and stops cleanly.

use crate::support::{spawn_kvindex, wait_for};
use serde_json::Value;
use std::time::Duration;

#[test]
fn demo_serves_the_lookup_it_suggests_and_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let demo = spawn_kvindex(
        &["demo", "--engines", "4", "--rate", "50"],
        dir.path(),
        &[],
        Duration::from_secs(180),
    );
    // It listens only once its warm-up traffic is applied, and writes the query it suggests.
    let query: Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("demo-query.json")).expect("demo-query.json is written"),
    )
    .unwrap();
    let (status, answer) = demo.post("/v1/lookup", &query);
    assert_eq!(status, 200, "{answer}");
    let engines = answer["engines"].as_array().expect("engines");
    assert!(
        !engines.is_empty(),
        "the suggested lookup names engines: {answer}"
    );
    assert!(
        engines
            .iter()
            .all(|e| e["matched_blocks"].as_u64() > Some(0))
    );
    // The fleet keeps producing: the service is ready and events keep being applied.
    let applied = |stats: &Value| stats["events"]["applied_total"].as_u64().unwrap_or(0);
    let first = applied(&demo.stats());
    wait_for(
        "ready, and more events applied",
        Duration::from_secs(60),
        || {
            let ready = demo.get("/readyz").0 == 200;
            (ready && applied(&demo.stats()) > first).then_some(())
        },
    );
    demo.terminate();
}
