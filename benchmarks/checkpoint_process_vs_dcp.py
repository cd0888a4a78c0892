"""ampctl's checkpoint saving process (runner/checkpointing/checkpoint_process.py,
distributed.async_checkpointer=process) against
DCP's own, `dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)`, on the same states: what the
training process waits for at each save (the copy out of its states), how long until the checkpoint is on disk, and
what each prints on the terminal and at the process's end.

Each side runs in a process of its own (one rank: a gloo group of one for DCP's, which needs one), its stderr kept;
the sides alternate over rounds. The states change as soon as a save returns (training goes on), and each
checkpoint is loaded back and compared with the values it was given. Prints medians over rounds: the first save
(which starts the saving process) and the steady ones, the lines each wrote on stderr, whether a traceback was among
them, and whether every checkpoint held what it was given.

    python benchmarks/checkpoint_process_vs_dcp.py                       # 64 MiB of states, 3 rounds of 4 saves
    python benchmarks/checkpoint_process_vs_dcp.py --mib 512 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIDES = ("ampctl", "dcp")


def one_process(side: str, mib: int, saves: int, out_dir: Path) -> None:
    """The child: `saves` saves of the same states, each waited for before the next (as a run waits for the
    previous save before its next); its timings as a JSON line on stdout."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    states = {f"layer{i}": torch.randn(mib * 2**20 // 4 // 8) for i in range(8)}
    blocked, written = [], []
    if side == "ampctl":
        from ampctl.engine.parallel import Parallel
        from ampctl.runner.checkpointing.checkpoint_process import SavingProcess

        saver = SavingProcess(Parallel(), timeout_s=600)
        save = lambda step: saver.save(states, str(out_dir / f"step_{step}"))  # noqa: E731
    else:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        save = lambda step: dcp.async_save(states, checkpoint_id=str(out_dir / f"step_{step}"),  # noqa: E731
                                           async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    whole = []
    for step in range(saves):
        expected = {name: tensor.clone() for name, tensor in states.items()}
        start = time.perf_counter()
        future = save(step)
        blocked.append(time.perf_counter() - start)
        for tensor in states.values():  # training goes on at once: the save must hold the values it was given
            tensor.add_(1.0)
        future.result()
        written.append(time.perf_counter() - start)
        loaded = {name: torch.empty_like(tensor) for name, tensor in states.items()}
        dcp.load(loaded, checkpoint_id=str(out_dir / f"step_{step}"), no_dist=True)
        whole.append(all(torch.equal(loaded[name], expected[name]) for name in states))
    if side == "ampctl":
        saver.close()
    print(json.dumps({"blocked_s": blocked, "written_s": written, "whole": all(whole)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="the states' size")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child process's
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return one_process(args.side, args.mib, args.saves, Path(args.out))
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for side in SIDES[::1 if round_index % 2 == 0 else -1]:
                out = Path(tmp) / f"{side}{round_index}"
                done = subprocess.run([sys.executable, __file__, "--side", side, "--mib", str(args.mib), "--saves",
                                       str(args.saves), "--out", str(out)], capture_output=True, text=True,
                                      timeout=900)
                timings = json.loads(done.stdout.strip().splitlines()[-1])
                timings["stderr_lines"] = len(done.stderr.splitlines())
                timings["traceback"] = "Traceback" in done.stderr
                timings["exit"] = done.returncode
                results[side].append(timings)
    print(f"({args.mib} MiB of states, {args.saves} saves a process, {args.rounds} rounds alternating; medians over "
          "rounds; 'blocked': what the training process waits for at a save)")
    for side, rounds in results.items():
        first_blocked = statistics.median(r["blocked_s"][0] for r in rounds)
        first_written = statistics.median(r["written_s"][0] for r in rounds)
        blocked = statistics.median(statistics.median(r["blocked_s"][1:]) for r in rounds)
        written = statistics.median(statistics.median(r["written_s"][1:]) for r in rounds)
        lines = statistics.median(r["stderr_lines"] for r in rounds)
        whole = "every checkpoint holds the values it was given" if all(r["whole"] for r in rounds) else \
            "NOT every checkpoint holds the values it was given"
        print(f"  {side:<7} first save: blocked {first_blocked * 1e3:7.1f} ms, written {first_written:5.2f} s;  "
              f"later: blocked {blocked * 1e3:6.1f} ms, written {written:5.2f} s;  stderr {lines:.0f} lines"
              f"{', a traceback' if any(r['traceback'] for r in rounds) else ''}, exit {rounds[0]['exit']}; {whole}")


if __name__ == "__main__":
    main()
