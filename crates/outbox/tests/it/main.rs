//! The library against a real PostgreSQL: the writer (tokio-postgres and
//! sqlx), the inbox, migrations and schema checks, and the claim's plan.
//! The relay and the `outbox` binary are tested in their own crates.

#![allow(unreachable_pub, missing_docs)]

mod claim;
mod contract;
mod events;
mod support;
mod writer;
