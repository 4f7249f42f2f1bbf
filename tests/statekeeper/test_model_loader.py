"""The bundled model's first-use conversion (statekeeper/model_loader.py)."""

import threading

import transformers

from statekeeper.model_loader import convert_gguf


class _Saved:
    """Stands for the dequantized model and its tokenizer: each save writes its files slowly, so that two
    conversions at once are both writing."""

    config = object()

    def __init__(self, both_saving: threading.Barrier):
        self.both_saving = both_saving

    def save_pretrained(self, directory):
        directory.mkdir(parents=True, exist_ok=True)
        self.both_saving.wait(10)
        (directory / f"{type(self).__name__}-{id(self)}.json").write_text("{}")
        (directory / "config.json").write_text("{}")


def test_two_processes_converting_the_model_at_once_both_get_the_cache(tmp_path, monkeypatch):
    """The service and `statekeeper profile` (or two test workers) on one cold cache wrote into one .partial
    folder: one removed it while the other wrote, and a start failed (or renamed a half-written cache into
    place for every later start). Each converts into a folder of its own; the second to finish takes the
    first one's cache."""
    both_saving = threading.Barrier(2)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: _Saved(both_saving))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *args, **kwargs: _Saved(both_saving))
    gguf, target = tmp_path / "model.gguf", tmp_path / "cache" / "smollm2"
    target.parent.mkdir()
    results, failures = [], []

    def convert():
        try:
            results.append(convert_gguf(gguf, target))
        except Exception as exc:  # noqa: BLE001 - what the start would have died of
            failures.append(exc)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert failures == [] and results == [target, target]
    assert (target / "config.json").exists() and [p.name for p in target.parent.iterdir()] == ["smollm2"]


def test_a_cache_left_incomplete_is_converted_again_and_old_partials_go(tmp_path, monkeypatch):
    """The conversion renamed its folder into place unsynced and nothing checked it after: a power loss could
    leave config.json beside a truncated file, loaded (and failing) at every start. A crash mid-conversion left
    a .partial folder (half a GiB for the bundled model) that nothing removed."""
    import os
    import time

    from statekeeper import model_loader

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(model_loader, "bundled_gguf_path", lambda: gguf)
    conversions = []

    def loaded(*args, **kwargs):
        conversions.append(args)
        return _Saved(threading.Barrier(1))

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", loaded)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    root = tmp_path / "cache"
    target = model_loader.resolve_model_dir("smollm2", root)
    assert len(conversions) == 2 and model_loader.resolve_model_dir("smollm2", root) == target
    assert len(conversions) == 2  # whole: used as it is
    stale = root / (target.name + ".partial-crashed")
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 100)
    os.utime(stale, (time.time() - 2 * 3600, time.time() - 2 * 3600))
    saved = next(path for path in target.iterdir() if path.name.startswith("_Saved"))
    saved.write_text("")  # what a power loss after the rename can leave
    assert model_loader.resolve_model_dir("smollm2", root) == target
    assert len(conversions) == 4 and not stale.exists()
