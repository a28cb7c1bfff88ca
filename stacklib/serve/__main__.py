"""`python -m stacklib.serve --model-dir models/`: serve every model under models/<name>/<version>/."""

import argparse
import json

from stacklib import http
from stacklib.serve.repository import ModelRepository
from stacklib.serve.server import create_app


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stacklib.serve", description=__doc__)
    parser.add_argument("--model-dir", required=True, help="a folder of <name>/<version>/ exported artifacts")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=32, help="most rows in one model call")
    parser.add_argument("--batch-timeout-ms", type=float, default=2.0,
                        help="how long a batch waits for more requests after its first")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="most rows x length in one call of a sequence model (default: no cap)")
    parser.add_argument("--poll-interval", type=float, default=1.0, help="seconds between model-dir scans")
    args = parser.parse_args(argv)
    repository = ModelRepository(args.model_dir, max_batch_size=args.max_batch_size,
                                 batch_timeout=args.batch_timeout_ms / 1e3, poll_interval=args.poll_interval,
                                 max_batch_tokens=args.max_batch_tokens)
    print(json.dumps(repository.start().status(), indent=1), flush=True)
    try:
        http.serve(create_app(repository), host=args.host, port=args.port)
    finally:
        repository.close()


if __name__ == "__main__":
    main()
