"""A rank for the launcher tests: joins the process group (env://, as speculators' trainer does),
sums its rank + 1 over all ranks, prints the sum, and holds its sockets open a moment so a
listener guard sees them. ``PROBE_FAIL_RANK`` makes that rank exit with status 3 instead, after
which the others wait (``PROBE_HANG_S``) as a rank blocked on a dead peer would."""

import os
import sys
import time

import torch
import torch.distributed as dist

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    if os.environ.get("PROBE_FAIL_RANK") == str(rank):
        sys.exit(3)
    if os.environ.get("PROBE_FAIL_RANK"):
        time.sleep(float(os.environ.get("PROBE_HANG_S", "600")))
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {total.item():g}", flush=True)
    time.sleep(1.0)
    dist.destroy_process_group()
