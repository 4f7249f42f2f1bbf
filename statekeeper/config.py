"""Plain dataclass configuration used inside the service (settings.py builds these at the boundary)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from statekeeper.placement.policy import PLACEMENT_POLICIES
from statekeeper.placement.retention import Retention
from statekeeper.tenancy import TenantLimits
from statekeeper.history.config import HistoryConfig  # owned by the history, which opens the store from it
# TierConfig is owned by storage, which builds the tiers from it
from storage.tier_config import TierConfig, check_redis_url  # noqa: F401

MiB = 1024 * 1024

# int8 / int4, then options: -v<B> values at B bits (2, 3, 4, 8; else as keys), -kc keys grouped per channel,
# -rot Hadamard-rotated rows, -sym / -vsym symmetric codes (no zero point) for keys and values / values only,
# -g<N> group size, -vg<N> the values' group size, -pk<P> top-scored key rows at 8 bits, -s<N> the first N
# tokens' rows also kept exact
CODEC_NAME = re.compile(r"int(?P<bits>[48])(?:-v(?P<vbits>[2348]))?(?P<kc>-kc)?(?P<rot>-rot)?(?P<sym>-v?sym)?"
                        r"(?:-g(?P<group>\d+))?"
                        r"(?:-vg(?P<vgroup>\d+))?(?:-pk(?P<precise>\d+))?(?:-s(?P<sinks>\d+))?")
CODEC_PATTERN = rf"^(none|{CODEC_NAME.pattern})$"  # the same names, for pydantic fields


def check_live_keep(keep: float, live_keep: float | None, budgets: str, merge: bool) -> None:
    """A live selection is a wider share than `keep`, up to 1, of the same scores: not of calibrated budgets
    (a profile is for one share) nor with merging (merged rows are not the exact state's)."""
    if live_keep is not None and not (keep < live_keep <= 1 and budgets != "calibrated" and not merge):
        raise ValueError("live_keep is a wider share than keep, up to 1, without calibrated budgets or merging")


def codec_options(codec: str, group_size: int = 64) -> dict | None:
    """The IntCodec fields a codec name asks for (None for "none"; `group_size` where the name has no
    -g<N>). Raises ValueError for a name or group size the codec cannot take: the one check that the
    settings, the API (through CompressionConfig) and compression/codec.py all run."""
    if codec == "none":
        return None
    match = CODEC_NAME.fullmatch(codec)
    if match is None:
        raise ValueError(f"unknown codec {codec!r}: none, or int8/int4 with options -v<B>, -kc, -rot, -sym|-vsym, "
                         "-g<N>, -vg<N>, -pk<P>, -s<N> in that order")
    group = int(match["group"] or group_size)
    value_group = int(match["vgroup"]) if match["vgroup"] else None
    if any(size < 2 or size & (size - 1) for size in (group, value_group or group)):
        raise ValueError(f"codec {codec!r} with group size {group}: group sizes must be powers of two")
    precise = int(match["precise"]) if match["precise"] else 0
    if match["precise"] and not (0 < precise < 100 and match["bits"] == "4"):
        raise ValueError(f"codec {codec!r}: -pk<P> takes int4 keys and a percentage between 1 and 99")
    if match["sym"] and not match["rot"] or match["sym"] == "-sym" and match["kc"]:
        # only rotated rows are near zero-mean (a key channel along tokens is not)
        raise ValueError(f"codec {codec!r}: {match['sym']} takes rotated rows (-rot) grouped per token")
    return {"bits": int(match["bits"]), "group_size": group, "keys_per_channel": bool(match["kc"]),
            "rotate": bool(match["rot"]), "exact_tokens": int(match["sinks"] or 0),
            "value_bits": int(match["vbits"]) if match["vbits"] else None, "value_group_size": value_group,
            "precise_key_percent": precise, "symmetric_values": bool(match["sym"]),
            "symmetric_keys": match["sym"] == "-sym"}


# How the live model's linear layers hold their weights (kernels/weight_linear.py): fp32 as loaded; int8
# (bfloat16 activations); dyn-int8 (activations quantized per call too); int4-g<N> (groups of N inputs).
# The output layer (tied to the embedding) is held like the others, or in float32 (-fphead) or int8 (-int8head).
WEIGHT_PRECISION = re.compile(r"(?P<kind>fp32|int8|dyn-int8|int4)(?:-g(?P<group>\d+))?(?:-(?P<head>fp|int8)head)?")
WEIGHT_PRECISION_PATTERN = rf"^(auto|{WEIGHT_PRECISION.pattern})$"
INT4_GROUP_SIZES = (32, 64, 128, 256)  # kernels/weight_linear.py has the same: config stays torch-free


@dataclass(frozen=True, slots=True)
class WeightPrecision:
    kind: str  # fp32 | int8 | dyn-int8 | int4
    group_size: int | None = None  # int4 only
    head: str | None = None  # the output layer's kind when not `kind`: fp32 or int8

    @classmethod
    def parse(cls, name: str) -> "WeightPrecision":
        """The one check of a WEIGHT_PRECISION name (settings, WorkerConfig and the loader all use it)."""
        match = WEIGHT_PRECISION.fullmatch(name)
        if match is None:
            raise ValueError(f"unknown weight precision {name!r}: fp32, int8, dyn-int8 or int4-g<N>, "
                             "optionally with -fphead or -int8head")
        kind, group = match["kind"], int(match["group"]) if match["group"] else None
        if (kind == "int4") != (group is not None) or (group is not None and group not in INT4_GROUP_SIZES):
            raise ValueError(f"weight precision {name!r}: int4 takes -g<N> with N in {INT4_GROUP_SIZES} (aten's "
                             "int4 CPU kernel), the others no group")
        head = {"fp": "fp32", "int8": "int8", None: None}[match["head"]]
        if (kind == "fp32" and head is not None) or head == kind:
            raise ValueError(f"weight precision {name!r}: the head option names another kind than the layers'")
        return cls(kind, group, head)

    @property
    def head_kind(self) -> str:
        return self.head or self.kind

    @property
    def name(self) -> str:
        group = f"-g{self.group_size}" if self.group_size else ""
        return self.kind + group + {"fp32": "-fphead", "int8": "-int8head", None: ""}[self.head]


KV_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")  # what model_loader.pick_device turns into a torch.device
TOOL_CALL_FORMATS = ("auto", "hermes", "mistral", "llama3_json", "none")


@dataclass(slots=True)
class WorkerConfig:
    model: str = "smollm2"  # "smollm2" (bundled GGUF) or a local Hugging Face model directory
    model_cache_dir: Path = Path("models")
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    num_threads: int = 1
    prefill_chunk_tokens: int = 512
    keep_freed_memory_warm: bool = True  # see statekeeper/memory.py
    # WEIGHT_PRECISION above, or auto: int4-g32-int8head for the bundled model (its GGUF holds its layers in
    # 4 bits per block of 32 and the embedding in int8: BENCHMARKS.md, issue 17), fp32 for any other
    weight_precision: str = "auto"
    # The live KV cache's dtype (stored KV keeps it): auto | float32 | bfloat16 | float16; auto is bfloat16 for
    # the bundled model, the model's dtype for any other (model_loader.resolve_kv_dtype). Attention over a long
    # history reads the whole cache at every decode step: half the bytes, less of that time (BENCHMARKS.md,
    # issue 17 "A bfloat16 KV cache").
    kv_dtype: str = "auto"
    # From how many rows the weight-only layers hand a product to a GEMM: None measures it at start, with
    # which GEMM (bfloat16 or float32: statekeeper/dense_rows_choice.py); a number is used as it is, with the
    # default GEMM (kernels/weight_linear.py default_gemm: bfloat16 where the CPU has it natively).
    gemm_rows: int | None = None
    # A Jinja chat template file used instead of the model's own (as vLLM's --chat-template): for a model
    # whose template does not say what its deployment needs (statekeeper/chat.py renders every turn with it).
    chat_template: Path | None = None
    # How the model writes tool calls: auto (read from the chat template) | hermes | mistral | llama3_json |
    # none (statekeeper/tool_calls.py).
    tool_call_format: str = "auto"

    def __post_init__(self):
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        is_quantized = self.weight_precision != "auto" and WeightPrecision.parse(self.weight_precision).kind != "fp32"
        if is_quantized and (self.device.startswith("cuda") or self.dtype not in ("auto", "float32")):
            raise ValueError(f"weight precision {self.weight_precision!r} runs CPU kernels in a float32 model: "
                             "device cpu or auto, dtype float32 or auto")
        if self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if self.tool_call_format not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool_call_format must be one of {', '.join(TOOL_CALL_FORMATS)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}")
        if self.gemm_rows is not None and self.gemm_rows < 1:
            raise ValueError("gemm_rows must be >= 1 (or unset: measured at start)")
        if self.prefill_chunk_tokens < 16:
            raise ValueError("prefill_chunk_tokens must be >= 16")


LANE_SETTINGS = ("auto", "on", "off")
COMPRESSION_POLICIES = ("none", "krul", "krul_fixed", "minicache", "heads")
SCORERS = ("expected", "snapkv", "kvzip")
BUDGETS = ("adaptive", "uniform", "calibrated", "global")


@dataclass(slots=True)
class CompressionConfig:
    """How an inactive conversation's KV is stored. Defaults come from the fidelity measurements in
    BENCHMARKS.md; a session may override any field at creation."""

    # The default is the smallest point measured that meets every fidelity bar, recall of early facts
    # included (BENCHMARKS.md, issue 13: 8x smaller than the fp16 KV): per-head eviction by KVzip scores
    # with global budgets (layers compete too), keeping half, then Hadamard-rotated rows written with
    # symmetric codes (no zero point), keys at 4 bits and values at 3 in groups of 64, the 8% of key rows
    # the eviction scored highest at 8 bits, token 0 (the attention sink) kept exact. It changes replies after a restore (top-1 agreement below 1): policy none with codec none is
    # lossless.
    policy: str = "heads"  # none | krul | krul_fixed | minicache (cross-layer sharing, Krul §4 / MiniCache) | heads
    ratio: float = 0.2  # r_l: fraction of layers that share
    gamma: float = 0.6  # I-R threshold (Krul §4)
    t: float = 0.5  # SLERP interpolation
    retain_angle: float = 0.5  # rows further apart than this fraction of pi stay unmerged
    share_keys: bool = False
    share_values: bool = True
    codec: str = "int4-v3-rot-sym-pk8-s1"  # none | int8 | int4 [-v<B>][-kc][-rot][-sym|-vsym][-g<N>][-vg<N>][-pk<P>][-s<N>]: how stored vectors are written, after sharing (compression/codec.py)
    group_size: int = 64  # elements per quantization scale, along the head dimension
    # policy "heads": per-head token budgets (compression/head_budget.py)
    keep: float = 0.5  # fraction of (head, token) entries kept
    scorer: str = "kvzip"  # kvzip | expected | snapkv
    budgets: str = "global"  # adaptive (Ada-KV) | uniform | calibrated (TANGRAM profile; uniform without one) | global (KVzip: layers compete too)
    merge: bool = False  # KeepKV: evicted tokens merge into kept ones
    # With an exact copy (SessionConfig.exact_copy_tier): a wider share whose positions the blob stores too, the
    # entries the reply attends, exact, after a restore from the copy (whose prompt attends every row; e.g. keep
    # 0.33, live_keep 0.5: a 12x fast copy, half live)
    live_keep: float | None = None

    def __post_init__(self):
        if self.policy not in COMPRESSION_POLICIES:
            raise ValueError(f"compression policy must be one of {COMPRESSION_POLICIES}")
        codec_options(self.codec, self.group_size)
        if self.scorer not in SCORERS or self.budgets not in BUDGETS:
            raise ValueError(f"scorer must be one of {SCORERS}, budgets one of {BUDGETS}")
        if not 0 < self.keep <= 1:
            raise ValueError("keep lies in (0, 1]")
        check_live_keep(self.keep, self.live_keep, self.budgets, self.merge)
        if not 0 <= self.ratio <= 1 or not 0 <= self.t <= 1 or not 0 <= self.retain_angle <= 1:
            raise ValueError("ratio, t and retain_angle lie in [0, 1]")

    @property
    def is_lossless(self) -> bool:
        return self.policy == "none" and self.codec == "none"

    @property
    def needs_stats(self) -> bool:
        """Whether turns gather attention statistics for this compression (a cost on every layer of every
        step): Krul's layer pairs, and the per-head scorers that read recent queries or received attention.
        KVzip scores come from the stored KV alone; only KeepKV merging adds the recent queries."""
        if self.policy in ("krul", "krul_fixed"):
            return True
        return self.policy == "heads" and (self.scorer != "kvzip" or self.merge)


@dataclass(slots=True)
class SessionConfig:
    idle_offload_seconds: float = 300.0
    active_kv_budget_bytes: int = 2048 * MiB
    max_content_chars: int = 32_000
    max_tokens_limit: int = 4096
    sweep_interval_seconds: float = 1.0
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    # Offload stores the exact state; compression re-encodes the stored blob later (sessions/offload.py):
    # after it has stayed idle this long (sooner when demoted or the fastest tier is nearly full) ...
    compress_after_seconds: float = 600.0
    # Which blob leaves a full tier and which get compressed (statekeeper/placement/): "lru" (least recently
    # used; compression on the schedule above) or "value" (expected returns, costs and bytes decide both).
    placement_policy: str = "value"
    # A tier below the fastest (without a codec) that keeps each compressed conversation's exact state beside
    # its compressed blob: a restore of that blob then takes the exact state whole, or the working set the
    # blob names (CompressionConfig.live_keep; issue 33, BENCHMARKS.md). None: the exact state goes once
    # compressed.
    exact_copy_tier: str | None = None
    # Opt-in: every turn appended to this JSON-lines file as the simulator reads it (statekeeper/simulation/
    # trace.py: hashed conversation and tenant tags, times, token counts; no text), to replay a real day.
    trace_file: Path | None = None
    # Retention defaults by tenant ("*": every tenant), each a dict of some of pinned / priority / ttl_seconds
    # (statekeeper/placement/retention.py); a conversation's own settings override them field by field.
    tenant_retention: dict[str, dict] = field(default_factory=dict)
    # ... only once no turn has run for this long, in background model jobs of this many tokens each
    # (the most a live step can wait behind compression).
    compress_quiet_seconds: float = 1.0
    compress_chunk_tokens: int = 64
    # Compressions that need only the stored KV (the default's KVzip scoring among them) run in a child
    # process with its own copy of the model, on another core, instead of between live steps on the model
    # thread (sessions/compress_process.py); the quiet wait and the chunks above are for the model thread.
    compress_process: bool = True
    # Turns (and scorings) under way at once; one more is refused with 429 and Retry-After instead of
    # queueing behind the one model thread without bound.
    max_concurrent_turns: int = 32
    # Continuous batching (scheduler/batch.py): conversations advanced by one forward (1: each alone), and
    # the prefill tokens one step may carry besides the decoding turns' (whole chunks of the worker's).
    batch_max_sessions: int = 16
    batch_prefill_tokens: int = 512
    # A second model thread for prompts longer than one prefill chunk (and scorings as long), on a core the
    # model thread does not use, so that one client's prompt at the context limit does not hold every other
    # user's first token for a chunk at a time: on | off | auto (on where the CPU has a core to spare for
    # it: scheduler/lanes.py).
    long_prefill_lane: str = "auto"
    # Idle conversations (no KV in memory, no turn) kept in memory, least recently used beyond this
    # leave it: their history is in the store and their KV in the tiers, so they come back whole.
    max_idle_sessions: int = 10_000
    # ... and at most this many bytes of them (LiveSession.estimated_bytes: a long history holds ~36 bytes
    # a token and its text), so a few huge conversations cannot fill the memory a count allows.
    max_idle_bytes: int = 256 * MiB
    # The stored blobs' meta remembered (sessions/blob_meta.py), least recently used beyond this forgotten.
    blob_meta_cache_bytes: int = 16 * MiB
    # Once no turn has run for this long, memory freed since the last time goes back to the kernel (it is
    # kept while turns run, for their KV: statekeeper/memory.py).
    give_back_memory_after_seconds: float = 10.0
    # Shutdown stores the active states for at most this long (Docker kills 10 s after SIGTERM).
    shutdown_seconds: float = 8.0
    # The admin dashboard's charts take a sample of the stats this often (an hour of them is kept).
    dashboard_sample_seconds: float = 5.0
    tenant_limits: TenantLimits = field(default_factory=TenantLimits)  # each tenant's, enforced per tenant

    def __post_init__(self):
        if self.max_idle_bytes < 0 or self.blob_meta_cache_bytes < 0:
            raise ValueError("max_idle_bytes and blob_meta_cache_bytes must be >= 0")
        if self.max_concurrent_turns < 1 or self.max_idle_sessions < 0 or self.shutdown_seconds < 0:
            raise ValueError("max_concurrent_turns must be >= 1, max_idle_sessions and shutdown_seconds >= 0")
        if self.idle_offload_seconds < 0 or self.give_back_memory_after_seconds < 0:
            raise ValueError("idle_offload_seconds and give_back_memory_after_seconds must be >= 0")
        if self.compress_after_seconds < 0 or self.compress_quiet_seconds < 0:
            raise ValueError("compress_after_seconds and compress_quiet_seconds must be >= 0")
        if self.dashboard_sample_seconds <= 0:
            raise ValueError("dashboard_sample_seconds must be > 0")
        if self.compress_chunk_tokens < 16:
            raise ValueError("compress_chunk_tokens must be >= 16")
        for tenant, settings in self.tenant_retention.items():
            try:
                Retention.of(settings)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"tenant_retention[{tenant!r}]: {exc}") from None
        if self.placement_policy not in PLACEMENT_POLICIES:
            raise ValueError(f"placement_policy must be one of {', '.join(PLACEMENT_POLICIES)}")
        if self.long_prefill_lane not in LANE_SETTINGS:
            raise ValueError(f"long_prefill_lane must be one of {', '.join(LANE_SETTINGS)}")


@dataclass(slots=True)
class LeaseConfig:
    """Coordination of replicas that share a history (statekeeper/coordination.py): a lease per
    conversation in the Redis at `url`, held for a turn."""

    url: str = field(repr=False)  # may hold a password
    password: str | None = field(default=None, repr=False)
    key_prefix: str = "statekeeper:"
    ttl_ms: int = 10_000  # a dead replica's lease frees itself after this long; renewed every third of it
    wait_seconds: float = 2.0  # a turn on a conversation leased elsewhere waits this long, then 409

    def __post_init__(self):
        if self.ttl_ms < 100 or self.wait_seconds < 0:
            raise ValueError("lease ttl_ms must be >= 100 and wait_seconds >= 0")
        check_redis_url(self.url, "the lease store's url")


def check_exact_copy_tier(name: str | None, tiers: list) -> None:
    """An exact copy lives below the fastest tier (it is read only with a compressed blob from above) in a tier
    that stores it as it is (a codec would re-encode it lossily)."""
    if name is None:
        return
    below = [tier for tier in tiers[1:] if tier.name == name]
    if not below:
        raise ValueError(f"exact_copy_tier {name!r} is not a configured tier below the fastest "
                         f"({', '.join(tier.name for tier in tiers[1:]) or 'none'})")
    if below[0].codec != "none":
        raise ValueError(f"exact_copy_tier {name!r} re-encodes its blobs (codec {below[0].codec})")


@dataclass(slots=True)
class ServiceConfig:
    data_dir: Path
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    tiers: list[TierConfig] = field(default_factory=list)
    promote_on_read: bool = False
    admin_token: str | None = field(default=None, repr=False)
    show_docs: bool = True  # /docs, /redoc and /openapi.json (off in production)
    max_body_bytes: int = 8 * MiB  # a larger request body is refused with 413 before it is read (api/limits.py)
    restore_planning: bool = True  # split restores between recompute and load by the hardware profile
    auth: str = "none"  # "api_key": every /v1 route but /v1/admin needs an API key (statekeeper.tenancy)
    allowed_hosts: tuple[str, ...] | None = None  # without API keys, the Host names served (api/browser_guard.py)
    index_secret: bytes | None = field(default=None, repr=False)  # None: <data_dir>/index-secret
    metrics_public: bool = False  # /metrics without the admin token (a scraper on a private network)
    metrics_token: str | None = field(default=None, repr=False)  # reads /metrics and nothing else
    history: HistoryConfig = field(default_factory=HistoryConfig)
    lease: LeaseConfig | None = None  # None: one replica, no coordination

    def __post_init__(self):
        for tier in self.tiers:  # storage keeps a tier's codec name; what it may be is known here
            try:
                codec_options(tier.codec)
            except ValueError as exc:
                raise ValueError(f"tier {tier.name}: {exc}") from None
        check_exact_copy_tier(self.sessions.exact_copy_tier, self.tiers)

    @property
    def profile_dir(self) -> Path:
        """Calibrated per-head budget profiles (`statekeeper calibrate`)."""
        return self.data_dir / "profiles"

    @property
    def history_path(self) -> Path:
        return self.data_dir / "history.lmdb"

    @property
    def keys_path(self) -> Path:
        return self.data_dir / "keys.lmdb"

    @property
    def tier_index_path(self) -> Path:
        return self.data_dir / "kv-index.lmdb"
