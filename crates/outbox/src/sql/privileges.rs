//! The statements behind [`crate::privileges`]: one query that answers, for
//! the connected role, every privilege a command needs; one that looks up
//! what a GRANT must name and only the catalog knows (the `id` column's
//! sequence, an owner); and the GRANT statements themselves.
//!
//! Objects come in as rendered, quoted names (`Config::qualified`,
//! `Config::companion`) and are passed as bind parameters to the catalog
//! functions (`to_regclass`, `has_table_privilege`, …), never spliced into
//! the query. GRANT takes no parameters: its text is built here from
//! validated identifiers ([`Ident`]) and names the catalog quoted
//! (`pg_get_serial_sequence`, `quote_ident`).

use tokio_postgres::GenericClient;

use super::typed::typed;
use crate::Ident;

/// `$1` kinds, `$2` objects, `$3` privileges, `$4` the bare schema of each.
/// For each requirement, by its 1-based position: whether the current
/// role has it, NULL when that cannot be known because the object (or its
/// schema) does not exist or the schema is closed to the role (its own
/// `USAGE` requirement says so; the schema check names a missing table
/// better). Every function here is strict, so a NULL object gives NULL.
/// `owner` is membership in the role that owns the table (what ALTER, DROP
/// and `PARTITION OF` need); `replication` the role's attribute; `publication`
/// membership in its owner (the WAL source comments on it).
const CHECK: &str = "SELECT r.ord::int4, current_user::text, CASE \
        WHEN r.kind = 'replication' \
             THEN (SELECT a.rolreplication OR a.rolsuper FROM pg_roles AS a WHERE a.rolname = current_user) \
        WHEN r.kind = 'publication' \
             THEN pg_has_role((SELECT p.pubowner FROM pg_publication AS p WHERE p.pubname = r.object), 'USAGE') \
        WHEN NOT EXISTS (SELECT 1 FROM pg_namespace AS n WHERE n.nspname = r.schema) THEN NULL \
        WHEN r.kind = 'schema' THEN has_schema_privilege(r.schema, r.privilege) \
        WHEN NOT has_schema_privilege(r.schema, 'USAGE') THEN NULL \
        WHEN r.kind = 'table' THEN has_table_privilege(to_regclass(r.object), r.privilege) \
        WHEN r.kind = 'sequence' THEN CASE WHEN to_regclass(r.object) IS NOT NULL \
             THEN has_sequence_privilege(pg_get_serial_sequence(r.object, 'id'), r.privilege) END \
        WHEN r.kind = 'function' THEN has_function_privilege(to_regprocedure(r.object), r.privilege) \
        WHEN r.kind = 'owner' \
             THEN pg_has_role((SELECT c.relowner FROM pg_class AS c WHERE c.oid = to_regclass(r.object)), 'USAGE') \
     END \
     FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) WITH ORDINALITY AS r(kind, object, privilege, schema, ord) \
     ORDER BY r.ord";

/// `$1` kinds, `$2` objects. What a GRANT names for each, quoted by the
/// server: a table's `id` sequence, a table's owner; NULL for the other
/// kinds and for what does not exist.
const RESOLVE: &str = "SELECT r.ord::int4, CASE r.kind \
        WHEN 'sequence' THEN CASE WHEN to_regclass(r.object) IS NOT NULL \
             THEN pg_get_serial_sequence(r.object, 'id') END \
        WHEN 'owner' THEN (SELECT quote_ident(pg_get_userbyid(c.relowner)) FROM pg_class AS c \
                            WHERE c.oid = to_regclass(r.object)) \
     END \
     FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS r(kind, object, ord) ORDER BY r.ord";

/// One requirement as [`check`] and [`resolve`] take it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Asked<'a> {
    /// `schema`, `table`, `sequence` (the `id` sequence of the table
    /// named), `function` (a signature), `owner` (of the table named),
    /// `replication`, `publication` (its owner).
    pub(crate) kind: &'a str,
    /// The quoted, qualified object (a publication: its bare name).
    pub(crate) object: &'a str,
    /// `SELECT`, `USAGE`, …; ignored by the kinds that have none.
    pub(crate) privilege: &'a str,
    /// The bare schema the object is in.
    pub(crate) schema: &'a str,
}

/// What [`check`] found: the connected role, and per requirement (in the
/// order asked) whether it holds, None when the object is missing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Held {
    /// `current_user`.
    pub(crate) role: String,
    /// One per requirement, in order.
    pub(crate) granted: Vec<Option<bool>>,
}

/// Every requirement of `asked`, in one round trip.
pub(crate) async fn check(
    client: &impl GenericClient,
    asked: &[Asked<'_>],
) -> Result<Held, tokio_postgres::Error> {
    let kinds: Vec<String> = asked.iter().map(|a| a.kind.to_owned()).collect();
    let objects: Vec<String> = asked.iter().map(|a| a.object.to_owned()).collect();
    let privileges: Vec<String> = asked.iter().map(|a| a.privilege.to_owned()).collect();
    let schemas: Vec<String> = asked.iter().map(|a| a.schema.to_owned()).collect();
    let rows = client
        .query_typed(
            CHECK,
            &[
                typed(&kinds),
                typed(&objects),
                typed(&privileges),
                typed(&schemas),
            ],
        )
        .await?;
    let mut role = String::new();
    let mut granted = Vec::with_capacity(rows.len());
    for row in rows {
        role = row.try_get(1)?;
        granted.push(row.try_get(2)?);
    }
    if role.is_empty() {
        // Nothing asked: still say who asked.
        role = client
            .query_typed_one("SELECT current_user::text", &[])
            .await?
            .try_get(0)?;
    }
    Ok(Held { role, granted })
}

/// What each requirement's GRANT names that only the catalog knows (see
/// `RESOLVE`), in order; None where nothing is needed or nothing exists.
pub(crate) async fn resolve(
    client: &impl GenericClient,
    asked: &[Asked<'_>],
) -> Result<Vec<Option<String>>, tokio_postgres::Error> {
    let kinds: Vec<String> = asked.iter().map(|a| a.kind.to_owned()).collect();
    let objects: Vec<String> = asked.iter().map(|a| a.object.to_owned()).collect();
    client
        .query_typed(RESOLVE, &[typed(&kinds), typed(&objects)])
        .await?
        .iter()
        .map(|row| row.try_get(1))
        .collect()
}

/// The statement that gives `role` what `kind` asks of `object`:
/// `privileges` (comma-separated) on a table, sequence, schema or
/// function; membership in an owner (`object` is then the owner, quoted by
/// the server); the REPLICATION attribute; a publication's ownership.
pub(crate) fn grant(kind: &str, object: &str, privileges: &str, role: &Ident) -> String {
    let role = role.quoted();
    match kind {
        "schema" => format!("GRANT {privileges} ON SCHEMA {object} TO {role}"),
        "sequence" => format!("GRANT {privileges} ON SEQUENCE {object} TO {role}"),
        "function" => format!("GRANT {privileges} ON FUNCTION {object} TO {role}"),
        "owner" => format!("GRANT {object} TO {role}"),
        "replication" => format!("ALTER ROLE {role} REPLICATION"),
        "publication" => format!("ALTER PUBLICATION {object} OWNER TO {role}"),
        _ => format!("GRANT {privileges} ON TABLE {object} TO {role}"),
    }
}

/// Runs one GRANT (or ALTER) statement built by [`grant`].
pub(crate) async fn apply(client: &impl GenericClient, statement: &str) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(statement).await
}
