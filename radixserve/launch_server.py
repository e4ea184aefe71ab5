"""``python -m radixserve.launch_server --model-path ...``, as SGLang users type it.

The import stays under the main guard: the server's child processes are
spawned, and a spawned child imports this module again (as ``__mp_main__``);
at module level that would load the HTTP server (FastAPI, the OpenAI routes,
the launcher) into every child."""

import sys

if __name__ == "__main__":
    from radixserve.entrypoints.http_server import main

    sys.exit(main())
