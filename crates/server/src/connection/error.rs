//! Errors that end a connection.

use warren_protocol::error::FrameError;

#[derive(Debug)]
pub enum ConnError {
    /// Close the connection with connection.close (reply text already formatted, e.g. "FRAME_ERROR - ...").
    Close { code: u16, text: String, class_id: u16, method_id: u16 },
    /// The peer went away (EOF, reset) or must be dropped without ceremony (missed heartbeats).
    Gone,
}

impl ConnError {
    pub fn new(code: u16, text: impl Into<String>, class_id: u16, method_id: u16) -> Self {
        ConnError::Close { code, text: text.into(), class_id, method_id }
    }
}

impl From<FrameError> for ConnError {
    fn from(e: FrameError) -> Self {
        let code = e.reply_code();
        let (class_id, method_id) = e.method_ids().unwrap_or((0, 0));
        ConnError::new(code, format!("{} - {e}", warren_broker::error::reply_name(code)), class_id, method_id)
    }
}
