"""The model worker: the one place that runs the model. Prefill, decode and sampling over a KVCache the
service owns. Not thread-safe: the session service calls it from a single model thread."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kernels.int8_linear import int8_versions, swapped_linears
from kernels.weight_linear import use_dense_from_rows, warm_many_row_kernels
from statekeeper import batch_forward
from statekeeper.batch_forward import Segment
from statekeeper.compression import attention_stats
from statekeeper.compression.attention_stats import AttentionStats, ReconstructionScores, collecting, head_bias
from statekeeper.compression.reconstruction import (DEFAULT_SCORING, ForwardDone, FusedReconstructionScores,
                                                    ReconstructionScoring, ReconstructionStep, plan_steps)
from statekeeper.compression.reconstruction import PROMPT as RECONSTRUCTION_PROMPT
from statekeeper.config import WorkerConfig
from statekeeper.kv_cache import GaveWay, KVCache, giving_way
from statekeeper.memory import keep_freed_memory_warm
from statekeeper.model_loader import LoadedModel, kv_fingerprint, resolve_kv_dtype, with_weights
from statekeeper.threads import use_threads


def sliding_windows(config, num_layers: int) -> list[int | None]:
    """Each decoder layer's attention window in tokens (None: it attends to the whole history): the sliding
    layers of a config with `layer_types` (Gemma 2/3), every layer of one with a `sliding_window` in use
    (Mistral; Qwen 2 only with use_sliding_window)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if kind == "sliding_attention" else None for kind in layer_types[:num_layers]]
    return [window if getattr(config, "use_sliding_window", True) else None] * num_layers


def read_chat_template(path: Path, tokenizer) -> str:
    """The template in the file at `path`, checked by rendering a short conversation with `tokenizer`; a
    ValueError naming the file says what is wrong (the service does not start with it)."""
    try:
        template = path.read_text()
        tokenizer.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                                      chat_template=template, tokenize=False, add_generation_prompt=True)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"chat template {path}: {exc}") from None
    except Exception as exc:  # Jinja's syntax and runtime errors, and a template that raises itself
        raise ValueError(f"chat template {path} does not render a conversation: {exc}") from None
    return template


class ModelWorker:
    def __init__(self, loaded: LoadedModel, config: WorkerConfig):
        use_threads(config.num_threads)  # the calling thread's: the one that will run the model
        if config.keep_freed_memory_warm and next(loaded.model.parameters()).device.type == "cpu":
            keep_freed_memory_warm()
        loaded = with_weights(loaded, config.weight_precision)  # the fingerprint records the weight precision
        self.model = loaded.model
        # Every many-row kernel the forwards can need, compiled now: no request pays a compilation or
        # leaves a kernel behind (kernels/bf16_gemm.py)
        warm_many_row_kernels(self.decoder_layer_modules(), config.prefill_chunk_tokens)
        if config.gemm_rows is not None:  # else measured at start (statekeeper/dense_rows_choice.py)
            use_dense_from_rows(self.model.modules(), config.gemm_rows)
        # SDPA, plus statistics only inside `collecting`, per conversation in a packed forward
        attention_stats.install(self.model, batch_forward.attention)
        self.can_pack = batch_forward.supports_packing(self.model)
        self.tokenizer = loaded.tokenizer
        if config.chat_template is not None:
            self.tokenizer.chat_template = read_chat_template(config.chat_template, self.tokenizer)
        if self.tokenizer.chat_template is None:  # a base model: CHAT_TEMPLATE gives it one (vLLM's --chat-template)
            raise RuntimeError(f"{loaded.path} has no chat template: give one with STATEKEEPER_CHAT_TEMPLATE")
        self.config = config
        model_config = self.model.config.get_text_config(decoder=True)
        self.num_layers: int = model_config.num_hidden_layers
        self.num_kv_heads: int = model_config.num_key_value_heads
        self.head_dim: int = getattr(model_config, "head_dim", None) or (
            model_config.hidden_size // model_config.num_attention_heads
        )
        self.context_length: int = model_config.max_position_embeddings
        self.sliding_windows = sliding_windows(model_config, self.num_layers)
        self.device = next(self.model.parameters()).device
        if self.device.type == "cuda":
            # cuDNN's attention builds an execution graph per shape, and every decode step's KV length is a
            # new one: on an H100 the model thread spent 84% of its time building them with the GPU idle
            # (benchmarks/gpu_decode_steps.py). Flash and memory-efficient attention take any length.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.dtype = next(self.model.parameters()).dtype
        self.is_bundled = loaded.is_bundled
        self.model_fingerprint = loaded.fingerprint  # the weights' alone, whatever the KV dtype
        self.use_kv_dtype(resolve_kv_dtype(config.kv_dtype, loaded.is_bundled, self.dtype))
        self.stop_token_ids = self._stop_token_ids()
        self._int8: dict | None = None  # see _int8_linears

    def use_kv_dtype(self, dtype: torch.dtype) -> None:
        """Keeps new caches' KV in `dtype` (statekeeper/kv_dtype_choice.py picks it where KV_DTYPE=auto); the
        fingerprint says which dtype stored KV was kept in, so a blob kept in another is not restored."""
        self.kv_dtype = dtype
        self.fingerprint = (self.model_fingerprint if dtype == self.dtype
                            else kv_fingerprint(self.model_fingerprint, dtype))

    def _stop_token_ids(self) -> set[int]:
        ids = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return ids

    @property
    def has_sliding_layers(self) -> bool:
        return any(window is not None for window in self.sliding_windows)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    def decoder_layers(self) -> list:
        return list(self.model.get_decoder().layers)

    def decoder_layer_modules(self) -> list:
        return [module for layer in self.decoder_layers() for module in layer.modules()]

    def new_cache(self) -> KVCache:
        return KVCache(self.num_layers, self.kv_dtype)

    def new_stats(self) -> AttentionStats:
        return AttentionStats(self.num_layers)

    @torch.inference_mode()
    def prefill(self, cache: KVCache, token_ids: list[int], stats: AttentionStats | None = None,
                give_way: Callable[[], bool] | None = None) -> torch.Tensor:
        """Appends `token_ids` to the cache in chunks; returns the logits after the last one. `give_way` (a
        background prefill's): checked before each layer; where it says live work waits, the prefill stops
        there and raises GaveWay with the cache and `stats` as they were before it."""
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        if give_way is None:
            return self._prefill(cache, token_ids, stats)
        mark, saved = cache.mark(), None if stats is None else stats.snapshot()
        try:
            with giving_way(give_way):
                return self._prefill(cache, token_ids, stats)
        except GaveWay:
            cache.rollback(mark)  # the layers it reached hold rows the others do not
            if stats is not None:
                stats.rewind(saved)
            raise

    def _prefill(self, cache: KVCache, token_ids: list[int], stats: AttentionStats | None) -> torch.Tensor:
        chunk = self.config.prefill_chunk_tokens
        logits = None
        with collecting(stats):
            for start in range(0, len(token_ids), chunk):
                logits = self._forward(cache, token_ids[start : start + chunk])
        return logits

    @torch.inference_mode()
    def score(self, cache: KVCache, token_ids: list[int], reply_from: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing: appends `token_ids` and returns, for every position i >= 1, the log-probability
        of token i and the greedy choice, both predicted from the positions before it. `reply_from`: the
        index where the cache's reply begins (KVCache.begin_reply), as in a turn whose prompt ends before it."""
        chunk = self.config.prefill_chunk_tokens
        logprobs, greedy = [], []
        previous = None  # the last position's log-softmax of the previous chunk predicts this chunk's first token
        cut = {reply_from} if reply_from is not None and 0 < reply_from < len(token_ids) else set()
        starts = sorted(set(range(0, len(token_ids), chunk)) | cut)
        for start, end in zip(starts, starts[1:] + [len(token_ids)]):
            if start == reply_from:
                cache.begin_reply()
            piece = token_ids[start:end]
            input_ids = torch.tensor([piece], dtype=torch.long, device=self.device)
            logits = self.run_model(cache, input_ids).logits[0].float()
            log_softmax = torch.log_softmax(logits, dim=-1)
            predictors = log_softmax[:-1] if previous is None else torch.cat([previous, log_softmax[:-1]])
            targets = torch.tensor(piece if previous is not None else piece[1:], device=self.device)
            logprobs.append(predictors.gather(1, targets[:, None])[:, 0].cpu())
            greedy.append(predictors.argmax(dim=-1).cpu())
            previous = log_softmax[-1:]
        return torch.cat(logprobs), torch.cat(greedy)

    @torch.inference_mode()
    def reconstruction_scores(self, cache: KVCache, history: list[int],
                              scoring: ReconstructionScoring = DEFAULT_SCORING,
                              chunk_tokens: int | None = None) -> list[torch.Tensor]:
        """KVzip-style per-head scores for the history in `cache`: the model is prompted to repeat the
        history, which is teacher-forced in chunks of `chunk_tokens` (default: the prefill chunk), and the
        attention each history entry receives is recorded (compression/reconstruction.py). The cache is
        cropped back afterwards."""
        collector, steps = self.reconstruction_plan(cache, history, chunk_tokens, scoring)
        try:
            for step in steps:
                self.reconstruction_step(cache, collector, step)
        finally:
            cache.truncate(collector.history_tokens)
        return collector.scores

    def reconstruction_plan(self, cache: KVCache, history: list[int], chunk_tokens: int | None = None,
                            scoring: ReconstructionScoring = DEFAULT_SCORING
                            ) -> tuple[FusedReconstructionScores | ReconstructionScores, list[ReconstructionStep]]:
        """The collector and the steps to feed, one reconstruction_step each (the service runs them as
        background work between live steps, `chunk_tokens` at a time, so a live step waits for at most
        one); the caller crops the cache back afterwards."""
        length = cache.num_tokens
        prompt = self.tokenizer.encode(RECONSTRUCTION_PROMPT, add_special_tokens=False)
        steps = plan_steps(history[:length], prompt, chunk_tokens or self.config.prefill_chunk_tokens,
                           scoring.context_chunk_tokens)
        if scoring.fused:
            collector = FusedReconstructionScores(self.num_layers, length, scoring.int8_linears, scoring.window_tokens,
                                                  len(prompt))
        else:
            collector = ReconstructionScores(self.num_layers, length)
        return collector, steps

    @torch.inference_mode()
    def reconstruction_step(self, cache: KVCache, collector: FusedReconstructionScores | ReconstructionScores,
                            step: ReconstructionStep) -> None:
        if step.is_chunk_start:  # a new repetition chunk attends to the history only: the views shrink,
            cache.set_length(collector.history_tokens)  # the buffers stay (the caller truncates at the end)
        if isinstance(collector, FusedReconstructionScores):
            collector.step_history_start = step.history_start
        linears = self._int8_linears() if getattr(collector, "int8_linears", False) else {}
        with collecting(collector), swapped_linears(linears):
            try:
                self.run_model(cache, torch.tensor([step.tokens], device=self.device), logits_to_keep=1)
            except ForwardDone:  # the fused collector has what it needs after the last layer's attention
                pass

    def _int8_linears(self) -> dict:
        """Int8 copies of the decoder layers' linears, for scoring forwards only; packed on first use."""
        if self._int8 is None:
            modules = [m for m in self.decoder_layer_modules() if isinstance(m, torch.nn.Linear)]
            self._int8 = int8_versions(modules)
        return self._int8

    @torch.inference_mode()
    def decode(self, cache: KVCache, token_id: int, stats: AttentionStats | None = None) -> torch.Tensor:
        with collecting(stats):
            return self._forward(cache, [token_id])

    @torch.inference_mode()
    def step(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Appends each segment's tokens to its conversation's cache in one forward (batch_forward.py) and
        returns each one's last-position logits. One segment, or a model that cannot be packed, runs as
        prefill and decode do."""
        if len(segments) == 1 or not self.can_pack:
            logits = []
            for segment in segments:
                with collecting(segment.stats):
                    logits.append(self._forward(segment.cache, segment.token_ids))
            return logits
        return list(batch_forward.packed_forward(self.model, segments, self.device, self.kv_dtype))

    def _forward(self, cache: KVCache, token_ids: list[int]) -> torch.Tensor:
        input_ids = self.input_ids(token_ids)
        return self.run_model(cache, input_ids, logits_to_keep=1).logits[0, -1].float()

    def input_ids(self, token_ids: list[int]) -> torch.Tensor:
        """[1, n] token ids on the model's device. On a GPU through pinned memory, without a host wait: a copy
        from pageable memory waits for the stream to drain first (a restore queues its forwards behind
        copies still running, statekeeper/device_restore.py)."""
        ids = torch.tensor([token_ids], dtype=torch.long)
        if self.device.type == "cpu":
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)

    def run_model(self, cache: KVCache, input_ids: torch.Tensor, **kwargs):
        """One forward that appends to `cache`, honouring its per-head attention bias if it has one (the
        cache's buffers, built once: the forward only slices them)."""
        with head_bias(cache.attention_bias(cache.num_tokens + input_ids.shape[-1], self.kv_dtype)):
            return self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, **kwargs)

    @staticmethod
    def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
        if temperature <= 0:
            return int(torch.argmax(logits))
        # In float64 (a temperature of 1e-300 is 0 in float32) with the top logit shifted to 0 first: a
        # tiny temperature then sends the others to -inf, never inf - inf (NaN), and samples the top token.
        shifted = logits.double() - logits.max().double()
        probs = torch.softmax(shifted / temperature, dim=-1).float()
        if top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
            drop[0] = False  # also when top_p is below float32's smallest number
            sorted_probs[drop] = 0.0
            choice = torch.multinomial(sorted_probs.cpu(), 1, generator=generator)
            return int(order[choice.to(order.device)])
        return int(torch.multinomial(probs.cpu(), 1, generator=generator))
