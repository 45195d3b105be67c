//! A CMQ request's parameters: an `application/x-www-form-urlencoded` query or body, each name once,
//! numbered lists as `name.1`, `name.2`, ... (`msgBody.n`, `receiptHandle.n`, `msgTag.n`).

use std::collections::HashMap;

use super::CmqError;

/// At most this many parameters in one request (a batch of 16 with 16 tags each is far below).
const MAX_PARAMS: usize = 1024;

/// The pairs of a form, in order; refused if there are too many.
pub fn parse_form(raw: &[u8]) -> Result<Vec<(String, String)>, CmqError> {
    let mut pairs = Vec::new();
    for (k, v) in form_urlencoded::parse(raw) {
        if pairs.len() == MAX_PARAMS {
            return Err(CmqError::invalid(format!("more than {MAX_PARAMS} parameters")));
        }
        pairs.push((k.into_owned(), v.into_owned()));
    }
    Ok(pairs)
}

pub struct Params(HashMap<String, String>);

impl Params {
    pub fn new(pairs: Vec<(String, String)>) -> Result<Params, CmqError> {
        let mut map = HashMap::with_capacity(pairs.len());
        for (k, v) in pairs {
            if map.contains_key(&k) {
                return Err(CmqError::invalid(format!("parameter '{k}' is given more than once")));
            }
            map.insert(k, v);
        }
        Ok(Params(map))
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    pub fn required(&self, name: &str) -> Result<&str, CmqError> {
        self.get(name).ok_or_else(|| CmqError::invalid(format!("parameter '{name}' is required")))
    }

    /// An integer parameter within `range`, or `default` when absent (or empty, as the SDK sends
    /// unset optional values).
    pub fn int(&self, name: &str, default: i64, range: std::ops::RangeInclusive<i64>) -> Result<i64, CmqError> {
        let value = match self.get(name).map(str::trim) {
            None | Some("") => return Ok(default),
            Some(v) => v.parse::<i64>().map_err(|_| CmqError::invalid(format!("{name} must be an integer, not '{v}'")))?,
        };
        if !range.contains(&value) {
            return Err(CmqError::invalid(format!("{name} must be from {} to {}, not {value}", range.start(), range.end())));
        }
        Ok(value)
    }

    /// The values of `prefix.1`, `prefix.2`, ... in number order; at most `max` of them.
    pub fn numbered(&self, prefix: &str, max: usize) -> Result<Vec<&str>, CmqError> {
        let mut found: Vec<(u64, &str)> = Vec::new();
        for (k, v) in &self.0 {
            let Some(n) = k.strip_prefix(prefix).and_then(|rest| rest.strip_prefix('.')) else { continue };
            let n: u64 = n.parse().map_err(|_| CmqError::invalid(format!("parameter '{k}': expected {prefix}.N with N a number from 1")))?;
            if n == 0 {
                return Err(CmqError::invalid(format!("parameter '{k}': lists are numbered from 1")));
            }
            found.push((n, v));
        }
        if found.len() > max {
            return Err(CmqError::invalid(format!("at most {max} {prefix}.N parameters in one request, not {}", found.len())));
        }
        found.sort_unstable_by_key(|(n, _)| *n);
        Ok(found.into_iter().map(|(_, v)| v).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(raw: &str) -> Result<Params, CmqError> {
        Params::new(parse_form(raw.as_bytes())?)
    }

    #[test]
    fn numbered_lists_come_in_number_order_and_are_bounded() {
        let p = params("msgBody.2=b&msgBody.10=c&msgBody.1=a&queueName=q").unwrap();
        assert_eq!(p.numbered("msgBody", 16).unwrap(), vec!["a", "b", "c"]);
        assert!(p.numbered("msgBody", 2).is_err());
        assert!(p.numbered("receiptHandle", 16).unwrap().is_empty());
        assert!(params("msgBody.x=1").unwrap().numbered("msgBody", 16).is_err());
        assert!(params("msgBody.0=1").unwrap().numbered("msgBody", 16).is_err());
    }

    #[test]
    fn bad_parameters_are_refused_with_a_reason() {
        assert!(params("a=1&a=2").is_err(), "a name twice");
        let p = params("n=12&e=&x=abc&big=99999999999999999999").unwrap();
        assert_eq!(p.int("n", 0, 0..=30).unwrap(), 12);
        assert_eq!(p.int("e", 7, 0..=30).unwrap(), 7);
        assert_eq!(p.int("absent", 7, 0..=30).unwrap(), 7);
        assert!(p.int("n", 0, 0..=10).is_err());
        assert!(p.int("x", 0, 0..=10).is_err());
        assert!(p.int("big", 0, 0..=10).is_err());
        assert!(p.required("absent").unwrap_err().message.contains("absent"));
        let many = (0..2000).map(|i| format!("k{i}=v")).collect::<Vec<_>>().join("&");
        assert!(parse_form(many.as_bytes()).is_err());
    }
}
