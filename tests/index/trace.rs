//! The trace replay on the head of the Mooncake op stream (`tests/fixtures/trace/`): every lookup
//! answer is checked against the trace's reference (speed is measured by the bench, not here).

use kvindex::bench::trace::{self, ReplayError};
use std::path::PathBuf;
use std::time::Duration;

fn workload() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/trace/mooncake-64w-head.jsonl.gz"
    ))
}

#[test]
fn the_head_of_the_mooncake_trace_matches_every_reference_answer() {
    let trace = trace::load(&workload(), None).expect("the trace fixture loads");
    assert!(trace.finds > 500, "the prefix holds finds: {}", trace.finds);
    for shards in [1, 2] {
        let report = trace::run(&trace, shards, 1, false).expect("every find matches its expect");
        assert_eq!(report.skipped, 0, "no store or remove may be skipped");
        assert!(report.memberships > 0);
        assert_eq!(
            report.split,
            [Duration::ZERO; 3],
            "events are timed only when asked"
        );
    }
    let split = trace::run(&trace, 1, 1, true).expect("answers match").split;
    assert!(
        split.iter().all(|d| !d.is_zero()),
        "stores, removes and finds each timed: {split:?}"
    );
}

#[test]
fn a_wrong_reference_answer_fails_the_run_with_its_line() {
    let text = concat!(
        r#"{"op":"store","worker":1,"dp_rank":0,"event_id":1,"parent":null,"blocks":[[10,100],[11,101]]}"#,
        "\n",
        r#"{"op":"store","worker":2,"dp_rank":0,"event_id":1,"parent":null,"blocks":[[10,200]]}"#,
        "\n",
        r#"{"op":"find","hashes":[10,11],"expect":[[1,2],[2,1]]}"#,
        "\n",
        r#"{"op":"remove","worker":1,"dp_rank":0,"event_id":2,"hashes":[101]}"#,
        "\n",
        r#"{"op":"find","hashes":[10,11],"expect":[[1,2],[2,1]]}"#,
        "\n",
    );
    let trace = trace::parse(text.as_bytes(), None).expect("parses");
    match trace::run(&trace, 1, 1, true) {
        Err(ReplayError::Mismatch {
            line,
            expected,
            got,
        }) => {
            assert_eq!(line, 5);
            assert_eq!(expected, vec![("1".to_string(), 2), ("2".to_string(), 1)]);
            assert_eq!(got, vec![("1".to_string(), 1), ("2".to_string(), 1)]);
        }
        other => panic!(
            "expected a mismatch on line 5, got {:?}",
            other.map(|r| r.block_ops_per_sec)
        ),
    }
    // The same trace with the right answer passes, sharded too.
    let fixed = text.replace(
        "\"hashes\":[101]}\n{\"op\":\"find\",\"hashes\":[10,11],\"expect\":[[1,2],[2,1]]}",
        "\"hashes\":[101]}\n{\"op\":\"find\",\"hashes\":[10,11],\"expect\":[[1,1],[2,1]]}",
    );
    let trace = trace::parse(fixed.as_bytes(), None).expect("parses");
    for shards in [1, 2] {
        trace::run(&trace, shards, 1, false).expect("answers match");
    }
}
