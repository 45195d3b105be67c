//! Who a client is and what it may do: users' password hashes (RabbitMQ's formats), constant-time
//! comparison of secrets, the recorded users, vhosts and permissions (`defs`, the metadata ops'
//! fields) and the node's compiled view of them (`users`). docs/internals/security-plan.md.

pub mod defs;
pub mod password;
pub mod policy;
pub mod users;

pub use password::{same_secret, Algorithm, PasswordHash};
pub use users::{exchange_resource, Perm, Permission, User, Users};
