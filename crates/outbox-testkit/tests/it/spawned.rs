//! A child's output is captured line by line; it can be waited on and
//! killed.

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use nix::sys::signal::Signal;
use outbox_testkit::Spawned;
use tokio::process::Command;

use crate::LONG;

fn sh(script: &str) -> Command {
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(script);
    cmd
}

#[tokio::test]
async fn wait_for_line_then_kill() {
    let mut child = Spawned::spawn(sh("echo hello; echo oops >&2; sleep 30")).unwrap();
    assert_eq!(child.wait_for_line("hello", LONG).await.unwrap(), "hello");
    assert_eq!(child.wait_for_line("oops", LONG).await.unwrap(), "oops");
    assert_eq!(child.count_lines("o"), 2);

    child.kill().unwrap();
    let status = child.wait(LONG).await.unwrap();
    assert_eq!(status.signal(), Some(Signal::SIGKILL as i32));
    assert!(
        child.signal(Signal::SIGTERM).is_err(),
        "no signals to an exited child"
    );
}

#[tokio::test]
async fn output_is_complete_after_wait_and_ended_output_fails_fast() {
    let mut child = Spawned::spawn(sh("for i in 1 2 3; do echo line $i; done; exit 3")).unwrap();
    let status = child.wait(LONG).await.unwrap();
    assert_eq!(status.code(), Some(3));
    assert_eq!(child.lines(), ["line 1", "line 2", "line 3"]);

    let started = std::time::Instant::now();
    let err = child.wait_for_line("never", LONG).await.unwrap_err();
    assert!(started.elapsed() < LONG / 2, "it must not wait out the timeout");
    let text = err.to_string();
    assert!(text.contains("exited") && text.contains("line 3"), "{text}");
}

#[tokio::test]
async fn signal_and_wait_timeout() {
    let mut child = Spawned::spawn(sh(
        "trap 'echo got term; exit 0' TERM; echo ready; while :; do sleep 0.05; done",
    ))
    .unwrap();
    child.wait_for_line("ready", LONG).await.unwrap();
    child.signal(Signal::SIGTERM).unwrap();
    child.wait_for_line("got term", LONG).await.unwrap();
    assert_eq!(child.wait(LONG).await.unwrap().code(), Some(0));

    let mut stuck = Spawned::spawn(sh("sleep 30")).unwrap();
    let err = stuck.wait(Duration::from_millis(100)).await.unwrap_err();
    assert!(err.to_string().contains("killed it"), "{err}");
    let err = stuck
        .wait_for_line("anything", Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("exited"), "{err}");
}
