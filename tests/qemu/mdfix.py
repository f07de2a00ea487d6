#!/usr/bin/env python3
"""Host-side helpers of tests/qemu/md-fixtures.sh (standard library only).

  pattern  --name N --seed S --size BYTES --out FILE
      Writes the deterministic pattern: 4 KiB blocks, each a 64-byte ASCII header naming
      the pattern and the block's logical byte offset, then SHAKE-256(name, seed, block)
      bytes. A misplaced chunk says where it came from: `xxd -l 64 -s OFF member.img`.
  compose  --base FILE --over FILE --out FILE
      OUT = OVER's bytes, then BASE's from len(OVER) on (the degraded array's final content).
  manifest --dir DIR --name N --level L --layout NAME --chunk BYTES --members N
           --image-bytes B --seed S [--rewrite-seed S --rewrite-bytes B --fail-slot K]
      Writes DIR/manifest.json from what the guest left in DIR (devices, detail.txt,
      examine.txt, array_size, ...) and `mdadm --examine` of the member images on the host.
"""
import argparse
import hashlib
import json
import os
import re
import subprocess
import sys

BLOCK = 4096
LAYOUT_IDS = {
    "left-asymmetric": 0, "right-asymmetric": 1, "left-symmetric": 2,
    "right-symmetric": 3, "parity-first": 4, "parity-last": 5,
}


def pattern_block(name, seed, index):
    header = ("ferroraid-mdfix %s seed=%d off=0x%012x" % (name, seed, index * BLOCK)).encode()
    header = header[:63].ljust(63, b".") + b"\n"
    body = hashlib.shake_256(b"%s:%d:%d" % (name.encode(), seed, index)).digest(BLOCK - 64)
    return header + body


def cmd_pattern(a):
    if a.size % BLOCK:
        sys.exit("mdfix.py pattern: --size must be a multiple of %d" % BLOCK)
    with open(a.out, "wb") as f:
        for i in range(a.size // BLOCK):
            f.write(pattern_block(a.name, a.seed, i))


def cmd_compose(a):
    with open(a.over, "rb") as f:
        over = f.read()
    with open(a.base, "rb") as f:
        base = f.read()
    if len(over) > len(base):
        sys.exit("mdfix.py compose: %s is longer than %s" % (a.over, a.base))
    with open(a.out, "wb") as f:
        f.write(over + base[len(over):])


def parse_examine(text):
    """`mdadm --examine` of one or more devices -> {device: {key: value}}."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(\S.*):$", line)
        if m:
            cur = out.setdefault(m.group(1), {})
            continue
        m = re.match(r"^\s*([^:]+?)\s*:\s*(.*?)\s*$", line)
        if m and cur is not None:
            cur.setdefault(m.group(1), m.group(2))
    return out


def sectors(value):
    m = re.match(r"^(\d+) sectors", value or "")
    if not m:
        raise ValueError("expected 'N sectors', got %r" % value)
    return int(m.group(1))


def parse_detail_members(text):
    """The device table of `mdadm --detail`: [(raid_device or None, state, device)]."""
    rows, table = [], False
    for line in text.splitlines():
        if re.match(r"^\s*Number\s+Major\s+Minor\s+RaidDevice\s+State", line):
            table = True
            continue
        if not table or not line.strip():
            continue
        f = line.split()
        slot = None if f[3] == "-" else int(f[3])
        dev = f[-1] if f[-1].startswith("/dev/") else None
        state = " ".join(f[4:-1] if dev else f[4:])
        rows.append((slot, state, dev))
    return rows


def read(path):
    with open(path) as f:
        return f.read()


def cmd_manifest(a):
    d = a.dir
    devices = []  # (index, serial, guest dev)
    for line in read(os.path.join(d, "devices")).splitlines():
        i, serial, dev = line.split()
        devices.append((int(i), serial, dev))
    by_dev = {dev: (i, serial) for i, serial, dev in devices}
    by_index = {i: (serial, dev) for i, serial, dev in devices}
    images = {i: "d%d.img" % i for i, _, _ in devices}

    # The host's own mdadm reads the members (plain files: no md driver needed).
    exam_text = ""
    host_exam = {}
    for i, _, _ in devices:
        p = images[i]
        r = subprocess.run(["mdadm", "--examine", p], capture_output=True, text=True, cwd=d)
        if r.returncode != 0:
            sys.exit("mdfix.py manifest: `mdadm --examine %s` failed (%d): %s" % (p, r.returncode, r.stderr))
        exam_text += r.stdout
        host_exam[i] = parse_examine(r.stdout)[p]
    with open(os.path.join(d, "examine-host.txt"), "w") as f:
        f.write(exam_text)

    detail = read(os.path.join(d, "detail.txt"))
    rows = parse_detail_members(detail)
    members = []
    for slot in range(a.members):
        row = next((r for r in rows if r[0] == slot and r[2]), None)
        if row:
            i, serial = by_dev[row[2]]
            members.append({"slot": slot, "image": images[i], "serial": serial, "guest_device": row[2],
                            "state": "active", "md_state": row[1]})
        else:
            # Not in the array any more: the image whose (stale) superblock still claims the slot.
            claim = [i for i in host_exam if host_exam[i].get("Device Role") == "Active device %d" % slot
                     and not any(m.get("image") == images[i] for m in members)]
            if len(claim) != 1:
                sys.exit("mdfix.py manifest: slot %d is not active and %d images claim it" % (slot, len(claim)))
            i = claim[0]
            members.append({"slot": slot, "image": images[i], "serial": by_index[i][0], "guest_device": by_index[i][1],
                            "state": "removed", "md_state": "removed (failed and removed; its superblock is stale)"})
    index_of = {img: i for i, img in images.items()}
    for m in members:
        e = host_exam[index_of[m["image"]]]
        m["events"] = int(e["Events"])
        m["device_role"] = e.get("Device Role")
        m["superblock_state"] = e.get("State")
        m["array_state"] = e.get("Array State")

    active = [host_exam[index_of[m["image"]]] for m in members if m["state"] == "active"]
    first = active[0]
    for e in active[1:]:
        for key in ("Data Offset", "Used Dev Size", "Array Size", "Events", "Array UUID"):
            if e.get(key) != first.get(key):
                sys.exit("mdfix.py manifest: active members disagree on %r: %r vs %r" % (key, e.get(key), first.get(key)))
    data_offset = sectors(first["Data Offset"]) * 512
    avail = sectors(first["Avail Dev Size"]) * 512
    # mdadm prints "Used Dev Size" (the superblock's `size`) only when it differs from
    # "Avail Dev Size" (its `data_size`).
    used = sectors(first["Used Dev Size"]) * 512 if "Used Dev Size" in first else avail
    m = re.search(r"^\s*Used Dev Size : (\d+) ", detail, re.M)
    if not m or int(m.group(1)) * 1024 != used:
        sys.exit("mdfix.py manifest: mdadm --detail's Used Dev Size (KiB) disagrees with --examine's %d bytes" % used)
    array_size = int(read(os.path.join(d, "array_size")).strip())
    nd = a.members - (1 if a.level == 5 else 2)
    if array_size != used * nd:
        sys.exit("mdfix.py manifest: array size %d != used dev size %d x %d data members" % (array_size, used, nd))

    pattern = {"file": "pattern.bin", "bytes": array_size, "seed": a.seed,
               "generator": "tests/qemu/mdfix.py pattern --name %s --seed %d" % (a.name, a.seed)}
    if a.rewrite_bytes:
        pattern["rewrite"] = {"bytes": a.rewrite_bytes, "seed": a.rewrite_seed,
                              "generator": "tests/qemu/mdfix.py pattern --name %s-rewrite --seed %d"
                              % (a.name, a.rewrite_seed),
                              "note": "written over logical bytes 0..bytes after the failed member was removed; "
                                      "pattern.bin is the final content"}
    mismatch = os.path.join(d, "mismatch_cnt")
    kernel = dict(l.split("=", 1) for l in read(os.path.join(d, "..", "kernel.txt")).split())
    manifest = {
        "name": a.name,
        "level": a.level,
        "layout": a.layout,
        "layout_md": LAYOUT_IDS[a.layout],
        "chunk_bytes": a.chunk,
        "raid_devices": a.members,
        "metadata": first.get("Version"),
        "array_uuid": first.get("Array UUID"),
        "md_name": first.get("Name"),
        "feature_map": first.get("Feature Map"),
        "member_image_bytes": a.image_bytes,
        "data_offset_bytes": data_offset,
        "data_size_bytes": used,
        "avail_dev_size_bytes": avail,
        "super_offset_bytes": sectors(first["Super Offset"]) * 512,
        "array_size_bytes": array_size,
        "events": int(first["Events"]),
        "degraded": any(m["state"] != "active" for m in members),
        "members": members,
        "pattern": pattern,
        # md's `check` after the pattern (not run on the degraded array): null when not run.
        "mismatch_cnt": int(read(mismatch).strip()) if os.path.exists(mismatch) else None,
        "kernel": kernel,
        "mdadm_version": read(os.path.join(d, "..", "mdadm-version.txt")).strip(),
        "files": {"detail": "detail.txt", "examine_guest": "examine.txt", "examine_host": "examine-host.txt",
                  "mdstat": "mdstat.txt", "console_log": "../console.log"},
    }
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pattern")
    p.add_argument("--name", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--out", required=True)
    c = sub.add_parser("compose")
    c.add_argument("--base", required=True)
    c.add_argument("--over", required=True)
    c.add_argument("--out", required=True)
    m = sub.add_parser("manifest")
    m.add_argument("--dir", required=True)
    m.add_argument("--name", required=True)
    m.add_argument("--level", type=int, required=True)
    m.add_argument("--layout", required=True)
    m.add_argument("--chunk", type=int, required=True)
    m.add_argument("--members", type=int, required=True)
    m.add_argument("--image-bytes", type=int, required=True)
    m.add_argument("--seed", type=int, required=True)
    m.add_argument("--rewrite-seed", type=int, default=0)
    m.add_argument("--rewrite-bytes", type=int, default=0)
    a = ap.parse_args()
    {"pattern": cmd_pattern, "compose": cmd_compose, "manifest": cmd_manifest}[a.cmd](a)


if __name__ == "__main__":
    main()
