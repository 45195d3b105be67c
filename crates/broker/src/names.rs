//! Names the broker makes up: server-named queues, consumer tags, direct reply-to addresses.

/// `prefix` (`amq.gen-` for a queue, as RabbitMQ names server-named queues) followed by 22 random
/// URL-safe base64 characters.
pub fn generated_name(prefix: &str) -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut rng = rand::thread_rng();
    let mut s = String::with_capacity(prefix.len() + 22);
    s.push_str(prefix);
    for _ in 0..22 {
        s.push(ALPHABET[rng.gen_range(0..ALPHABET.len())] as char);
    }
    s
}
