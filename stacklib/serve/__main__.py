"""`python -m stacklib.serve --model-dir models/`: serve every model under models/<name>/<version>/."""

import argparse
import json
import sys

from stacklib import http
from stacklib.serve.repository import ModelRepository
from stacklib.serve.server import create_app


def main(argv: list[str] | None = None) -> int:
    """The command line; a user mistake exits with status 2 and one message."""
    parser = argparse.ArgumentParser(prog="python -m stacklib.serve", description=__doc__)
    parser.add_argument("--model-dir", required=True,
                        help="a folder of <name>/<version>/ exported artifacts")
    parser.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: %(default)s)")
    parser.add_argument("--max-batch-size", type=int, default=32,
                        help="most rows in one model call (default: %(default)s)")
    parser.add_argument("--batch-timeout-ms", type=float, default=2.0,
                        help="how long a batch waits for more requests after its first "
                             "(default: %(default)s)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="most rows x length in one call of a sequence model (default: no cap)")
    parser.add_argument("--poll-interval", type=float, default=1.0,
                        help="seconds between model-dir scans (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        sock = http.listen_socket(args.host, args.port)
        repository = ModelRepository(args.model_dir, max_batch_size=args.max_batch_size,
                                     batch_timeout=args.batch_timeout_ms / 1e3,
                                     poll_interval=args.poll_interval, max_batch_tokens=args.max_batch_tokens)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    print(json.dumps(repository.start().status(), indent=1), flush=True)
    try:
        http.serve(create_app(repository), sock)
    finally:
        repository.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
