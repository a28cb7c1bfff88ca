"""The child process of a notebook's setup cell (see stacklib.hw.hosted), and its checks.

    python -m stacklib.hw install ACCELERATOR     bring the packages to the lock (pip only if needed)
    python -m stacklib.hw describe RUNTIME        print stacklib.hw.describe() (RUNTIME: colab, kaggle, local)
    python -m stacklib.hw plan ACCELERATOR FILE   write this host's pins to FILE, print the requirements
    python -m stacklib.hw check ACCELERATOR       print what is off the lock (JSON); exit 1 if anything is

ACCELERATOR is tpu, gpu or cpu (none).
"""

import dataclasses
import json
import sys

from stacklib import hw
from stacklib.hw import hosted


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "describe":
        print(dataclasses.replace(hw.describe(), runtime=args[0]))
        return 0
    accelerator = None if args[0] == "cpu" else args[0]
    if command == "install":
        return hosted.install(accelerator)
    lock = hosted.read_lock()
    wanted = hosted.requirements(accelerator, lock)
    pins = hosted.pins_for_this_host(lock)
    if command == "plan":
        with open(args[1], "w") as file:
            file.writelines(f"{name}=={version}\n" for name, version in sorted(pins.items()))
        print(json.dumps(wanted))
        return 0
    if command == "check":
        wrong = hosted.mismatches(wanted, pins)
        print(json.dumps(wrong, sort_keys=True))
        return 1 if wrong else 0
    raise SystemExit(f"unknown command {command!r}; see python -m stacklib.hw's docstring")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
