"""``radixserve serve`` and ``python -m radixserve.launch_server``: parse the
server's arguments, start the scheduler ranks, then load the HTTP server
(and with it torch) and serve. The ranks' start-up (their own imports, the
model, the weights) thus overlaps the main process's imports, about 1.8 s
on two cores; this module and what it imports first load neither."""

from __future__ import annotations

import argparse

from radixserve.entrypoints.launcher import raise_open_file_limit, start_ranks_early
from radixserve.server_args import ServerArgs


def serve(argv: list[str] | None = None) -> int:
    """Parse ``argv``, start the ranks, serve; returns the exit code."""
    parser = argparse.ArgumentParser(prog="radixserve serve", description="Start the radixserve HTTP server")
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(argv))
    raise_open_file_limit()  # first: the children inherit it
    ranks = start_ranks_early(args)
    try:
        from radixserve.entrypoints.http_server import launch_server
    except BaseException:
        if ranks is not None:
            ranks.stop()
        raise
    return launch_server(args, ranks)
