//! Who a client is: users' password hashes (RabbitMQ's formats) and constant-time comparison of
//! secrets. Permissions and user records come here with issue 37 (docs/internals/security-plan.md).

pub mod password;

pub use password::{same_secret, Algorithm, PasswordHash};
