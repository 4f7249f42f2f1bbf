"""Request and response bodies, one schema per direction."""

from __future__ import annotations

import json
import math
from typing import Annotated, Literal

from fastapi import Path
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from statekeeper.config import CODEC_PATTERN
from statekeeper.placement.retention import MAX_TTL_SECONDS, MIN_TTL_SECONDS, PRIORITIES
from statekeeper.tenancy import TENANT_PATTERN

RestoreSource = Literal["active", "dram", "lmdb", "ssd", "redis", "recompute"]
MAX_METADATA_BYTES = 16 * 1024  # as JSON
MAX_METADATA_DEPTH = 8
MAX_SCORE_MESSAGES = 64


def _encodable(text: str) -> str:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"), which has no UTF-8 form and no tokens."""
    if not _has_utf8(text):
        raise ValueError("text contains a lone surrogate (not valid Unicode)")
    return text


def json_problem(value, depth_limit: int) -> str | None:
    """What keeps `value` (parsed JSON: a client's object the service stores or renders) from being kept as it
    is, or None: dicts and lists nested more than `depth_limit` levels, a string or key with a lone surrogate
    (no UTF-8 form: the tokenizer refuses it), a NaN or infinite number (no JSON form: PostgreSQL's json refuses
    it). Iterative, since the JSON parser takes nesting deeper than Python's recursion limit."""
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            if depth == depth_limit:
                return f"nests deeper than {depth_limit} levels"
            if isinstance(item, dict):
                pending.extend((key, depth) for key in item)
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
        elif isinstance(item, str) and not _has_utf8(item):
            return "contains a lone surrogate (not valid Unicode)"
        elif isinstance(item, float) and not math.isfinite(item):
            return "contains NaN or an infinite number (not valid JSON)"
    return None


def _has_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _small_metadata(metadata: dict | None) -> dict | None:
    """Metadata is stored with the conversation and returned with it: a bounded, shallow JSON object."""
    if metadata is None:
        return None
    if (problem := json_problem(metadata, MAX_METADATA_DEPTH)) is not None:
        raise ValueError(f"metadata {problem}")
    if len(json.dumps(metadata, ensure_ascii=False).encode("utf-8", "surrogatepass")) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is larger than {MAX_METADATA_BYTES} bytes as JSON")
    return metadata


Text = Annotated[str, AfterValidator(_encodable)]
# Ids are secrets.token_urlsafe(24): 32 URL-safe characters. Anything else is refused before any lookup.
SessionId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="a session id as POST /v1/sessions gave it")]
Metadata = Annotated[dict | None, AfterValidator(_small_metadata)]


class CompressionOptions(BaseModel):
    """Per-session overrides of the service's compression settings (unset fields keep the defaults)."""

    model_config = ConfigDict(extra="forbid")
    policy: Literal["none", "krul", "krul_fixed", "minicache", "heads"] | None = None
    ratio: float | None = Field(None, ge=0, le=1)
    gamma: float | None = Field(None, ge=0, le=1)
    t: float | None = Field(None, ge=0, le=1)
    retain_angle: float | None = Field(None, ge=0, le=1)
    share_keys: bool | None = None
    share_values: bool | None = None
    codec: str | None = Field(None, pattern=CODEC_PATTERN)
    group_size: int | None = Field(None, ge=1, le=4096)
    keep: float | None = Field(None, gt=0, le=1)
    scorer: Literal["expected", "snapkv", "kvzip"] | None = None
    budgets: Literal["adaptive", "uniform", "calibrated", "global"] | None = None
    merge: bool | None = None


class RetentionOptions(BaseModel):
    """A conversation's own retention settings (statekeeper/placement/retention.py); unset fields keep its
    tenant's."""

    model_config = ConfigDict(extra="forbid")
    pinned: bool | None = None  # its stored KV leaves a tier only when nothing unpinned is left
    priority: Literal[PRIORITIES] | None = None  # Retention's own list
    ttl_seconds: int | None = Field(None, ge=MIN_TTL_SECONDS, le=MAX_TTL_SECONDS)  # its stored KV dropped then

    def settings(self) -> dict | None:
        return self.model_dump(exclude_none=True) or None


class RetentionPublic(BaseModel):
    """The retention that applies: the conversation's own settings over its tenant's."""

    pinned: bool
    priority: Literal[PRIORITIES]
    ttl_seconds: int | None


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    system: Text | None = None  # as long as a message may be (413 past MAX_CONTENT_CHARS)
    metadata: Metadata = None
    compression: CompressionOptions | None = None
    retention: RetentionOptions | None = None


class SessionCreated(BaseModel):
    id: str
    created_at: str


class SessionPublic(BaseModel):
    id: str
    state: Literal["active", "inactive"]
    tier: str | None
    turns: int
    tokens: int
    stored_bytes: int | None
    compression: str  # the session's compression policy
    codec: str  # how the stored blob's vectors are written now: none | int8 | int4...
    # Offload stores the exact state; compression re-encodes it later, in the background.
    is_compressed: bool | None  # None while nothing is stored
    retention: RetentionPublic


class MessageCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: Text
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=5.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)  # torch.Generator's range
    stream: bool = False


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class StreamTimes(BaseModel):
    compute_ms: float  # T_C: recompute of the prefix
    load_ms: float  # T_L: loading the rest
    total_ms: float


class RestorePipeline(BaseModel):
    """A restore that recomputed a prefix while loading the rest (Krul §6): the plan and what happened."""

    recompute_tokens: int
    tokens: int
    planned: StreamTimes
    measured: StreamTimes
    bubble_fraction: float  # idle time on the longer side / restore time
    fallback: str | None  # why the loaded part was recomputed instead


class LayerwiseTimes(BaseModel):
    """Milliseconds from the blob's read: its last layer decoded, the model thread taking the turn up, the
    prompt's prefill done (waits included); and what that prefill spent waiting for layers."""

    load_ms: float
    queued_ms: float
    compute_ms: float
    wait_ms: float
    total_ms: float


class LayerwiseRestore(BaseModel):
    """A compressed blob decoded layer by layer behind the turn's wait and its prompt's prefill."""

    tokens: int
    prefill_tokens: int
    measured: LayerwiseTimes
    fallback: str | None


class DeviceRestore(BaseModel):
    """A GPU worker's restore: the blob copied to the device as stored (a compressed one decoded there), a
    planned prefix recomputed, the turn's message queued behind the layers (statekeeper/device_restore.py)."""

    tokens: int
    recompute_tokens: int
    message_tokens: int  # of the turn's prompt, prefilled with the restore (0: it rode the batch after it)
    compressed: bool
    copied_bytes: int
    copy_calls: int
    staged_bytes: int  # of copied_bytes, through the pinned ring (the rest was copied in place)
    reused_slots: int
    host_waits: int  # ring slots the host waited for: still being read by an earlier copy
    enqueue_ms: float  # host time to queue the whole restore
    fallback: str | None  # why everything was recomputed instead


class Restore(BaseModel):
    source: RestoreSource
    ms: float
    pipeline: RestorePipeline | None = None
    layerwise: LayerwiseRestore | None = None
    device: DeviceRestore | None = None
    exact_copy: str | None = None  # the tier whose exact copy a compressed blob's restore took (EXACT_COPY_TIER)


class Timings(BaseModel):
    ttft_ms: float
    total_ms: float
    lock_wait_ms: float = 0.0  # waiting for the conversation, held by another request (an offload, a compaction)
    first_queue_ms: float | None = None  # the prompt's prefill waiting in line for the model thread


class MessagePublic(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str  # the answer; a reasoning template's think block is in `reasoning`
    reasoning: str | None = None  # None where the chat template has no think blocks
    usage: Usage
    restore: Restore
    timings: Timings


class Message(BaseModel):
    role: str
    content: str
    tool_calls: list[dict] | None = None  # an assistant message's calls, in OpenAI's shape
    tool_call_id: str | None = None  # a tool message's: the call it answers


class MessageList(BaseModel):
    data: list[Message]


class TierHealth(BaseModel):
    name: str
    available: bool


class Health(BaseModel):
    status: Literal["ok", "degraded"]  # degraded: a tier is unreachable; turns still work (recompute)
    model: str
    tiers: list[TierHealth]
    notes: list[str] = []  # e.g. calibrated budgets requested but no profile for this model


class TierStatsPublic(BaseModel):
    name: str
    available: bool
    usage_bytes: int
    budget_bytes: int
    blobs: int
    hits: int
    misses: int
    promotions: int
    demotions: int
    evictions: int
    errors: int


class ModelThreadStats(BaseModel):
    live_seconds: float  # turns and restores
    background_seconds: float  # compression of stored blobs
    live_jobs: int
    background_jobs: int
    live_queued: int  # jobs waiting in line now
    background_queued: int
    live_wait_seconds: float  # what the jobs run so far waited in line, added up
    background_wait_seconds: float
    batch_steps: int  # batched forwards run (scheduler/batch.py) ...
    batch_rows: int  # ... the tokens they carried ...
    batch_sessions: int  # ... and the conversations: batch_sessions / batch_steps is the mean batch


class LongLaneStats(BaseModel):
    """The second model thread (scheduler/lanes.py): long prompts, and next turns' prefills in background time."""

    live_seconds: float
    background_seconds: float
    live_jobs: int
    background_jobs: int
    live_queued: int
    live_wait_seconds: float  # what its live jobs waited in line, added up (behind a background job: one layer)


class ExactCopyStats(BaseModel):
    """Exact states kept beside compressed blobs, and the compressed restores that took them."""

    kept: int
    not_kept: int  # no tier could take the copy
    restores: int
    missing: int  # a compressed restore found no copy (evicted, or none kept)
    rejected: int  # copies that failed their checks or were of another state: deleted


class CompressionStats(BaseModel):
    compressed: int
    cancelled: int  # stopped by a turn for the conversation while under way
    failed: int
    skipped: int  # kept exact: nothing to compress with
    declined: int  # kept exact: the placement policy judged its user unlikely to return (left for eviction)
    encode_seconds: float  # eviction and codec on an I/O thread, when compressing on the model thread
    queued: int  # stored exact, waiting to be compressed
    process_jobs: int  # jobs the compression process finished (scoring, eviction and codec all there)
    process_cpu_seconds: float  # the compression process's CPU time on them
    raw_bytes: int  # the compressed blobs' stored size before compression ...
    stored_bytes: int  # ... and after: raw_bytes / stored_bytes is the compression ratio
    exact_copies: ExactCopyStats  # EXACT_COPY_TIER (statekeeper/sessions/exact_copy.py)


class ReturnGapCount(BaseModel):
    from_s: float  # the gap bin's start: idle from this many seconds up to the next bin's start
    returns: int


class MeasuredCompressionPublic(BaseModel):
    """What the policy weighs compressing by: its priors, then the service's own compressions."""
    compressions_seen: int  # compressions the ratio is measured on
    compressions_timed: int  # ... and those whose CPU was (the compression process's)
    compression_ratio: float  # exact bytes over compressed
    compress_prefills: float | None  # compressing a 1,000-token blob, in prefills of it (CPU)


class PlacementStats(BaseModel):
    """The placement policy (PLACEMENT_POLICY) and what its return-gap model has seen."""
    policy: Literal["lru", "value"]
    held: int  # conversations it knows (idle or stored)
    predicted_returns_within_hour: float  # the model's chance of a return within an hour, summed at each idle start
    returns_within_hour: int  # ... and the returns that came within the hour: its calibration
    lru_fallbacks: int  # victims chosen by LRU because the policy's books lacked them
    expired: int  # stored states dropped because their retention TTL passed
    forgotten: int  # conversations stored nowhere and away a week, dropped from the policy's books
    residence_s: dict[str, float]  # per tier, how long its victims had been idle (the horizon blobs are valued on)
    return_gaps: list[ReturnGapCount]  # the return-gap histogram: returns by how long the conversation was idle
    compression: MeasuredCompressionPublic


class ForecastRow(BaseModel):
    multiple: float  # of every tier's budget
    tiers: dict[str, int]  # the budgets simulated, bytes
    resumed: dict[str, int]  # resumed turns by where their KV came from
    hit_rate: float | None  # resumed turns that did not recompute (None: no resumed turn yet)
    recomputed_tokens: int
    first_token_ms_p50: float  # estimated from the cost profile
    first_token_ms_p95: float


class Forecast(BaseModel):
    """The service's recent turns replayed through the simulator with its tiers' budgets scaled."""
    turns: int
    conversations: int
    policy: Literal["lru", "value"]
    rows: list[ForecastRow]


class IdleSessionsHeld(BaseModel):
    count: int
    max_count: int  # MAX_IDLE_SESSIONS
    bytes: int  # estimated (LiveSession.estimated_bytes)
    max_bytes: int  # MAX_IDLE_MB


class BlobMetaHeld(BaseModel):
    entries: int
    bytes: int
    max_bytes: int


class HeapHeld(BaseModel):
    """glibc's allocator (statekeeper/memory.py heap_bytes)."""

    in_use: int  # allocated and not freed
    free_held: int  # freed, kept in its arenas


class MemoryBounds(BaseModel):
    idle_sessions: IdleSessionsHeld
    blob_meta: BlobMetaHeld
    freed_given_back_bytes: int  # freed memory returned to the kernel once quiet (statekeeper/memory.py)
    heap: HeapHeld | None = None  # None where the allocator is not glibc's


class NextTurnStats(BaseModel):
    """Chat templates that render a history otherwise the next time: next turns prepared in background time."""

    prepared: int
    abandoned: int
    tokens: int
    seconds: float  # the model thread's CPU time for them
    date_changes: int  # midnights that changed what a template writing today's date renders
    after_date_change: int  # of `prepared`, those prepared at a date change
    early_tokens: int  # of `tokens`, prefilled while the turn's reply was generated
    early_without_room: int  # next turns' heads not prefilled during a reply: the active KV budget was full
    followed_tokens: int  # of `early_tokens`, the reply's own, prefilled as they were sampled
    ahead_tokens: int  # of `tokens`, prefilled before a midnight for the date after it
    ready_at_date_change: int  # of `after_date_change`, those whose state was whole before the change
    gave_way: int  # background jobs stopped between two layers for live work on their lane (run again)
    gave_way_seconds: float  # of `seconds`, those stopped jobs' (their work lost)


class KVDtypeTiming(BaseModel):
    dtype: str
    decode_ms: float  # one conversation's decode step (statekeeper/kv_dtype_choice.py CONTEXT tokens)
    batched_ms: float  # one step of BATCH conversations
    ms_per_token: float  # what the choice compares


class KVDtypeChosen(BaseModel):
    """The live KV cache's dtype, and why: set by KV_DTYPE, or measured fastest at start (KV_DTYPE=auto)."""

    dtype: str
    reason: str
    cpu: str  # where it was measured ("" when not measured)
    timings: list[KVDtypeTiming]


class GemmRowsTiming(BaseModel):
    rows: int
    kernel_us: float  # the quantized kernel over the model's weight-only layers in turn
    bf16_gemm_us: float  # the bfloat16 GEMM over the same
    fp32_gemm_us: float  # the float32 GEMM over the same


class GemmRowsChosen(BaseModel):
    """From how many rows the weight-only layers use the GEMM (statekeeper/dense_rows_choice.py)."""

    rows: int | None  # None: never (the GEMM is slower at every row count on this CPU)
    gemm: Literal["bfloat16", "float32"]  # the dtype the GEMM computes in: the faster at many rows on this CPU
    reason: str
    cpu: str
    timings: list[GemmRowsTiming]


class StorageStats(BaseModel):
    tiers: list[TierStatsPublic]
    sessions_in_memory: int  # conversation objects held (active ones and up to MAX_IDLE_SESSIONS idle ones)
    active_sessions: int
    active_kv_bytes: int
    active_kv_budget_bytes: int
    turns_in_progress: int
    missing_blobs_at_start: int
    model_thread: ModelThreadStats
    long_prefill_lane: LongLaneStats | None  # None: one model thread (LONG_PREFILL_LANE, or one core for it)
    compression: CompressionStats
    placement: PlacementStats
    next_turn: NextTurnStats
    kv_dtype: KVDtypeChosen
    dense_rows: GemmRowsChosen | None = None  # None: the model has no weight-only layers, or no start-up profile
    memory: MemoryBounds  # what grows with the history rather than the load, against its bounds


class TierMove(BaseModel):
    tier: Annotated[str, Field(min_length=1, max_length=32)]  # a tier of this service: dram, lmdb, ssd, redis


class ConversationRow(BaseModel):
    """A conversation as the admin dashboard's table shows it."""
    id: str
    tenant: str
    state: Literal["active", "inactive"]
    tier: str | None  # where its stored KV is; None while active or when stored nowhere (it recomputes)
    turns: int
    tokens: int
    stored_bytes: int | None
    codec: str | None  # the stored blob's codec; None: nothing stored, or the tier cannot be read now
    policy: str  # its compression policy
    created_at: str
    last_active: str | None  # its last use in memory, else its last committed turn (or its creation)


class ConversationPage(BaseModel):
    data: list[ConversationRow]
    next_after: str | None  # pass as `after` for the next page; None on the last


class StatsSample(BaseModel):
    t: float  # Unix time
    ttft_ms: dict[str, list[float]]  # restore source -> [p50, p95] of the turns since the sample before
    restores_per_s: dict[str, float]  # restore source (a tier, or recompute) -> turns per second
    hit_rate: float | None  # share of the turns since the sample before that did not recompute; None: no turns
    tier_bytes: dict[str, int]
    compression_ratio: float  # raw / stored bytes of the blobs compressed so far (1.0 before any)
    queue_depth: int  # jobs waiting for the model thread


class StatsHistoryPublic(BaseModel):
    interval_s: float
    window_s: float
    samples: list[StatsSample]
    codecs: dict[str, str]  # tier -> its codec


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Text


class ScoreCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_SCORE_MESSAGES)


class TokenScorePublic(BaseModel):
    token: int
    text: str
    logprob: float
    greedy_token: int
    greedy_text: str
    match: bool


class ScoreTotals(BaseModel):
    tokens: int
    matches: int
    top1_agreement: float
    mean_logprob: float
    perplexity: float


class ScorePublic(BaseModel):
    tokens: list[TokenScorePublic]
    totals: ScoreTotals
    restore: Restore


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: Annotated[str, Field(pattern=TENANT_PATTERN)]


class KeyPublic(BaseModel):
    key_id: str
    tenant: str
    created_at: str
    revoked: bool


class KeyCreated(KeyPublic):
    key: str  # shown this once: only its digest is kept


class KeyList(BaseModel):
    data: list[KeyPublic]


class TenantLimitsPublic(BaseModel):
    """Each tenant's limits; 0 is none."""

    sessions: int
    stored_bytes: int
    requests_per_minute: int
    concurrent_turns: int


class TenantUsage(BaseModel):
    tenant: str  # "" is the one tenant of a service without API keys
    sessions: int
    stored_bytes: int
    requests_last_minute: int
    turns_in_progress: int


class TenantList(BaseModel):
    limits: TenantLimitsPublic
    data: list[TenantUsage]
    # Retention defaults by tenant ("*": every one): those set at run time over STATEKEEPER_TENANT_RETENTION's
    retention: dict[str, RetentionOptions]


class TenantRetention(BaseModel):
    """A tenant's retention defaults after a change: those set at run time (empty: the configured ones apply),
    and what applies to its conversations that have none of their own."""

    tenant: str
    settings: RetentionOptions
    applies: RetentionPublic


class ErrorBody(BaseModel):
    """Every error but a 422: what went wrong, in words."""

    detail: str


ERROR_DESCRIPTIONS = {
    400: "the turn would not fit the model's context, or max_tokens is over the service's limit",
    401: "the admin token or the API key is missing, wrong or revoked",
    403: "the admin API is disabled (no admin token configured)",
    404: "no such session",
    409: "a turn is already running on this session",
    413: "content, system prompt or request body over the service's limit",
    429: "too many turns under way; try again after Retry-After seconds",
    503: "the history store is not writable",
    507: "the conversation store is out of space; nothing was saved",
}


def error_responses(*codes: int) -> dict:
    """OpenAPI `responses` for these error statuses (FastAPI documents 422 itself)."""
    return {code: {"model": ErrorBody, "description": ERROR_DESCRIPTIONS[code]} for code in codes}


def json_error_responses(*codes: int) -> dict:
    """error_responses for a route whose own answer is not JSON (/metrics): FastAPI documents a `model`
    in the route's media type, but the errors are JSON like every other route's."""
    schema = {"$ref": f"#/components/schemas/{ErrorBody.__name__}"}  # there: every other route's errors use it
    return {code: {"description": ERROR_DESCRIPTIONS[code], "content": {"application/json": {"schema": schema}}}
            for code in codes}
