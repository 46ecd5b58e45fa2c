//! Bind parameters with their PostgreSQL types, as an unnamed statement
//! needs them: tokio-postgres's `query_typed` parses, binds and runs in one
//! round trip only when told each parameter's type, which a prepared
//! statement would have learnt from the server.
//!
//! The type comes from the Rust value ([`PgType`]), so a statement's
//! parameters are written once, `[typed(&ids), typed(&owner)]`, for both
//! ways a statement runs (prepared, which ignores the types, or unnamed).
//! Only the types the statements bind are listed; a new one is one line.

use chrono::{DateTime, Utc};
use tokio_postgres::types::{ToSql, Type};
use uuid::Uuid;

pub(crate) use crate::writer::Typed;

/// The PostgreSQL type a Rust value is bound as.
pub(crate) trait PgType {
    /// Its type (for a slice or `Vec`, the array type).
    const TYPE: Type;
}

/// Each Rust type with its PostgreSQL type and array type; slices and
/// `Vec`s of it bind as the array.
macro_rules! pg_types {
    ($($rust:ty => $one:ident, $many:ident;)*) => {$(
        impl PgType for $rust {
            const TYPE: Type = Type::$one;
        }
        impl PgType for &[$rust] {
            const TYPE: Type = Type::$many;
        }
        impl PgType for Vec<$rust> {
            const TYPE: Type = Type::$many;
        }
    )*};
}

pg_types! {
    bool => BOOL, BOOL_ARRAY;
    i32 => INT4, INT4_ARRAY;
    i64 => INT8, INT8_ARRAY;
    f64 => FLOAT8, FLOAT8_ARRAY;
    String => TEXT, TEXT_ARRAY;
    Uuid => UUID, UUID_ARRAY;
    DateTime<Utc> => TIMESTAMPTZ, TIMESTAMPTZ_ARRAY;
}

impl PgType for &str {
    const TYPE: Type = Type::TEXT;
}

impl PgType for Vec<&str> {
    const TYPE: Type = Type::TEXT_ARRAY;
}

/// Arrays with NULL elements.
impl PgType for Vec<Option<&str>> {
    const TYPE: Type = Type::TEXT_ARRAY;
}

impl PgType for Vec<Option<DateTime<Utc>>> {
    const TYPE: Type = Type::TIMESTAMPTZ_ARRAY;
}

/// NULL, or a value of `T`'s type.
impl<T: PgType> PgType for Option<T> {
    const TYPE: Type = T::TYPE;
}

/// `value` with its type, for `query_typed` and friends.
pub(crate) fn typed<T: ToSql + Sync + PgType>(value: &T) -> Typed<'_> {
    (value, T::TYPE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_value_binds_as_its_type() {
        let ids: &[i64] = &[1, 2];
        assert_eq!(typed(&ids).1, Type::INT8_ARRAY);
        assert_eq!(typed(&"relay").1, Type::TEXT);
        assert_eq!(typed(&vec![String::new()]).1, Type::TEXT_ARRAY);
        assert_eq!(typed(&1.5_f64).1, Type::FLOAT8);
        assert_eq!(typed(&None::<&[i64]>).1, Type::INT8_ARRAY);
        // Each type accepts what it is bound as, so a bind never fails on it.
        assert!(<&[i64] as ToSql>::accepts(&typed(&ids).1));
        assert!(<DateTime<Utc> as ToSql>::accepts(&typed(&Utc::now()).1));
    }
}
