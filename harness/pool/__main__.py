"""``python -m harness.pool {stop,status} [ROOT]``. ``stop``: stop the kept pools (``--keep-pool``) of the checkout at
ROOT (the working directory by default), every xdist worker's; ``--all``: every kept pool of this user. ``status``:
what each of them says of itself, by xdist worker."""
from __future__ import annotations

import argparse
import os
import sys

from .kept import stop


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.pool", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    halt = sub.add_parser("stop", help="stop kept pools")
    halt.add_argument("root", nargs="?", default=os.getcwd(), help="the checkout (default: the working directory)")
    halt.add_argument("--all", action="store_true", help="every kept pool of this user")
    show = sub.add_parser("status", help="what each of this checkout's kept pools says of itself (JSON, by xdist "
                                         "worker; 'main' without xdist), exit 1 if none")
    show.add_argument("root", nargs="?", default=os.getcwd(), help="the checkout (default: the working directory)")
    args = parser.parse_args(argv)
    if args.command == "status":
        import json

        from .kept import statuses

        answer = statuses(args.root)
        print(json.dumps(answer))
        return 0 if answer else 1
    stopped = stop(None if args.all else args.root)
    print(f"stopped {len(stopped)} kept pool(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
