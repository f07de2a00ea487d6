#!/usr/bin/env python3
"""Writes the seeds of the `nbd_conn` fuzz target (fuzz/seeds/nbd_conn/): whole NBD
conversations built from proto.md by hand, independently of the Rust code, in the
target's input format (src/nbd_conversation.rs): a setup byte, two fragmentation bytes,
a TLS byte, then the client's byte stream (handshake flags, options, requests and write
payloads). With TLS the stream stays plaintext NBD: after the NBD_OPT_STARTTLS
acknowledgement the target's client makes the TLS handshake itself and encrypts the rest
of the stream, so no TLS bytes are in a seed.

Run from anywhere: python3 fuzz/gen_nbd_conn_seeds.py
"""
import os
import struct

IHAVEOPT = 0x49484156454F5054
REQUEST_MAGIC = 0x25609513
FIXED_NEWSTYLE, NO_ZEROES = 1, 2
OPT_EXPORT_NAME, OPT_ABORT, OPT_LIST, OPT_STARTTLS, OPT_INFO, OPT_GO, OPT_STRUCTURED_REPLY = (
    1, 2, 3, 5, 6, 7, 8)
OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT = 9, 10
INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE = 1, 2, 3
READ, WRITE, DISC, FLUSH, TRIM, CACHE, WRITE_ZEROES, BLOCK_STATUS = 0, 1, 2, 3, 4, 5, 6, 7
FUA, NO_HOLE, DF, REQ_ONE, FAST_ZERO = 1, 2, 4, 8, 16
EXPORT = b"fuzz"


def option(opt, data=b""):
    return struct.pack(">QII", IHAVEOPT, opt, len(data)) + data


def info_request(name, infos=()):
    return struct.pack(">I", len(name)) + name + struct.pack(">H", len(infos)) + b"".join(
        struct.pack(">H", i) for i in infos)


def meta_request(name, queries=()):
    """NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT data (proto.md "Option types")."""
    return struct.pack(">I", len(name)) + name + struct.pack(">I", len(queries)) + b"".join(
        struct.pack(">I", len(q)) + q for q in queries)


class Requests:
    """Request headers with unique handles (and write payloads)."""

    def __init__(self):
        self.handle = 0x1000
        self.out = b""

    def __call__(self, cmd, offset=0, length=0, flags=0, payload=None):
        self.handle += 1
        self.out += struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, self.handle, offset, length)
        if cmd == WRITE:
            self.out += payload if payload is not None else bytes((self.handle + i) & 0xFF
                                                                 for i in range(length))
        return self


# The TLS byte: bits 0-1 the server's mode, bit 2 an eager client (no TLS after the
# acknowledgement), bit 3 TLS 1.2 only, bits 4-7 a ciphertext byte to flip.
TLS_OFF, TLS_ALLOW, TLS_REQUIRE, TLS_REQUIRE_CERT = 0, 1, 2, 3
TLS_EAGER, TLS_12 = 4, 8


def tamper(k):
    return k << 4


def seed(setup, frag, stream, tls=TLS_OFF):
    return bytes([setup]) + struct.pack(">HB", frag, tls) + stream


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds", "nbd_conn")
    os.makedirs(out, exist_ok=True)
    seeds = {}

    # libnbd-like: structured replies, list, info, go with block sizes; every command.
    r = Requests()
    r(WRITE, 0, 4096, FUA)(READ, 0, 4096)(WRITE_ZEROES, 8192, 8192)(TRIM, 16384, 4096, FUA)
    r(FLUSH)(READ, 100, 1000)(READ, 0, 65536)(READ, 0, 0)(WRITE, 512, 1024, 0)
    r(BLOCK_STATUS, 0, 65536)(CACHE, 0, 4096)(9, 0, 0)(WRITE_ZEROES, 0, 4096, FAST_ZERO)
    r(READ, 0, 4096, DF)(READ, 1 << 40, 4096)(WRITE, 130048, 4096)(DISC)
    seeds["structured-go"] = seed(0x18, 0, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
                                  + option(OPT_STRUCTURED_REPLY) + option(OPT_LIST)
                                  + option(OPT_INFO, info_request(EXPORT, [INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]))
                                  + option(OPT_GO, info_request(EXPORT, [INFO_BLOCK_SIZE]))
                                  + r.out)

    # Old-style client: NBD_OPT_EXPORT_NAME of the default export, simple replies,
    # pipelined requests, an unaligned write whose payload must be consumed.
    r = Requests()
    r(WRITE, 4096, 8192)(WRITE, 1000, 14)(READ, 4096, 8192)(READ, 0, 1 << 25)(FLUSH, 0, 0, FUA)
    r(TRIM, 0, 8192)(WRITE_ZEROES, 0, 512, NO_HOLE)(READ, 0, 512)(DISC)
    seeds["export-name"] = seed(0x00, 0x5a17, struct.pack(">I", FIXED_NEWSTYLE)
                                + option(OPT_EXPORT_NAME, b"") + r.out)

    # GO without structured replies, small buffers (reads and writes split), two
    # requests in flight, the client ends with its side shut down (no NBD_CMD_DISC).
    r = Requests()
    r(WRITE, 0, 40960)(READ, 0, 40960)(READ, 8192, 512)(WRITE, 65536, 16384, FUA)(READ, 65536, 32768)
    seeds["split-pieces"] = seed(0x0C, 0x0101, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
                                 + option(OPT_GO, info_request(b"")) + r.out)

    # Options that do not lead to transmission: unknown, STARTTLS (refused: no TLS), an
    # unknown export, malformed INFO data, then NBD_OPT_ABORT.
    seeds["options-abort"] = seed(0x00, 0x0003, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
                                  + option(99, b"xyz") + option(OPT_STARTTLS)
                                  + option(OPT_INFO, info_request(b"nope"))
                                  + option(OPT_GO, b"\x00\x00\x00\x09ab")
                                  + option(OPT_LIST, b"x") + option(OPT_ABORT))

    # RAID6, a slow client with a small server send buffer: the whole export read back in
    # one request, the stream in odd pieces.
    r = Requests()
    r(WRITE, 0, 65536)(READ, 0, 131072)(READ, 4096, 61440)(FLUSH)(DISC)
    seeds["raid6-slow-reader"] = seed(0x99, 0x7e3c, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
                                      + option(OPT_STRUCTURED_REPLY)
                                      + option(OPT_GO, info_request(EXPORT, [INFO_BLOCK_SIZE]))
                                      + r.out)

    # 4096-byte blocks: 512-byte requests are refused (a refused write's payload consumed).
    r = Requests()
    r(WRITE, 512, 512)(READ, 0, 512)(WRITE, 4096, 4096)(READ, 4096, 4096)(TRIM, 0, 4096)(DISC)
    seeds["4k-blocks"] = seed(0x02, 0x0042, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
                              + option(OPT_GO, info_request(EXPORT)) + r.out)

    # No trim and write-zeroes: both refused; a client that drops the socket at the end.
    r = Requests()
    r(TRIM, 0, 4096)(WRITE_ZEROES, 0, 4096)(WRITE, 0, 4096)(READ, 0, 4096)
    seeds["no-trim-drop"] = seed(0x23, 0x0909, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
                                 + option(OPT_STRUCTURED_REPLY)
                                 + option(OPT_GO, info_request(EXPORT)) + r.out)

    # Server shutdown while requests are in flight (drain), one request at a time.
    r = Requests()
    for i in range(8):
        r(WRITE, i * 8192, 8192)(READ, i * 8192, 8192)
    seeds["shutdown-drain"] = seed(0x40, 0x0011, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
                                   + option(OPT_GO, info_request(EXPORT)) + r.out)

    # Block status (base:allocation): LIST with no query and with `base:`, SET before
    # structured replies (invalid), an unknown context (nothing selected), another export
    # (unknown), then the context selected; in transmission: the whole export, REQ_ONE,
    # beyond the end, zero length, after writes and a whole-stripe write-zeroes (a RAID5 ×
    # 3 stripe is 8 KiB), a misaligned one, and reads of what it reports.
    r = Requests()
    r(BLOCK_STATUS, 0, 131072)(BLOCK_STATUS, 0, 131072, REQ_ONE)(BLOCK_STATUS, 131072, 512)
    r(BLOCK_STATUS, 0, 0)(WRITE, 8192, 4096)(WRITE, 40960, 16384, FUA)(BLOCK_STATUS, 0, 131072)
    r(BLOCK_STATUS, 4096, 65536, REQ_ONE | FUA)(WRITE_ZEROES, 40960, 8192)(BLOCK_STATUS, 0, 131072)
    r(BLOCK_STATUS, 100, 512)(BLOCK_STATUS, 0, 512, DF)(READ, 0, 65536)(TRIM, 8192, 8192)
    r(BLOCK_STATUS, 0, 65536)(DISC)
    seeds["block-status"] = seed(0x08, 0, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
                                 + option(OPT_LIST_META_CONTEXT, meta_request(EXPORT))
                                 + option(OPT_LIST_META_CONTEXT, meta_request(b"", [b"base:"]))
                                 + option(OPT_SET_META_CONTEXT, meta_request(EXPORT, [b"base:allocation"]))
                                 + option(OPT_STRUCTURED_REPLY)
                                 + option(OPT_SET_META_CONTEXT, meta_request(EXPORT, [b"x:y"]))
                                 + option(OPT_SET_META_CONTEXT, meta_request(b"nope", [b"base:allocation"]))
                                 + option(OPT_SET_META_CONTEXT, b"\x00\x00\x00\x00\x00\x00\x00\x02")
                                 + option(OPT_SET_META_CONTEXT, meta_request(b"", [b"x:y", b"base:allocation"]))
                                 + option(OPT_GO, info_request(EXPORT, [INFO_BLOCK_SIZE]))
                                 + r.out)

    # RAID6, the context selected then NBD_OPT_EXPORT_NAME (the selection is kept),
    # block status pipelined with writes and reads, a slow client, odd pieces.
    r = Requests()
    for i in range(6):
        r(WRITE, i * 24576, 4096)(BLOCK_STATUS, 0, 131072)(READ, i * 24576, 8192, 0)
        r(BLOCK_STATUS, i * 8192, 16384, REQ_ONE)
    r(WRITE_ZEROES, 0, 131072)(BLOCK_STATUS, 0, 131072)(DISC)
    seeds["block-status-raid6-export-name"] = seed(
        0x89, 0x3c3c, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
        + option(OPT_STRUCTURED_REPLY)
        + option(OPT_SET_META_CONTEXT, meta_request(EXPORT, [b"base:allocation"]))
        + option(OPT_EXPORT_NAME, EXPORT) + r.out)

    # TLS allowed: STARTTLS first, then structured replies and GO inside TLS, commands
    # in odd pieces (the ciphertext is sent in the same pieces).
    r = Requests()
    r(WRITE, 0, 8192, FUA)(READ, 0, 8192)(WRITE_ZEROES, 8192, 4096)(TRIM, 12288, 4096)
    r(FLUSH)(READ, 4096, 40000)(WRITE, 65536, 20000)(READ, 65536, 20480)(DISC)
    seeds["tls-go"] = seed(0x18, 0x3a11, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
                           + option(OPT_STARTTLS) + option(OPT_STRUCTURED_REPLY)
                           + option(OPT_GO, info_request(EXPORT, [INFO_BLOCK_SIZE]))
                           + r.out, TLS_ALLOW)

    # TLS allowed: structured replies and NBD_OPT_INFO in the clear, then STARTTLS, which
    # drops them (proto.md): GO inside TLS without structured replies gets simple replies.
    r = Requests()
    r(WRITE, 0, 4096)(READ, 0, 4096)(READ, 4096, 12288)(FLUSH)(DISC)
    seeds["tls-state-dropped"] = seed(0x08, 0x0000, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
                                      + option(OPT_STRUCTURED_REPLY) + option(OPT_INFO, info_request(EXPORT))
                                      + option(OPT_STARTTLS) + option(OPT_GO, info_request(EXPORT))
                                      + r.out, TLS_ALLOW)

    # TLS required: options in the clear refused (NBD_REP_ERR_TLS_REQD), then STARTTLS,
    # a second STARTTLS inside TLS (NBD_REP_ERR_INVALID), list, GO, simple replies.
    r = Requests()
    r(WRITE, 0, 4096)(READ, 0, 4096)(WRITE, 4096, 1024)(READ, 0, 65536)(FLUSH)(DISC)
    seeds["tls-require-refused-first"] = seed(
        0x08, 0x0000, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
        + option(OPT_LIST) + option(OPT_INFO, info_request(EXPORT)) + option(OPT_STRUCTURED_REPLY)
        + option(OPT_STARTTLS) + option(OPT_STARTTLS) + option(OPT_LIST)
        + option(OPT_GO, info_request(EXPORT)) + r.out, TLS_REQUIRE)

    # TLS allowed, a plaintext client: served as without TLS.
    r = Requests()
    r(WRITE, 0, 4096)(READ, 0, 4096)(TRIM, 0, 4096)(READ, 0, 8192)(DISC)
    seeds["tls-allow-plaintext"] = seed(0x00, 0x0102, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
                                        + option(OPT_STRUCTURED_REPLY)
                                        + option(OPT_GO, info_request(EXPORT)) + r.out, TLS_ALLOW)

    # Client certificates required, TLS 1.2, RAID6, a slow client; NBD_OPT_EXPORT_NAME
    # inside TLS.
    r = Requests()
    r(WRITE, 0, 32768)(READ, 0, 65536)(WRITE_ZEROES, 0, 4096)(READ, 0, 4096)(DISC)
    seeds["tls-client-cert-tls12"] = seed(0x89, 0x0777, struct.pack(">I", FIXED_NEWSTYLE)
                                          + option(OPT_STARTTLS) + option(OPT_EXPORT_NAME, EXPORT)
                                          + r.out, TLS_REQUIRE_CERT | TLS_12)

    # TLS required and NBD_OPT_EXPORT_NAME in the clear: closed without export data.
    seeds["tls-require-export-name"] = seed(0x00, 0x0000, struct.pack(">I", FIXED_NEWSTYLE)
                                            + option(OPT_EXPORT_NAME, EXPORT), TLS_REQUIRE)

    # A client whose ClientHello is corrupted in flight: the server ends the handshake.
    r = Requests()
    r(READ, 0, 4096)(DISC)
    seeds["tls-tampered-hello"] = seed(0x00, 0x0000, struct.pack(">I", FIXED_NEWSTYLE | NO_ZEROES)
                                       + option(OPT_STARTTLS) + option(OPT_GO, info_request(EXPORT))
                                       + r.out, TLS_ALLOW | tamper(1))

    for name, data in sorted(seeds.items()):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
        print(f"{name}: {len(data)} bytes")


if __name__ == "__main__":
    main()
