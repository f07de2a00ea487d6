#!/usr/bin/env python3
"""Write fuzz/seeds/nvmf_pdu/: NVMe/TCP PDU streams built from the layouts of the NVMe/TCP
transport spec 1.0 §3.6.2 (independently of ferroraid's encoder), in the input format of
fuzz_targets/nvmf_pdu.rs: byte 0 setup (bit 0 HDGST, bit 1 DDGST, bit 2 host side,
bit 3 already initialized, bits 4-5 PDA index into 0/1/3/31, bit 6 small limits),
byte 1 piece-size seed, then the stream."""
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


def pdu(typ, psh, hlen, data=b"", hd=False, dd=False, flags=0, pda=0):
    """A PDU: CH + PSH (hlen bytes), HDGST, PAD to PDO, DATA, DDGST."""
    digested = typ not in (0, 1, 2, 3)
    hd = hd and digested
    hdr_end = hlen + (4 if hd else 0)
    if data and typ in (4, 6, 7):
        align = (pda + 1) * 4
        pdo = -(-hdr_end // align) * align
    else:
        pdo = 0
    if typ in (2, 3):
        pdo = 0
    dd = dd and bool(data) and typ in (4, 6, 7)
    flags |= (1 if hd else 0) | (2 if dd else 0)
    body_start = pdo if pdo else hdr_end
    plen = body_start + len(data) + (4 if dd else 0)
    ch = struct.pack("<BBBBI", typ, flags, hlen, pdo, plen)
    head = (ch + psh).ljust(hlen, b"\0")
    out = head
    if hd:
        out += struct.pack("<I", crc32c(head))
    out = out.ljust(body_start, b"\0") + data
    if dd:
        out += struct.pack("<I", crc32c(data))
    assert len(out) == plen
    return out


def icreq(hd, dd):
    return pdu(0, struct.pack("<HBBI", 0, 0, hd | (dd << 1), 0), 128)


def icresp(hd, dd):
    return pdu(1, struct.pack("<HBBI", 0, 0, hd | (dd << 1), 131072), 128)


def sqe(opc, cid, nsid, sgl_len, sgl_id, cdw10=0, cdw12=0):
    sgl = struct.pack("<QI3xB", 0, sgl_len, sgl_id)
    return struct.pack("<BBHIQQ", opc, 0x40, cid, nsid, 0, 0) + sgl + struct.pack("<6I", cdw10, 0, cdw12, 0, 0, 0)


def controller_stream(hd, dd, pda=0):
    d = bytes(range(256)) * 4
    s = b""
    s += pdu(4, sqe(0x7F, 0, 0x01, 1024, 0x01), 72, d, hd, dd, pda=pda)  # Fabrics Connect, in-capsule
    s += pdu(4, sqe(0x01, 1, 1, 512, 0x01), 72, d[:512], hd, dd, pda=pda)  # Write in-capsule
    s += pdu(4, sqe(0x01, 2, 1, 8192, 0x5A, cdw12=15), 72, b"", hd, dd, pda=pda)  # Write by R2T
    s += pdu(6, struct.pack("<HHII4x", 2, 1, 0, 4096), 24, d * 4, hd, dd, pda=pda)
    s += pdu(6, struct.pack("<HHII4x", 2, 1, 4096, 4096), 24, d * 4, hd, dd, flags=4, pda=pda)
    s += pdu(4, sqe(0x00, 3, 1, 0, 0x5A), 72, b"", hd, dd, pda=pda)  # Flush
    return s


def host_stream(hd, dd, pda=0):
    d = bytes(range(200))
    cqe = struct.pack("<IIHHHH", 0, 0, 1, 0, 0, 0)
    s = b""
    s += pdu(5, cqe, 24, b"", hd, dd)
    s += pdu(9, struct.pack("<HHII4x", 2, 1, 0, 8192), 24, b"", hd, dd)
    s += pdu(7, struct.pack("<H2xII4x", 4, 0, len(d)), 24, d, hd, dd, pda=pda)
    s += pdu(7, struct.pack("<H2xII4x", 4, 200, len(d)), 24, d, hd, dd, flags=4, pda=pda)
    s += pdu(3, struct.pack("<HI", 1, 2), 24, cqe[:8] + b"\x05\0\x18\0\x18\0\0\0")
    return s


here = os.path.dirname(os.path.abspath(__file__))
out = os.path.join(here, "seeds", "nvmf_pdu")
os.makedirs(out, exist_ok=True)
seeds = {
    "ctrl-plain": bytes([0x00, 1]) + icreq(0, 0) + controller_stream(False, False),
    "ctrl-digests": bytes([0x03, 7]) + icreq(1, 1) + controller_stream(True, True),
    "ctrl-started-hdgst-small": bytes([0x49, 3]) + controller_stream(True, False)[:2000],
    "ctrl-termreq": bytes([0x00, 9]) + pdu(2, struct.pack("<HI", 2, 0), 24, b"\x04\0\x48\0\x48\0\0\0"),
    "host-digests": bytes([0x07, 5]) + icresp(1, 1) + host_stream(True, True),
    "host-started-pda1": bytes([0x1F, 11]) + host_stream(True, True, pda=1),
}
for name, b in seeds.items():
    with open(os.path.join(out, name), "wb") as f:
        f.write(b)
    print(name, len(b))
