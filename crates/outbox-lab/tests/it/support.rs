//! Shared test plumbing: the `outbox-lab` binary with a clean environment
//! and `OUTBOX_BIN` pointing at the workspace's `outbox`, and opening a
//! report in headless chromium.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

pub const LONG: Duration = Duration::from_secs(60);

/// The workspace's `outbox` binary, beside this test's: the test runs from
/// `target/<profile>/deps/it-…`, cargo puts `outbox` in `target/<profile>/`.
/// `cargo nextest run --workspace` builds it; `-p outbox-lab` alone does not.
pub fn outbox_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test runs from target/<profile>/deps");
    let outbox = profile.join("outbox");
    assert!(
        outbox.is_file(),
        "{} is missing: build it first with `cargo build -p outbox-cli` \
         (`cargo nextest run --workspace` builds it)",
        outbox.display()
    );
    outbox
}

/// The `outbox-lab` binary with a clean environment (no inherited
/// OUTBOX_*, DATABASE_URL or NOTIFY_SOCKET) and `OUTBOX_BIN` set to the
/// workspace's `outbox`.
pub fn lab_cmd() -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-lab"));
    for (key, _) in std::env::vars() {
        if key.starts_with("OUTBOX_") || ["DATABASE_URL", "RUST_LOG", "NOTIFY_SOCKET"].contains(&key.as_str())
        {
            cmd.env_remove(key);
        }
    }
    cmd.env("OUTBOX_BIN", outbox_bin());
    cmd.env("RUST_LOG", "info,outbox_relay=debug");
    cmd.kill_on_drop(true);
    cmd
}

/// Runs `outbox-lab <args>` to completion, within a minute.
pub async fn run_lab(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut cmd = lab_cmd();
    cmd.args(args).envs(envs.iter().copied());
    tokio::time::timeout(LONG, cmd.output())
        .await
        .expect("outbox-lab timed out")
        .expect("run outbox-lab")
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Opens the report in headless chromium: the DOM it built has every
/// section (an element of each id in `sections`), the console logged no
/// error, and the screenshot is a PNG (kept as the test's artifact).
pub async fn open_in_chromium(report: &Path, screenshot: &Path, sections: &[&str]) {
    let chromium = ["chromium", "chromium-browser"]
        .into_iter()
        .find(|c| {
            std::process::Command::new("which")
                .arg(c)
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .expect(
            "chromium is not installed: `apt-get install chromium` (scripts/test.sh installs it as root)",
        );
    let url = format!("file://{}", report.display());
    let _ = std::fs::remove_file(screenshot);
    let base = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--enable-logging=stderr",
        "--v=0",
        "--window-size=1280,4000",
    ];
    let run = |extra: Vec<String>| {
        let mut cmd = tokio::process::Command::new(chromium);
        cmd.args(base).args(extra).arg(&url).kill_on_drop(true);
        async move {
            tokio::time::timeout(Duration::from_secs(120), cmd.output())
                .await
                .expect("chromium within 2 minutes")
                .expect("run chromium")
        }
    };
    let dom = run(vec!["--dump-dom".to_owned()]).await;
    assert!(dom.status.success(), "chromium --dump-dom: {}", text(&dom.stderr));
    let dom_text = text(&dom.stdout);
    for name in sections {
        assert!(
            dom_text.contains(&format!("id=\"{name}\"")),
            "chromium's DOM lacks {name}"
        );
    }
    assert!(dom_text.contains("<svg"), "chromium's DOM has the plots");
    let console_errors: Vec<&str> = text(&dom.stderr)
        .lines()
        .filter(|l| l.contains("CONSOLE") || l.contains("Uncaught"))
        .map(|_| "console message")
        .collect();
    assert!(console_errors.is_empty(), "{}", text(&dom.stderr));

    let shot = run(vec![format!("--screenshot={}", screenshot.display())]).await;
    assert!(
        shot.status.success(),
        "chromium --screenshot: {}",
        text(&shot.stderr)
    );
    let png = std::fs::read(screenshot).expect("the screenshot was written");
    assert!(
        png.len() > 10_000 && png.starts_with(b"\x89PNG"),
        "a PNG screenshot"
    );
    eprintln!("screenshot: {}", screenshot.display());
}
