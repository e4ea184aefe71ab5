"""``python -m radixserve.launch_server --model-path ...``, as SGLang users type it.

The import stays under the main guard: the server's child processes are
spawned, and a spawned child imports this module again (as ``__mp_main__``),
where it must load and start nothing. ``entrypoints/serve.py`` starts the
scheduler ranks before it loads the HTTP server and torch."""

import sys

if __name__ == "__main__":
    from radixserve.entrypoints.serve import serve

    sys.exit(serve())
