//! Decoding errors. Each maps to the AMQP reply code the offending connection is closed with.

use crate::constants as c;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("unknown frame type {frame_type}")]
    UnknownFrameType { frame_type: u8 },
    #[error("frame does not end with 0xCE (found {found:#04x}): the stream is out of sync")]
    BadFrameEnd { found: u8 },
    #[error("frame of {size} bytes exceeds the negotiated frame_max of {frame_max}")]
    TooLarge { size: u32, frame_max: u32 },
    #[error("truncated {what} at offset {offset}: need {need} bytes, have {have}")]
    Truncated { what: &'static str, offset: usize, need: usize, have: usize },
    #[error("malformed {what} at offset {offset}: {detail}")]
    Syntax { what: &'static str, offset: usize, detail: String },
    #[error("unknown method {class_id}.{method_id}")]
    UnknownMethod { class_id: u16, method_id: u16 },
    /// A method's arguments could not be decoded.
    #[error("cannot decode {name}: {source}")]
    InMethod { name: &'static str, class_id: u16, method_id: u16, source: Box<FrameError> },
}

impl FrameError {
    pub fn reply_code(&self) -> u16 {
        match self {
            FrameError::UnknownFrameType { .. } | FrameError::BadFrameEnd { .. } | FrameError::TooLarge { .. } => {
                c::FRAME_ERROR
            }
            FrameError::Truncated { .. } | FrameError::Syntax { .. } | FrameError::InMethod { .. } => c::SYNTAX_ERROR,
            FrameError::UnknownMethod { .. } => c::NOT_IMPLEMENTED,
        }
    }

    /// The class and method the error is about, when known (for connection.close).
    pub fn method_ids(&self) -> Option<(u16, u16)> {
        match self {
            FrameError::UnknownMethod { class_id, method_id } | FrameError::InMethod { class_id, method_id, .. } => {
                Some((*class_id, *method_id))
            }
            _ => None,
        }
    }
}
