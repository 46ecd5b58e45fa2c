//! Integration tests of `outbox-lab`: the lab, the bench, the soak and the
//! demo, each run through the binary against the throwaway services it
//! starts, with the relays it drives run from the workspace's `outbox`
//! binary. One binary for the whole crate to save link time.

#![allow(unreachable_pub, missing_docs)]

mod bench;
mod demo;
mod lab;
mod soak;
mod support;
