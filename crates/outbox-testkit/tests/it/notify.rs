//! A `NOTIFY_SOCKET` keeps every datagram, so a signal sent before the wait
//! still counts; a child that exits without one fails the wait early.

use std::os::unix::net::UnixDatagram;
use std::time::Duration;

use outbox_testkit::{Notifications, Spawned};
use tokio::process::Command;

use crate::LONG;

#[tokio::test]
async fn lines_sent_before_and_after_the_wait_both_count() {
    let n = Notifications::bind().unwrap();
    let sender = UnixDatagram::unbound().unwrap();
    sender.send_to(b"READY=1\nSTATUS=relay ready", n.path()).unwrap();
    n.wait_for("READY=1", LONG).await.unwrap();
    n.wait_for("STATUS=relay ready", LONG).await.unwrap();
    assert!(!n.has("READY"), "whole lines only");

    let path = n.path().to_owned();
    let later = tokio::spawn(async move {
        tokio::task::yield_now().await;
        sender.send_to(b"STOPPING=1", path).unwrap();
    });
    n.wait_for("STOPPING=1", LONG).await.unwrap();
    later.await.unwrap();
    assert_eq!(n.received(), ["READY=1\nSTATUS=relay ready", "STOPPING=1"]);

    let err = n
        .wait_for("never=1", Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("STOPPING=1"), "{err}");
}

#[tokio::test]
async fn a_child_gets_the_socket_and_its_exit_ends_the_wait() {
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg("echo \"socket $NOTIFY_SOCKET\"");
    let mut child = Spawned::spawn_notified(cmd).unwrap();
    let path = child.notifications().unwrap().path().display().to_string();
    let started = std::time::Instant::now();
    let err = child.wait_for_notification("READY=1", LONG).await.unwrap_err();
    assert!(started.elapsed() < LONG / 2, "it must not wait out the timeout");
    assert!(err.to_string().contains("output ended"), "{err}");
    child.wait(LONG).await.unwrap();
    assert_eq!(child.lines(), [format!("socket {path}")]);

    let plain = Spawned::spawn(Command::new("true")).unwrap();
    assert!(plain.wait_for_notification("READY=1", LONG).await.is_err());
    assert!(!plain.notified("READY=1"));
}

#[tokio::test]
async fn datagrams_are_read_as_they_come_so_a_burst_never_fills_the_queue() {
    let n = Notifications::bind().unwrap();
    let path = n.path().to_owned();
    // A blocking sender would stall at the kernel's queue limit if nobody
    // read until the wait.
    let burst = tokio::task::spawn_blocking(move || {
        let sender = UnixDatagram::unbound().unwrap();
        for i in 0..2_000 {
            sender.send_to(format!("N={i}").as_bytes(), &path).unwrap();
        }
    });
    burst.await.unwrap();
    n.wait_for("N=1999", LONG).await.unwrap();
    assert_eq!(n.received().len(), 2_000);
}
