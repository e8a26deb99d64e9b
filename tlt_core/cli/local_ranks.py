"""Local ranks for a command: N processes on this machine, one torch.distributed rank each
(gloo), as `torchrun --standalone --nproc-per-node N` would start them, without the launcher.

TLT's drafter is trained by the ranks that finish their share of a rollout early, while the
others still decode the tail; with one process there is no such rank. The CPU's cores are split
between the ranks (intra-op threads), so N ranks use the machine as one process would. Rank 0
prints and writes; the other ranks' standard output is discarded, and they log warnings and
errors only (tlt_core.cli.logs), at most the level the command was started with.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from typing import Callable

import torch
import torch.multiprocessing as mp

from tlt_core.cli.logs import configure_logging, current_level

logger = logging.getLogger(__name__)

LAUNCHED = "TLT_LOCAL_RANKS"  # set in the ranks this module starts


def under_a_launcher() -> bool:
    """True inside a rank that this module or torchrun started."""
    return LAUNCHED in os.environ or "WORLD_SIZE" in os.environ


def run_local_ranks(nproc: int, command: Callable, *args) -> int:
    """Runs command(*args) in `nproc` local ranks and returns rank 0's exit code; a rank that
    fails stops the others, and its exit code is returned."""
    threads = max(1, torch.get_num_threads() // nproc)
    environment = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                   "WORLD_SIZE": str(nproc), LAUNCHED: "1"}
    try:
        mp.spawn(_rank_main, args=(environment, threads, current_level(), command, args),
                 nprocs=nproc, join=True)
    except mp.ProcessExitedException as error:  # the rank printed why (a SystemExit message)
        return error.exit_code if error.exit_code and error.exit_code > 0 else 1
    except mp.ProcessRaisedException as error:
        logger.error("rank %d failed:\n%s", error.error_index, error)
        return 1
    return 0


def _rank_main(rank: int, environment: dict, threads: int, log_level: int, command: Callable,
               args) -> None:
    os.environ.update(environment, RANK=str(rank), LOCAL_RANK=str(rank))
    configure_logging(log_level, rank)  # a spawned process starts with logging unconfigured
    torch.set_num_threads(threads)
    quiet = open(os.devnull, "w") if rank else contextlib.nullcontext(sys.stdout)
    with quiet as out, contextlib.redirect_stdout(out):
        code = command(*args)
    if code:
        raise SystemExit(code)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
