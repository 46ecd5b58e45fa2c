//! Turning pgoutput's messages into outbox rows: the relation messages that
//! name the outbox's columns, its inserts (protocol version 1, values as
//! text), and the logical decoding messages `Outbox::emit` writes.
//!
//! One stream may carry several outboxes (a fleet's tenants, one slot per
//! database): each is known by its number in the source, and every event
//! decoded says which it belongs to, by its relation (`schema.table`) or
//! its message prefix.
//!
//! Columns are found by name in the latest relation message, so a column an
//! operator adds (`ALTER TABLE … ADD COLUMN`) or a different column order
//! changes nothing. Values arrive as the server prints them; the replication
//! session sets `DateStyle=ISO` and `TimeZone=UTC` so timestamps parse one
//! way.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use outbox::OutboxRow;
use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

/// A message pgoutput sent that the relay cannot make sense of: the
/// stream is given up and read again (it is not an event's fault).
#[derive(Debug, thiserror::Error)]
#[error("malformed pgoutput message: {0}")]
pub(crate) struct Malformed(String);

/// An event decoded from an insert or a message. `None` where the
/// decoders return it: not for this relay (another table, a dead letter
/// recorded as a row, another prefix, a message type the relay does not
/// need).
#[derive(Debug)]
pub(crate) struct Decoded {
    /// The outbox it belongs to: its number in the source.
    pub(crate) outbox: u32,
    pub(crate) row: OutboxRow,
    /// The row's id in the table; `None` for an emitted event.
    pub(crate) table_id: Option<i64>,
    /// Why its payload or headers could not be parsed, or which column
    /// breaks the table contract: a dead letter, never sent.
    pub(crate) unreadable: Option<String>,
    /// The payload's size as text, for `--batch-max-bytes`.
    pub(crate) bytes: u64,
}

/// The outbox's columns, by position in the tuples of its relation.
#[derive(Debug, Default, Clone)]
struct Columns {
    id: Option<usize>,
    event_id: Option<usize>,
    aggregate_type: Option<usize>,
    aggregate_id: Option<usize>,
    event_type: Option<usize>,
    payload: Option<usize>,
    headers: Option<usize>,
    created_at: Option<usize>,
    attempts: Option<usize>,
    published_at: Option<usize>,
    dead_at: Option<usize>,
}

/// Decodes the stream of one replication session.
#[derive(Debug, Default)]
pub(crate) struct Decoder {
    /// The outboxes by `(schema, table)`, as relation messages name them.
    tables: HashMap<(String, String), u32>,
    /// The outboxes by the logical decoding message prefix of their
    /// emitted events.
    prefixes: HashMap<String, u32>,
    /// Each relation id a relation message named (after each reconnect,
    /// and again after an `ALTER TABLE`).
    relations: HashMap<u32, Relation>,
}

/// A relation the stream named.
#[derive(Debug)]
struct Relation {
    name: (String, String),
    /// Its outbox, `None` for a table that is not an outbox of this
    /// source (yet: [`Decoder::add`] may make it one).
    outbox: Option<u32>,
    columns: Columns,
}

/// An emitted event's content (see `EMIT` in `outbox::sql`).
#[derive(Deserialize)]
struct Emitted {
    event_id: Option<Uuid>,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    payload: Value,
    #[serde(default)]
    headers: Option<Value>,
    created_at: Option<DateTime<Utc>>,
}

/// Reads big-endian fields off the front of a message.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        if self.0.len() < n {
            return Err(Malformed(format!("{} bytes left, {n} needed", self.0.len())));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }

    fn i16(&mut self) -> Result<i16, Malformed> {
        Ok(i16::from_be_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }

    fn u32(&mut self) -> Result<u32, Malformed> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn i32(&mut self) -> Result<i32, Malformed> {
        Ok(i32::from_be_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn cstr(&mut self) -> Result<&'a str, Malformed> {
        let end = self
            .0
            .iter()
            .position(|b| *b == 0)
            .ok_or_else(|| Malformed("a string without its terminator".into()))?;
        let s = std::str::from_utf8(&self.0[..end]).map_err(|e| Malformed(e.to_string()))?;
        self.0 = &self.0[end + 1..];
        Ok(s)
    }
}

impl Decoder {
    /// A decoder of one outbox's events, number 0.
    #[cfg(test)]
    pub(crate) fn new(schema: &str, table: &str, prefix: &str) -> Self {
        let mut decoder = Self::default();
        decoder.add(0, schema, table, prefix);
        decoder
    }

    /// Decodes `schema.table`'s inserts and the messages with `prefix` as
    /// events of outbox `outbox` from now on.
    pub(crate) fn add(&mut self, outbox: u32, schema: &str, table: &str, prefix: &str) {
        let name = (schema.to_owned(), table.to_owned());
        // pgoutput names a relation once per session: one named before it
        // was an outbox of this source is one from now on.
        for r in self.relations.values_mut().filter(|r| r.name == name) {
            r.outbox = Some(outbox);
        }
        self.tables.insert(name, outbox);
        self.prefixes.insert(prefix.to_owned(), outbox);
    }

    /// One pgoutput message (an `XLogData` payload other than begin and
    /// commit, which the replication client reports itself).
    pub(crate) fn data(&mut self, data: &[u8]) -> Result<Option<Decoded>, Malformed> {
        let mut r = Reader(data);
        match r.u8()? {
            b'R' => {
                self.relation(&mut r)?;
                Ok(None)
            }
            b'I' => {
                let relid = r.u32()?;
                let Some((outbox, columns)) = self
                    .relations
                    .get(&relid)
                    .and_then(|r| Some((r.outbox?, r.columns.clone())))
                else {
                    return Ok(None);
                };
                if r.u8()? != b'N' {
                    return Err(Malformed("an insert without its new tuple".into()));
                }
                let values = tuple(&mut r)?;
                Ok(insert(&columns, &values)?.map(|d| Decoded { outbox, ..d }))
            }
            // Updates, deletes, truncates, types and origins: the
            // publication sends only inserts; anything else is not ours.
            _ => Ok(None),
        }
    }

    /// A logical decoding message: an emitted event if its prefix is this
    /// outbox's. `lsn` names an event that came without an `event_id`, so
    /// a redelivery carries the same one.
    pub(crate) fn message(&self, prefix: &str, content: &[u8], lsn: u64) -> Option<Decoded> {
        let outbox = *self.prefixes.get(prefix)?;
        Some(match serde_json::from_slice::<Emitted>(content) {
            Ok(e) => contract(Decoded {
                outbox,
                row: OutboxRow {
                    id: 0,
                    event_id: e.event_id.unwrap_or_else(|| Uuid::from_u64_pair(lsn, 0)),
                    aggregate_type: e.aggregate_type,
                    aggregate_id: e.aggregate_id,
                    event_type: e.event_type,
                    payload: e.payload,
                    headers: e.headers.unwrap_or_else(|| Value::Object(Default::default())),
                    created_at: e.created_at.unwrap_or_else(Utc::now),
                    attempts: 0,
                    first_failed_at: None,
                },
                table_id: None,
                unreadable: None,
                bytes: content.len() as u64,
            }),
            Err(error) => Decoded {
                outbox,
                row: OutboxRow {
                    id: 0,
                    event_id: Uuid::from_u64_pair(lsn, 0),
                    aggregate_type: String::new(),
                    aggregate_id: String::new(),
                    event_type: String::new(),
                    payload: Value::String(String::from_utf8_lossy(content).into_owned()),
                    headers: Value::Object(Default::default()),
                    created_at: Utc::now(),
                    attempts: 0,
                    first_failed_at: None,
                },
                table_id: None,
                unreadable: Some(format!("emitted message: {error}")),
                bytes: content.len() as u64,
            },
        })
    }

    fn relation(&mut self, r: &mut Reader<'_>) -> Result<(), Malformed> {
        let relid = r.u32()?;
        let schema = r.cstr()?;
        let name = r.cstr()?;
        let _replica_identity = r.u8()?;
        let n = r.i16()?;
        let mut columns = Columns::default();
        let mut other = None;
        for i in 0..usize::try_from(n).unwrap_or(0) {
            let _flags = r.u8()?;
            let slot = match r.cstr()? {
                "id" => &mut columns.id,
                "event_id" => &mut columns.event_id,
                "aggregate_type" => &mut columns.aggregate_type,
                "aggregate_id" => &mut columns.aggregate_id,
                "event_type" => &mut columns.event_type,
                "payload" => &mut columns.payload,
                "headers" => &mut columns.headers,
                "created_at" => &mut columns.created_at,
                "attempts" => &mut columns.attempts,
                "published_at" => &mut columns.published_at,
                "dead_at" => &mut columns.dead_at,
                _ => &mut other,
            };
            *slot = Some(i);
            let _type = r.u32()?;
            let _modifier = r.i32()?;
        }
        let name = (schema.to_owned(), name.to_owned());
        let outbox = self.tables.get(&name).copied();
        self.relations.insert(
            relid,
            Relation {
                name,
                outbox,
                columns,
            },
        );
        Ok(())
    }
}

/// A tuple's values as text (`None`: NULL).
fn tuple<'a>(r: &mut Reader<'a>) -> Result<Vec<Option<&'a str>>, Malformed> {
    let n = r.i16()?;
    let mut values = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
    for _ in 0..n {
        values.push(match r.u8()? {
            b'n' => None,
            b't' => {
                let len = usize::try_from(r.i32()?).map_err(|_| Malformed("a negative length".into()))?;
                let bytes = r.take(len)?;
                Some(std::str::from_utf8(bytes).map_err(|e| Malformed(e.to_string()))?)
            }
            // An insert carries every value; an unchanged TOAST value ('u')
            // only appears in updates, binary ('b') only when asked for.
            kind => return Err(Malformed(format!("a tuple value of kind {:?}", kind as char))),
        });
    }
    Ok(values)
}

fn insert(c: &Columns, values: &[Option<&str>]) -> Result<Option<Decoded>, Malformed> {
    let get = |col: Option<usize>, name: &str| -> Result<Option<&str>, Malformed> {
        let i = col.ok_or_else(|| Malformed(format!("the outbox's relation has no {name} column")))?;
        values
            .get(i)
            .copied()
            .ok_or_else(|| Malformed(format!("the insert has no value for {name}")))
    };
    let required = |col: Option<usize>, name: &str| -> Result<&str, Malformed> {
        get(col, name)?.ok_or_else(|| Malformed(format!("{name} is NULL")))
    };
    // A dead letter recorded as a row (an emitted event the relay gave up
    // on) or a row inserted as published is not to be delivered.
    let set = |col: Option<usize>| col.and_then(|i| values.get(i).copied().flatten()).is_some();
    if set(c.dead_at) || set(c.published_at) {
        return Ok(None);
    }
    let parse = |what: &str, text: &str| -> Result<i64, Malformed> {
        text.parse()
            .map_err(|e| Malformed(format!("{what} {text:?}: {e}")))
    };
    let id = parse("id", required(c.id, "id")?)?;
    let mut unreadable = None;
    let mut json = |name: &str, text: Option<&str>| -> Value {
        match text.map(serde_json::from_str::<Value>) {
            Some(Ok(v)) => v,
            Some(Err(e)) => {
                unreadable.get_or_insert_with(|| format!("{name}: {e}"));
                Value::Null
            }
            None => Value::Object(Default::default()),
        }
    };
    let payload_text = required(c.payload, "payload")?;
    let payload = json("payload", Some(payload_text));
    let headers = json("headers", get(c.headers, "headers")?);
    let created_at = required(c.created_at, "created_at")?;
    let row = OutboxRow {
        id,
        event_id: required(c.event_id, "event_id")?
            .parse()
            .map_err(|e| Malformed(format!("event_id: {e}")))?,
        aggregate_type: required(c.aggregate_type, "aggregate_type")?.to_owned(),
        aggregate_id: required(c.aggregate_id, "aggregate_id")?.to_owned(),
        event_type: required(c.event_type, "event_type")?.to_owned(),
        payload,
        headers,
        created_at: DateTime::parse_from_str(created_at, "%Y-%m-%d %H:%M:%S%.f%#z")
            .map_err(|e| Malformed(format!("created_at {created_at:?}: {e}")))?
            .with_timezone(&Utc),
        attempts: match get(c.attempts, "attempts")? {
            Some(a) => i32::try_from(parse("attempts", a)?).unwrap_or(i32::MAX),
            None => 0,
        },
        // The WAL source keeps a failing event's window in memory; a row
        // read from the log (a requeued one too) starts afresh.
        first_failed_at: None,
    };
    Ok(Some(contract(Decoded {
        outbox: 0,
        row,
        table_id: Some(id),
        unreadable,
        bytes: payload_text.len() as u64,
    })))
}

/// A readable event that breaks the table contract becomes unreadable,
/// naming the column: an emitted event never met the table's constraints,
/// and a row may predate them (migration 8 does not validate old rows).
fn contract(mut d: Decoded) -> Decoded {
    if d.unreadable.is_none() {
        d.unreadable = outbox::contract::check_row(&d.row).err().map(|v| v.to_string());
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cstr(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }

    fn relation(relid: u32, schema: &str, table: &str, cols: &[&str]) -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend_from_slice(&relid.to_be_bytes());
        cstr(&mut m, schema);
        cstr(&mut m, table);
        m.push(b'd');
        m.extend_from_slice(&i16::try_from(cols.len()).unwrap().to_be_bytes());
        for c in cols {
            m.push(0);
            cstr(&mut m, c);
            m.extend_from_slice(&25u32.to_be_bytes());
            m.extend_from_slice(&(-1i32).to_be_bytes());
        }
        m
    }

    fn insert_msg(relid: u32, values: &[Option<&str>]) -> Vec<u8> {
        let mut m = vec![b'I'];
        m.extend_from_slice(&relid.to_be_bytes());
        m.push(b'N');
        m.extend_from_slice(&i16::try_from(values.len()).unwrap().to_be_bytes());
        for v in values {
            match v {
                None => m.push(b'n'),
                Some(s) => {
                    m.push(b't');
                    m.extend_from_slice(&i32::try_from(s.len()).unwrap().to_be_bytes());
                    m.extend_from_slice(s.as_bytes());
                }
            }
        }
        m
    }

    const COLS: &[&str] = &[
        "id",
        "event_id",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "payload",
        "created_at",
        "published_at",
        "attempts",
        "next_attempt_at",
        "last_error",
        "headers",
        "given_up_at",
        "dead_at",
        "added_later",
    ];

    fn values<'a>(payload: &'a str, dead_at: Option<&'a str>) -> Vec<Option<&'a str>> {
        vec![
            Some("42"),
            Some("6f1c2a52-2f0b-4a8e-9a53-0e0c8a4b8f11"),
            Some("orders"),
            Some("7"),
            Some("OrderCreated"),
            Some(payload),
            Some("2026-12-06 07:23:38.123456+00"),
            None,
            Some("0"),
            Some("2026-12-06 07:23:38.123456+00"),
            None,
            Some("{\"trace\": \"x\"}"),
            None,
            dead_at,
            Some("whatever"),
        ]
    }

    #[test]
    fn an_insert_of_the_outbox_becomes_its_row() {
        let mut d = Decoder::new("public", "outbox", "outbox:public.outbox");
        assert!(d.data(&relation(7, "public", "outbox", COLS)).unwrap().is_none());
        let Decoded {
            row,
            table_id,
            unreadable,
            ..
        } = d
            .data(&insert_msg(7, &values("{\"n\": 1}", None)))
            .unwrap()
            .expect("an event");
        assert_eq!((row.id, table_id, unreadable), (42, Some(42), None));
        assert_eq!(row.aggregate_id, "7");
        assert_eq!(row.payload, serde_json::json!({"n": 1}));
        assert_eq!(row.headers, serde_json::json!({"trace": "x"}));
        assert_eq!(row.created_at.to_rfc3339(), "2026-12-06T07:23:38.123456+00:00");
    }

    #[test]
    fn a_fleets_stream_names_each_events_outbox_by_relation_and_prefix() {
        let mut d = Decoder::default();
        d.add(3, "tenant_3", "outbox", "outbox:tenant_3.outbox");
        d.add(5, "tenant_5", "outbox", "outbox:tenant_5.outbox");
        for (relid, schema) in [(7, "tenant_5"), (8, "tenant_3"), (9, "tenant_9")] {
            d.data(&relation(relid, schema, "outbox", COLS)).unwrap();
        }
        let of = |d: &mut Decoder, relid| {
            d.data(&insert_msg(relid, &values("{}", None)))
                .unwrap()
                .map(|e| e.outbox)
        };
        assert_eq!(
            (of(&mut d, 7), of(&mut d, 8), of(&mut d, 9)),
            (Some(5), Some(3), None)
        );
        let content = br#"{"aggregate_type":"a","aggregate_id":"1","event_type":"E","payload":{}}"#;
        assert_eq!(
            d.message("outbox:tenant_3.outbox", content, 1).map(|e| e.outbox),
            Some(3)
        );
        assert!(d.message("outbox:tenant_9.outbox", content, 1).is_none());
    }

    #[test]
    fn other_tables_dead_letters_and_unreadable_payloads() {
        let mut d = Decoder::new("public", "outbox", "outbox:public.outbox");
        d.data(&relation(7, "public", "outbox", COLS)).unwrap();
        d.data(&relation(8, "public", "orders", &["id"])).unwrap();
        assert!(d.data(&insert_msg(8, &[Some("1")])).unwrap().is_none());
        let dead = values("{}", Some("2026-12-06 07:23:38+00"));
        assert!(d.data(&insert_msg(7, &dead)).unwrap().is_none());
        let Decoded { unreadable, .. } = d
            .data(&insert_msg(7, &values("{\"n\": 1e400}", None)))
            .unwrap()
            .expect("an event");
        assert!(unreadable.unwrap().starts_with("payload: "));
        assert!(
            d.data(&insert_msg(7, &values("{}", None))[..20]).is_err(),
            "truncated"
        );
    }

    #[test]
    fn an_emitted_message_of_this_outbox_becomes_a_row_without_id() {
        let d = Decoder::new("public", "outbox", "outbox:public.outbox");
        let content = br#"{"event_id":"6f1c2a52-2f0b-4a8e-9a53-0e0c8a4b8f11","aggregate_type":"a","aggregate_id":"1","event_type":"E","payload":{"x":1},"headers":{},"created_at":"2026-12-06T07:23:38.123456+00:00"}"#;
        let Decoded { row, table_id, .. } = d.message("outbox:public.outbox", content, 99).expect("an event");
        assert_eq!((row.id, table_id), (0, None));
        assert_eq!(row.payload, serde_json::json!({"x": 1}));
        assert!(d.message("other", content, 99).is_none());
        // Without an event_id (plain SQL), one derived from the position,
        // the same on every redelivery.
        let bare = br#"{"aggregate_type":"a","aggregate_id":"1","event_type":"E","payload":{}}"#;
        let a = d.message("outbox:public.outbox", bare, 99).expect("an event");
        let b = d.message("outbox:public.outbox", bare, 99).expect("an event");
        assert_eq!(a.row.event_id, b.row.event_id);
    }

    /// No constraint sees an emitted event, nor a row older than
    /// migration 8: what breaks the table contract is a dead letter
    /// naming the column.
    #[test]
    fn events_that_break_the_table_contract_are_unreadable() {
        let d = Decoder::new("public", "outbox", "outbox:public.outbox");
        let unreadable = |content: &str| {
            d.message("outbox:public.outbox", content.as_bytes(), 99)
                .expect("an event")
                .unreadable
        };
        let event = |aggregate_type: &str, headers: &str| {
            format!(
                r#"{{"aggregate_type":"{aggregate_type}","aggregate_id":"1","event_type":"E","payload":{{}},"headers":{headers}}}"#
            )
        };
        assert_eq!(unreadable(&event("billing", r#"{"trace":"x"}"#)), None);
        assert_eq!(
            unreadable(&event("billing", r#"["trace"]"#)).as_deref(),
            Some("headers: expected a JSON object of strings, got an array")
        );
        assert!(
            unreadable(&event("billing / eu", "{}"))
                .unwrap()
                .starts_with("aggregate_type \"billing / eu\" is not a name"),
        );

        let mut d = Decoder::new("public", "outbox", "outbox:public.outbox");
        d.data(&relation(7, "public", "outbox", COLS)).unwrap();
        let mut row = values("{}", None);
        row[2] = Some("");
        let Decoded { unreadable, .. } = d.data(&insert_msg(7, &row)).unwrap().expect("an event");
        assert_eq!(unreadable.as_deref(), Some("aggregate_type is empty"));
    }
}
