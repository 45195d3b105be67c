//! Connections in their handshake, bounded in all and per source address: one source holding
//! silent or slow handshakes cannot lock the others out until the handshake timeout frees them.
//! A connection past its source's share waits (unread) for one of the source's slots, up to its
//! handshake's deadline, so a client opening many connections at once is slowed, not refused; at
//! most as many wait as the bound in all. Past either bound a connection is closed at once.
//!
//! Shared by the cluster port (`transport`) and the AMQP listener (the server's `login_guard`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;

/// The address a limit counts by: an IPv4 address (IPv4-mapped ones too) or an IPv6 /64 (one
/// host usually has a whole /64).
pub fn source_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
    }
}

pub struct HandshakeSlots {
    inner: Arc<Mutex<SlotCounts>>,
    /// Told whenever a slot is given back (waiters try again).
    freed: Arc<tokio::sync::Notify>,
    max: usize,
    max_per_source: usize,
}

#[derive(Default)]
struct SlotCounts {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
    /// Connections waiting for a slot of their source.
    waiting: usize,
}

/// One connection's place among those in their handshake; given back when dropped.
pub struct HandshakeSlot {
    inner: Arc<Mutex<SlotCounts>>,
    freed: Arc<tokio::sync::Notify>,
    source: IpAddr,
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        {
            let mut counts = self.inner.lock();
            counts.total -= 1;
            if let Some(n) = counts.by_source.get_mut(&self.source) {
                *n -= 1;
                if *n == 0 {
                    counts.by_source.remove(&self.source);
                }
            }
        }
        self.freed.notify_waiters();
    }
}

/// A connection's place among those waiting for a slot.
pub struct Waiting(Arc<Mutex<SlotCounts>>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.lock().waiting -= 1;
    }
}

/// Why a connection got no handshake slot.
#[derive(Debug, PartialEq, Eq)]
pub enum NoSlot {
    /// `max-handshakes` connections are in their handshake.
    All(usize),
    /// `max-handshakes-per-source` of them come from this address.
    Source(usize),
    /// As many wait for a slot of their source as `max-handshakes`.
    Waiting(usize),
}

impl HandshakeSlots {
    pub fn new(max: usize, max_per_source: usize) -> HandshakeSlots {
        HandshakeSlots { inner: Default::default(), freed: Default::default(), max, max_per_source }
    }

    /// A place among those that wait for a slot of their source, if there is one.
    pub fn wait_place(&self) -> Result<Waiting, NoSlot> {
        let mut counts = self.inner.lock();
        if counts.waiting >= self.max {
            return Err(NoSlot::Waiting(self.max));
        }
        counts.waiting += 1;
        Ok(Waiting(self.inner.clone()))
    }

    /// Waits up to `deadline` for a slot for `peer` (one of its source's given back).
    pub async fn wait_for(&self, peer: IpAddr, deadline: tokio::time::Instant, _place: Waiting) -> Option<HandshakeSlot> {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            match self.take(peer) {
                Ok(slot) => return Some(slot),
                Err(NoSlot::Source(_)) | Err(NoSlot::All(_)) | Err(NoSlot::Waiting(_)) => {}
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                return None;
            }
        }
    }

    pub fn take(&self, peer: IpAddr) -> Result<HandshakeSlot, NoSlot> {
        let source = source_key(peer);
        let mut counts = self.inner.lock();
        if counts.total >= self.max {
            return Err(NoSlot::All(self.max));
        }
        let from_source = counts.by_source.entry(source).or_insert(0);
        if *from_source >= self.max_per_source {
            return Err(NoSlot::Source(self.max_per_source));
        }
        *from_source += 1;
        counts.total += 1;
        Ok(HandshakeSlot { inner: self.inner.clone(), freed: self.freed.clone(), source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn slots_are_bounded_per_source_and_in_all_and_given_back() {
        let slots = HandshakeSlots::new(3, 2);
        let a1 = slots.take(ip("10.0.0.1")).unwrap();
        let _a2 = slots.take(ip("10.0.0.1")).unwrap();
        assert_eq!(slots.take(ip("10.0.0.1")).err(), Some(NoSlot::Source(2)));
        let _b = slots.take(ip("10.0.0.2")).unwrap();
        assert_eq!(slots.take(ip("10.0.0.3")).err(), Some(NoSlot::All(3)));
        drop(a1);
        assert!(slots.take(ip("10.0.0.1")).is_ok());
        // One IPv6 /64 is one source; an IPv4-mapped address is its IPv4 address.
        let slots = HandshakeSlots::new(10, 1);
        let _v6 = slots.take(ip("2001:db8::1")).unwrap();
        assert!(slots.take(ip("2001:db8::ffff:1")).is_err());
        assert!(slots.take(ip("2001:db8:0:1::1")).is_ok());
        let _v4 = slots.take(ip("10.0.0.9")).unwrap();
        assert!(slots.take(ip("::ffff:10.0.0.9")).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_past_its_source_share_waits_for_a_slot_of_its_source() {
        let slots = Arc::new(HandshakeSlots::new(2, 1));
        let held = slots.take(ip("10.0.0.1")).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let waiter = {
            let slots = slots.clone();
            let place = slots.wait_place().unwrap();
            tokio::spawn(async move { slots.wait_for(ip("10.0.0.1"), deadline, place).await.is_some() })
        };
        let _second = slots.wait_place().unwrap();
        assert_eq!(slots.wait_place().err(), Some(NoSlot::Waiting(2)), "at most max-handshakes wait");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiter.is_finished());
        drop(held);
        assert!(waiter.await.unwrap(), "the freed slot goes to the waiter");
        // Nothing freed: the wait ends at the deadline.
        let _held = slots.take(ip("10.0.0.1")).unwrap();
        let place = slots.wait_place().unwrap();
        let started = tokio::time::Instant::now();
        assert!(slots.wait_for(ip("10.0.0.1"), started + Duration::from_secs(3), place).await.is_none());
        assert_eq!(started.elapsed(), Duration::from_secs(3));
    }
}
