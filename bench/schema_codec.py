"""What the one codec (tpassrun/schema) costs per record and per channel message, on the golden samples of
``tests/golden/schema.json``: CPU microseconds per ``from_json`` / ``to_json`` (``decode`` / ``encode``), best of
``--repeats`` rounds of ``--number`` calls (process time: the cost on one core, however loaded the machine).

    python bench/schema_codec.py [--number 2000] [--repeats 9]

To compare with the hand-written codecs it replaced, run it against the tree of b9502b2 laid out as installed:

    git archive b9502b2 tpassrun rendezvous health | tar -x -C /tmp/old
    mv /tmp/old/rendezvous /tmp/old/health /tmp/old/tpassrun/
    PYTHONPATH=/tmp/old python bench/schema_codec.py

Figures only; the last line is JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import timeit
from pathlib import Path
from typing import Any, Callable

from common import print_json

import tpassrun
from tpassrun.channel import protocol as P
from tpassrun.records import NodeStatus, Report, SwapPlan, Taint
from tpassrun.rendezvous.state import Generation

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "schema.json"
CASES = {"SwapPlan (node plan)": (SwapPlan, "plan_node"), "Report (every field)": (Report, "report_full"),
         "NodeStatus (3 rows)": (NodeStatus, "status_full"), "Taint": (Taint, "taint_full"),
         "Generation": (Generation, "generation")}


def cost(call: Callable[[], Any], number: int, repeats: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=repeats, timer=time.process_time)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    gold = json.loads(GOLDEN.read_text())["records"]
    print(f"tpassrun from {Path(tpassrun.__file__).parent}")
    out: dict[str, Any] = {}
    for name, (cls, key) in CASES.items():
        doc = json.loads(gold[key]["json"])
        record = cls.from_json(doc)
        read = cost(functools.partial(cls.from_json, doc), args.number, args.repeats)
        write = cost(record.to_json, args.number, args.repeats)
        out[name] = {"read_us": round(read, 2), "write_us": round(write, 2)}
        print(f"{name:22s} from_json {read:7.1f} us   to_json {write:7.1f} us")
    msg = P.Assign(world=P.WorldSpec(rank=1, world_size=2), swap_id="s", key="k", listen_host="h")
    line = P.encode(msg, slot=1)
    read = cost(lambda: P.decode_command(line), args.number, args.repeats)
    write = cost(lambda: P.encode(msg, slot=1), args.number, args.repeats)
    out["Assign (channel)"] = {"read_us": round(read, 2), "write_us": round(write, 2)}
    print(f"{'Assign (channel)':22s} decode    {read:7.1f} us   encode  {write:7.1f} us")
    print_json(out)


if __name__ == "__main__":
    main()
