"""The start-up choices that change what `statekeeper serve` computes, as a service reports them in
GET /v1/admin/tiers: the live KV cache's dtype (`kv_dtype`) and the GEMM the quantized layers hand many-row
products to, with the row count it takes them from (`dense_rows`). Two runs that made other choices ran other
kernels, so a ratio of their times says nothing about what the benchmark compares; `why_not_comparable` says
so. A choice a service does not report (a service from before the report, or one that measured nothing at
start) is None: unknown, and not held against a comparison."""

from __future__ import annotations

# GEMM_ROWS for "never take a GEMM": the setting has no word for it, and no product has this many rows.
NEVER_ROWS = 1_000_000_000


def reported_choices(admin: dict) -> dict:
    """{"kv_dtype", "gemm", "gemm_rows"} from GET /v1/admin/tiers's answer (`admin`); gemm_rows None with a
    gemm named: that GEMM is never taken."""
    kv_dtype = (admin.get("kv_dtype") or {}).get("dtype")
    dense_rows = admin.get("dense_rows") or {}
    return {"kv_dtype": kv_dtype, "gemm": dense_rows.get("gemm"), "gemm_rows": dense_rows.get("rows")}


def pinned_settings(measured: dict) -> dict[str, str]:
    """The settings with which a service that measures nothing at start (RESTORE_PLANNING=false) runs the KV
    dtype and GEMM row count `measured` chose: KV_DTYPE and GEMM_ROWS, for those known."""
    settings = {}
    if measured.get("kv_dtype"):
        settings["STATEKEEPER_KV_DTYPE"] = measured["kv_dtype"]
    if measured.get("gemm"):
        settings["STATEKEEPER_GEMM_ROWS"] = str(measured["gemm_rows"] or NEVER_ROWS)
    return settings


def pinned_choices(reported: dict, settings: dict[str, str]) -> dict:
    """What a service started with `settings` (pinned_settings) runs, where it does not report it: with
    GEMM_ROWS the worker takes the default GEMM (kernels/weight_linear.py default_gemm, the same on this machine
    for the service as here), which may not be the one measured."""
    if reported.get("gemm") or "STATEKEEPER_GEMM_ROWS" not in settings:
        return reported
    rows = int(settings["STATEKEEPER_GEMM_ROWS"])
    return reported | {"gemm": default_gemm(), "gemm_rows": None if rows >= NEVER_ROWS else rows}


def default_gemm() -> str:
    """The GEMM a worker takes without a measurement (kernels/weight_linear.py; imported here only, for torch)."""
    from kernels.weight_linear import default_gemm as worker_default

    return worker_default()


def describe_gemm(choices: dict) -> str:
    """E.g. "float32 GEMM from 16 rows", "GEMM ?" where unknown."""
    if choices.get("gemm") is None:
        return "GEMM ?"
    rows = choices.get("gemm_rows")
    return f"{choices['gemm']} GEMM " + ("never" if rows is None else f"from {rows} rows")


def describe(choices: dict | None) -> str:
    """E.g. "KV bfloat16, float32 GEMM from 16 rows"; "?" for what is unknown."""
    choices = choices or {}
    return f"KV {choices.get('kv_dtype') or '?'}, {describe_gemm(choices)}"


# The settings that make a choice on purpose: a configuration that sets one compares on that choice.
CHOICE_SETTINGS = {"kv_dtype": "STATEKEEPER_KV_DTYPE", "gemm": "STATEKEEPER_GEMM_ROWS"}


def deliberate_choices(settings: dict[str, str]) -> list[str]:
    """The choices a configuration's own settings make (kv-fp32's KV dtype, gemm16's GEMM): what it measures."""
    return [choice for choice, setting in CHOICE_SETTINGS.items() if setting in settings]


def why_not_comparable(mine: dict | None, theirs: dict | None, deliberate=()) -> str | None:
    """Why two runs' figures are not comparable (the choices both know that differ, other than the
    `deliberate` ones either configuration makes on purpose), or None if they are."""
    mine, theirs = mine or {}, theirs or {}
    differ = []
    if "kv_dtype" not in deliberate and mine.get("kv_dtype") and theirs.get("kv_dtype") \
            and mine["kv_dtype"] != theirs["kv_dtype"]:
        differ.append(f"KV dtype {mine['kv_dtype']} vs {theirs['kv_dtype']}")
    if "gemm" not in deliberate and mine.get("gemm") and theirs.get("gemm") \
            and describe_gemm(mine) != describe_gemm(theirs):
        differ.append(f"{describe_gemm(mine)} vs {describe_gemm(theirs)}")
    return "; ".join(differ) or None
