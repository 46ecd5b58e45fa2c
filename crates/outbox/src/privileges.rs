//! What each kind of role needs, in least privilege: the writer, the relay
//! (per source), the consumer, the console, retention, replay, migrations.
//!
//! One list, [`Role::requirements`], read from the statements in
//! [`crate::sql`] and the migrations: every command checks it at startup
//! ([`check`]: one query for every privilege, so a missing one is a
//! configuration error naming it and the command that grants it, not a
//! `permission denied` in a loop), and `outbox migrate --grant ROLE --as
//! KIND` applies it ([`grants`], then [`apply`]). `docs/privileges.md`
//! is its table for people; a test there runs each command as a role with
//! exactly these grants.
//!
//! What is not here: the role's own login (`CONNECT` on the database is
//! `PUBLIC`'s by default), a consumer's `--apply` statement (the
//! application's own tables), and functions `PUBLIC` may run
//! (`pg_notify`, the advisory locks, `pg_stat_activity`).

use std::fmt;
use std::str::FromStr;

use crate::{Config, Error, Ident, InboxConfig};

/// A kind of role, as `outbox migrate --grant ROLE --as KIND` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Role {
    /// The application writing events (`Outbox::enqueue`); `emit` needs
    /// nothing.
    Writer,
    /// `outbox relay` (`--source poll`, either claim mode).
    Relay,
    /// `outbox relay --source wal`.
    RelayWal,
    /// `outbox consume`: the inbox table.
    Consume,
    /// `outbox stats` and `dlq list`.
    Stats,
    /// `outbox admin` without a token (read-only), and `outbox relays`.
    AdminRead,
    /// `outbox admin` with a token (requeue, give up), and `dlq requeue`
    /// and `dlq give-up`.
    Admin,
    /// `outbox cleanup`, and `relay --retention` on a plain outbox.
    Cleanup,
    /// `outbox cleanup --inbox`.
    CleanupInbox,
    /// `outbox partitions maintain`, and `relay --retention` on a daily
    /// partitioned outbox: DDL, so the table's owner.
    Partitions,
    /// `outbox replay`.
    Replay,
    /// `outbox migrate`: the table's owner, and CREATE on its schema.
    Migrate,
}

impl Role {
    /// Every kind, in the order the docs list them.
    pub const ALL: [Role; 12] = [
        Role::Writer,
        Role::Relay,
        Role::RelayWal,
        Role::Consume,
        Role::Stats,
        Role::AdminRead,
        Role::Admin,
        Role::Cleanup,
        Role::CleanupInbox,
        Role::Partitions,
        Role::Replay,
        Role::Migrate,
    ];

    /// Its name for `--as`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Writer => "writer",
            Role::Relay => "relay",
            Role::RelayWal => "relay-wal",
            Role::Consume => "consume",
            Role::Stats => "stats",
            Role::AdminRead => "admin-read",
            Role::Admin => "admin",
            Role::Cleanup => "cleanup",
            Role::CleanupInbox => "cleanup-inbox",
            Role::Partitions => "partitions",
            Role::Replay => "replay",
            Role::Migrate => "migrate",
        }
    }

    /// Whether its objects are the inbox's rather than the outbox's.
    pub fn on_inbox(self) -> bool {
        matches!(self, Role::Consume | Role::CleanupInbox)
    }

    /// What it needs, with why. `leases`: the relay takes partition leases
    /// (every `--ordering` but `none`).
    pub fn requirements(self, leases: bool) -> Vec<Requirement> {
        use Object::*;
        let need = |object, privilege, why| Requirement {
            role: self,
            object,
            privilege,
            why,
        };
        let usage = need(Schema, "USAGE", "to name anything in it");
        let ledger = need(Ledger, "SELECT", "the schema version check at startup");
        let mut list = Vec::new();
        match self {
            Role::Writer => list.extend([
                usage,
                need(Outbox, "INSERT", "enqueue"),
                need(Sequence, "USAGE", "enqueue: the id's default"),
            ]),
            Role::Relay => {
                list.extend([
                    usage,
                    ledger,
                    need(
                        Outbox,
                        "SELECT",
                        "the claim, the claim floor, the next retry, stats",
                    ),
                    need(
                        Outbox,
                        "UPDATE",
                        "the claim (FOR UPDATE), marks, retries, dead letters",
                    ),
                ]);
                if leases {
                    for table in [Relays, Leases] {
                        for privilege in ["SELECT", "INSERT", "UPDATE", "DELETE"] {
                            list.push(need(
                                table,
                                privilege,
                                "the lease tick (heartbeat, rebalancing), the claim's FOR SHARE, leaving",
                            ));
                        }
                    }
                    list.push(need(TickFn, "EXECUTE", "the lease tick"));
                    // Route state rides on the lease tick (no leases, no
                    // route state: see docs/routing.md).
                    list.push(need(Routes, "SELECT", "route pauses, read on the heartbeat"));
                    for table in [RouteState, Rollup] {
                        for privilege in ["SELECT", "INSERT", "UPDATE", "DELETE"] {
                            list.push(need(
                                table,
                                privilege,
                                "route state and the rollup, written on the heartbeat (upsert, old rows deleted)",
                            ));
                        }
                    }
                }
            }
            Role::RelayWal => list.extend([
                usage,
                ledger,
                need(Outbox, "SELECT", "the backfill after a lost slot"),
                need(Outbox, "INSERT", "dead letters of emitted events"),
                need(Outbox, "UPDATE", "dead letters"),
                need(Outbox, "DELETE", "--wal-cleanup delete, recovery's re-insert"),
                need(
                    Sequence,
                    "USAGE",
                    "dead letters of emitted events: the id's default",
                ),
                need(
                    Replication,
                    "REPLICATION",
                    "the replication connection and its slot",
                ),
                need(Publication, "OWNER", "the backfill's mark on the publication"),
            ]),
            Role::Consume => list.extend([
                need(InboxSchema, "USAGE", "to name anything in it"),
                need(InboxLedger, "SELECT", "the schema version check at startup"),
                need(Inbox, "SELECT", "the record's ON CONFLICT (event_id)"),
                need(
                    Inbox,
                    "INSERT",
                    "recording each event in the side effect's transaction",
                ),
            ]),
            Role::Stats => list.extend([usage, ledger, need(Outbox, "SELECT", "counts, dead letters")]),
            Role::AdminRead | Role::Admin => {
                list.extend([
                    usage,
                    ledger,
                    need(
                        Outbox,
                        "SELECT",
                        "backlog, throughput, dead letters, an event's story",
                    ),
                    need(Relays, "SELECT", "the relays"),
                    need(Leases, "SELECT", "the partitions each relay holds"),
                    need(Routes, "SELECT", "the routes page: pauses"),
                    need(RouteState, "SELECT", "the routes page: what relays report"),
                    need(Rollup, "SELECT", "the routes page: deliveries per minute"),
                    need(Replays, "SELECT", "the replays page"),
                    need(Audit, "SELECT", "the audit trail"),
                ]);
                if self == Role::Admin {
                    list.extend([
                        need(
                            Outbox,
                            "INSERT",
                            "requeue (a dead letter is inserted again, same id)",
                        ),
                        need(Outbox, "UPDATE", "give up"),
                        need(Outbox, "DELETE", "requeue, purge"),
                        need(Routes, "INSERT", "pause a route"),
                        need(Routes, "UPDATE", "pause and resume a route"),
                        need(Audit, "INSERT", "recording every change"),
                        need(AuditSequence, "USAGE", "an audit row's id"),
                        need(Replays, "INSERT", "a replay job started from the console"),
                        need(Replays, "UPDATE", "a replay job's cursor and state"),
                        need(ReplaysSequence, "USAGE", "a new replay job's id"),
                        need(Removed, "SELECT", "what cleanup removed, counted before a replay"),
                    ]);
                }
            }
            Role::Cleanup => list.extend([
                usage,
                ledger,
                need(Outbox, "SELECT", "finding published rows past the cutoff"),
                need(Outbox, "DELETE", "deleting them"),
                need(
                    Removed,
                    "SELECT",
                    "adding to what retention removed (ON CONFLICT)",
                ),
                need(Removed, "INSERT", "recording what retention removed, for replay"),
                need(Removed, "UPDATE", "adding to what retention removed"),
            ]),
            Role::CleanupInbox => list.extend([
                need(InboxSchema, "USAGE", "to name anything in it"),
                need(InboxLedger, "SELECT", "the schema version check at startup"),
                need(Inbox, "SELECT", "finding records past the cutoff"),
                need(Inbox, "DELETE", "deleting them"),
            ]),
            Role::Partitions => list.extend([
                usage,
                ledger,
                need(Schema, "CREATE", "creating the coming days' partitions"),
                need(Outbox, "OWNER", "attaching and dropping partitions"),
                need(
                    Removed,
                    "SELECT",
                    "adding to what retention removed (ON CONFLICT)",
                ),
                need(Removed, "INSERT", "recording a dropped day, for replay"),
                need(Removed, "UPDATE", "adding to what retention removed"),
            ]),
            Role::Replay => list.extend([
                usage,
                ledger,
                need(Outbox, "SELECT", "the published events it sends again"),
                need(Replays, "SELECT", "--resume, --list"),
                need(Replays, "INSERT", "a new job"),
                need(Replays, "UPDATE", "the job's cursor and state"),
                need(ReplaysSequence, "USAGE", "a new job's id"),
                need(
                    Removed,
                    "SELECT",
                    "what retention removed of the events it matches",
                ),
            ]),
            Role::Migrate => list.extend([
                usage,
                need(Schema, "CREATE", "creating the tables"),
                need(Outbox, "OWNER", "altering the table"),
            ]),
        }
        list
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL.into_iter().find(|r| r.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Role::ALL.iter().map(|r| r.name()).collect();
            format!("unknown role kind {s:?}: expected one of {}", names.join(", "))
        })
    }
}

/// What a requirement is on, resolved against a [`Tables`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Object {
    Schema,
    Outbox,
    /// The outbox's `id` sequence.
    Sequence,
    /// `<table>_migrations`.
    Ledger,
    Relays,
    Leases,
    TickFn,
    Removed,
    Replays,
    ReplaysSequence,
    /// `<table>_routes`, `<table>_route_state`, `<table>_rollup`.
    Routes,
    RouteState,
    Rollup,
    /// `<table>_audit` and its id sequence.
    Audit,
    AuditSequence,
    InboxSchema,
    Inbox,
    InboxLedger,
    Publication,
    /// The role itself (its REPLICATION attribute).
    Replication,
}

/// One privilege a role of a kind needs, on one object, and why.
#[derive(Debug, Clone)]
pub struct Requirement {
    /// The kind that needs it (for the fix's `--as`).
    pub role: Role,
    object: Object,
    /// `SELECT`, `USAGE`, …; `OWNER` for ownership, `REPLICATION` for the
    /// attribute.
    pub privilege: &'static str,
    /// What of the role's work needs it.
    pub why: &'static str,
}

/// The objects of one outbox and one inbox, named.
#[derive(Debug, Clone)]
pub struct Tables {
    outbox: Config,
    inbox: InboxConfig,
}

/// One requirement as the catalog query takes it, and as people read it.
struct Named {
    kind: &'static str,
    object: String,
    schema: String,
    /// For messages: `table public.outbox_relays`.
    shown: String,
}

impl Tables {
    /// The outbox `outbox` and the inbox `inbox` (its default when the
    /// command has none).
    pub fn new(outbox: Config, inbox: InboxConfig) -> Self {
        Self { outbox, inbox }
    }

    /// The outbox alone.
    pub fn outbox(outbox: Config) -> Self {
        Self::new(outbox, InboxConfig::default())
    }

    fn name(&self, r: &Requirement) -> Result<Named, Error> {
        let o = &self.outbox;
        let (schema, shown_schema) = match r.object {
            Object::InboxSchema | Object::Inbox | Object::InboxLedger => (
                self.inbox.schema.as_str().to_owned(),
                self.inbox.schema.to_string(),
            ),
            _ => (o.schema.as_str().to_owned(), o.schema.to_string()),
        };
        let bare = |suffix: &str| format!("{shown_schema}.{}{suffix}", o.table);
        let (kind, object, shown) = match r.object {
            Object::Schema | Object::InboxSchema => {
                let quoted = if r.object == Object::Schema {
                    o.schema.quoted()
                } else {
                    self.inbox.schema.quoted()
                };
                ("schema", quoted, format!("schema {shown_schema}"))
            }
            Object::Outbox if r.privilege == "OWNER" => (
                "owner",
                o.qualified(),
                format!("table {} (membership in its owner's role)", o.display_name()),
            ),
            Object::Outbox => ("table", o.qualified(), format!("table {}", o.display_name())),
            Object::Sequence => (
                "sequence",
                o.qualified(),
                format!("the id sequence of {}", o.display_name()),
            ),
            Object::Ledger
            | Object::Relays
            | Object::Leases
            | Object::Removed
            | Object::Replays
            | Object::Routes
            | Object::RouteState
            | Object::Rollup
            | Object::Audit => {
                let suffix = match r.object {
                    Object::Ledger => "_migrations",
                    Object::Relays => "_relays",
                    Object::Leases => "_leases",
                    Object::Removed => "_removed",
                    Object::Routes => "_routes",
                    Object::RouteState => "_route_state",
                    Object::Rollup => "_rollup",
                    Object::Audit => "_audit",
                    _ => "_replays",
                };
                ("table", o.companion(suffix)?, format!("table {}", bare(suffix)))
            }
            Object::ReplaysSequence => (
                "sequence",
                o.companion("_replays")?,
                format!("the id sequence of {}", bare("_replays")),
            ),
            Object::AuditSequence => (
                "sequence",
                o.companion("_audit")?,
                format!("the id sequence of {}", bare("_audit")),
            ),
            Object::TickFn => (
                "function",
                // The signature the migrations create (0003, 0004).
                format!(
                    "{}(uuid, text, interval, int4, int4[], timestamptz[])",
                    o.companion("_relay_tick")?
                ),
                format!("function {}", bare("_relay_tick")),
            ),
            Object::Inbox => (
                "table",
                self.inbox.qualified(),
                format!("table {}", self.inbox.display_name()),
            ),
            Object::InboxLedger => (
                "table",
                format!(
                    "{}.{}",
                    self.inbox.schema.quoted(),
                    Ident::new("--inbox-table", &format!("{}_migrations", self.inbox.table))?.quoted()
                ),
                format!("table {}_migrations", self.inbox.display_name()),
            ),
            Object::Publication => {
                let p = o.wal_publication()?;
                ("publication", p.as_str().to_owned(), format!("publication {p}"))
            }
            Object::Replication => ("replication", String::new(), "the role".to_owned()),
        };
        Ok(Named {
            kind,
            object,
            schema,
            shown,
        })
    }
}

/// What [`check`] is asked: the kinds whose work a command does.
#[derive(Debug, Clone)]
pub struct Needs {
    roles: Vec<Role>,
    leases: bool,
}

impl Needs {
    /// The union of `roles`' requirements, the relay's with leases.
    pub fn of(roles: &[Role]) -> Self {
        Self {
            roles: roles.to_vec(),
            leases: true,
        }
    }

    /// A relay that takes no partition leases (`--ordering none`).
    #[must_use]
    pub fn without_leases(mut self) -> Self {
        self.leases = false;
        self
    }

    /// Every requirement, each once, in the kinds' order.
    pub fn requirements(&self) -> Vec<Requirement> {
        let mut all: Vec<Requirement> = Vec::new();
        for role in &self.roles {
            for r in role.requirements(self.leases) {
                if !all
                    .iter()
                    .any(|seen| seen.object == r.object && seen.privilege == r.privilege)
                {
                    all.push(r);
                }
            }
        }
        all
    }
}

/// A requirement's object as the query takes it.
fn asked<'a>(named: &'a Named, privilege: &'static str) -> crate::sql::privileges::Asked<'a> {
    crate::sql::privileges::Asked {
        kind: named.kind,
        object: &named.object,
        privilege,
        schema: &named.schema,
    }
}

/// What is missing, grouped by object in order: `SELECT, INSERT on table
/// public.outbox_relays`.
fn describe(missing: &[(&Requirement, &Named)]) -> String {
    let mut groups: Vec<(String, Vec<&str>)> = Vec::new();
    for (r, named) in missing {
        let privilege = match r.privilege {
            "OWNER" => "ownership",
            "REPLICATION" => "the REPLICATION attribute",
            p => p,
        };
        match groups.iter_mut().find(|(shown, _)| *shown == named.shown) {
            Some((_, privileges)) => privileges.push(privilege),
            None => groups.push((named.shown.clone(), vec![privilege])),
        }
    }
    groups
        .into_iter()
        .map(|(shown, privileges)| match privileges.as_slice() {
            ["the REPLICATION attribute"] => "the REPLICATION attribute".to_owned(),
            ["ownership"] => format!("ownership of {shown}"),
            _ => format!("{} on {shown}", privileges.join(", ")),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Fails with [`Error::MissingPrivileges`] unless the connected role holds
/// everything `needs` lists on `tables`, checked in one query. An object
/// that does not exist is left to the schema check, which says `outbox
/// migrate` better.
#[cfg(feature = "tokio-postgres")]
pub async fn check(
    client: &impl tokio_postgres::GenericClient,
    tables: &Tables,
    needs: &Needs,
) -> Result<(), Error> {
    let requirements = needs.requirements();
    let named = requirements
        .iter()
        .map(|r| tables.name(r))
        .collect::<Result<Vec<_>, _>>()?;
    let asks: Vec<_> = requirements
        .iter()
        .zip(&named)
        .map(|(r, n)| asked(n, r.privilege))
        .collect();
    let held = crate::sql::privileges::check(client, &asks)
        .await
        .map_err(Error::pg("checking the role's privileges"))?;
    let missing: Vec<(&Requirement, &Named)> = requirements
        .iter()
        .zip(&named)
        .zip(&held.granted)
        .filter(|(_, granted)| **granted == Some(false))
        .map(|(pair, _)| pair)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let mut kinds: Vec<Role> = Vec::new();
    for (r, _) in &missing {
        if !kinds.contains(&r.role) {
            kinds.push(r.role);
        }
    }
    Err(Error::MissingPrivileges {
        role: held.role.clone(),
        missing: describe(&missing),
        fix: fix(
            &held.role,
            &kinds,
            &tables.outbox,
            missing.iter().any(|(r, _)| r.role == Role::RelayWal),
        ),
    })
}

/// `outbox migrate --grant ROLE --as KINDS`, with the table flags that are
/// not their defaults.
fn fix(role: &str, kinds: &[Role], outbox: &Config, superuser: bool) -> String {
    let kinds: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
    let mut command = format!("outbox migrate --grant {role} --as {}", kinds.join(","));
    if outbox.schema.as_str() != "public" {
        command.push_str(&format!(" --schema {}", outbox.schema));
    }
    if outbox.table.as_str() != "outbox" {
        command.push_str(&format!(" --table {}", outbox.table));
    }
    if superuser {
        command.push_str(" (run as a superuser: REPLICATION and the publication's owner)");
    } else {
        command.push_str(" (run as the table's owner)");
    }
    command
}

/// The statements that give `grantee` what `roles` need on `tables`, in
/// order, one per object: `GRANT SELECT, UPDATE ON TABLE "public"."outbox"
/// TO "app_relay"`. Reads the catalog for what only it knows (the `id`
/// sequences, the outbox's owner); changes nothing. Each statement is
/// idempotent.
#[cfg(feature = "tokio-postgres")]
pub async fn grants(
    client: &impl tokio_postgres::GenericClient,
    tables: &Tables,
    roles: &[Role],
    grantee: &Ident,
) -> Result<Vec<String>, Error> {
    let requirements = Needs::of(roles).requirements();
    let named = requirements
        .iter()
        .map(|r| tables.name(r))
        .collect::<Result<Vec<_>, _>>()?;
    let asks: Vec<_> = requirements
        .iter()
        .zip(&named)
        .map(|(r, n)| asked(n, r.privilege))
        .collect();
    let resolved = crate::sql::privileges::resolve(client, &asks)
        .await
        .map_err(Error::pg("reading the catalog for the grants"))?;
    // (kind, object) → privileges, in first-seen order.
    let mut statements: Vec<(&'static str, String, Vec<&'static str>)> = Vec::new();
    for ((r, n), found) in requirements.iter().zip(&named).zip(resolved) {
        if n.kind == "owner" && found.is_none() && r.role == Role::Migrate {
            // No table yet: whoever creates it owns it.
            continue;
        }
        let object = match n.kind {
            "sequence" | "owner" => found.ok_or_else(|| Error::NothingToGrantOn {
                what: n.shown.clone(),
            })?,
            "publication" => Ident::new("--table", &n.object)?.quoted(),
            _ => n.object.clone(),
        };
        match statements
            .iter_mut()
            .find(|(kind, o, _)| *kind == n.kind && *o == object)
        {
            Some((_, _, privileges)) => privileges.push(r.privilege),
            None => statements.push((n.kind, object, vec![r.privilege])),
        }
    }
    Ok(statements
        .into_iter()
        .map(|(kind, object, privileges)| {
            crate::sql::privileges::grant(kind, &object, &privileges.join(", "), grantee)
        })
        .collect())
}

/// Runs `statements` (from [`grants`]) in one transaction: all or none.
#[cfg(feature = "tokio-postgres")]
pub async fn apply(client: &mut tokio_postgres::Client, statements: &[String]) -> Result<(), Error> {
    let tx = client
        .transaction()
        .await
        .map_err(Error::pg("starting the grants' transaction"))?;
    for statement in statements {
        crate::sql::privileges::apply(&tx, statement)
            .await
            .map_err(Error::pg("granting"))?;
    }
    tx.commit().await.map_err(Error::pg("committing the grants"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_parses_back_from_its_name() {
        for role in Role::ALL {
            assert_eq!(role.name().parse::<Role>(), Ok(role));
            assert!(!role.requirements(true).is_empty(), "{role}");
        }
        assert!("relays".parse::<Role>().unwrap_err().contains("relay-wal"));
    }

    #[test]
    fn names_every_object_quoted() {
        let tables = Tables::new(
            Config::new("app", "events").unwrap(),
            InboxConfig::new("app", "seen").unwrap(),
        );
        for role in Role::ALL {
            for r in role.requirements(true) {
                let n = tables.name(&r).unwrap();
                match n.kind {
                    "replication" => assert!(n.object.is_empty()),
                    "publication" => assert_eq!(n.object, "app_events"),
                    _ => assert!(n.object.starts_with("\"app\""), "{}", n.object),
                }
                assert_eq!(n.schema, "app");
            }
        }
    }

    #[test]
    fn a_relay_without_leases_needs_no_lease_table() {
        let with = Needs::of(&[Role::Relay]).requirements();
        let without = Needs::of(&[Role::Relay]).without_leases().requirements();
        // Leases: 8 on two tables and the tick; route state: 1 + 8.
        assert_eq!(with.len(), without.len() + 18);
        assert!(without.iter().all(|r| r.object != Object::Leases));
        assert!(without.iter().all(|r| r.object != Object::RouteState));
    }

    #[test]
    fn missing_privileges_are_grouped_by_object() {
        let tables = Tables::outbox(Config::default());
        let reqs = Needs::of(&[Role::Relay, Role::Partitions]).requirements();
        let named: Vec<Named> = reqs.iter().map(|r| tables.name(r).unwrap()).collect();
        let pick = |object: Object, privilege: &str| {
            let i = reqs
                .iter()
                .position(|r| r.object == object && r.privilege == privilege)
                .unwrap();
            (&reqs[i], &named[i])
        };
        let text = describe(&[
            pick(Object::Relays, "INSERT"),
            pick(Object::Relays, "DELETE"),
            pick(Object::Outbox, "OWNER"),
        ]);
        assert_eq!(
            text,
            "INSERT, DELETE on table public.outbox_relays; ownership of table public.outbox (membership in its owner's role)"
        );
        assert_eq!(
            fix(
                "app",
                &[Role::Relay],
                &Config::new("app", "events").unwrap(),
                false
            ),
            "outbox migrate --grant app --as relay --schema app --table events (run as the table's owner)"
        );
    }
}
