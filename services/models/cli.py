"""`prfaas model prepare`: build an embedded checkpoint ahead of time."""
from __future__ import annotations


def register(subparsers) -> None:
    from services.models.registry import PREPARERS

    parser = subparsers.add_parser("model", help="prepare the embedded models",
                                   description="Prepare an embedded model into the cache directory "
                                   "($PRFAAS_CACHE_DIR, default ~/.cache/prfaas); safe to repeat.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    prepare = actions.add_parser("prepare", help="prepare a model and print its directory")
    prepare.add_argument("name", nargs="?", default="smollm2-135m-instruct", choices=sorted(PREPARERS),
                         help="which model (default: %(default)s)")
    prepare.set_defaults(func=_prepare)


def _prepare(args) -> int:
    import logging

    from services.models.registry import prepare

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(prepare(args.name))
    return 0
