"""Where rxe's re-sends start: reads the capture `guest_test.py --capture` takes (tcpdump -i any
in the VM's root namespace, UDP 4791, headers only) and prints, per queue pair, every run of
re-sent requests with the packets just before it.

At a bridge port a packet is seen twice: "In" as it arrives from its sender's veth, "Out" as it
leaves for its receiver's. So a PSN that goes backwards in the In stream was re-sent or reordered
by the sender's own namespace, one missing from Out was lost in the bridge, and the IPv4 ID (set
when rxe builds the packet) tells which of two packets was built first.

usage: python3 scripts/vm/roce_pcap.py results/vm/<run-id>/e2e-roce.pcap [--around SRC DST PSN]
"""
from __future__ import annotations

import argparse
import collections
import struct
from collections.abc import Iterator
from pathlib import Path

SLL, SLL2 = 113, 276  # Linux cooked captures (tcpdump -i any)
OUTGOING = 4  # the cooked header's packet type for a packet the host sends
ACKNOWLEDGE = 0x11
REQUESTS = set(range(0x00, 0x0D))  # RC SEND, WRITE and READ request opcodes
NAK_PSN_SEQ = 0x60


def packets(path: Path) -> Iterator[dict]:
    """One dict per RoCEv2 packet: time, direction, addresses, IPv4 TOS and ID, BTH opcode,
    destination QP and PSN, and the first byte after the BTH (an ACK's syndrome)."""
    with open(path, "rb") as f:
        head = f.read(24)
        magic = struct.unpack("<I", head[:4])[0]
        e = "<" if magic in (0xA1B2C3D4, 0xA1B23C4D) else ">"
        scale = 1e9 if magic in (0xA1B23C4D, 0x4D3CB2A1) else 1e6
        linktype = struct.unpack(e + "I", head[20:24])[0]
        if linktype not in (SLL, SLL2):
            raise SystemExit(f"{path}: link type {linktype}; expected a tcpdump -i any capture")
        while len(rec := f.read(16)) == 16:
            sec, frac, incl, orig = struct.unpack(e + "IIII", rec)
            d = f.read(incl)
            if linktype == SLL2:
                proto, ptype, off = struct.unpack(">H", d[0:2])[0], d[10], 20
            else:
                ptype, proto, off = struct.unpack(">H", d[0:2])[0], struct.unpack(">H", d[14:16])[0], 16
            if proto != 0x0800:
                continue
            ip = d[off:]
            udp = ip[(ip[0] & 15) * 4:]
            bth = udp[8:20]
            if len(bth) < 12:
                continue
            yield {"t": sec + frac / scale, "dir": "Out" if ptype == OUTGOING else "In",
                   "src": ".".join(map(str, ip[12:16])), "dst": ".".join(map(str, ip[16:20])),
                   "tos": ip[1], "ipid": int.from_bytes(ip[4:6], "big"), "op": bth[0],
                   "qp": int.from_bytes(bth[5:8], "big"), "psn": int.from_bytes(bth[9:12], "big"),
                   "syn": udp[20] if len(udp) > 20 else None, "bytes": orig}


def resend_runs(reqs: list[dict]) -> list[tuple[int, int]]:
    """(first, last) indices of each run of requests whose PSN is not above every earlier one."""
    runs: list[tuple[int, int]] = []
    top = -1
    for i, r in enumerate(reqs):
        if r["psn"] <= top and top - r["psn"] < 1 << 20:  # not a wrap of the 24-bit PSN
            if runs and runs[-1][1] == i - 1:
                runs[-1] = (runs[-1][0], i)
            else:
                runs.append((i, i))
        top = max(top, r["psn"])
    return runs


def line(r: dict, t0: float) -> str:
    return (f"{(r['t'] - t0) * 1e3:9.3f} ms {r['dir']:>3} {r['src']}->{r['dst']} qp {r['qp']} op {r['op']:#04x} "
            f"psn {r['psn']} ip id {r['ipid']} tos {r['tos']:#x} {r['bytes']} B"
            + (f" syndrome {r['syn']:#04x}" if r["op"] == ACKNOWLEDGE else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pcap", type=Path)
    ap.add_argument("--around", nargs=3, metavar=("SRC", "DST", "PSN"),
                    help="print both directions of SRC<->DST within 12 PSNs of PSN (In only)")
    args = ap.parse_args()
    rows = list(packets(args.pcap))
    if args.around:
        src, dst, psn = args.around[0], args.around[1], int(args.around[2])
        sel = [r for r in rows if r["dir"] == "In" and {r["src"], r["dst"]} == {src, dst} and abs(r["psn"] - psn) <= 12]
        for r in sel[:120]:
            print(line(r, sel[0]["t"]))
        return
    flows: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in rows:
        flows[(r["src"], r["dst"], r["qp"], r["dir"])].append(r)
    naks = sum(1 for r in rows if r["dir"] == "In" and r["op"] == ACKNOWLEDGE and r["syn"] is not None
               and r["syn"] & 0xE0 == NAK_PSN_SEQ)
    print(f"{len(rows)} RoCE packets ({sum(r['dir'] == 'In' for r in rows)} In, {sum(r['dir'] == 'Out' for r in rows)} "
          f"Out); PSN-sequence NAKs sent: {naks}")
    total = built_in_order = lost = 0
    for (src, dst, qp, d), rs in sorted(flows.items()):
        if d != "In":
            continue
        out = flows.get((src, dst, qp, "Out"), [])
        missing = collections.Counter((r["op"], r["psn"]) for r in rs) - collections.Counter((r["op"], r["psn"]) for r in out)
        lost += sum(missing.values())
        reqs = [r for r in rs if r["op"] in REQUESTS]
        runs = resend_runs(reqs)
        if not runs and not missing:
            continue
        print(f"{src} -> {dst} qp {qp}: {len(reqs)} requests, {len(runs)} re-send runs, "
              f"{sum(missing.values())} entered the bridge and did not leave it")
        for a, b in runs:
            r, prev = reqs[a], reqs[a - 1]
            overtaken_by = [x for x in reqs[:a] if x["psn"] > r["psn"]]
            in_order = bool(overtaken_by) and all(x["ipid"] > r["ipid"] for x in overtaken_by)
            built_in_order += in_order
            back = [x for x in rows if x["dir"] == "In" and x["src"] == dst and x["dst"] == src
                    and prev["t"] - 1 <= x["t"] <= r["t"]]
            why = (f"last packet back: op {back[-1]['op']:#04x} psn {back[-1]['psn']}"
                   + (f" syndrome {back[-1]['syn']:#04x}" if back[-1]["op"] == ACKNOWLEDGE else "")) if back else "none back"
            print(f"  {b - a + 1:3d} from psn {r['psn']} (highest before: {max(x['psn'] for x in reqs[:a])}); "
                  f"{'built before the higher PSNs (IP ID): reordered on its way out' if in_order else 're-sent'}; {why}")
        total += len(runs)
    print(f"re-send runs: {total}, of which {built_in_order} start with a packet built before the higher PSNs the bridge "
          f"saw first; packets lost in the bridge: {lost}")


if __name__ == "__main__":
    main()
