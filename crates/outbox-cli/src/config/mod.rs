//! `outbox relay --config outbox.toml`: every relay setting in one file, and
//! routes from aggregate types to sinks.
//!
//! Owns the file's shape, its checks, and how it is layered under the
//! command line and the environment ([`Layered`]); building the sinks is
//! `outbox_relay::sink`'s. Every key is a relay flag's id, its long name
//! with underscores (`--batch-size` = `batch_size`; `--kafka-option` =
//! `kafka_options`), and is checked by the flag's own value parser, so a
//! key takes exactly what its flag takes.
//!
//! Precedence, for the top-level keys: a flag on the command line, then its
//! environment variable, then the file, then the default. The file's values
//! are handed to clap as if they were flags, only for settings neither the
//! command line nor the environment gave (clap's `ValueSource` says which),
//! so clap stays the one parser. Inside a sink table (`[default]`,
//! `[routes.<type>]`) the table's own keys win for that route, and a key it
//! leaves out takes the top-level value. Unknown keys, bad values and a type
//! routed twice are errors naming the key and its line (exit 2), found
//! before the relay starts.
//!
//! ```toml
//! batch_size = 50                 # = --batch-size 50
//! ordering = "strict"
//! sink = "http://127.0.0.1:8080/events"
//! format = "cloudevents"
//!
//! [routes.orders]                 # aggregate type "orders"
//! sink = "nats://127.0.0.1:4222"
//! nats_subject = "orders.{event_type}"
//!
//! [routes.payments]
//! sink = "amqp://guest:guest@127.0.0.1:5672/%2f"
//! format = "debezium"
//!
//! [ordering_for]                  # per aggregate type, over `ordering`
//! payments = "partition"
//! ```
//!
//! | module | owns |
//! |---|---|
//! | `file.rs` | the file's shape, its keys, reading it, `path:line` |
//! | `layered.rs` | the file under flags and environment, each setting's [`Origin`] |
//! | `router.rs` | the sink tables over the flags' options, the routers (split by claim mode) |

mod file;
mod layered;
mod router;

pub(crate) use file::{ConfigFile, setting_keys, table_keys};
pub(crate) use layered::{Layered, Origin};
pub(crate) use router::{NamedSink, OtherLane};
