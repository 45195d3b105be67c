//! CMQ 2.0's request signature, exactly as Tencent's SDKs compute it:
//! `base64(HMAC(secretKey, METHOD + host + path + "?" + k1=v1&k2=v2...))` over every parameter but
//! `Signature`, sorted by name, with `_` in names written as `.`, over the *unescaped* values; a POST
//! leaves out values starting with `@` (the SDK's file-upload convention). `host` is the `Host`
//! header the client sent (what it was given: `127.0.0.1:15672`).

use base64::Engine;
use hmac::{Hmac, Mac};

use super::Params;

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

/// Feeds the text a request's signature is computed over to `out`, piece by piece (a batch's text
/// is as long as its bodies: it is never built, only hashed).
fn write_canonical(http_method: &str, host: &str, path: &str, params: &Params, mut out: impl FnMut(&[u8])) {
    let post = http_method.eq_ignore_ascii_case("POST");
    out(http_method.to_ascii_uppercase().as_bytes());
    out(host.as_bytes());
    out(path.as_bytes());
    out(b"?");
    let mut first = true;
    // `Params` iterates sorted by name, as the SDK sorts.
    for (k, v) in params.iter().filter(|(k, v)| *k != "Signature" && !(post && v.starts_with('@'))) {
        if !first {
            out(b"&");
        }
        first = false;
        for (i, part) in k.split('_').enumerate() {
            if i > 0 {
                out(b".");
            }
            out(part.as_bytes());
        }
        out(b"=");
        out(v.as_bytes());
    }
}

/// The string a request's signature is computed over (the tests compare it with the SDK's).
#[cfg(test)]
fn canonical(http_method: &str, host: &str, path: &str, params: &Params) -> String {
    let mut text = Vec::new();
    write_canonical(http_method, host, path, params, |piece| text.extend_from_slice(piece));
    String::from_utf8_lossy(&text).into_owned()
}

/// The base64 signature, with `key`, of the text `feed` writes.
fn signature(method: Method, key: &str, feed: impl FnOnce(&mut dyn FnMut(&[u8]))) -> String {
    fn hmac<M: Mac + hmac::digest::KeyInit>(key: &str, feed: impl FnOnce(&mut dyn FnMut(&[u8]))) -> String {
        let mut mac = <M as hmac::digest::KeyInit>::new_from_slice(key.as_bytes()).expect("HMAC takes a key of any length");
        feed(&mut |piece| mac.update(piece));
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    }
    match method {
        Method::Sha1 => hmac::<Hmac<sha1::Sha1>>(key, feed),
        Method::Sha256 => hmac::<Hmac<sha2::Sha256>>(key, feed),
    }
}

/// The base64 signature of `text` with `key`.
#[cfg(test)]
fn sign(method: Method, key: &str, text: &str) -> String {
    signature(method, key, |out| out(text.as_bytes()))
}

/// Whether `given` is the signature with `key` of a request with these parameters (compared in
/// constant time).
pub fn verify(method: Method, key: &str, http_method: &str, host: &str, path: &str, params: &Params, given: &str) -> bool {
    same(&signature(method, key, |out| write_canonical(http_method, host, path, params, out)), given)
}

/// Whether a MAC the server computed equals the one a client gave, in time that does not depend on
/// where they differ.
pub fn same(expected: &str, given: &str) -> bool {
    warren_broker::auth::same_secret(expected.as_bytes(), given.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> Params {
        let form = form_urlencoded::Serializer::new(String::new()).extend_pairs(pairs).finish();
        Params::parse(form.as_bytes()).unwrap()
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
        let p = params(&[("a", "1")]);
        let verify = |m, key, given| verify(m, key, "POST", "h", "/v2/index.php", &p, given);
        assert!(verify(Method::Sha1, "key", "YvXBdg7BQWEgM3dky4QYy59FfSc="));
        assert!(verify(Method::Sha256, "key", "5fndFVNUC3hqUqSL7+nkKcLAYuW1oA2eFh1NDyaZjZU="));
        assert!(!verify(Method::Sha1, "key", "YvXBdg7BQWEgM3dky4QYy59FfSd="));
        assert!(!verify(Method::Sha1, "kez", "YvXBdg7BQWEgM3dky4QYy59FfSc="));
        assert!(!verify(Method::Sha256, "key", "YvXBdg7BQWEgM3dky4QYy59FfSc="));
        assert!(!verify(Method::Sha1, "key", ""));
    }

    #[test]
    fn signature_methods_parse() {
        assert_eq!(Method::parse(None), Ok(Method::Sha1));
        assert_eq!(Method::parse(Some("HmacSHA256")), Ok(Method::Sha256));
        assert!(Method::parse(Some("md5")).is_err());
    }
}
