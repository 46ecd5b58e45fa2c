//! The files in `deploy/` against this binary, so they cannot drift from the
//! CLI: every command line they run (the systemd unit's `ExecStart`, the
//! Kubernetes manifest's `args`, the image's `CMD`) parses, and every
//! variable they set is one that command reads. No systemd, cluster or
//! network: `outbox <args> --help` makes clap parse and validate each flag
//! before `--help` (exit 2 on an unknown flag or a bad value) and then exit
//! 0 without running anything.

use std::path::Path;
use std::process::Command;

fn deploy_file(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// `outbox <args> --help`: its exit code and the help text.
fn help(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(args)
        .arg("--help")
        .env_clear()
        .output()
        .expect("run outbox");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// The help of a command line the deploy files run; panics naming `file`
/// if any flag in it is unknown or its value does not parse.
fn accepted(file: &str, args: &[&str]) -> String {
    let (code, text) = help(args);
    assert_eq!(
        code,
        Some(0),
        "{file}: `outbox {}` is refused:\n{text}",
        args.join(" ")
    );
    text
}

/// Whether a command's help lists `var` as the variable of one of its flags:
/// clap prints `[env: NAME=value]`, or `[env: NAME]` for hidden values.
fn reads_env(help: &str, var: &str) -> bool {
    help.contains(&format!("[env: {var}=")) || help.contains(&format!("[env: {var}]"))
}

/// `KEY` of every `KEY=value` and `#KEY=value` line: the variables the
/// example file sets or offers.
fn env_file_keys(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|line| line.trim_start_matches('#').split_once('='))
        .map(|(key, _)| key)
        .filter(|key| {
            !key.is_empty()
                && key
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        })
        .collect()
}

#[test]
fn the_check_refuses_what_the_binary_does_not_know() {
    // Without this, a check that accepted everything would pass too.
    assert_eq!(help(&["relay", "--no-such-flag"]).0, Some(2));
    assert_eq!(help(&["relay", "--batch-size", "0"]).0, Some(2));
    let (_, relay) = help(&["relay"]);
    assert!(reads_env(&relay, "OUTBOX_SINK"), "{relay}");
    assert!(reads_env(&relay, "DATABASE_URL"), "{relay}");
    assert!(!reads_env(&relay, "OUTBOX_NO_SUCH_VARIABLE"));
    assert_eq!(
        env_file_keys("A=1\n#B_2=x\n# prose, not a key: C=3\n"),
        ["A", "B_2"]
    );
}

#[test]
fn systemd_unit_and_its_environment_file_match_the_cli() {
    let unit = deploy_file("outbox-relay.service");
    let exec: Vec<&str> = unit
        .lines()
        .filter_map(|line| line.strip_prefix("ExecStart="))
        .collect();
    assert_eq!(exec.len(), 1, "one ExecStart in the unit: {exec:?}");
    let mut words = exec[0].split_whitespace();
    let program = words.next().expect("ExecStart names a program");
    assert!(program.ends_with("/outbox"), "ExecStart runs {program}");
    let args: Vec<&str> = words.collect();
    assert_eq!(args.first(), Some(&"relay"), "ExecStart={}", exec[0]);
    let relay = accepted("outbox-relay.service", &args);
    assert!(unit.contains("\nType=notify\n"), "the relay speaks sd_notify");
    assert!(unit.contains("\nEnvironmentFile=/etc/outbox/relay.env\n"));

    let env = deploy_file("relay.env.example");
    let keys = env_file_keys(&env);
    for required in ["DATABASE_URL", "OUTBOX_SINK"] {
        assert!(
            keys.contains(&required),
            "relay.env.example sets {required}: {keys:?}"
        );
    }
    for key in &keys {
        assert!(
            reads_env(&relay, key),
            "relay.env.example: `outbox relay` reads no {key}"
        );
    }
}

#[test]
fn kubernetes_manifest_matches_the_cli() {
    let manifest = deploy_file("kubernetes/relay.yaml");
    // Each container lists `args: [...]` (a flow sequence of quoted strings,
    // which is JSON) before its `env:`; every upper-case `- name:` is a
    // variable of the command above it. Commented lines (the probes that
    // wait for `--http`) are not checked.
    let mut commands = Vec::new();
    let mut current: Option<(Vec<String>, String)> = None;
    let mut checked = 0;
    for line in manifest.lines().map(str::trim).filter(|l| !l.starts_with('#')) {
        if let Some(list) = line.strip_prefix("args:") {
            let args: Vec<String> = serde_json::from_str(list.trim()).unwrap_or_else(|e| {
                panic!("relay.yaml: args as a flow sequence of quoted strings: {line}: {e}")
            });
            let argv: Vec<&str> = args.iter().map(String::as_str).collect();
            let text = accepted("kubernetes/relay.yaml", &argv);
            commands.push(args[0].clone());
            current = Some((args, text));
        } else if let Some(name) = line.strip_prefix("- name: ") {
            if !name
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            {
                continue; // a container's or a port's name
            }
            let (args, text) = current.as_ref().expect("relay.yaml: args before env");
            assert!(
                reads_env(text, name),
                "relay.yaml: `outbox {}` reads no {name}",
                args.join(" ")
            );
            checked += 1;
        }
    }
    assert_eq!(
        commands,
        ["migrate", "relay"],
        "the init container migrates, the container relays"
    );
    assert!(
        checked >= 3,
        "DATABASE_URL twice and OUTBOX_SINK at least: {checked} checked"
    );
}

#[test]
fn container_image_runs_the_relay() {
    let containerfile = deploy_file("container/Containerfile");
    let cmd = containerfile
        .lines()
        .find_map(|line| line.strip_prefix("CMD "))
        .expect("the Containerfile has a CMD");
    let args: Vec<String> = serde_json::from_str(cmd).expect("CMD in exec form");
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    accepted("container/Containerfile", &argv);
    assert!(containerfile.contains("ENTRYPOINT [\"/usr/local/bin/outbox\"]"));
}
