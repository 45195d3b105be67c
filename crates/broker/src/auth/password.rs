//! Password hashes as RabbitMQ stores them (`rabbit_password:hash/2`): four random salt bytes,
//! then `H(salt ‖ UTF-8 password)`, the whole base64-encoded in exports (`password_hash`), with the
//! algorithm named by `hashing_algorithm` (`rabbit_password_hashing_sha256`, RabbitMQ's default
//! since 3.6, or `rabbit_password_hashing_sha512`). A user imported from RabbitMQ logs in with its
//! RabbitMQ password, and Warren's hashes import into RabbitMQ. Checking recomputes the digest
//! and compares in constant time; an empty hash allows no password login (RabbitMQ's
//! passwordless users). `rabbit_password_hashing_md5` (exports from before 3.6) is not read yet:
//! it is refused with a message saying so.

use base64::Engine;
use sha2::{Digest, Sha256, Sha512};
use subtle::ConstantTimeEq;

const SALT_LEN: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    Sha256,
    Sha512,
}

impl Algorithm {
    /// RabbitMQ's name for it (`hashing_algorithm` in definitions).
    pub fn rabbitmq_name(self) -> &'static str {
        match self {
            Algorithm::Sha256 => "rabbit_password_hashing_sha256",
            Algorithm::Sha512 => "rabbit_password_hashing_sha512",
        }
    }

    pub fn from_rabbitmq_name(name: &str) -> Result<Algorithm, String> {
        match name {
            "rabbit_password_hashing_sha256" => Ok(Algorithm::Sha256),
            "rabbit_password_hashing_sha512" => Ok(Algorithm::Sha512),
            "rabbit_password_hashing_md5" => Err("rabbit_password_hashing_md5 (RabbitMQ before 3.6) is not supported: set the user's password again".to_owned()),
            other => Err(format!("unknown hashing_algorithm '{other}': use rabbit_password_hashing_sha256 or rabbit_password_hashing_sha512")),
        }
    }

    fn digest(self, salt: &[u8], password: &[u8]) -> Vec<u8> {
        match self {
            Algorithm::Sha256 => Sha256::new().chain_update(salt).chain_update(password).finalize().to_vec(),
            Algorithm::Sha512 => Sha512::new().chain_update(salt).chain_update(password).finalize().to_vec(),
        }
    }

    fn digest_len(self) -> usize {
        match self {
            Algorithm::Sha256 => 32,
            Algorithm::Sha512 => 64,
        }
    }
}

/// A salted password hash; `Debug` shows no byte of it.
#[derive(Clone, PartialEq, Eq)]
pub struct PasswordHash {
    algorithm: Algorithm,
    /// `salt ‖ digest`, or empty: no password login.
    bytes: Vec<u8>,
}

impl std::fmt::Debug for PasswordHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PasswordHash({}, <redacted>)", self.algorithm.rabbitmq_name())
    }
}

impl PasswordHash {
    /// Hashes `password` with a fresh random salt.
    pub fn new(algorithm: Algorithm, password: &str) -> PasswordHash {
        let salt: [u8; SALT_LEN] = rand::random();
        Self::with_salt(algorithm, salt, password)
    }

    fn with_salt(algorithm: Algorithm, salt: [u8; SALT_LEN], password: &str) -> PasswordHash {
        let mut bytes = salt.to_vec();
        bytes.extend(algorithm.digest(&salt, password.as_bytes()));
        PasswordHash { algorithm, bytes }
    }

    /// No password login (a user that logs in by certificate only, as RabbitMQ's passwordless).
    pub fn none(algorithm: Algorithm) -> PasswordHash {
        PasswordHash { algorithm, bytes: Vec::new() }
    }

    /// A hash from a RabbitMQ export: base64 `password_hash` and `hashing_algorithm`.
    pub fn from_rabbitmq(encoded: &str, algorithm: &str) -> Result<PasswordHash, String> {
        let algorithm = Algorithm::from_rabbitmq_name(algorithm)?;
        if encoded.is_empty() {
            return Ok(Self::none(algorithm));
        }
        let bytes = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).map_err(|_| "password_hash is not base64".to_owned())?;
        if bytes.len() != SALT_LEN + algorithm.digest_len() {
            return Err(format!(
                "password_hash has {} bytes, not the {} of a 4-byte salt and a {} digest",
                bytes.len(),
                SALT_LEN + algorithm.digest_len(),
                algorithm.rabbitmq_name()
            ));
        }
        Ok(PasswordHash { algorithm, bytes })
    }

    /// As a RabbitMQ export writes it: (`password_hash`, `hashing_algorithm`).
    pub fn to_rabbitmq(&self) -> (String, &'static str) {
        (base64::engine::general_purpose::STANDARD.encode(&self.bytes), self.algorithm.rabbitmq_name())
    }

    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Whether `password` is the one hashed (never, for no password). Constant time in the
    /// password's bytes and the digest.
    pub fn verify(&self, password: &str) -> bool {
        if self.bytes.len() != SALT_LEN + self.algorithm.digest_len() {
            // Spend the same work, so that timing does not tell a passwordless user apart.
            let _ = std::hint::black_box(self.algorithm.digest(&[0; SALT_LEN], password.as_bytes()));
            return false;
        }
        let (salt, digest) = self.bytes.split_at(SALT_LEN);
        same_secret(&self.algorithm.digest(salt, password.as_bytes()), digest)
    }

    /// Spends what a `verify` does, for an unknown user name: the answer's timing does not tell
    /// whether the user exists.
    pub fn verify_nothing(password: &str) {
        let _ = std::hint::black_box(Algorithm::Sha256.digest(&[0; SALT_LEN], password.as_bytes()));
    }
}

/// Whether two secrets are equal, in time that depends on their lengths only.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    bool::from(a.ct_eq(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// From RabbitMQ 3.10's `rabbitmqctl export_definitions` on this machine (`add_user alice
    /// 's3cret pässword'`, and the default guest).
    const RABBITMQ_ALICE: &str = "0Rk2Q6TQ+cnqfsSQATX41V1fpa0ti2m2Y9Gu6Kt6JCAfTILf";
    const RABBITMQ_GUEST: &str = "XxxFAS5KVA9Cp6zh8v0HgoE/PB31uwWPITbM4+f8SxclJbjc";
    /// Salt 01020304 and `guest` under SHA-512, as Python's hashlib computes it.
    const SHA512_GUEST: &str = "AQIDBANSvkE51MvG7pNDq4NjmP8SFay7rWsolg//30q7jnApCiuE049JxchapptDh7ryvu/VdvUXYHbwdpa9veVAv14=";

    #[test]
    fn rabbitmq_hashes_verify_their_passwords_only() {
        let alice = PasswordHash::from_rabbitmq(RABBITMQ_ALICE, "rabbit_password_hashing_sha256").unwrap();
        assert!(alice.verify("s3cret pässword"));
        assert!(!alice.verify("s3cret passwort"));
        assert!(!alice.verify(""));
        let guest = PasswordHash::from_rabbitmq(RABBITMQ_GUEST, "rabbit_password_hashing_sha256").unwrap();
        assert!(guest.verify("guest") && !guest.verify("Guest"));
        let sha512 = PasswordHash::from_rabbitmq(SHA512_GUEST, "rabbit_password_hashing_sha512").unwrap();
        assert!(sha512.verify("guest") && !sha512.verify("guest "));
        assert_eq!(PasswordHash::with_salt(Algorithm::Sha512, [1, 2, 3, 4], "guest").to_rabbitmq().0, SHA512_GUEST);
    }

    #[test]
    fn a_new_hash_round_trips_through_the_export_format_with_a_fresh_salt() {
        let a = PasswordHash::new(Algorithm::Sha256, "pw");
        let b = PasswordHash::new(Algorithm::Sha256, "pw");
        assert_ne!(a, b, "salted");
        let (encoded, algorithm) = a.to_rabbitmq();
        assert_eq!(algorithm, "rabbit_password_hashing_sha256");
        let back = PasswordHash::from_rabbitmq(&encoded, algorithm).unwrap();
        assert!(back.verify("pw") && !back.verify("pW"));
        assert!(!format!("{a:?}").contains(&encoded[..8]), "Debug shows no byte of the hash");
    }

    #[test]
    fn malformed_or_unsupported_hashes_are_refused_with_a_reason_and_empty_means_no_password() {
        assert!(PasswordHash::from_rabbitmq("not base64!", "rabbit_password_hashing_sha256").unwrap_err().contains("base64"));
        assert!(PasswordHash::from_rabbitmq(RABBITMQ_GUEST, "rabbit_password_hashing_sha512").unwrap_err().contains("bytes"));
        assert!(PasswordHash::from_rabbitmq(RABBITMQ_GUEST, "rabbit_password_hashing_md5").unwrap_err().contains("not supported"));
        assert!(PasswordHash::from_rabbitmq(RABBITMQ_GUEST, "bcrypt").unwrap_err().contains("unknown"));
        let none = PasswordHash::from_rabbitmq("", "rabbit_password_hashing_sha256").unwrap();
        assert!(!none.verify("") && !none.verify("guest"));
    }

    #[test]
    fn same_secret_only_for_equal_bytes() {
        assert!(same_secret(b"guest", b"guest"));
        assert!(same_secret(b"", b""));
        assert!(!same_secret(b"guest", b"guesT"));
        assert!(!same_secret(b"guest", b"guest\0"));
        assert!(!same_secret(b"guest", b"gues"));
        assert!(!same_secret(b"", b"\0"));
    }
}
