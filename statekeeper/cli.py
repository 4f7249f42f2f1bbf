"""`statekeeper` command line."""

from __future__ import annotations

import argparse
import logging


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from api.app import create_app
    from api.server import server_config
    from statekeeper.assembly import build_service
    from statekeeper.settings import load_settings

    settings = load_settings(args.config, host=args.host, port=args.port, data_dir=args.data_dir, model=args.model)
    config = settings.to_config()
    app = create_app(lambda: build_service(config), admin_token=config.admin_token,
                     max_body_bytes=config.max_body_bytes, show_docs=config.show_docs, auth=config.auth,
                     metrics_public=config.metrics_public, allowed_hosts=config.allowed_hosts,
                     send_seconds=settings.send_timeout_seconds, metrics_token=config.metrics_token)
    if config.auth == "none":
        logging.getLogger("statekeeper").warning(
            "no API keys: anyone who reaches %s:%d can use every conversation (STATEKEEPER_AUTH=api_key to "
            "require them)", settings.host, settings.port)
    uvicorn.Server(server_config(app, settings.host, settings.port, header_seconds=settings.header_timeout_seconds,
                                 max_connections=settings.max_connections, drain_seconds=settings.drain_seconds,
                                 send_buffer_bytes=settings.send_buffer_kb * 1024)).run()


def _prepare(args: argparse.Namespace) -> None:
    """Converts the bundled model into its safetensors cache (what `serve` would do on first start)."""
    from statekeeper.model_loader import resolve_model_dir
    from statekeeper.settings import load_settings

    settings = load_settings(args.config, data_dir=args.data_dir, model=args.model)
    print(resolve_model_dir(settings.model, settings.to_config().worker.model_cache_dir))


def _keys(args: argparse.Namespace) -> None:
    """API keys, managed on the data directory or the shared PostgreSQL history (beside a running service
    too)."""
    from statekeeper.assembly import open_keys
    from statekeeper.settings import load_settings

    store = open_keys(load_settings(args.config, data_dir=args.data_dir).to_config())
    try:
        if args.action == "create":
            record, key = store.create(args.tenant)
            print(f"{key}\t(key id {record.key_id}, tenant {record.tenant}; shown once, keep it)")
        elif args.action == "list":
            for record in store.list():
                print(f"{record.key_id}\t{record.tenant}\t{record.created_at}\t{'revoked' if record.revoked else 'active'}")
        elif not store.revoke(args.key_id):
            raise SystemExit(f"no key {args.key_id}")
    finally:
        store.close()


# Flags that every subcommand taking them accepts in any position: before the subcommand, after it, and
# after a `keys` action. Their default is SUPPRESS on every parser, so a subcommand's parser never
# overwrites a value given before it with its own default (argparse copies a subparser's whole namespace
# over the parent's); the later of two copies wins.
_SHARED_FLAGS = {"config": "env file with STATEKEEPER_* settings", "data_dir": "data directory",
                 "model": "'smollm2' or a local Hugging Face model directory"}
# What each subcommand reads of them.
_USES = {"serve": {"config", "data_dir", "model"}, "keys": {"config", "data_dir"},
         "prepare-model": {"config", "data_dir", "model"}, "profile": {"config", "data_dir", "model"},
         "calibrate": {"config", "data_dir", "model"}, "eval": {"model"}, "simulate": set(), "plan": set()}
# Tools with parsers of their own: the rest of the command line is theirs, the shared flags are handed on.
_TOOLS = {"eval": ("statekeeper.evaluation.fidelity", "fidelity of compressed states (benchmarks/fidelity.py)"),
          "calibrate": ("statekeeper.evaluation.calibration", "per-head budgets from sample conversations (TANGRAM)"),
          "profile": ("statekeeper.profile", "measure recompute and tier read speed for restore planning"),
          "simulate": ("statekeeper.simulation.command", "run the tier placement over a trace of conversations"),
          "plan": ("statekeeper.simulation.planner", "forecast hit rate, first tokens and recompute load per tier mix")}


def _shared(names) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    for name in names:
        parent.add_argument("--" + name.replace("_", "-"), help=_SHARED_FLAGS[name])
    return parent


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="statekeeper", parents=[_shared(_SHARED_FLAGS)])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP service", parents=[_shared(_USES["serve"])])
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.set_defaults(run=_serve)
    keys_flags = _shared(_USES["keys"])
    keys = commands.add_parser("keys", help="API keys: create --tenant T, list, revoke KEY_ID", parents=[keys_flags])
    key_actions = keys.add_subparsers(dest="action", required=True)
    key_actions.add_parser("create", parents=[keys_flags]).add_argument("--tenant", required=True)
    key_actions.add_parser("list", parents=[keys_flags])
    key_actions.add_parser("revoke", parents=[keys_flags]).add_argument("key_id")
    keys.set_defaults(run=_keys)
    prepare = commands.add_parser("prepare-model", help="convert the model cache now and print its path",
                                  parents=[_shared(_USES["prepare-model"])])
    prepare.set_defaults(run=_prepare)
    for name, (_, help_text) in _TOOLS.items():
        commands.add_parser(name, help=help_text, add_help=False, parents=[_shared(_USES[name])])
    return parser


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command not in _TOOLS and rest:
        parser.parse_args(argv)  # exits with argparse's message naming the arguments it does not know
    unused = sorted(name for name in _SHARED_FLAGS if hasattr(args, name) and name not in _USES[args.command])
    if unused:
        parser.error(f"{args.command} takes no {', '.join('--' + n.replace('_', '-') for n in unused)}")
    return args, rest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of a subcommand the CLI runs itself, every shared flag present (None if not given)."""
    return _with_every_shared_flag(_parse(argv)[0])


def _with_every_shared_flag(args: argparse.Namespace) -> argparse.Namespace:
    for name in _SHARED_FLAGS:
        if not hasattr(args, name):
            setattr(args, name, None)
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args, rest = _parse(argv)
    if args.command in _TOOLS:
        import importlib

        handed_on = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in _SHARED_FLAGS if hasattr(args, name)]
        importlib.import_module(_TOOLS[args.command][0]).main(handed_on + rest)
        return
    args = _with_every_shared_flag(args)
    args.run(args)


if __name__ == "__main__":
    main()
