//! Publishing: routing a message to its queues, delayed messages, and re-publishing dead letters.

use super::*;

impl VHost {
    /// Routes a message and offers it to every queue it reaches.
    /// `confirmed`: the publisher waits for the message to be durable (publisher confirms or a
    /// transaction); if not, queues may defer writing it (see `Queue::publish`).
    pub fn publish(&self, exchange: &str, message: Message, confirmed: bool) -> Result<PublishOutcome> {
        self.publish_by(exchange, message, confirmed, None)
    }

    /// [`VHost::publish`] by a connection's publisher session (`crate::publisher`): quorum queues the
    /// message reaches tell the session once their group applied (or refused) it, and the confirm
    /// waits for that as well as for the store ticket of the classic queues it reached.
    pub fn publish_by(&self, exchange: &str, message: Message, confirmed: bool, publisher: Option<Publisher>) -> Result<PublishOutcome> {
        self.publish_routed(exchange, message, confirmed, publisher, None)
    }

    /// Routes a message through `exchange` now and holds it for `delay_ms` before its queues get it
    /// (whatever the exchange's type): CMQ's `delaySeconds`. Durable once the ticket is, and once
    /// `publisher`'s session has it resolved (quorum queues).
    pub fn publish_delayed(&self, exchange: &str, message: Message, delay_ms: u64, publisher: Option<Publisher>) -> Result<PublishOutcome> {
        self.publish_routed(exchange, message, true, publisher, Some(delay_ms))
    }

    fn publish_routed(&self, exchange: &str, message: Message, confirmed: bool, publisher: Option<Publisher>, delay_ms: Option<u64>) -> Result<PublishOutcome> {
        let ex = self.publishable_exchange(exchange)?;
        if ex.name.is_empty() && message.routing_key.starts_with(direct_reply::PREFIX) {
            // A direct reply: straight to the waiting channel, no queue; on its node, if that is
            // another (a reply to a consumer gone there is dropped there, and not returned here).
            if let (Some(node), Some(host)) = (self.replies.elsewhere(&message.routing_key), self.quorum.host()) {
                let request = crate::queue::remote::wire::Request::Reply { vhost: self.name.clone(), message: crate::message::encode_stored(&message, None) };
                host.classic_request(node, request.encode(), Box::new(move |answer| {
                    if let Err(e) = answer {
                        tracing::debug!(node, error = %e, "a direct reply to a consumer on another node was not delivered");
                    }
                }));
                return Ok(PublishOutcome { routed: true, ..Default::default() });
            }
            let routed = self.replies.deliver(Arc::new(message));
            return Ok(PublishOutcome { routed, ..Default::default() });
        }
        let mut queues = Vec::new();
        self.route(&ex, &message, &mut queues);
        // In a cluster, a binding or queue another node just confirmed may not be applied here yet.
        if queues.is_empty() && self.metadata.is_replicated() && self.metadata.catch_up() {
            self.route(&ex, &message, &mut queues);
        }
        use crate::stats::Counter;
        crate::stats::add(if queues.is_empty() { Counter::Unroutable } else { Counter::Routed }, 1);
        let delay_ms = delay_ms.or_else(|| ex.delayed.then(|| crate::delay::record::requested_delay(&message)).flatten().map(|d| d as u64));
        if let Some(delay_ms) = delay_ms.filter(|d| *d > 0) {
            return self.hold_delayed(message, &queues, delay_ms, publisher);
        }
        self.deliver_to_queues(Arc::new(message), &queues, !confirmed, publisher)
    }

    /// A message a delayed exchange routed, with a positive `x-delay`: held until due, durable
    /// (and confirmed) as any persistent message. Routed now: mandatory and returns work as usual.
    /// A quorum queue's group holds it (replicated: it survives the loss of any minority of the
    /// group's nodes, this one included); for classic queues the node's delay store does
    /// (`crate::delay`).
    fn hold_delayed(&self, message: Message, queues: &[Arc<Queue>], delay_ms: u64, publisher: Option<Publisher>) -> Result<PublishOutcome> {
        let mut outcome = PublishOutcome { routed: !queues.is_empty(), ..Default::default() };
        if queues.is_empty() {
            return Ok(outcome);
        }
        crate::delay::check_delay(delay_ms)?;
        let now = crate::now_ms();
        // Kept as consumers get it once due (the node's delay store would negate it then).
        let mut message = message;
        crate::delay::record::negate_delay(&mut message);
        let message = Arc::new(message);
        // The classic queues' hold first: if it fails, no queue has the message.
        let held_here: Vec<u64> = queues.iter().filter(|q| !q.is_quorum()).map(|q| q.id).collect();
        if !held_here.is_empty() {
            outcome.ticket = Some(self.delays.hold(&self.name, &held_here, &message, delay_ms)?);
            outcome.store_behind = self.store.is_behind();
        }
        let mut header = BytesMut::new();
        for q in queues.iter().filter(|q| q.is_quorum()) {
            if header.is_empty() {
                encode_header(&message, Some(now), &mut header);
            }
            if let Some(enqueued) = q.publish_delayed(&message, &header, now, delay_ms, publisher) {
                outcome.took(q, enqueued?);
            }
        }
        Ok(outcome)
    }

    /// A delayed message now due, to one of the queues it was routed to: published as
    /// at-least-once dead letters are (`crate::deadletter_confirms`); `settle` is told true once the
    /// queue holds it durably, false when it refused it (full with `reject-publish`, its home node
    /// down or backed up, no majority in time) and it must be tried again.
    pub fn publish_due(&self, message: MessageRef, queue: &Arc<Queue>, settle: crate::deadletter::SettleDeadLetter) {
        let (session, seq) = self.dead_letter_confirms.publisher();
        let publisher = Publisher { session: &session, seq };
        match self.deliver_to_queues(message, std::slice::from_ref(queue), false, Some(publisher)) {
            Ok(outcome) => self.dead_letter_confirms.track(seq, outcome.ticket, outcome.rejected, settle),
            Err(e) => {
                tracing::warn!(vhost = %self.name, error = %e, "could not publish a due delayed message; trying again");
                self.dead_letter_confirms.track(seq, None, true, settle);
            }
        }
    }

    /// Delayed messages held for `queue` (`crate::delay`).
    pub fn delayed_count(&self, queue: &Queue) -> u64 {
        self.delays.count(queue.id) + queue.delayed_in_group()
    }

    fn deliver_to_queues(&self, message: MessageRef, queues: &[Arc<Queue>], lazy_ok: bool, publisher: Option<Publisher>) -> Result<PublishOutcome> {
        let mut outcome = PublishOutcome { routed: !queues.is_empty(), ..Default::default() };
        if queues.is_empty() {
            return Ok(outcome);
        }
        let now = crate::now_ms();
        // The store encoding's header, for queues that write the message to the store (persistent in a
        // durable queue, or a queue whose window is full). Small next to the body, so always built.
        let mut header = BytesMut::new();
        encode_header(&message, Some(now), &mut header);
        for q in queues {
            outcome.took(q, q.publish(&message, &header, now, lazy_ok, publisher)?);
        }
        Ok(outcome)
    }

    /// Collects the queues a message reaches from `exchange`: bindings, exchange-to-exchange
    /// bindings (each exchange visited once), and the alternate exchange when nothing matched.
    fn route(&self, exchange: &Arc<Exchange>, message: &Message, out: &mut Vec<Arc<Queue>>) {
        if exchange.name.is_empty() {
            if let Some(q) = self.queues.read().get(&message.routing_key) {
                out.push(q.clone());
            }
            return;
        }
        let to_exchanges = exchange.has_exchange_bindings();
        let headers = if exchange.kind == ExchangeKind::Headers || to_exchanges {
            PropertiesView::new(&message.properties).ok().and_then(|v| v.headers()).and_then(|r| r.ok())
        } else {
            None
        };
        if !to_exchanges && exchange.alternate.is_none() {
            // The common case: bindings to queues only, no alternate exchange; no graph walk.
            let mut dests = Vec::new();
            exchange.route(&message.routing_key, headers.as_ref(), &mut dests);
            out.extend(dests.into_iter().filter_map(|d| match d {
                Destination::Queue(q) => Some(q),
                Destination::Exchange(_) => None,
            }));
            return;
        }
        let mut visited: Vec<Arc<Exchange>> = vec![exchange.clone()];
        let mut pending: Vec<Arc<Exchange>> = vec![exchange.clone()];
        while let Some(ex) = pending.pop() {
            let mut dests = Vec::new();
            ex.route(&message.routing_key, headers.as_ref(), &mut dests);
            let mut matched = false;
            for d in dests {
                match d {
                    Destination::Queue(q) => {
                        matched = true;
                        if !out.iter().any(|o| Arc::ptr_eq(o, &q)) {
                            out.push(q);
                        }
                    }
                    Destination::Exchange(e) => {
                        matched = true;
                        if !visited.iter().any(|v| Arc::ptr_eq(v, &e)) {
                            visited.push(e.clone());
                            pending.push(e);
                        }
                    }
                }
            }
            if !matched {
                if let Some(alt) = ex.alternate.as_ref().and_then(|n| self.exchanges.read().get(n).cloned()) {
                    if !visited.iter().any(|v| Arc::ptr_eq(v, &alt)) {
                        visited.push(alt.clone());
                        pending.push(alt);
                    }
                }
            }
        }
    }

    /// Re-publishes dead letters to their dead-letter exchanges.
    ///
    /// Iterative, never recursive: a dead letter's publish can make more (a queue with TTL 0 expires
    /// it at once, to a queue that may dead-letter it again). Those join the vhost's work list, which
    /// one caller at a time works off: at most `DEAD_LETTERS_PER_TURN` here, the rest on a task that
    /// yields between turns, so a dead-letter chain or fan-out never holds a runtime thread for long.
    pub fn dead_letter(&self, letters: Vec<DeadLetter>) {
        if !self.dead_letters.push(letters) || self.dead_letters_turn() {
            return;
        }
        match (tokio::runtime::Handle::try_current(), self.me.upgrade()) {
            (Ok(rt), Some(me)) => {
                rt.spawn(async move {
                    while !me.dead_letters_turn() {
                        tokio::task::yield_now().await;
                    }
                });
            }
            // No runtime (tests, shutdown): finish here.
            _ => while !self.dead_letters_turn() {},
        }
    }

    /// Whether fewer than `deadletter::BACKLOG_LIMIT` dead letters wait to be re-published: a
    /// source that can make many at once (a quorum queue's expiry) makes more only then.
    pub fn dead_letter_room(&self) -> bool {
        self.dead_letters.has_room()
    }

    /// Calls `f` once fewer than `deadletter::BACKLOG_LIMIT` dead letters wait (now, if so).
    pub fn when_dead_letter_room(&self, f: crate::deadletter::WhenRoom) {
        self.dead_letters.when_room(f);
    }

    /// Re-publishes up to `DEAD_LETTERS_PER_TURN` waiting dead letters; true once none is left (the
    /// caller is then no longer the one working the list off).
    fn dead_letters_turn(&self) -> bool {
        for _ in 0..DEAD_LETTERS_PER_TURN {
            match self.dead_letters.next() {
                Some(letter) => self.republish_dead_letter(letter),
                None => return true,
            }
        }
        false
    }

    fn republish_dead_letter(&self, mut letter: DeadLetter) {
        let settle = letter.settle.take();
        let now_secs = crate::now_ms() / 1000;
        let Some(message) = dead_lettered_message(&letter, now_secs) else {
            // Its properties do not decode: it can never be re-published (logged there).
            if let Some(settle) = settle {
                settle(true);
            }
            return;
        };
        let Some(ex) = self.find_exchange(&letter.exchange) else {
            tracing::debug!(exchange = %letter.exchange, "dead-letter exchange does not exist; message dropped");
            // At-least-once: kept in its source until the exchange exists (as RabbitMQ).
            if let Some(settle) = settle {
                settle(false);
            }
            return;
        };
        let mut queues = Vec::new();
        self.route(&ex, &message, &mut queues);
        let routed = !queues.is_empty();
        queues.retain(|q| {
            let cycle = is_cycle(&message, letter.reason, &q.name);
            if cycle {
                tracing::debug!(queue = %q.name, from = %letter.queue, "dead letter dropped: it would go round an automatic dead-letter cycle");
            }
            !cycle
        });
        let Some(settle) = settle else {
            if let Err(e) = self.deliver_to_queues(Arc::new(message), &queues, false, None) {
                tracing::warn!(error = %e, "could not dead-letter a message");
            }
            return;
        };
        if queues.is_empty() {
            // Dropped for good by the cycle rule; or routed nowhere: kept in its source, tried again.
            settle(routed);
            return;
        }
        let (session, seq) = self.dead_letter_confirms.publisher();
        let publisher = Publisher { session: &session, seq };
        // Settled once every queue it reached answered (a classic queue that refused it, with
        // reject-publish, answered at once: then it is tried again).
        match self.deliver_to_queues(Arc::new(message), &queues, false, Some(publisher)) {
            Ok(outcome) => self.dead_letter_confirms.track(seq, outcome.ticket, outcome.rejected, settle),
            Err(e) => {
                tracing::warn!(error = %e, "could not dead-letter a message; its source keeps it and tries again");
                self.dead_letter_confirms.track(seq, None, true, settle);
            }
        }
    }
}
