//! Records the git commit the binary is built from, for the metric
//! `outbox_build_info{commit}`: `git rev-parse --short HEAD`, or `unknown`
//! where there is no git or no repository (a crate's tarball, `cargo
//! install` from crates.io). A build without the repository (the
//! container build's context has no `.git`) passes it in
//! `OUTBOX_BUILD_COMMIT`. Nothing here may fail the build.

use std::path::Path;
use std::process::Command;

/// `git <args>`'s output, trimmed; None if git is missing or fails.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

fn main() {
    println!("cargo:rerun-if-env-changed=OUTBOX_BUILD_COMMIT");
    let given = std::env::var("OUTBOX_BUILD_COMMIT")
        .ok()
        .filter(|c| !c.is_empty() && c != "unknown");
    let commit = given
        .or_else(|| git(&["rev-parse", "--short", "HEAD"]))
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=OUTBOX_COMMIT={commit}");
    // Run again when HEAD moves: HEAD itself (a branch switch), the
    // branch's ref (a commit) and packed-refs. Only paths that exist: a
    // missing one would run this, and rebuild the binary, every time.
    println!("cargo:rerun-if-changed=build.rs");
    let mut paths = vec!["HEAD".to_owned(), "packed-refs".to_owned()];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        paths.push(branch);
    }
    for path in paths {
        if let Some(file) = git(&["rev-parse", "--path-format=absolute", "--git-path", &path])
            && Path::new(&file).exists()
        {
            println!("cargo:rerun-if-changed={file}");
        }
    }
}
