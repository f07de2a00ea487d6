#!/usr/bin/env python3
"""Host-side helpers of tests/qemu/md-ppl.sh.

  write  URI --off BYTES --len BYTES --new FILE --acks FILE [--writers N] [--seed S]
      Small random writes (4-32 KiB, 4 KiB aligned) inside [off, off+len) of the NBD export
      URI, from N connections at once, until the server goes away: a block written at
      array offset X holds block (X - off) of FILE (the crash window's pattern). Each
      acknowledged write appends a line to ACKS. Needs python3-libnbd; it is meant to be
      cut off (the server is killed under it), so it exits 0 only if it never was.
  region ARRAY --base FILE --new FILE --off BYTES --len BYTES [--outside-only]
      Holds ARRAY (what was read back from the whole array) against the seeded pattern
      BASE: every 4 KiB block outside [off, off+len) must equal BASE's; inside it every
      block must be BASE's or NEW's (block (X - off)) -- nothing torn, nothing else --
      unless --outside-only. Prints the counts; exit 1 on a violation.
"""
import argparse
import random
import sys
import threading

BLOCK = 4096


def cmd_write(a):
    import nbd  # python3-libnbd

    with open(a.new, "rb") as f:
        new = f.read()
    assert len(new) >= a.len, "the crash window's pattern is shorter than the window"
    lock = threading.Lock()
    acks = open(a.acks, "a", buffering=1)
    errors = []

    def writer(k):
        rng = random.Random(a.seed * 1000 + k)
        h = nbd.NBD()
        h.connect_uri(a.uri)
        try:
            while True:
                n = rng.randint(1, 8)
                first = rng.randrange(0, a.len // BLOCK - n + 1)
                rel = first * BLOCK
                h.pwrite(new[rel:rel + n * BLOCK], a.off + rel)
                with lock:
                    acks.write("%d %d\n" % (a.off + rel, n * BLOCK))
        except Exception as e:  # the server went away: the expected end
            errors.append("writer %d: %s" % (k, e))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(a.writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("\n".join(errors), file=sys.stderr)
    sys.exit(1 if errors else 0)


def cmd_region(a):
    with open(a.array, "rb") as f:
        got = f.read()
    with open(a.base, "rb") as f:
        base = f.read()
    with open(a.new, "rb") as f:
        new = f.read()
    if len(got) != len(base):
        sys.exit("region: %s has %d bytes, the pattern %d" % (a.array, len(got), len(base)))
    outside = old = fresh = 0
    bad = []
    for b in range(len(got) // BLOCK):
        x = b * BLOCK
        blk = got[x:x + BLOCK]
        if a.off <= x < a.off + a.len:
            if blk == base[x:x + BLOCK]:
                old += 1
            elif blk == new[x - a.off:x - a.off + BLOCK]:
                fresh += 1
            elif not a.outside_only:
                bad.append("block at %d in the crash window is neither the pattern nor what was "
                           "written there (starts %r)" % (x, blk[:63]))
        elif blk == base[x:x + BLOCK]:
            outside += 1
        else:
            bad.append("block at %d outside the crash window differs from the pattern "
                       "(starts %r)" % (x, blk[:63]))
    window = a.len // BLOCK
    print("outside the crash window: %d blocks equal the pattern; in it (%d blocks): "
          "%d the pattern, %d rewritten, %d other" % (outside, window, old, fresh,
                                                     window - old - fresh))
    if bad:
        print("\n".join(bad[:10] + (["... %d more" % (len(bad) - 10)] if len(bad) > 10 else [])))
        sys.exit(1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("uri")
    w.add_argument("--off", type=int, required=True)
    w.add_argument("--len", type=int, required=True)
    w.add_argument("--new", required=True)
    w.add_argument("--acks", required=True)
    w.add_argument("--writers", type=int, default=4)
    w.add_argument("--seed", type=int, default=1)
    r = sub.add_parser("region")
    r.add_argument("array")
    r.add_argument("--base", required=True)
    r.add_argument("--new", required=True)
    r.add_argument("--off", type=int, required=True)
    r.add_argument("--len", type=int, required=True)
    r.add_argument("--outside-only", action="store_true")
    a = p.parse_args()
    {"write": cmd_write, "region": cmd_region}[a.cmd](a)


if __name__ == "__main__":
    main()
