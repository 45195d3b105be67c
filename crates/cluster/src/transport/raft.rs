//! openraft's network traits over the transport: one factory per group, one client per (group,
//! target). Votes, pre-votes, heartbeats and leader transfers go on the control link; log
//! replication and snapshots on the bulk link.

use std::future::Future;
use std::io::Cursor;
use std::marker::PhantomData;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use openraft::error::{NetworkError, RPCError, ReplicationClosed, StreamingError, Timeout, Unreachable};
use openraft::network::{RPCOption, RaftNetworkFactory, RaftNetworkV2};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, TransferLeaderRequest, TransferLeaderResponse,
    VoteRequest, VoteResponse,
};
use openraft::{RPCTypes, Snapshot};

use super::frame::RequestFrame;
use super::wire::{self, Dec, DecodeError, Enc, Wire};
use super::{LinkKind, Rpc, RpcError, Transport};
use crate::types::{GroupId, NodeAddr, NodeId, TypeConfig, Vote};

/// A snapshot at most this large travels whole, in one frame ([`Rpc::Snapshot`]); a larger one in
/// pieces of this size ([`Rpc::SnapshotChunk`]), so a snapshot is not bounded by the frame limit
/// (64 MiB: a quorum queue with millions of messages has a larger one).
pub const SNAPSHOT_CHUNK: usize = 16 << 20;

/// A state machine's snapshot data as it travels.
pub trait SnapshotWire: Sized + Send + 'static {
    fn to_wire(&self) -> Bytes;
    fn from_wire(bytes: Bytes) -> Result<Self, String>;
}

impl SnapshotWire for Bytes {
    fn to_wire(&self) -> Bytes {
        self.clone()
    }
    fn from_wire(bytes: Bytes) -> Result<Self, String> {
        Ok(bytes)
    }
}

impl SnapshotWire for Vec<u8> {
    fn to_wire(&self) -> Bytes {
        Bytes::copy_from_slice(self)
    }
    fn from_wire(bytes: Bytes) -> Result<Self, String> {
        Ok(bytes.to_vec())
    }
}

impl SnapshotWire for Cursor<Vec<u8>> {
    fn to_wire(&self) -> Bytes {
        Bytes::copy_from_slice(self.get_ref())
    }
    fn from_wire(bytes: Bytes) -> Result<Self, String> {
        Ok(Cursor::new(bytes.to_vec()))
    }
}

/// What [`Rpc::Snapshot`] carries: the leader's vote, the snapshot's metadata and its data.
pub struct SnapshotMessage {
    pub vote: Vote,
    pub meta: wire::SnapshotMeta,
    pub data: Bytes,
}

impl Wire for SnapshotMessage {
    fn encode(&self, e: &mut Enc<'_>) {
        e.vote(&self.vote);
        e.snapshot_meta(&self.meta);
        e.bytes(&self.data);
    }
    fn decode(d: &mut Dec) -> Result<Self, DecodeError> {
        Ok(SnapshotMessage { vote: d.vote()?, meta: d.snapshot_meta()?, data: d.bytes()? })
    }
}

/// What [`Rpc::SnapshotChunk`] carries: the bytes of `[offset, offset + data.len())` of a snapshot
/// of `total` bytes. The receiver collects the pieces of one snapshot (its id), in order, and
/// installs it with the last one, whose answer is the install's; the others are answered empty.
pub struct SnapshotChunk {
    pub vote: Vote,
    pub meta: wire::SnapshotMeta,
    pub offset: u64,
    pub total: u64,
    pub data: Bytes,
}

impl Wire for SnapshotChunk {
    fn encode(&self, e: &mut Enc<'_>) {
        e.vote(&self.vote);
        e.snapshot_meta(&self.meta);
        e.u64(self.offset);
        e.u64(self.total);
        e.bytes(&self.data);
    }
    fn decode(d: &mut Dec) -> Result<Self, DecodeError> {
        Ok(SnapshotChunk { vote: d.vote()?, meta: d.snapshot_meta()?, offset: d.u64()?, total: d.u64()?, data: d.bytes()? })
    }
}

/// Creates the clients of one group.
pub struct GroupNetworkFactory<SD> {
    transport: Transport,
    group: GroupId,
    _data: PhantomData<fn() -> SD>,
}

impl<SD> GroupNetworkFactory<SD> {
    pub fn new(transport: Transport, group: GroupId) -> Self {
        GroupNetworkFactory { transport, group, _data: PhantomData }
    }
}

impl<SD: SnapshotWire> RaftNetworkFactory<TypeConfig> for GroupNetworkFactory<SD> {
    type Network = GroupNetwork<SD>;

    async fn new_client(&mut self, target: NodeId, _node: &NodeAddr) -> GroupNetwork<SD> {
        GroupNetwork { transport: self.transport.clone(), group: self.group, target, link: LinkKind::Bulk, _data: PhantomData }
    }

    async fn new_heartbeat_client(&mut self, target: NodeId, _node: &NodeAddr) -> GroupNetwork<SD> {
        GroupNetwork { transport: self.transport.clone(), group: self.group, target, link: LinkKind::Control, _data: PhantomData }
    }
}

/// One group's client to one target node.
pub struct GroupNetwork<SD> {
    transport: Transport,
    group: GroupId,
    target: NodeId,
    /// Where append-entries go: bulk for replication, control for the heartbeat client.
    link: LinkKind,
    _data: PhantomData<fn() -> SD>,
}

impl<SD> GroupNetwork<SD> {
    fn timeout_error(&self, action: RPCTypes, timeout: Duration) -> Timeout<TypeConfig> {
        Timeout { action, id: self.transport.node_id(), target: self.target, timeout }
    }

    fn rpc_error(&self, action: RPCTypes, e: RpcError) -> RPCError<TypeConfig> {
        match e {
            RpcError::Timeout(_, t) => RPCError::Timeout(self.timeout_error(action, t)),
            RpcError::NotConnected(_) | RpcError::Lost(_) => RPCError::Unreachable(Unreachable::new(&e)),
            RpcError::Remote(..) | RpcError::TooLarge(_) => RPCError::Network(NetworkError::new(&e)),
        }
    }

    async fn call<Req: Wire, Resp: Wire>(
        &self,
        link: LinkKind,
        rpc: Rpc,
        action: RPCTypes,
        req: &Req,
        timeout: Duration,
    ) -> Result<Resp, RPCError<TypeConfig>> {
        let mut frame = RequestFrame::new(rpc, self.group, req.size_hint());
        req.encode(&mut Enc(frame.payload()));
        let answer = self
            .transport
            .request_frame(self.target, link, frame, timeout)
            .await
            .map_err(|e| self.rpc_error(action, e))?;
        wire::from_bytes(answer).map_err(|e| RPCError::Network(NetworkError::new(&e)))
    }
}

impl<SD: SnapshotWire> RaftNetworkV2<TypeConfig> for GroupNetwork<SD> {
    type SnapshotData = SD;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        if crate::test_hooks::holds_append(self.transport.node_id(), self.target, self.group, &rpc) {
            let e = std::io::Error::other("held by a test (test_hooks::hold_appends or hold_uniform_configs)");
            return Err(RPCError::Unreachable(Unreachable::new(&e)));
        }
        self.call(self.link, Rpc::AppendEntries, RPCTypes::AppendEntries, &rpc, option.soft_ttl()).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(LinkKind::Control, Rpc::Vote, RPCTypes::Vote, &rpc, option.soft_ttl()).await
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(LinkKind::Control, Rpc::PreVote, RPCTypes::Vote, &rpc, option.soft_ttl()).await
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot<openraft::impls::leader_id_adv::LeaderId<u64, NodeId>, NodeId, NodeAddr, SD>,
        cancel: impl Future<Output = ReplicationClosed> + Send + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let data = snapshot.snapshot.to_wire();
        let timeout = option.hard_ttl();
        let mut cancel = std::pin::pin!(cancel);
        let total = data.len();
        let mut offset = 0usize;
        loop {
            // Whole when it fits one piece (the RPC every version understands), else in pieces.
            let end = (offset + SNAPSHOT_CHUNK).min(total);
            let (rpc, mut buf) = if total <= SNAPSHOT_CHUNK {
                let msg = SnapshotMessage { vote, meta: snapshot.meta.clone(), data: data.clone() };
                let mut buf = BytesMut::with_capacity(64 + total);
                msg.encode(&mut Enc(&mut buf));
                (Rpc::Snapshot, buf)
            } else {
                let msg = SnapshotChunk { vote, meta: snapshot.meta.clone(), offset: offset as u64, total: total as u64, data: data.slice(offset..end) };
                let mut buf = BytesMut::with_capacity(128 + end - offset);
                msg.encode(&mut Enc(&mut buf));
                (Rpc::SnapshotChunk, buf)
            };
            let send = self.transport.request(self.target, LinkKind::Bulk, rpc, self.group, &buf, timeout);
            let answer = tokio::select! {
                a = send => a,
                closed = &mut cancel => return Err(StreamingError::Closed(closed)),
            };
            buf.clear();
            let answer = answer.map_err(|e| match self.rpc_error(RPCTypes::InstallSnapshot, e) {
                RPCError::Timeout(t) => StreamingError::Timeout(t),
                RPCError::Unreachable(u) => StreamingError::Unreachable(u),
                RPCError::Network(n) => StreamingError::Network(n),
                RPCError::RemoteError(r) => StreamingError::Network(NetworkError::new(&r)),
            })?;
            if end >= total {
                return wire::from_bytes(answer).map_err(|e| StreamingError::Network(NetworkError::new(&e)));
            }
            offset = end;
        }
    }

    async fn transfer_leader(
        &mut self,
        req: TransferLeaderRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<TransferLeaderResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(LinkKind::Control, Rpc::TransferLeader, RPCTypes::TransferLeader, &req, option.soft_ttl()).await
    }
}
