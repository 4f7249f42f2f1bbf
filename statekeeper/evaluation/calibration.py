"""Offline calibration: which layer pairs this model can share cheaply (the ranking `damage` methods
need in `statekeeper eval`), and per-head budgets (`statekeeper calibrate`, TANGRAM §4.1) written as
the HeadProfile the service reads (statekeeper/compression/head_profile.py).


Each candidate pair is shared alone on calibration conversations that the evaluation does not use; its
damage is the mean KL(full || shared) per teacher-forced assistant token. The issue's probe found that on
SmolLM2 the damage depends on which layers share (12-23 fragile) far more than on how alike their
attention maps are, so a ranking measured once per model is a candidate replacement for Krul's per-
conversation similarity ranking (Krul §5, Algorithm 1)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field

import torch

from statekeeper.chat import ChatFormatter
from statekeeper.compression import CrossLayerSharing
from statekeeper.compression.attention_stats import collecting
from statekeeper.compression.head_profile import HeadProfile, load_profile, profile_path, rho_key
from statekeeper.compression.taxonomy import HeadTaxonomy, attended, build_taxonomy, overlap, top_positions
from statekeeper.evaluation.teacher_forcing import (ContinuationCase, FidelityTotals, build_state,
                                                    compare_continuation, sharegpt_cases)
from statekeeper.worker import ModelWorker

Pair = tuple[int, int]


def adjacent_pairs(num_layers: int) -> list[Pair]:
    return [(layer, layer + 1) for layer in range(num_layers - 1)]


def pair_damage(worker: ModelWorker, cases: list[ContinuationCase], parts: list[str],
                candidates: list[Pair] | None = None, log=print) -> dict[str, list[tuple[Pair, float]]]:
    """For each of `parts` ("v", "k", "kv": what the pair shares), candidates sorted by mean KL, least
    damaging first. One state per case serves every candidate."""
    candidates = candidates or adjacent_pairs(worker.num_layers)
    totals = {(part, pair): FidelityTotals() for part in parts for pair in candidates}
    for index, case in enumerate(cases):
        state = build_state(worker, case.history[:-1])
        for part, pair in totals:
            probe = CrossLayerSharing(f"pair{pair}-{part}", "fixed", share_keys="k" in part,
                                      share_values="v" in part, pairs=[pair])
            totals[part, pair].add(compare_continuation(worker, case.history, case.continuation, case.spans,
                                                        probe, state))
        log(f"calibration: conversation {index + 1}/{len(cases)}")
    return {part: sorted(((pair, totals[part, pair].mean_kl) for pair in candidates), key=lambda item: item[1])
            for part in parts}


CALIBRATION_SKIP = 3000  # pair-damage conversations come from far beyond those the evaluation reads


def damage_parts(names: list[str]) -> list[str]:
    """What the `damage` methods among `names` share ("v", "k", "kv"), each needing its own ranking."""
    sharing = [name.partition("+")[0].partition("/")[0].partition("@")[0] for name in names]  # e.g. damage-kv
    return sorted({(spec.partition("-")[2] or "v") for spec in sharing if spec.startswith("damage")})


def calibrate_damage(worker: ModelWorker, names: list[str], count: int, length: int, log) -> dict:
    """The pair rankings the `damage` methods among `names` need, from `count` calibration conversations
    of about `length` tokens ({} when none is asked for)."""
    from statekeeper.evaluation.datasets import sharegpt_conversations

    parts = damage_parts(names)
    if not parts:
        return {}
    formatter = ChatFormatter(worker.tokenizer)
    conversations = itertools.islice(sharegpt_conversations(min_turns=4), CALIBRATION_SKIP, None)
    cases = sharegpt_cases(formatter, conversations, length, count, worker.tokenizer.eos_token_id)
    return pair_damage(worker, cases, parts, log=log)


# -- per-head budgets (TANGRAM §4.1) ---------------------------------------------------------------

def head_scores(worker: ModelWorker, history: list[int], scorer: str) -> tuple[list[torch.Tensor], object]:
    """Per layer [kv_heads, tokens] scores of one conversation's history, and the state's statistics."""
    from statekeeper.compression.scorers import SCORERS

    state = build_state(worker, history)
    stats = state.stats
    if scorer == "kvzip":
        return worker.reconstruction_scores(state.cache, history), stats
    method = SCORERS[scorer]()
    return [method.score(k, v, stats.recent_queries[i], k.shape[-1] ** -0.5)
            for i, (k, v) in enumerate(state.cache.export_layers())], stats


def retention_ratios(scores: list[torch.Tensor], rho: float, sink_tokens: int = 4, recent_tokens: int = 32) -> torch.Tensor:
    """[L, H]: the share of its tokens each head keeps when a layer's heads compete for the layer's
    ceil(rho * H * N) entries (Ada-KV's rule, TANGRAM §4.1 calibration)."""
    from statekeeper.compression.head_budget import HeadBudgetEviction

    selector = HeadBudgetEviction("calibration", keep=rho, budgets="adaptive", sink_tokens=sink_tokens,
                                  recent_tokens=recent_tokens)
    return torch.stack([selector.select(layer, None).float().mean(dim=1) for layer in scores])


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ranks_a, ranks_b = a.flatten().argsort().argsort().double(), b.flatten().argsort().argsort().double()
    ranks_a, ranks_b = ranks_a - ranks_a.mean(), ranks_b - ranks_b.mean()
    return float((ranks_a * ranks_b).sum() / (ranks_a.norm() * ranks_b.norm()).clamp_min(1e-12))


def calibrate_heads(worker: ModelWorker, histories: list[list[int]], rhos: list[float], scorer: str = "kvzip",
                    alpha: float = 2.0, log=print) -> HeadProfile:
    ratios = {rho: [] for rho in rhos}
    for index, history in enumerate(histories):
        scores, _ = head_scores(worker, history, scorer)
        for rho in rhos:
            ratios[rho].append(retention_ratios(scores, rho))
        done = (index + 1) * 30 // len(histories)
        log(f"calibrating [{'#' * done}{'.' * (30 - done)}] {index + 1}/{len(histories)}")
    budgets, means, stds, stability = {}, {}, {}, {}
    for rho, samples in ratios.items():
        stacked = torch.stack(samples)  # [samples, L, H]
        mean, std = stacked.mean(0), stacked.std(0, unbiased=len(samples) > 1).nan_to_num(0.0)
        key = rho_key(rho)
        budgets[key] = (mean + alpha * std).clamp(max=1.0).tolist()
        means[key], stds[key] = mean.tolist(), std.tolist()
        stability[key] = sum(_spearman(s, mean) for s in samples) / len(samples)
    return HeadProfile(worker.fingerprint, scorer, alpha, len(histories), budgets, means, stds, stability)


@dataclass(slots=True)
class _RecentQueries:
    """An attention collector keeping every layer's last `window` queries (post-RoPE)."""

    window: int
    queries: dict = field(default_factory=dict)

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        self.queries[layer] = query[0, :, -self.window :]


def calibrate_taxonomy(worker: ModelWorker, cases: list[ContinuationCase], live_rho: float = 0.5,
                       tau_stable: float = 0.5, tau_sim: float = 0.5, k_fraction: float = 0.1, pool: int = 7,
                       window: int = 16, max_continuation: int = 128, log=print) -> HeadTaxonomy:
    """HeteroCache's taxonomy (compression/taxonomy.py) from what `measure_heads` measures."""
    stability, pair_overlap = measure_heads(worker, cases, k_fraction, pool, window, max_continuation, log)
    return build_taxonomy(stability, pair_overlap, live_rho, tau_stable, tau_sim, k_fraction=k_fraction, pool=pool,
                          window=window, samples=len(cases))


def measure_heads(worker: ModelWorker, cases: list[ContinuationCase], k_fraction: float = 0.1, pool: int = 7,
                  window: int = 16, max_continuation: int = 128, log=print
                  ) -> tuple[list[list[float]], list[list[list[float]]]]:
    """Each KV head's stability [L][H] and each pair's similarity [L][H][H] from ShareGPT continuations: each history is
    prefilled; each head's top-k attended history positions from its last `window` queries are its baseline;
    then the real next user turn and reply are teacher-forced `window` tokens at a time (a returning user's
    question is the drift that matters), and after each, every head's current top-k is compared with its
    baseline (stability) and with its layer's other heads' (similarity). Medians over all steps."""
    layers, heads = worker.num_layers, worker.num_kv_heads
    stability = [[[] for _ in range(heads)] for _ in range(layers)]
    pairs = [[[[] for _ in range(heads)] for _ in range(heads)] for _ in range(layers)]
    scaling = worker.head_dim ** -0.5
    for index, case in enumerate(cases):
        state = build_state(worker, case.history[:-1])
        tokens = state.cache.num_tokens
        history_keys = [keys for keys, _ in state.cache.export_layers()]
        baseline = [top_positions(attended(state.stats.recent_queries[layer][:, -window:], history_keys[layer],
                                           scaling, pool), k_fraction) for layer in range(layers)]
        recent = _RecentQueries(window)
        fed = (case.history[-1:] + case.continuation)[:max_continuation]
        with collecting(recent), torch.inference_mode():
            for start in range(0, len(fed), window):
                worker.run_model(state.cache, torch.tensor([fed[start : start + window]], device=worker.device))
                for layer in range(layers):
                    keys = state.cache.export_layers()[layer][0][:, :tokens]
                    current = top_positions(attended(recent.queries[layer], keys, scaling, pool), k_fraction)
                    for head in range(heads):
                        stability[layer][head].append(overlap(current[head], baseline[layer][head]))
                        for other in range(heads):
                            pairs[layer][head][other].append(overlap(current[head], current[other]))
        log(f"taxonomy: conversation {index + 1}/{len(cases)}")
    median = lambda values: float(torch.tensor(values).median()) if values else 0.0  # noqa: E731
    return ([[median(h) for h in layer] for layer in stability],
            [[[median(o) for o in h] for h in layer] for layer in pairs])


def main(argv: list[str] | None = None) -> None:
    """`statekeeper calibrate`: per-head budgets from ShareGPT conversations, written next to the data."""
    import argparse
    import sys

    from statekeeper.evaluation.datasets import sharegpt_conversations
    from statekeeper.service_worker import load_service_worker
    from statekeeper.settings import load_settings

    parser = argparse.ArgumentParser(prog="statekeeper calibrate", description=main.__doc__)
    parser.add_argument("--config")
    parser.add_argument("--data-dir")
    parser.add_argument("--model")
    parser.add_argument("--scorer", default="kvzip", choices=["kvzip", "expected", "snapkv"])
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--rhos", default="0.25,0.3,0.5")
    parser.add_argument("--alpha", type=float, default=2.0)
    parser.add_argument("--min-tokens", type=int, default=800)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--taxonomy", action="store_true",
                        help="measure HeteroCache's head taxonomy instead (compression/taxonomy.py) on --samples "
                             "continuations of ~--max-tokens histories, and add it to the scorer's profile")
    parser.add_argument("--live-rho", type=float, default=0.5, help="taxonomy: the live cache's share of entries")
    parser.add_argument("--tau-stable", type=float, default=0.5)
    parser.add_argument("--tau-sim", type=float, default=0.5)
    parser.add_argument("--topk", type=float, default=0.1, help="taxonomy: top-k positions as a share of the history")
    args = parser.parse_args(argv)
    config = load_settings(args.config, data_dir=args.data_dir, model=args.model).to_config()
    worker, _, _ = load_service_worker(config)  # as the service builds it: the profile is kept per fingerprint
    formatter = ChatFormatter(worker.tokenizer)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    path = profile_path(config.profile_dir, worker.fingerprint, args.scorer)
    if args.taxonomy:
        conversations = itertools.islice(sharegpt_conversations(min_turns=4), CALIBRATION_OFFSET, None)
        cases = sharegpt_cases(formatter, conversations, args.max_tokens, args.samples, worker.tokenizer.eos_token_id)
        stability, pair_overlap = measure_heads(worker, cases, args.topk, log=log)
        try:
            taxonomy = build_taxonomy(stability, pair_overlap, args.live_rho, args.tau_stable, args.tau_sim,
                                      k_fraction=args.topk, samples=len(cases))
        except ValueError as exc:  # the measurements are kept: other thresholds need no second run
            kept = path.with_suffix(".taxonomy-measured.json")
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text(json.dumps({"stability": stability, "pair_overlap": pair_overlap}))
            values = sorted(s for layer in stability for s in layer)
            raise SystemExit(f"{exc}\nhead stability quartiles {values[len(values) // 4]:.2f} / "
                             f"{values[len(values) // 2]:.2f} / {values[3 * len(values) // 4]:.2f}; measurements in "
                             f"{kept} (compression/taxonomy.py build_taxonomy)") from None
        profile = load_profile(config.profile_dir, worker.fingerprint, args.scorer,
                               (worker.num_layers, worker.num_kv_heads)) or HeadProfile(
            worker.fingerprint, args.scorer, args.alpha, 0, {}, {}, {}, {})
        profile.taxonomy = taxonomy.to_dict()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(profile.to_json())
        counts = taxonomy.counts()
        print(f"{path}\nhead roles: " + ", ".join(f"{count} {role}" for role, count in counts.items())
              + f"; live budgets of anchors and satellites {min(min(b) for b in taxonomy.live_budgets):.3f}-"
              f"{max(max(b) for b in taxonomy.live_budgets):.3f}")
        return
    histories = []
    for conversation in itertools.islice(sharegpt_conversations(min_turns=4), CALIBRATION_OFFSET, None):
        messages = [{"role": role, "content": content} for role, content in conversation]
        tokens, _ = formatter.append_turns([], [], messages[: 2 * (len(messages) // 2)], worker.tokenizer.eos_token_id)
        if args.min_tokens <= len(tokens):
            histories.append(tokens[: args.max_tokens])
        if len(histories) == args.samples:
            break
    profile = calibrate_heads(worker, histories, [float(x) for x in args.rhos.split(",")], args.scorer, args.alpha,
                              log=log)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json())
    print(f"{path}\nhead-ranking stability (Spearman with the mean profile): "
          + ", ".join(f"rho {k}: {v:.3f}" for k, v in profile.stability.items()))


CALIBRATION_OFFSET = 4000  # calibration conversations lie beyond those the benchmarks read
