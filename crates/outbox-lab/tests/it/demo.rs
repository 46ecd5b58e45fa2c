//! `outbox-lab demo`: the whole pattern end to end on throwaway services,
//! its counts as the README's quick start prints them.

use crate::support::{run_lab, text};

#[tokio::test]
async fn demo_runs_end_to_end_on_throwaway_services() {
    let out = run_lab(&["demo", "--orders", "30"], &[]).await;
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains("every paid order shipped exactly once"),
        "{stdout}"
    );
    assert!(
        stdout.contains("5 replayed, 0 processed again, 5 answered as duplicates"),
        "{stdout}"
    );
}
