//! Every key the loader accepts, listed from the structures it reads.

use serde::Deserialize;

use super::raw::*;

/// Every key a config file can set, as dotted paths with `[]` after an
/// array of tables (`server.tls.cert_file`, `routes[].timeout_ms`,
/// `tokens.keys[].kid`), read from the structs the loader deserializes, so
/// that the documentation can be checked against what the loader accepts
/// rather than against a list kept by hand: a field added to any of them,
/// at any depth, is listed here without a change to this function.
pub fn accepted_keys() -> Result<Vec<String>, String> {
    use serde::de::{self, IntoDeserializer, Visitor};
    use std::cell::RefCell;

    // Walks the structs the way serde offers them to a deserializer: a
    // struct asks for its fields by name, an option is present, a sequence
    // has one element, and anything else is a key whose path is recorded.
    struct Probe<'a> {
        path: String,
        keys: &'a RefCell<Vec<String>>,
    }

    impl Probe<'_> {
        fn key(&self) {
            let path = self.path.strip_suffix("[]").unwrap_or(&self.path);
            self.keys.borrow_mut().push(path.to_string());
        }

        fn below(&self, name: &str) -> Self {
            let path = if self.path.is_empty() {
                name.to_string()
            } else {
                format!("{}.{name}", self.path)
            };
            Probe {
                path,
                keys: self.keys,
            }
        }
    }

    impl<'de> de::Deserializer<'de> for Probe<'_> {
        type Error = de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
            self.key();
            v.visit_str("")
        }

        fn deserialize_bool<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
            self.key();
            v.visit_bool(false)
        }

        fn deserialize_u64<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
            self.key();
            v.visit_u64(0)
        }

        fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
            v.visit_some(self)
        }

        fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
            let element = Probe {
                path: format!("{}[]", self.path),
                keys: self.keys,
            };
            v.visit_seq(de::value::SeqDeserializer::new(std::iter::once(element)))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            v: V,
        ) -> Result<V::Value, Self::Error> {
            let entries = fields.iter().map(|&f| (f, self.below(f)));
            v.visit_map(de::value::MapDeserializer::new(entries))
        }

        serde::forward_to_deserialize_any! {
            i8 i16 i32 i64 i128 u8 u16 u32 u128 f32 f64 char str string bytes
            byte_buf unit unit_struct newtype_struct tuple tuple_struct map enum
            identifier ignored_any
        }
    }

    impl<'de, 'a> IntoDeserializer<'de, de::value::Error> for Probe<'a> {
        type Deserializer = Probe<'a>;

        fn into_deserializer(self) -> Probe<'a> {
            self
        }
    }

    let keys = RefCell::new(Vec::new());
    let root = Probe {
        path: String::new(),
        keys: &keys,
    };
    RawConfig::deserialize(root).map_err(|e| e.to_string())?;
    let mut keys = keys.into_inner();
    keys.sort();
    keys.dedup();
    Ok(keys)
}
