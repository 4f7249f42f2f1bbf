"""The `statekeeper` command line: every subcommand takes its flags wherever a user writes them (before or
after the subcommand, before or after a `keys` action), and a flag given twice keeps the later one."""

import argparse

import pytest

from statekeeper.cli import main, parse_args
from statekeeper.tenancy import KeyStore


@pytest.mark.parametrize("argv", [
    ["keys", "create", "--tenant", "acme", "--data-dir", "D"],
    ["keys", "create", "--data-dir", "D", "--tenant", "acme"],
    ["keys", "--data-dir", "D", "create", "--tenant", "acme"],
    ["--data-dir", "D", "keys", "create", "--tenant", "acme"],
])
def test_keys_create_takes_the_data_dir_in_any_position(argv):
    args = parse_args(argv)
    assert (args.command, args.action, args.tenant, args.data_dir) == ("keys", "create", "acme", "D")


@pytest.mark.parametrize("argv", [
    ["keys", "list", "--data-dir", "D", "--config", "C"],
    ["keys", "--config", "C", "list", "--data-dir", "D"],
    ["--config", "C", "--data-dir", "D", "keys", "list"],
])
def test_keys_list_takes_its_flags_in_any_position(argv):
    args = parse_args(argv)
    assert (args.action, args.data_dir, args.config) == ("list", "D", "C")


@pytest.mark.parametrize("argv", [
    ["keys", "revoke", "k1", "--data-dir", "D"],
    ["keys", "revoke", "--data-dir", "D", "k1"],
    ["keys", "--data-dir", "D", "revoke", "k1"],
])
def test_keys_revoke_takes_its_flags_in_any_position(argv):
    args = parse_args(argv)
    assert (args.action, args.key_id, args.data_dir) == ("revoke", "k1", "D")


@pytest.mark.parametrize("argv", [
    ["serve", "--port", "9000", "--data-dir", "D", "--model", "M", "--config", "C", "--host", "h"],
    ["--config", "C", "--data-dir", "D", "serve", "--model", "M", "--port", "9000", "--host", "h"],
    ["--model", "M", "serve", "--config", "C", "--host", "h", "--data-dir", "D", "--port", "9000"],
])
def test_serve_takes_its_flags_in_any_position(argv):
    args = parse_args(argv)
    assert (args.command, args.host, args.port, args.data_dir, args.model, args.config) == (
        "serve", "h", 9000, "D", "M", "C")


@pytest.mark.parametrize("argv", [
    ["prepare-model", "--data-dir", "D", "--model", "M"],
    ["--data-dir", "D", "prepare-model", "--model", "M"],
    ["--model", "M", "--data-dir", "D", "prepare-model"],
])
def test_prepare_model_takes_its_flags_in_any_position(argv):
    args = parse_args(argv)
    assert (args.command, args.data_dir, args.model) == ("prepare-model", "D", "M")


def test_a_flag_given_before_and_after_the_subcommand_keeps_the_later():
    assert parse_args(["--data-dir", "A", "keys", "--data-dir", "B", "list"]).data_dir == "B"
    assert parse_args(["--data-dir", "A", "keys", "list", "--data-dir", "C"]).data_dir == "C"


def test_flags_the_subcommand_does_not_have_are_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        parse_args(["keys", "list", "--port", "9000"])
    assert refused.value.code == 2 and "--port" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["profile", "calibrate"])
@pytest.mark.parametrize("where", ["before", "after"])
def test_tools_get_the_shared_flags_from_either_side_of_their_name(command, where, monkeypatch):
    module = {"profile": "statekeeper.profile", "calibrate": "statekeeper.evaluation.calibration"}[command]
    received = []
    monkeypatch.setattr(f"{module}.main", received.append)
    shared = ["--config", "C", "--data-dir", "D", "--model", "M"]
    main(shared + [command, "--samples", "3"] if where == "before" else [command, "--samples", "3"] + shared)
    tool = argparse.ArgumentParser()  # what the tool's own parser reads from the arguments it is handed
    for flag in ("--config", "--data-dir", "--model", "--samples"):
        tool.add_argument(flag)
    assert vars(tool.parse_args(received[0])) == {"config": "C", "data_dir": "D", "model": "M", "samples": "3"}


def test_keys_create_with_the_data_dir_after_the_action_writes_there(tmp_path, capsys):
    """The user's report: `statekeeper keys create --tenant acme --data-dir /srv/sk` failed with
    "unrecognized arguments: --data-dir"."""
    main(["keys", "create", "--tenant", "acme", "--data-dir", str(tmp_path)])
    key = capsys.readouterr().out.strip().split("\t")[0]
    store = KeyStore(tmp_path / "keys.lmdb")
    try:
        assert store.tenant_of(key) == "acme"
    finally:
        store.close()
    main(["keys", "list", "--data-dir", str(tmp_path)])
    assert capsys.readouterr().out.split("\t")[1] == "acme"


def test_prepare_model_with_its_flags_after_the_name_prints_the_local_model(tiny_model_dir, tmp_path, capsys):
    main(["prepare-model", "--model", str(tiny_model_dir), "--data-dir", str(tmp_path)])
    assert capsys.readouterr().out.strip() == str(tiny_model_dir)
