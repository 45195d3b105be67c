//! Protocol constants from the AMQP 0-9-1 specification as RabbitMQ ships it
//! (`amqp-rabbitmq-0.9.1.json`): frame types, sizes, reply codes and class ids.

/// Frame type: method frame.
pub const FRAME_METHOD: u8 = 1;
/// Frame type: content header frame.
pub const FRAME_HEADER: u8 = 2;
/// Frame type: content body frame.
pub const FRAME_BODY: u8 = 3;
/// Frame type: heartbeat frame.
pub const FRAME_HEARTBEAT: u8 = 8;
/// Every frame ends with this octet.
pub const FRAME_END: u8 = 0xCE;
/// Smallest frame_max a peer may negotiate; frames up to this size are always allowed.
pub const FRAME_MIN_SIZE: u32 = 4096;
/// Bytes of envelope around every frame payload: type (1), channel (2), size (4), frame end (1).
pub const FRAME_OVERHEAD: u32 = 8;
/// The protocol header a client sends before the first frame.
pub const PROTOCOL_HEADER: [u8; 8] = *b"AMQP\x00\x00\x09\x01";

// Reply codes.
pub const REPLY_SUCCESS: u16 = 200;
pub const CONTENT_TOO_LARGE: u16 = 311;
pub const NO_ROUTE: u16 = 312;
pub const NO_CONSUMERS: u16 = 313;
pub const CONNECTION_FORCED: u16 = 320;
pub const INVALID_PATH: u16 = 402;
pub const ACCESS_REFUSED: u16 = 403;
pub const NOT_FOUND: u16 = 404;
pub const RESOURCE_LOCKED: u16 = 405;
pub const PRECONDITION_FAILED: u16 = 406;
pub const FRAME_ERROR: u16 = 501;
pub const SYNTAX_ERROR: u16 = 502;
pub const COMMAND_INVALID: u16 = 503;
pub const CHANNEL_ERROR: u16 = 504;
pub const UNEXPECTED_FRAME: u16 = 505;
pub const RESOURCE_ERROR: u16 = 506;
pub const NOT_ALLOWED: u16 = 530;
pub const NOT_IMPLEMENTED: u16 = 540;
pub const INTERNAL_ERROR: u16 = 541;

// Class ids.
pub const CLASS_CONNECTION: u16 = 10;
pub const CLASS_CHANNEL: u16 = 20;
pub const CLASS_ACCESS: u16 = 30;
pub const CLASS_EXCHANGE: u16 = 40;
pub const CLASS_QUEUE: u16 = 50;
pub const CLASS_BASIC: u16 = 60;
pub const CLASS_CONFIRM: u16 = 85;
pub const CLASS_TX: u16 = 90;

/// Deepest nesting of field tables and arrays accepted when decoding, so that hostile
/// input cannot exhaust the stack. RabbitMQ itself has no such limit; real clients
/// never come near it.
pub const MAX_FIELD_NESTING: usize = 64;

/// Longest short string on the wire (its length is one octet).
pub const SHORT_STRING_MAX: usize = 255;
