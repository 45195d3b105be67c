//! The AMQP 0-9-1 codec: frames, methods, content headers, field tables, as RabbitMQ speaks
//! them. Pure: bytes in, values out; no I/O, no async.
//!
//! Invariants: nothing read from the wire can panic (every read is bounds-checked, lengths are
//! checked before use, table nesting is limited); a frame's declared size is checked against
//! `frame_max` before its payload is buffered; body payloads are split off the read buffer
//! without copying; content-header properties are kept as the raw bytes received.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic))]

pub mod codec;
pub mod constants;
pub mod error;
pub mod field;
pub mod frame;
pub mod method;
pub mod properties;

pub use error::FrameError;
pub use field::{FieldTable, FieldValue};
pub use frame::{parse_frame, ContentHeader, Frame};
pub use method::Method;
pub use properties::{BasicProperties, PropertiesView};
