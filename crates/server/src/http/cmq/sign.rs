//! CMQ 2.0's request signature, exactly as Tencent's SDKs compute it:
//! `base64(HMAC(secretKey, METHOD + host + path + "?" + k1=v1&k2=v2...))` over every parameter but
//! `Signature`, sorted by name, with `_` in names written as `.`, over the *unescaped* values; a POST
//! leaves out values starting with `@` (the SDK's file-upload convention). `host` is the `Host`
//! header the client sent (what it was given: `127.0.0.1:15672`).

use base64::Engine;
use hmac::{Hmac, Mac};

/// `SignatureMethod`: HmacSHA1 when absent, as the SDK's default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Sha1,
    Sha256,
}

impl Method {
    pub fn parse(name: Option<&str>) -> Result<Method, String> {
        match name {
            None | Some("HmacSHA1") => Ok(Method::Sha1),
            Some("HmacSHA256") => Ok(Method::Sha256),
            Some(other) => Err(format!("SignatureMethod must be HmacSHA1 or HmacSHA256, not '{other}'")),
        }
    }
}

/// The string a request's signature is computed over.
pub fn canonical(http_method: &str, host: &str, path: &str, params: &[(String, String)]) -> String {
    let post = http_method.eq_ignore_ascii_case("POST");
    let mut signed: Vec<&(String, String)> = params.iter().filter(|(k, v)| k != "Signature" && !(post && v.starts_with('@'))).collect();
    signed.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = String::with_capacity(64 + params.iter().map(|(k, v)| k.len() + v.len() + 2).sum::<usize>());
    out.push_str(&http_method.to_ascii_uppercase());
    out.push_str(host);
    out.push_str(path);
    out.push('?');
    for (i, (k, v)) in signed.into_iter().enumerate() {
        if i > 0 {
            out.push('&');
        }
        out.push_str(&k.replace('_', "."));
        out.push('=');
        out.push_str(v);
    }
    out
}

/// The base64 signature of `text` with `key`.
pub fn sign(method: Method, key: &str, text: &str) -> String {
    let digest = match method {
        Method::Sha1 => {
            let mut mac = Hmac::<sha1::Sha1>::new_from_slice(key.as_bytes()).expect("HMAC takes a key of any length");
            mac.update(text.as_bytes());
            mac.finalize().into_bytes().to_vec()
        }
        Method::Sha256 => {
            let mut mac = Hmac::<sha2::Sha256>::new_from_slice(key.as_bytes()).expect("HMAC takes a key of any length");
            mac.update(text.as_bytes());
            mac.finalize().into_bytes().to_vec()
        }
    };
    base64::engine::general_purpose::STANDARD.encode(digest)
}

/// Whether `given` is the signature of `text` with `key` (compared in constant time).
pub fn verify(method: Method, key: &str, text: &str, given: &str) -> bool {
    same(&sign(method, key, text), given)
}

/// Whether a MAC the server computed equals the one a client gave, in time that does not depend on
/// where they differ.
pub fn same(expected: &str, given: &str) -> bool {
    expected.len() == given.len() && expected.bytes().zip(given.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_canonical_string_is_the_sdks() {
        // What qcloud-cmq-sdk-py3's Sign.make builds for these parameters (sorted by name, `_` as `.`,
        // Signature and POST's @-values left out, values unescaped).
        let p = params(&[("b", "2"), ("a_x", "1 &=x"), ("Signature", "zzz"), ("file", "@/etc/passwd"), ("Action", "SendMessage")]);
        assert_eq!(canonical("post", "127.0.0.1:15672", "/v2/index.php", &p), "POST127.0.0.1:15672/v2/index.php?Action=SendMessage&a.x=1 &=x&b=2");
        assert_eq!(canonical("GET", "h", "/v2/index.php", &p), "GETh/v2/index.php?Action=SendMessage&a.x=1 &=x&b=2&file=@/etc/passwd");
    }

    #[test]
    fn signatures_match_the_sdks_and_a_changed_byte_fails() {
        // python3 -c 'import hmac,hashlib,base64; print(base64.b64encode(hmac.new(b"key", b"POSTh/v2/index.php?a=1", hashlib.sha1).digest()))'
        let text = "POSTh/v2/index.php?a=1";
        assert_eq!(sign(Method::Sha1, "key", text), "YvXBdg7BQWEgM3dky4QYy59FfSc=");
        assert_eq!(sign(Method::Sha256, "key", text), "5fndFVNUC3hqUqSL7+nkKcLAYuW1oA2eFh1NDyaZjZU=");
        assert!(verify(Method::Sha1, "key", text, "YvXBdg7BQWEgM3dky4QYy59FfSc="));
        assert!(!verify(Method::Sha1, "key", text, "YvXBdg7BQWEgM3dky4QYy59FfSd="));
        assert!(!verify(Method::Sha1, "kez", text, "YvXBdg7BQWEgM3dky4QYy59FfSc="));
        assert!(!verify(Method::Sha256, "key", text, "YvXBdg7BQWEgM3dky4QYy59FfSc="));
        assert!(!verify(Method::Sha1, "key", text, ""));
    }

    #[test]
    fn signature_methods_parse() {
        assert_eq!(Method::parse(None), Ok(Method::Sha1));
        assert_eq!(Method::parse(Some("HmacSHA256")), Ok(Method::Sha256));
        assert!(Method::parse(Some("md5")).is_err());
    }
}
