"""``python -m radixserve.launch_server --model-path ...``, as SGLang users type it."""

import sys

from radixserve.entrypoints.http_server import main

if __name__ == "__main__":
    sys.exit(main())
