#!/usr/bin/env python3
"""The store of torchrun's agent, for tests/support/torchrun_env.sh.

As torchrun's static rendezvous does, node 0's agent serves a TCPStore on MASTER_PORT (0: a free
port), every node's agent connects to it, and node 0 waits until all of them did. Prints
"ready <port>" once the rendezvous is complete, then keeps the store until stdin closes: the
launcher holds the other end, so the store goes away with it however the launcher ends.
"""
import argparse
import datetime
import sys

import torch.distributed as dist


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--addr", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the agents")
    a = p.parse_args()
    args = dict(host_name=a.addr, port=a.port, world_size=a.nnodes, is_master=a.node_rank == 0,
                timeout=datetime.timedelta(seconds=a.timeout), wait_for_workers=True,
                multi_tenant=True)
    try:
        # torch >= 2.4 serves with libuv by default; Debian's torch 2.6 is built without it.
        store = dist.TCPStore(use_libuv=False, **args)
    except TypeError:  # torch < 2.2: no use_libuv (and only the classic server)
        store = dist.TCPStore(**args)
    print(f"ready {store.port}", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # one line for the launcher's log, not a traceback
        sys.exit(f"agent_store: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
