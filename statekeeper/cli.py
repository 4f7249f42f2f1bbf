"""`statekeeper` command line."""

from __future__ import annotations

import argparse
import logging


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from api.app import create_app
    from statekeeper.service import build_service
    from statekeeper.settings import load_settings

    settings = load_settings(args.config, host=args.host, port=args.port, data_dir=args.data_dir, model=args.model)
    config = settings.to_config()
    app = create_app(lambda: build_service(config), admin_token=config.admin_token,
                     max_body_bytes=config.max_body_bytes, show_docs=config.show_docs, auth=config.auth,
                     metrics_public=config.metrics_public)
    if config.auth == "none":
        logging.getLogger("statekeeper").warning(
            "no API keys: anyone who reaches %s:%d can use every conversation (STATEKEEPER_AUTH=api_key to "
            "require them)", settings.host, settings.port)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")


def _prepare(args: argparse.Namespace) -> None:
    """Converts the bundled model into its safetensors cache (what `serve` would do on first start)."""
    from statekeeper.model_loader import resolve_model_dir
    from statekeeper.settings import load_settings

    settings = load_settings(args.config, data_dir=args.data_dir, model=args.model)
    print(resolve_model_dir(settings.model, settings.to_config().worker.model_cache_dir))


def _keys(args: argparse.Namespace) -> None:
    """API keys, managed on the data directory or the shared PostgreSQL history (beside a running service
    too)."""
    from statekeeper.service import open_keys
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


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="statekeeper")
    parser.add_argument("--config", help="env file with STATEKEEPER_* settings")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--data-dir")
    serve.add_argument("--model", help="'smollm2' or a local Hugging Face model directory")
    serve.set_defaults(run=_serve)
    keys = commands.add_parser("keys", help="API keys: create --tenant T, list, revoke KEY_ID")
    keys.add_argument("--data-dir")
    key_actions = keys.add_subparsers(dest="action", required=True)
    key_actions.add_parser("create").add_argument("--tenant", required=True)
    key_actions.add_parser("list")
    key_actions.add_parser("revoke").add_argument("key_id")
    keys.set_defaults(run=_keys)
    prepare = commands.add_parser("prepare-model", help="convert the model cache now and print its path")
    prepare.add_argument("--data-dir")
    prepare.add_argument("--model")
    prepare.set_defaults(run=_prepare)
    evaluate = commands.add_parser("eval", help="fidelity of compressed states (benchmarks/fidelity.py)",
                                   add_help=False)
    evaluate.set_defaults(run=None)
    calibrate = commands.add_parser("calibrate", help="per-head budgets from sample conversations (TANGRAM)",
                                    add_help=False)
    calibrate.set_defaults(run=None)
    profile = commands.add_parser("profile", help="measure recompute and tier read speed for restore planning",
                                  add_help=False)
    profile.set_defaults(run=None)
    args, rest = parser.parse_known_args(argv)
    if args.command == "eval":
        from statekeeper.evaluation.fidelity import main as eval_main

        eval_main(rest)
        return
    if args.command == "profile":
        from statekeeper.profile import main as profile_main

        profile_main(([f"--config={args.config}"] if args.config else []) + rest)
        return
    if args.command == "calibrate":
        from statekeeper.evaluation.calibration import main as calibrate_main

        calibrate_main(([f"--config={args.config}"] if args.config else []) + rest)
        return
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
