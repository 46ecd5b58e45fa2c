//! The relay as a library, in one process, against a real PostgreSQL: what
//! a process running several relays (a fleet) relies on. The `outbox`
//! binary's end-to-end tests are in `crates/outbox-cli/tests/it`.

#![allow(unreachable_pub, missing_docs)]

mod context;
mod support;
