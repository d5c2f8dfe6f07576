"""Directory records are signed by their writers (comms/identity.py, peers/signing.py): a holder of the
swarm secret can write to the DHT, but not a record in another peer's name, nor an old record of a
peer re-stored to outlive its newer ones; with an allowlist, records of unlisted peers are not read."""

from __future__ import annotations

import asyncio
import logging
import struct

import msgpack
import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID

from diloco.comms.identity import Identity, public_key_of, verify
from diloco.peers import PeerRecord
from diloco.peers.signing import MAGIC, SignedRecords, check, sign

KEY = b"k" * 20  # a DHT key id, as hivemind hands it to the validator


def _record(identity: Identity, peer: str | None = None, expiration: float = 1000.5, **fields) -> DHTRecord:
    """A record for `peer` (default: the identity's own), signed with `identity` as the DHT would."""
    value = msgpack.packb(PeerRecord(peer=peer or identity.peer_id, status="training", round=3, **fields).to_wire())
    unsigned = DHTRecord(KEY, msgpack.packb(peer or identity.peer_id), value, expiration)
    return DHTRecord(KEY, unsigned.subkey, sign(identity, unsigned) if peer is None else value, expiration)


@pytest.mark.unit
def test_a_peer_id_embeds_its_key_and_signatures_check_against_the_id_alone():
    me, other = Identity.generate(), Identity.generate()
    assert me.peer_id.startswith("12D3KooW") and me.peer_id != other.peer_id
    assert PeerID.from_base58(me.peer_id).to_base58() == me.peer_id  # libp2p's own encoding agrees
    assert public_key_of(me.peer_id) == me.public_key
    sig = me.sign(b"data")
    assert verify(me.peer_id, b"data", sig)
    assert not verify(me.peer_id, b"datA", sig)  # any change to the data
    assert not verify(other.peer_id, b"data", sig)  # another peer's id
    assert not verify(me.peer_id, b"data", sig[:-1] + bytes([sig[-1] ^ 1]))
    rsa = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # an RSA peer id: the key is not in it
    for bad in (rsa, "peer0", "", "0OIl", "1" * 200):
        assert public_key_of(bad) is None and not verify(bad, b"data", sig)
    assert "sign" not in repr(me) and me.peer_id in repr(me)


@pytest.mark.unit
def test_the_key_file_is_private_and_gone_after_use():
    import os
    import stat

    me = Identity.generate()
    with me.key_file() as path:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        data = open(path, "rb").read()
        assert data[:4] == b"\x08\x01\x12\x40" and data[-32:] == me.public_key  # libp2p's Ed25519 PrivateKey
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))


@pytest.mark.unit
def test_an_identity_file_keeps_the_peer_id_is_private_locked_and_checked(tmp_path, caplog):
    import os
    import stat

    from diloco.comms.identity import IdentityError

    path = str(tmp_path / "site.key")
    first = Identity.load(path)  # created
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(IdentityError, match="in use by another process"):
        Identity.load(path)  # two peers under one id would take each other's connections
    first.release()
    again = Identity.load(path)
    assert again.peer_id == first.peer_id and again.sign(b"x") == first.sign(b"x")  # Ed25519 is deterministic
    again.release()
    os.chmod(path, 0o400)  # hardened: read-only is enough
    Identity.load(path).release()
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="diloco.comms.identity"):
        Identity.load(path).release()
    assert "identity_file_readable" in caplog.text
    data = open(path, "rb").read()
    damaged = tmp_path / "damaged.key"
    damaged.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the public half no longer matches
    with pytest.raises(IdentityError, match="damaged"):
        Identity.load(str(damaged))
    empty = tmp_path / "empty.key"
    empty.write_bytes(b"")
    with pytest.raises(IdentityError, match="is empty: delete it"):
        Identity.load(str(empty))
    rsa = tmp_path / "rsa.key"
    from hivemind.p2p import P2P
    P2P.generate_identity(str(rsa))  # hivemind's own kind of identity file: RSA
    with pytest.raises(IdentityError, match="not a libp2p Ed25519 key file"):
        Identity.load(str(rsa))
    with pytest.raises(IdentityError, match="cannot create"):
        Identity.load(str(tmp_path / "no-such-dir" / "x.key"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged.key", "empty.key", "rsa.key", "site.key"]  # no temp files


@pytest.mark.unit
def test_with_an_allowlist_only_listed_peers_records_are_read(caplog):
    """Every node stores every correctly signed record (so that allowlists that differ for a while do
    not make nodes drop each other's answers); a reader with an allowlist reads only listed peers'."""
    from types import SimpleNamespace as NS

    from diloco.peers import DHTDirectory

    a, b, c = (Identity.generate().peer_id for _ in range(3))

    class Node:  # what hivemind's DHTNode.get returns, signatures already checked and stripped
        async def get(self, key, latest):
            return NS(value={p: NS(value=PeerRecord(peer=p, status="training", round=1).to_wire()) for p in (a, b, c)})

    listed = DHTDirectory(Node(), "run", allow=frozenset({a, b}))
    with caplog.at_level(logging.WARNING, logger="diloco.peers.signing"):
        for _ in range(2):
            assert sorted(r.peer for r in asyncio.run(listed.read())) == sorted([a, b])
    assert listed.dropped == {"not_allowed": 2}
    assert caplog.text.count("reason=not_allowed") == 1 and c in caplog.text  # logged once
    assert len(asyncio.run(DHTDirectory(Node(), "run").read())) == 3  # no allowlist: everyone


@pytest.mark.unit
def test_only_the_writers_own_signature_over_key_subkey_expiration_and_value_checks():
    me, forger = Identity.generate(), Identity.generate()
    good = _record(me)
    assert check(good) == ""
    sig_at = len(good.value) - 64 - len(MAGIC)
    cases = {
        # a secret-holder writing in my name: unsigned, or signed with its own key
        "unsigned": _record(forger, peer=me.peer_id),
        "signed by another key": DHTRecord(KEY, good.subkey, _record(forger).value, good.expiration_time),
        # my genuine record, re-stored to outlive my newer ones, or moved to another run's key
        "later expiration": DHTRecord(KEY, good.subkey, good.value, good.expiration_time + 1000),
        "another key": DHTRecord(b"x" * 20, good.subkey, good.value, good.expiration_time),
        "a value byte flipped": DHTRecord(KEY, good.subkey, bytes([good.value[0] ^ 1]) + good.value[1:],
                                          good.expiration_time),
        "the signature flipped": DHTRecord(KEY, good.subkey, good.value[:sig_at] + bytes([good.value[sig_at] ^ 1]) +
                                           good.value[sig_at + 1:], good.expiration_time),
        "an integer expiration": DHTRecord(KEY, good.subkey, good.value, 1000),
    }
    expected = {"unsigned": "unsigned_record"}
    for name, rec in cases.items():
        assert check(rec) == expected.get(name, "bad_signature"), name
    assert check(DHTRecord(KEY, msgpack.packb(7), good.value, 1.0)) == "not_a_peer_record"
    assert check(DHTRecord(KEY, b"\xc1", good.value, 1.0)) == "not_a_peer_record"  # not msgpack
    # we sign only our own records: one of another peer passes through unsigned (and is refused)
    theirs = DHTRecord(KEY, msgpack.packb(forger.peer_id), b"v", 1.5)
    assert sign(me, theirs) == b"v"
    # what is signed: magic, lengths and expiration, then key, subkey and value (no ambiguity between them)
    assert struct.calcsize(">IIId") == 20


@pytest.mark.unit
def test_the_validator_counts_and_logs_refusals_once_and_strips_what_it_passes(caplog):
    me, forger = Identity.generate(), Identity.generate()
    v = SignedRecords(me)
    good = _record(me)
    assert v.validate(good) and msgpack.unpackb(v.strip_value(good))["round"] == 3
    bad = _record(forger, peer=me.peer_id)
    with caplog.at_level(logging.WARNING, logger="diloco.peers.signing"):
        assert not v.validate(bad) and not v.validate(bad)
    assert v.rejected == {"unsigned_record": 2}
    assert [r.getMessage() for r in caplog.records] == [f"event=record_refused writer={me.peer_id} reason=unsigned_record"]
    with pytest.raises(RuntimeError, match="without our identity"):
        SignedRecords(None).sign_value(good)


# ---------------------------------------------------------------------- real daemons and DHT nodes


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_secret_holder_cannot_write_or_erase_another_peers_record_in_the_dht():
    """Two honest peers and a malicious holder of the swarm secret whose DHT node signs and checks
    nothing. It stores, with a far later expiration, a record in peer A's name saying A left at
    round 99, and re-stores A's genuine record with a later expiration. The honest nodes refuse both
    stores (and count them), both honest peers still read A's true record, and A's next heartbeat
    goes through."""
    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time

    from diloco.comms.auth import HmacAuthorizer
    from diloco.comms.introduce import connect
    from diloco.comms.p2p import P2PTransport
    from diloco.peers import DHTDirectory

    secret, run = "s" * 32, "signed"

    async def main():
        ia, ib = Identity.generate(), Identity.generate()
        ta = await P2PTransport.create(identity=ia)
        addrs = [str(m) for m in await ta.visible_addresses()]
        tb = await P2PTransport.create(identity=ib, initial_peers=addrs)
        tm = await P2PTransport.create(initial_peers=addrs)
        dirs, node_m = [], None
        try:
            assert (ta.peer_id, tb.peer_id) == (ia.peer_id, ib.peer_id)  # the daemons run under our keys
            da = await DHTDirectory.create(ta.p2p, run, [], authorizer=HmacAuthorizer(secret, run), identity=ia)
            dirs.append(da)
            db = await DHTDirectory.create(tb.p2p, run, addrs, authorizer=HmacAuthorizer(secret, run), identity=ib)
            dirs.append(db)
            # M holds the secret, so it can read B's address in B's record: it dials B itself
            await connect(tm.p2p, tb.peer_id, await tb.visible_addresses(), 10)
            node_m = await DHTNode.create(p2p=tm.p2p, initial_peers=addrs, num_workers=4, cache_locally=False,
                                          authorizer=HmacAuthorizer(secret, run))  # no validator: signs nothing
            await da.publish(PeerRecord(peer=ia.peer_id, status="training", round=3), 30)
            await db.publish(PeerRecord(peer=ib.peer_id, status="training", round=3), 30)
            before = sorted((r.peer, r.round) for r in await db.read())
            forged = PeerRecord(peer=ia.peer_id, status="left", round=99).to_wire()
            forged_ok = await node_m.store(da.key, forged, get_dht_time() + 1000, subkey=ia.peer_id)
            # A's genuine signed value (M holds a replica, or reads it from any answer), re-stored on
            # the honest nodes with a later expiration, so that it would outlive A's next records
            key_id = DHTID.generate(source=da.key)
            stored = da.node.protocol.storage.get(key_id).value.get(ia.peer_id)
            replay_ok = [await node_m.protocol.call_store(t.p2p.peer_id, [key_id], [stored.value],
                                                          [stored.expiration_time + 1000], [ia.peer_id])
                         for t in (ta, tb)]
            reads = [sorted((r.peer, r.status, r.round) for r in await d.read()) for d in (da, db)]
            await da.publish(PeerRecord(peer=ia.peer_id, status="training", round=4), 30)
            after = sorted((r.peer, r.round) for r in await db.read())
            return dict(before=before, forged_ok=forged_ok, replay_ok=replay_ok, reads=reads, after=after,
                        dropped=[dict(d.dropped) for d in (da, db)], a=ia.peer_id, b=ib.peer_id)
        finally:
            if node_m is not None:
                await node_m.shutdown()
            for d in dirs:
                await d.close()
            for t in (ta, tb, tm):
                await t.close()

    r = asyncio.run(main())
    a, b = r["a"], r["b"]
    assert r["before"] == sorted([(a, 3), (b, 3)])
    assert r["forged_ok"] is False  # no honest node stored it
    assert r["replay_ok"] == [[False], [False]]  # nor the replay
    assert all(read == sorted([(a, "training", 3), (b, "training", 3)]) for read in r["reads"]), r["reads"]
    assert r["after"] == sorted([(a, 4), (b, 3)])
    dropped = [d for d in r["dropped"]]
    assert all(d.get("unsigned_record", 0) >= 1 and d.get("bad_signature", 0) >= 1 for d in dropped), dropped


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_sites_with_kept_identities_and_allowlists_train_and_keep_an_unlisted_peer_out(tmp_path, monkeypatch):
    """Two sites keep their keys in files (`--identity`), so each knows the other's peer id in advance
    and lists it (`--allow-peer`): they train together. A third holder of the secret, not listed, is
    refused at its join handshake (exit 1, naming the allowlist). `diloco status` (a holder of the secret whose peer
    id nobody listed) still lists both: the allowlist keeps its hello out, not its reads of the directory. The run
    then ends at one round (SIGUSR2)."""
    import json
    import secrets
    import signal
    import time

    from cli_util import invoke
    from multiproc_util import TINY, Peers, new_peer_ids

    keys = {n: tmp_path / f"{n}.key" for n in "abc"}
    ids = dict(zip(keys, new_peer_ids(list(keys.values()))))
    group = Peers(tmp_path, f"id-{secrets.token_hex(3)}")
    common = ["--rounds", "1000", "-H", "5", "--wait-for", "2", *TINY]
    try:
        a = group.spawn(0, ["start", "--identity", str(keys["a"]), "--allow-peer", ids["b"], *common])
        addr = group.address(0)
        assert addr.endswith("/p2p/" + ids["a"])  # the daemon runs under the kept key
        b = group.spawn(1, ["join", addr, "--identity", str(keys["b"]), "--allow-peer", ids["a"], *common])
        c = group.spawn(2, ["join", addr, "--identity", str(keys["c"]), *common])
        assert group.wait(c, 90) == 1 and "allowlist" in group.log(2), group.log(2)
        deadline = time.monotonic() + 90
        while not [r for r in group.lines(1, "round") if r["committed"] and r["peers"] == 2]:
            assert time.monotonic() < deadline, group.log(1)
            time.sleep(0.2)
        for noisy in ("hivemind", "asyncio"):  # the command quiets them for its own run: restored after the test
            monkeypatch.setattr(logging.getLogger(noisy), "level", logging.getLogger(noisy).level)
        seen = invoke(["status", addr, "--run-id", group.run_id, "--json", "--interval", "0.5"],
                      env={"DILOCO_SECRET": group.secret})
        assert seen.exit_code == 0, seen.stderr
        assert sorted(r["peer"] for r in json.loads(seen.stdout)) == sorted([ids["a"], ids["b"]]), seen.stdout
        a.send_signal(signal.SIGUSR2)  # the end of the whole run: both end at one round
        for i, p in enumerate((a, b)):
            assert group.wait(p, 120) == 0, group.log(i)
        finals = [group.lines(i, "final")[-1] for i in (0, 1)]
        assert finals[0]["digest"] == finals[1]["digest"] and finals[0]["round"] == finals[1]["round"] >= 2, finals
        assert all(f["records_dropped"] == {} for f in finals), finals
        assert {r["peers"] for i in (0, 1) for r in group.lines(i, "round") if r["committed"]} == {2}
    finally:
        group.kill_all()
