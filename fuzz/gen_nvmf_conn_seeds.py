#!/usr/bin/env python3
"""Write fuzz/seeds/nvmf_conn/: whole NVMe/TCP conversations in the input format of
fuzz/src/nvmf_conn.rs (byte 0 setup, byte 1 piece-size seed, then actions: 0 send with a
2-byte big-endian length, 1 wait, 2 connect, 3 select (op >> 3), 4 drop, 5 half-close,
6 shutdown, 7 settle). The PDUs are built from the layouts of the NVMe/TCP transport spec
1.0 §3.6.2 and the NVMe Base 2.0 / NVM command set command formats, with this script's own
CRC32C, independently of ferroraid's encoder. Run it after changing the input format."""
import os
import struct

POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected
TABLE = []
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ POLY if c & 1 else c >> 1
    TABLE.append(c)


def crc32c(b):
    c = 0xFFFFFFFF
    for x in b:
        c = TABLE[(c ^ x) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283

SUBNQN = b"nqn.2026-11.org.ferroraid:fuzz"
DISCOVERY = b"nqn.2014-08.org.nvmexpress.discovery"
HOSTNQN = b"nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001"
IN_CAPSULE, TRANSPORT = 0x01, 0x5A


class Conn:
    """One host connection's PDU builder (its digests, from its ICReq)."""

    def __init__(self, hd=False, dd=False):
        self.hd, self.dd = hd, dd

    def pdu(self, typ, psh, hlen, data=b"", flags=0):
        hd = self.hd and typ not in (0, 1, 2, 3)
        hdr_end = hlen + (4 if hd else 0)
        dd = self.dd and bool(data) and typ in (4, 6, 7)
        flags |= (1 if hd else 0) | (2 if dd else 0)
        pdo = hdr_end if data else 0  # CPDA 0: data right after the header (digest)
        plen = hdr_end + len(data) + (4 if dd else 0)
        head = (struct.pack("<BBBBI", typ, flags, hlen, pdo, plen) + psh).ljust(hlen, b"\0")
        out = head + (struct.pack("<I", crc32c(head)) if hd else b"") + data
        if dd:
            out += struct.pack("<I", crc32c(data))
        assert len(out) == plen
        return out

    def icreq(self):
        return self.pdu(0, struct.pack("<HBBI", 0, 0, self.hd | (self.dd << 1), 0), 128)

    def cmd(self, opc, cid, nsid=0, data=b"", length=None, cdw=(0, 0, 0, 0, 0, 0)):
        """A CapsuleCmd: in-capsule `data`, or a transport SGL of `length` bytes."""
        if data:
            sgl = struct.pack("<QI3xB", 0, len(data), IN_CAPSULE)
        else:
            sgl = struct.pack("<QI3xB", 0, length or 0, TRANSPORT)
        sqe = struct.pack("<BBHIQQ", opc, 0x40, cid, nsid, 0, 0) + sgl + struct.pack("<6I", *cdw)
        return self.pdu(4, sqe, 72, data)

    def connect(self, cid, qid, sqsize=31, cntlid=0xFFFF, kato=0, subnqn=SUBNQN):
        d = bytearray(1024)
        d[0:16] = bytes(range(1, 17))
        d[16:18] = struct.pack("<H", cntlid)
        d[256:256 + len(subnqn)] = subnqn
        d[512:512 + len(HOSTNQN)] = HOSTNQN
        return self.cmd(0x7F, cid, 0x01, bytes(d), cdw=(qid << 16, sqsize, kato, 0, 0, 0))

    def prop_get(self, cid, ofst, eight=False):
        return self.cmd(0x7F, cid, 0x04, cdw=(int(eight), ofst, 0, 0, 0, 0))

    def prop_set(self, cid, ofst, value):
        return self.cmd(0x7F, cid, 0x00, cdw=(0, ofst, value, 0, 0, 0))

    def disconnect(self, cid):
        return self.cmd(0x7F, cid, 0x08)

    def rw(self, opc, cid, slba, nlb, data=b"", length=None, fua=False):
        cdw12 = (nlb - 1) | (1 << 30 if fua else 0)
        return self.cmd(opc, cid, 1, data, length, (slba & 0xFFFFFFFF, slba >> 32, cdw12, 0, 0, 0))


def send(b):
    if not b:
        return b""
    out = b""
    while b:
        piece, b = b[:0xFFFF], b[0xFFFF:]
        out += bytes([0]) + struct.pack(">H", len(piece)) + piece
    return out


WAIT, CONNECT, DROP, HALF_CLOSE, SHUTDOWN, SETTLE = b"\x01", b"\x02", b"\x04", b"\x05", b"\x06", b"\x07"


def select(k):
    return bytes([3 | (k << 3)])


def admin_setup(c, aers=1, kato=0):
    """ICReq and admin Connect (the host waits for its answer: no capsule may follow it
    before), then CAP, CC.EN, CSTS, Identify, features, logs, Keep Alive, AERs."""
    s = send(c.icreq() + c.connect(0, 0, kato=kato)) + SETTLE
    b = c.prop_get(1, 0x00, eight=True) + c.prop_get(2, 0x08)  # CAP, VS
    b += c.prop_set(3, 0x14, 0)  # CC = 0
    b += c.prop_set(4, 0x14, 1 | (6 << 16) | (4 << 20))  # CC.EN, IOSQES 6, IOCQES 4
    b += c.prop_get(5, 0x1C)  # CSTS
    b += c.cmd(0x06, 6, 0, length=4096, cdw=(1, 0, 0, 0, 0, 0))  # Identify Controller
    b += c.cmd(0x06, 7, 1, length=4096, cdw=(0, 0, 0, 0, 0, 0))  # Identify Namespace 1
    b += c.cmd(0x06, 8, 0, length=4096, cdw=(2, 0, 0, 0, 0, 0))  # Active NS list
    b += c.cmd(0x06, 9, 1, length=4096, cdw=(3, 0, 0, 0, 0, 0))  # NS descriptors
    b += c.cmd(0x09, 10, 0, cdw=(0x07, (3 << 16) | 3, 0, 0, 0, 0))  # Set Features queues: 4
    b += c.cmd(0x0A, 11, 0, cdw=(0x07, 0, 0, 0, 0, 0))  # Get Features queues
    b += c.cmd(0x0A, 12, 0, cdw=(0x06, 0, 0, 0, 0, 0))  # Get Features VWC
    b += c.cmd(0x09, 13, 0, cdw=(0x0B, 0x100, 0, 0, 0, 0))  # Set Features async event config
    b += c.cmd(0x02, 14, 0xFFFFFFFF, length=512, cdw=(0x02 | (127 << 16), 0, 0, 0, 0, 0))  # SMART
    b += c.cmd(0x02, 15, 0xFFFFFFFF, length=64, cdw=(0x01 | (15 << 16), 0, 0, 0, 0, 0))  # errors
    b += c.cmd(0x18, 16, 0)  # Keep Alive
    b += c.cmd(0x42, 17, 0)  # unknown admin opcode
    for k in range(aers):
        b += c.cmd(0x0C, 20 + k, 0)
    return s + send(b)


def io_queue(c, qid=1, cntlid=1, sqsize=31):
    return send(c.icreq() + c.connect(0, qid, sqsize=sqsize, cntlid=cntlid)) + SETTLE


def pattern(n, salt):
    return bytes(((i * 7) ^ salt) & 0xFF for i in range(n))


def io_mix(c, bs):
    """Read/Write in-capsule and by R2T, Flush, Write Zeroes, DSM, Compare (good and bad),
    out of range, unknown opcode."""
    blk4k = 4096 // bs
    s = c.rw(0x01, 1, 0, blk4k, data=pattern(4096, 1))  # Write in-capsule 4 KiB
    s += c.rw(0x02, 2, 0, blk4k, length=4096)  # Read it back
    s += c.rw(0x01, 3, 64 * blk4k // 8, 4 * blk4k, length=16384, fua=True)  # Write by R2T, FUA
    s += c.rw(0x02, 4, 64 * blk4k // 8, 4 * blk4k, length=16384)  # Read 16 KiB
    s += c.rw(0x05, 5, 0, blk4k, data=pattern(4096, 1))  # Compare: equal
    s += c.rw(0x05, 6, 0, blk4k, data=pattern(4096, 2))  # Compare: differs
    s += c.cmd(0x00, 7, 1)  # Flush
    s += c.rw(0x08, 8, 16 * blk4k, 8 * blk4k)  # Write Zeroes 32 KiB
    rng = struct.pack("<IIQ", 0, 2 * blk4k, 24 * blk4k) + struct.pack("<IIQ", 0, blk4k, 40 * blk4k)
    s += c.cmd(0x09, 9, 1, rng, cdw=(1, 1 << 2, 0, 0, 0, 0))  # DSM deallocate, 2 ranges
    s += c.rw(0x02, 10, 1 << 40, 1, length=bs)  # out of range
    s += c.cmd(0x7E, 11, 1)  # unknown I/O opcode
    s += c.rw(0x02, 12, 24 * blk4k, 32 * blk4k, length=131072)  # Read 128 KiB
    s += c.rw(0x01, 13, 0, 32 * blk4k, length=131072)  # Write 128 KiB by R2T
    return s


def conversation(hd=False, dd=False, bs=512, aers=1, extra_admin=b"", io=None):
    a, q = Conn(hd, dd), Conn(hd, dd)
    out = admin_setup(a, aers) + send(extra_admin) + SETTLE
    out += CONNECT + io_queue(q)
    out += send(io if io is not None else io_mix(q, bs)) + SETTLE
    return out, a, q


here = os.path.dirname(os.path.abspath(__file__))
out = os.path.join(here, "seeds", "nvmf_conn")
os.makedirs(out, exist_ok=True)
seeds = {}

# Setup: bit 0 RAID6 4K, bit 1 small buffers, bit 2 withhold R2T data, bits 3-4 ending
# (0 half-close checked, 1 drop, 2 shutdown, 3 half-close now), bit 5 4 KiB H2CData.
body, a, q = conversation()
seeds["admin-io"] = bytes([0x00, 0]) + body
body, a, q = conversation(hd=True, dd=True, bs=4096, aers=4)
seeds["digests-raid6-pieces"] = bytes([0x01, 7]) + body
body, a, q = conversation(hd=True, bs=512, aers=5)  # one AER past the limit: refused
seeds["hdgst-aer-limit-small-h2c"] = bytes([0x20, 3]) + body

# Many large writes and reads in flight with 2 pool buffers.
q = Conn()
many = b"".join(q.rw(0x01, 30 + k, k * 64, 128, length=65536) for k in range(6))
many += b"".join(q.rw(0x02, 40 + k, k * 64, 128, length=65536) for k in range(6))
body, a, q = conversation(io=many)
seeds["small-buffers"] = bytes([0x02, 0]) + body

# The host never answers R2Ts: those writes (and the commands needing a buffer) wait.
q = Conn()
wh = q.rw(0x01, 1, 0, 16, length=8192) + q.rw(0x02, 2, 0, 8, data=b"", length=4096)
wh += q.rw(0x02, 3, 64, 128, length=65536) + q.cmd(0x00, 4, 1)
body, a, q = conversation(io=wh)
seeds["withhold-r2t"] = bytes([0x06, 0]) + body

# A Fabrics Disconnect of the I/O queue, then commands it never reads.
q = Conn()
dis = q.rw(0x01, 1, 0, 8, data=pattern(4096, 3)) + q.disconnect(2) + q.cmd(0x00, 3, 1)
body, a, q = conversation(io=dis)
seeds["io-disconnect"] = bytes([0x00, 0]) + body

# The discovery controller: Connect, CC.EN, Identify, discovery log page.
d = Conn()
disc = send(d.icreq() + d.connect(0, 0, subnqn=DISCOVERY, kato=0)) + SETTLE
disc_rest = d.prop_set(1, 0x14, 1 | (6 << 16) | (4 << 20)) + d.prop_get(2, 0x1C)
disc_rest += d.cmd(0x06, 3, 0, length=4096, cdw=(1, 0, 0, 0, 0, 0))
disc_rest += d.cmd(0x02, 4, 0, length=1024, cdw=(0x70 | (255 << 16), 0, 0, 0, 0, 0))
disc_rest += d.cmd(0x0C, 5, 0) + d.cmd(0x18, 6, 0)
seeds["discovery"] = bytes([0x00, 0]) + disc + send(disc_rest) + SETTLE

# Malformed PDUs: a capsule with a bad header digest on the admin queue (C2HTermReq),
# and an H2CData nobody asked for on the I/O queue.
a, q = Conn(hd=True), Conn()
bad = bytearray(a.prop_get(9, 0x08))
bad[72] ^= 0xFF
term = admin_setup(a) + send(bytes(bad) + a.cmd(0x18, 10, 0)) + SETTLE
term += CONNECT + io_queue(q)
term += send(q.pdu(6, struct.pack("<HHII4x", 1, 7, 0, 0), 24, b"x" * 512, flags=4))
seeds["termreq"] = bytes([0x00, 0]) + term + WAIT

# Disconnects at odd bytes: the admin queue dropped mid-capsule with I/O in flight.
body, a, q = conversation()
cut = body + select(0) + send(a.cmd(0x18, 50, 0)[:40]) + DROP + WAIT
seeds["admin-drop-mid-capsule"] = bytes([0x08, 5]) + cut
# The I/O queue cut inside an R2T's data (answers stop with the socket) and a server shutdown.
body, a, q = conversation(io=io_mix(Conn(), 512)[:-300])
seeds["shutdown-busy"] = bytes([0x10, 0]) + body
body, a, q = conversation()
seeds["half-close-now"] = bytes([0x18, 2]) + body

for name, b in seeds.items():
    with open(os.path.join(out, name), "wb") as f:
        f.write(b)
    print(name, len(b))
