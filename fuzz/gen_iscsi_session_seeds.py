#!/usr/bin/env python3
"""Writes the seed corpus of the `iscsi_session` fuzz target (fuzz/seeds/iscsi_session/).

Each seed is a whole, valid iSCSI session in the input format of
fuzz/src/iscsi_session.rs: a setup byte, then actions (send bytes on the current
connection, wait, half-close, drop, connect, select, shutdown, stop reading). The PDUs
are built here from RFC 7143 (section numbers in the helpers), independently of the
target's code. What the generator must predict of the target:
- connection k (0-based, in the order the input opens them) is the local server's
  connection number k + 1, whose CHAP challenge byte i is (31 * (k + 1) + i) mod 256
  and CHAP_I is k + 1 (ferroraid::iscsi::local);
- the first session gets TSIH 1;
- an R2T's Target Transfer Tag is (task slot << 16) | R2TSN, and a command issued when no
  other task is live takes task slot 0 (the front-end's free slots are a stack).

Run it from anywhere: python3 fuzz/gen_iscsi_session_seeds.py
"""

import hashlib
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds", "iscsi_session")
TARGET = "iqn.2026-11.org.ferroraid:fuzz"
INITIATOR = "iqn.2026-01.org.example:fuzzer"
CHAP_USER = "fuzz-initiator"
CHAP_SECRET = b"initiator-secret"
CHAP_TARGET_USER = "fuzz-target"


def crc32c_table():
    t = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        t.append(c)
    return t


CRC_TABLE = crc32c_table()


def crc32c(b):
    c = 0xFFFFFFFF
    for x in b:
        c = CRC_TABLE[(c ^ x) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283


def text(keys):
    return b"".join(f"{k}={v}".encode() + b"\0" for k, v in keys)


class Conn:
    """One initiator connection: builds its PDUs with its digests and sequence numbers."""

    def __init__(self, index):
        self.index = index
        self.hd = False
        self.dd = False
        self.itt = 0x100 * (index + 1)
        self.cmd_sn = 1
        self.exp_stat_sn = 0

    def pdu(self, opcode, flags, fields, data=b"", immediate=False):
        """A PDU (section 11.1): 48-byte BHS with `fields` {offset: bytes}, no AHS."""
        h = bytearray(48)
        h[0] = opcode | (0x40 if immediate else 0)
        h[1] = flags
        h[5:8] = struct.pack(">I", len(data))[1:]
        for at, v in fields.items():
            h[at : at + len(v)] = v
        out = bytes(h)
        if self.hd:
            out += struct.pack("<I", crc32c(out))
        if data:
            padded = data + b"\0" * (-len(data) % 4)
            out += padded
            if self.dd:
                out += struct.pack("<I", crc32c(padded))
        return out

    def next_itt(self):
        self.itt += 1
        return self.itt

    def login(self, flags, keys, isid=b"\x80\x00\x00\x00\x00\x01", tsih=0, cid=0):
        """Login Request (section 11.12): flags T|C|CSG|NSG; CmdSN stays during login."""
        data = text(keys)
        return self.pdu(
            0x03,
            flags,
            {
                8: isid,
                14: struct.pack(">H", tsih),
                16: struct.pack(">I", self.itt),
                20: struct.pack(">H", cid),
                24: struct.pack(">I", self.cmd_sn),
                28: struct.pack(">I", self.exp_stat_sn),
            },
            data,
            immediate=True,
        )

    def scsi(self, cdb, edtl=0, read=False, write=False, data=b"", final=True, itt=None):
        """SCSI Command (section 11.3), simple task attribute, LUN 0."""
        itt = self.next_itt() if itt is None else itt
        flags = (0x80 if final else 0) | (0x40 if read else 0) | (0x20 if write else 0) | 1
        cdb = bytes(cdb) + b"\0" * (16 - len(cdb))
        p = self.pdu(
            0x01,
            flags,
            {
                16: struct.pack(">I", itt),
                20: struct.pack(">I", edtl),
                24: struct.pack(">I", self.cmd_sn),
                28: struct.pack(">I", self.exp_stat_sn),
                32: cdb,
            },
            data,
        )
        self.cmd_sn += 1
        return p, itt

    def data_out(self, itt, data, offset, data_sn=0, ttt=0xFFFFFFFF, final=True):
        """SCSI Data-Out (section 11.7)."""
        return self.pdu(
            0x05,
            0x80 if final else 0,
            {
                16: struct.pack(">I", itt),
                20: struct.pack(">I", ttt),
                28: struct.pack(">I", self.exp_stat_sn),
                36: struct.pack(">I", data_sn),
                40: struct.pack(">I", offset),
            },
            data,
        )

    def data_outs(self, itt, data, offset, seg, ttt=0xFFFFFFFF):
        """One data sequence split into segments of at most `seg` bytes."""
        out = b""
        n = 0
        at = 0
        while at < len(data):
            piece = data[at : at + seg]
            out += self.data_out(
                itt, piece, offset + at, n, ttt, final=at + len(piece) == len(data)
            )
            at += len(piece)
            n += 1
        return out

    def tmf(self, function, ref_itt=0xFFFFFFFF, ref_cmd_sn=0):
        """Task Management Function Request (section 11.5), immediate."""
        itt = self.next_itt()
        return self.pdu(
            0x02,
            0x80 | function,
            {
                16: struct.pack(">I", itt),
                20: struct.pack(">I", ref_itt),
                24: struct.pack(">I", self.cmd_sn),
                28: struct.pack(">I", self.exp_stat_sn),
                32: struct.pack(">I", ref_cmd_sn),
            },
            immediate=True,
        )

    def nop(self, data=b"", ping=True):
        """NOP-Out (section 11.18): a ping (ITT set, immediate) or a bare one."""
        itt = self.next_itt() if ping else 0xFFFFFFFF
        return self.pdu(
            0x00,
            0x80,
            {
                16: struct.pack(">I", itt),
                20: struct.pack(">I", 0xFFFFFFFF),
                24: struct.pack(">I", self.cmd_sn),
                28: struct.pack(">I", self.exp_stat_sn),
            },
            data,
            immediate=True,
        )

    def text_req(self, keys):
        """Text Request (section 11.10), not immediate."""
        itt = self.next_itt()
        p = self.pdu(
            0x04,
            0x80,
            {
                16: struct.pack(">I", itt),
                20: struct.pack(">I", 0xFFFFFFFF),
                24: struct.pack(">I", self.cmd_sn),
                28: struct.pack(">I", self.exp_stat_sn),
            },
            text(keys),
        )
        self.cmd_sn += 1
        return p

    def logout(self, reason=0, cid=0):
        """Logout Request (section 11.14): close the session (0) or the connection (1)."""
        itt = self.next_itt()
        p = self.pdu(
            0x06,
            0x80 | reason,
            {
                16: struct.pack(">I", itt),
                20: struct.pack(">H", cid),
                24: struct.pack(">I", self.cmd_sn),
                28: struct.pack(">I", self.exp_stat_sn),
            },
            immediate=True,
        )
        return p


# SCSI CDBs (SPC-4 / SBC-4).
TEST_UNIT_READY = [0x00]
INQUIRY = [0x12, 0, 0, 0, 96, 0]
INQUIRY_83 = [0x12, 1, 0x83, 0, 255, 0]
INQUIRY_B0 = [0x12, 1, 0xB0, 0, 64, 0]
READ_CAPACITY_16 = [0x9E, 0x10] + [0] * 8 + [0, 0, 0, 32, 0, 0]
REPORT_LUNS = [0xA0, 0, 0, 0, 0, 0, 0, 0, 0, 64, 0, 0]
MODE_SENSE_6 = [0x1A, 0, 0x3F, 0, 192, 0]
SYNC_CACHE_10 = [0x35] + [0] * 9


def read10(lba, blocks):
    return [0x28, 0] + list(struct.pack(">I", lba)) + [0] + list(struct.pack(">H", blocks)) + [0]


def write10(lba, blocks):
    return [0x2A, 0] + list(struct.pack(">I", lba)) + [0] + list(struct.pack(">H", blocks)) + [0]


def pattern(n, seed):
    return bytes((seed * 7 + i * 13) & 0xFF for i in range(n))


class Seed:
    """A seed: the setup byte and the actions."""

    def __init__(self, setup):
        self.b = bytearray([setup])

    def send(self, data, piece=7):
        while data:
            d, data = data[:65535], data[65535:]
            self.b += bytes([piece << 5]) + struct.pack(">H", len(d)) + d
        return self

    def wait(self, n=1):
        self.b += b"\x01" * n
        return self

    def half_close(self):
        self.b += b"\x02"
        return self

    def drop(self):
        self.b += b"\x03"
        return self

    def connect(self):
        self.b += b"\x04"
        return self

    def select(self, k):
        self.b += bytes([5 | (k << 3)])
        return self

    def shutdown(self):
        self.b += b"\x06"
        return self

    def toggle_reading(self):
        self.b += b"\x07"
        return self


def setup_byte(array=0, digests=False, chap=0, small_buffers=False, small_segments=False,
               small_bursts=False):
    return (array | (4 if digests else 0) | (chap << 3) | (0x20 if small_buffers else 0)
            | (0x40 if small_segments else 0) | (0x80 if small_bursts else 0))


def op_keys(immediate=True, initial_r2t=False, digests=False, mrdsl=8192, first=65536,
            max_burst=262144, outstanding=1):
    d = "CRC32C,None" if digests else "None"
    return [
        ("HeaderDigest", d),
        ("DataDigest", d),
        ("MaxRecvDataSegmentLength", str(mrdsl)),
        ("InitialR2T", "Yes" if initial_r2t else "No"),
        ("ImmediateData", "Yes" if immediate else "No"),
        ("MaxBurstLength", str(max_burst)),
        ("FirstBurstLength", str(first)),
        ("MaxOutstandingR2T", str(outstanding)),
        ("MaxConnections", "4"),
        ("ErrorRecoveryLevel", "0"),
        ("DataPDUInOrder", "Yes"),
        ("DataSequenceInOrder", "Yes"),
        ("DefaultTime2Wait", "2"),
        ("DefaultTime2Retain", "0"),
        ("IFMarker", "No"),
        ("OFMarker", "No"),
    ]


def login_none(s, c, ops, tsih=0, cid=0, discovery=False):
    """AuthMethod=None then operational negotiation (two stages, section 6.3)."""
    first = [("InitiatorName", INITIATOR)]
    if discovery:
        first.append(("SessionType", "Discovery"))
    else:
        first += [("SessionType", "Normal"), ("TargetName", TARGET)]
    first.append(("AuthMethod", "None"))
    s.send(c.login(0x81, first, tsih=tsih, cid=cid)).wait()
    s.send(c.login(0x87, ops, tsih=tsih, cid=cid)).wait()
    c.exp_stat_sn += 2


def login_chap(s, c, ops, mutual=False, tsih=0, cid=0, discovery=False):
    """AuthMethod=CHAP (RFC 7143 section 12.1.3, RFC 1994 MD5), then operational keys."""
    first = [("InitiatorName", INITIATOR)]
    if discovery:
        first.append(("SessionType", "Discovery"))
    else:
        first += [("SessionType", "Normal"), ("TargetName", TARGET)]
    first.append(("AuthMethod", "CHAP,None"))
    s.send(c.login(0x81, first, tsih=tsih, cid=cid)).wait()
    s.send(c.login(0x81, [("CHAP_A", "5")], tsih=tsih, cid=cid)).wait()
    conn_id = c.index + 1
    ident = conn_id & 0xFF
    challenge = bytes((31 * conn_id + i) & 0xFF for i in range(16))
    resp = hashlib.md5(bytes([ident]) + CHAP_SECRET + challenge).hexdigest()
    keys = [("CHAP_N", CHAP_USER), ("CHAP_R", "0x" + resp)]
    if mutual:
        keys += [("CHAP_I", "77"), ("CHAP_C", "0x" + bytes(range(100, 116)).hex())]
    s.send(c.login(0x81, keys, tsih=tsih, cid=cid)).wait()
    s.send(c.login(0x87, ops, tsih=tsih, cid=cid)).wait()
    c.exp_stat_sn += 4


def probe(s, c):
    """The commands an initiator issues after login."""
    for cdb, n in [
        (TEST_UNIT_READY, 0),
        (INQUIRY, 96),
        (INQUIRY_83, 255),
        (INQUIRY_B0, 64),
        (READ_CAPACITY_16, 32),
        (REPORT_LUNS, 64),
        (MODE_SENSE_6, 192),
    ]:
        p, _ = c.scsi(cdb, edtl=n, read=n > 0)
        s.send(p)
    s.wait()


def write_immediate(s, c, lba, blocks, bs=512, seed=1, seg=8192):
    """WRITE(10) with immediate data and, beyond it, unsolicited Data-Out (InitialR2T=No)."""
    data = pattern(blocks * bs, seed)
    imm = data[:seg]
    # F bit clear: unsolicited Data-Out follow (section 11.3.4).
    p, itt = c.scsi(write10(lba, blocks), edtl=len(data), write=True, data=imm,
                    final=len(data) <= seg)
    s.send(p)
    if len(data) > seg:
        s.send(c.data_outs(itt, data[seg:], seg, seg))
    s.wait()
    return data


def write_r2t(s, c, lba, blocks, bs=512, seed=2, burst=65536, seg=8192, slot=0):
    """WRITE(10) without immediate data, answered R2T by R2T (InitialR2T=Yes)."""
    data = pattern(blocks * bs, seed)
    p, itt = c.scsi(write10(lba, blocks), edtl=len(data), write=True)
    s.send(p).wait()
    k = 0
    at = 0
    while at < len(data):
        piece = data[at : at + burst]
        s.send(c.data_outs(itt, piece, at, seg, ttt=(slot << 16) | k)).wait()
        at += len(piece)
        k += 1
    return data


def read_back(s, c, lba, blocks, bs=512):
    p, _ = c.scsi(read10(lba, blocks), edtl=blocks * bs, read=True)
    s.send(p).wait()


def logout(s, c):
    s.send(c.logout()).wait()


def basic():
    s = Seed(setup_byte(0))
    c = Conn(0)
    login_none(s, c, op_keys())
    probe(s, c)
    write_immediate(s, c, 0, 4)
    write_immediate(s, c, 8, 64)  # 32 KiB: 8 KiB immediate, then Data-Out
    read_back(s, c, 0, 72)
    s.send(c.nop(b"ping-data")).wait()
    s.send(c.text_req([("SendTargets", "All")])).wait()
    p, _ = c.scsi(SYNC_CACHE_10)
    s.send(p).wait()
    logout(s, c)
    return s


def r2t():
    s = Seed(setup_byte(1, small_bursts=True))
    c = Conn(0)
    login_none(s, c, op_keys(immediate=False, initial_r2t=True, max_burst=4096, first=4096))
    write_r2t(s, c, 0, 32, burst=4096)  # 16 KiB in four R2Ts of 4 KiB
    read_back(s, c, 0, 32)
    write_r2t(s, c, 100, 3, burst=4096)
    logout(s, c)
    return s


def r2t_outstanding():
    s = Seed(setup_byte(3, small_bursts=True))
    c = Conn(0)
    login_none(s, c, op_keys(immediate=True, initial_r2t=False, max_burst=4096, first=1024,
                            outstanding=4))
    # 1 KiB immediate (FirstBurstLength), then R2Ts for the rest, up to 4 outstanding.
    data = pattern(16 * 512, 5)
    p, itt = c.scsi(write10(40, 16), edtl=len(data), write=True, data=data[:1024])
    s.send(p).wait()
    at = 1024
    k = 0
    while at < len(data):
        piece = data[at : at + 4096]
        s.send(c.data_outs(itt, piece, at, 2048, ttt=k))
        at += len(piece)
        k += 1
    s.wait()
    read_back(s, c, 40, 16)
    logout(s, c)
    return s


def chap_one_way():
    s = Seed(setup_byte(0, chap=1))
    c = Conn(0)
    login_chap(s, c, op_keys())
    probe(s, c)
    write_immediate(s, c, 16, 8, seed=3)
    read_back(s, c, 16, 8)
    logout(s, c)
    return s


def chap_mutual_digests():
    s = Seed(setup_byte(1, digests=True, chap=3))
    c = Conn(0)
    login_chap(s, c, op_keys(digests=True), mutual=True)
    c.hd = c.dd = True
    probe(s, c)
    write_immediate(s, c, 0, 40, seed=4)
    read_back(s, c, 0, 40)
    s.send(c.nop(b"digest")).wait()
    logout(s, c)
    return s


def discovery():
    s = Seed(setup_byte(0))
    c = Conn(0)
    login_none(s, c, [("MaxRecvDataSegmentLength", "8192"), ("HeaderDigest", "None"),
                      ("DataDigest", "None")], discovery=True)
    s.send(c.text_req([("SendTargets", "All")])).wait()
    s.send(c.nop(b"x")).wait()
    p, _ = c.scsi(INQUIRY, edtl=96, read=True)  # rejected in discovery
    s.send(p).wait()
    logout(s, c)
    # Then a normal session on a second connection.
    s.connect()
    c2 = Conn(1)
    login_none(s, c2, op_keys())
    probe(s, c2)
    logout(s, c2)
    return s


def discovery_chap_digests():
    s = Seed(setup_byte(2, digests=True, chap=2))
    c = Conn(0)
    login_chap(s, c, [("HeaderDigest", "CRC32C"), ("DataDigest", "CRC32C"),
                      ("MaxRecvDataSegmentLength", "4096")], discovery=True)
    c.hd = c.dd = True
    s.send(c.text_req([("SendTargets", "All")])).wait()
    logout(s, c)
    return s


def abort():
    s = Seed(setup_byte(0))
    c = Conn(0)
    login_none(s, c, op_keys(immediate=False, initial_r2t=True))
    data = pattern(16 * 512, 6)
    p, itt = c.scsi(write10(0, 16), edtl=len(data), write=True)
    s.send(p).wait()
    # The R2T came; abort the task instead of sending data (ABORT TASK, section 11.5.1).
    s.send(c.tmf(1, ref_itt=itt, ref_cmd_sn=c.cmd_sn - 1)).wait()
    s.send(c.tmf(1, ref_itt=0x9999, ref_cmd_sn=c.cmd_sn)).wait()  # no such task
    p, itt2 = c.scsi(write10(32, 8), edtl=8 * 512, write=True)
    s.send(p).wait()
    s.send(c.tmf(5)).wait()  # LOGICAL UNIT RESET
    s.send(c.tmf(2)).wait()  # ABORT TASK SET
    s.send(c.tmf(6)).wait()  # TARGET WARM RESET
    p, _ = c.scsi(TEST_UNIT_READY)
    s.send(p).wait()
    s.send(c.tmf(8)).wait()  # TASK REASSIGN: not supported at ERL 0
    write_r2t(s, c, 0, 4, seed=7)
    logout(s, c)
    return s


def two_connections():
    s = Seed(setup_byte(1))
    c0 = Conn(0)
    login_none(s, c0, op_keys(immediate=False, initial_r2t=True))
    write_r2t(s, c0, 0, 8, seed=8)
    s.connect()
    c1 = Conn(1)
    c1.cmd_sn = c0.cmd_sn
    login_none(s, c1, op_keys(immediate=False, initial_r2t=True), tsih=1, cid=1)
    read_back(s, c1, 0, 8)
    c0.cmd_sn = c1.cmd_sn
    s.select(0)
    # A write left waiting for its data when its connection drops.
    p, _ = c0.scsi(write10(64, 8), edtl=8 * 512, write=True)
    s.send(p).wait()
    s.drop()
    c1.cmd_sn = c0.cmd_sn
    s.select(1)
    read_back(s, c1, 0, 8)
    logout(s, c1)
    return s


def busy_small_buffers():
    s = Seed(setup_byte(0, small_buffers=True))
    c = Conn(0)
    login_none(s, c, op_keys())
    # More reads than buffers in flight at once, a reader that stops reading.
    s.toggle_reading()
    for i in range(12):
        p, _ = c.scsi(read10(i * 8, 32), edtl=32 * 512, read=True)
        s.send(p)
    s.wait(3)
    s.toggle_reading()
    s.wait(2)
    for i in range(4):
        write_immediate(s, c, i * 16, 16, seed=10 + i)
    s.half_close()
    s.wait(2)
    return s


def small_segments():
    s = Seed(setup_byte(2, small_segments=True))
    c = Conn(0)
    login_none(s, c, op_keys(mrdsl=512, first=4096))
    # 4096-byte blocks; the target takes 512-byte segments.
    write_immediate(s, c, 0, 1, bs=4096, seed=20, seg=512)  # FirstBurstLength: 4096
    read_back(s, c, 0, 2, bs=4096)
    s.send(c.nop(b"z" * 512)).wait()
    logout(s, c)
    return s


def pieces_and_drop():
    s = Seed(setup_byte(3, digests=True))
    c = Conn(0)
    first = [("InitiatorName", INITIATOR), ("SessionType", "Normal"),
             ("TargetName", TARGET), ("AuthMethod", "None")]
    s.send(c.login(0x81, first), piece=0).wait(2)  # 16 bytes a turn
    s.send(c.login(0x87, op_keys(digests=True)), piece=1).wait(2)
    c.hd = c.dd = True
    probe(s, c)
    data = pattern(32 * 512, 30)
    p, itt = c.scsi(write10(0, 32), edtl=len(data), write=True, data=data[:8192], final=False)
    s.send(p + c.data_outs(itt, data[8192:], 8192, 8192)[:5000], piece=2).wait()
    s.drop()
    return s


def shutdown_busy():
    s = Seed(setup_byte(0))
    c = Conn(0)
    login_none(s, c, op_keys(immediate=False, initial_r2t=True))
    p, _ = c.scsi(write10(0, 16), edtl=16 * 512, write=True)
    s.send(p).wait()
    p, _ = c.scsi(read10(0, 64), edtl=64 * 512, read=True)
    s.send(p)
    s.shutdown().wait(3)
    return s


def shutdown_r2t_data():
    """Shutdown requested while a write waits for its solicited data: the data still
    comes in and the write completes before the connection closes."""
    s = Seed(setup_byte(1))
    c = Conn(0)
    login_none(s, c, op_keys(immediate=False, initial_r2t=True))
    data = pattern(8 * 512, 40)
    p, itt = c.scsi(write10(8, 8), edtl=len(data), write=True)
    s.send(p).wait()
    s.shutdown().wait()
    s.send(c.data_outs(itt, data, 0, 8192, ttt=0)).wait(2)
    return s


SEEDS = {
    "basic": basic,
    "r2t": r2t,
    "r2t-outstanding": r2t_outstanding,
    "chap": chap_one_way,
    "chap-mutual-digests": chap_mutual_digests,
    "discovery": discovery,
    "discovery-chap-digests": discovery_chap_digests,
    "abort": abort,
    "two-connections": two_connections,
    "busy-small-buffers": busy_small_buffers,
    "small-segments": small_segments,
    "pieces-and-drop": pieces_and_drop,
    "shutdown-busy": shutdown_busy,
    "shutdown-r2t-data": shutdown_r2t_data,
}


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, make in SEEDS.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(bytes(make().b))
    print(f"{len(SEEDS)} seeds in {OUT}")


if __name__ == "__main__":
    main()
