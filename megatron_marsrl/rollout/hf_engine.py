"""The embedded rollout engine: transformers generate() with KV cache, in-process.

It starts in seconds and on tiny CPU models outruns SGLang's torch-native path (PLATFORM.md:
1234 vs 512 tok/s), so it is the CPU default; SGLang is the engine of record on GPU. Both take
the same HF checkpoint-named weight updates and return the same records.

Log-probs are those of the sampling distribution (logits / temperature), i.e. what Megatron
recomputes with the same temperature, so their difference is the train/rollout mismatch.
"""
from __future__ import annotations

import re
from itertools import groupby
from typing import Iterable

import torch

from megatron_marsrl.rollout.batcher import BatchedEngine, DynamicBatcher
from megatron_marsrl.rollout.engine import EngineOutput, EngineRequest, EngineSampling
from megatron_marsrl.rollout.routed_experts import RoutedExpertsRecorder, left_padded_rows

# transformers 5 keeps Qwen3-MoE experts fused in memory (experts.gate_up_proj [E, 2I, H],
# experts.down_proj [E, H, I]) while checkpoints (and our export) name them per expert.
_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


class UnknownWeightError(KeyError):
    """A weight update named a tensor the engine's model does not have."""


class TransformersEngine(BatchedEngine):
    """In-process engine over a HF checkpoint directory. Thread-safe: requests submitted
    while a batch runs form the next batch (rollout/batcher.py)."""

    def __init__(self, model_dir: str, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                 max_total_tokens: int = 4096, max_batch_tokens: int = 65536, device: str | None = None):
        """``max_total_tokens`` bounds one request (prompt + max_new_tokens), ``max_batch_tokens``
        the sum over a batch (at least one request's). ``device``: default CUDA when available
        (the current device), else CPU."""
        import transformers

        if max_batch_tokens < max_total_tokens:
            raise ValueError(f"max_batch_tokens={max_batch_tokens} < max_total_tokens={max_total_tokens}: a batch "
                             "must hold one whole request; raise max_batch_tokens")

        self.device = torch.device(device or (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
                                              else "cpu"))
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device)
        self.model.eval()
        self.config = self.model.config
        self.max_total_tokens = max_total_tokens
        self.weight_version = 0
        self._params = dict(self.model.named_parameters())
        self._generator = torch.Generator().manual_seed(seed)
        eos = self.config.eos_token_id
        self._eos = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._batcher = DynamicBatcher(self._run_batch, token_budget=max_batch_tokens, name="hf-engine")

    # ---- generation -------------------------------------------------------------------
    def _run_batch(self, requests: list[EngineRequest]) -> list[EngineOutput]:
        """One batch from the batcher: one generate() per set of stop tokens (the only setting
        a batch must share; temperature, top-p/k, seed and length are per row)."""
        outputs: dict[int, EngineOutput] = {}
        order = sorted(range(len(requests)), key=lambda i: _stops_key(requests[i].sampling))
        for _, group in groupby(order, key=lambda i: _stops_key(requests[i].sampling)):
            idx = list(group)
            for i, out in zip(idx, self._generate_recording([requests[i] for i in idx])):
                outputs[i] = out
        return [outputs[i] for i in range(len(requests))]

    def _generate_recording(self, requests: list[EngineRequest]) -> list[EngineOutput]:
        """One batch; with hooks on the MoE routers when a request asks for routed experts."""
        if not any(r.return_routed_experts for r in requests):
            return self._generate_batch(requests)
        with RoutedExpertsRecorder(self.model, self.config.num_hidden_layers) as recorder:
            outs = self._generate_batch(requests)
        routed = recorder.take(len(requests))
        width = max(len(r.prompt_ids) for r in requests)  # _generate_batch left-pads to this width
        for row, (req, out) in enumerate(zip(requests, outs)):
            if req.return_routed_experts:
                out.routed_experts = left_padded_rows(routed, row, width=width, prompt_len=len(req.prompt_ids),
                                                      output_len=len(out.output_ids))
        return outs

    def _check_request(self, req: EngineRequest) -> None:
        if not req.prompt_ids:
            raise ValueError(f"request {req.rid!r}: empty prompt")
        total = len(req.prompt_ids) + req.sampling.max_new_tokens
        if total > self.max_total_tokens:
            raise ValueError(f"request {req.rid!r}: prompt {len(req.prompt_ids)} + max_new_tokens "
                             f"{req.sampling.max_new_tokens} = {total} tokens exceeds max_total_tokens={self.max_total_tokens}")
        vocab = self.config.vocab_size
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {req.rid!r}: token ids {bad[:5]} outside the vocabulary (size {vocab})")

    @torch.no_grad()
    def _generate_batch(self, requests: list[EngineRequest]) -> list[EngineOutput]:
        stops = set(self._eos) | set(requests[0].sampling.stop_token_ids)
        pad = self._eos[0] if self._eos else 0
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, req in enumerate(requests):  # left padding: generation appends on the right
            ids[row, width - len(req.prompt_ids):] = torch.tensor(req.prompt_ids)
            mask[row, width - len(req.prompt_ids):] = 1
        # Each row samples from its own generator: a seeded request gets the same tokens whatever
        # it is batched with; unseeded rows share the engine's generator. Sampling never touches
        # torch's global RNG: the trainer runs Megatron in another thread at the same time, and
        # its RNG tracker saves/restores the global state around forwards. Gumbel-max over the
        # filtered logits is an exact draw from softmax(logits / T).
        rows = [(r.sampling, self._generator if r.sampling.seed is None
                 else torch.Generator().manual_seed(r.sampling.seed & (2**63 - 1))) for r in requests]
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
            logits_processor=[_GumbelSampler(rows)], max_new_tokens=max(r.sampling.max_new_tokens for r in requests),
            eos_token_id=sorted(stops) or None, pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
        new = out.sequences[:, width:]
        scale = torch.tensor([r.sampling.temperature or 1.0 for r in requests], device=new.device)[:, None]  # greedy: 1
        # step by step: never a [batch, steps, vocab] tensor
        token_logp = torch.stack([torch.log_softmax(step.float() / scale, dim=-1).gather(-1, new[:, t, None])[:, 0]
                                  for t, step in enumerate(out.logits)], dim=1).cpu()
        new = new.cpu()
        return [self._record(req, new[row], token_logp[row], stops) for row, req in enumerate(requests)]

    def _record(self, req: EngineRequest, tokens: torch.Tensor, logp: torch.Tensor, stops: set) -> EngineOutput:
        ids = tokens.tolist()[: req.sampling.max_new_tokens]  # longer rows of the batch ran on
        end = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
        finish = "stop" if end is not None else "length"
        end = end or len(ids)
        return EngineOutput(rid=req.rid, prompt_ids=list(req.prompt_ids), output_ids=ids[:end],
                            logprobs=logp[:end].tolist(), finish_reason=finish, weight_version=self.weight_version)

    @torch.no_grad()
    def score(self, sequences: list[list[int]], *, temperature: float = 1.0) -> list[list[float]]:
        width = max(len(s) for s in sequences)
        ids = torch.zeros((len(sequences), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):  # right padding: causal attention ignores it
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        with self._batcher.exclusive():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        logp = torch.log_softmax(logits[:, :-1].float().cpu() / temperature, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        return [logp[row, : len(seq) - 1].tolist() for row, seq in enumerate(sequences)]

    # ---- weights ----------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], *, version: int) -> int:
        """Copy HF checkpoint-named tensors into the model. Unknown names raise (unlike
        SGLang, which ignores them): a sync that changes nothing must not pass silently."""
        applied = 0
        with self._batcher.exclusive():
            for bucket in buckets:
                for name, tensor in bucket:
                    self._target(name).copy_(tensor)
                    applied += 1
            self.weight_version = version
        return applied

    def read_weights(self, names: list[str], rows: int) -> dict[str, torch.Tensor]:
        with self._batcher.exclusive():
            return {name: self._target(name)[:rows].to("cpu", copy=True) for name in names}

    def _target(self, name: str) -> torch.Tensor:
        if name in self._params:
            return self._params[name].data
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return self._params["model.embed_tokens.weight"].data
        match = _EXPERT.match(name)
        if match:
            e, proj = int(match["e"]), match["proj"]
            fused = self._params.get(f"{match['prefix']}.{'down' if proj == 'down' else 'gate_up'}_proj")
            if fused is not None:
                if proj == "down":
                    return fused.data[e]
                half = fused.shape[1] // 2
                return fused.data[e, :half] if proj == "gate" else fused.data[e, half:]
        raise UnknownWeightError(f"weight update names {name!r}, which this {self.config.model_type} model does not have")

    def shutdown(self) -> None:
        self._batcher.close()
        self.model = None
        self._params = {}


def _stops_key(s: EngineSampling) -> tuple[int, ...]:
    return tuple(sorted(s.stop_token_ids))


class _GumbelSampler:
    """Logits processor: each row perturbed as :func:`gumbel_perturb` does with its own sampling
    and generator, so that transformers' greedy decoding picks an exact sample per row. The rows
    draw their noise in row order (unseeded rows share one generator), then rows of the same
    sampling are filtered and perturbed together: the same values as row by row, at a fraction
    of the per-row calls."""

    def __init__(self, rows: list[tuple[EngineSampling, torch.Generator]]):
        self.rows = rows
        groups: dict[tuple, list[int]] = {}
        for row, (s, _) in enumerate(rows):
            groups.setdefault((s.temperature, s.top_k, s.top_p), []).append(row)
        self.groups = list(groups.values())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        draws = {row: torch.rand(scores.shape[-1], generator=g)
                 for row, (s, g) in enumerate(self.rows) if s.temperature != 0}
        out = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
        for rows in self.groups:
            s = self.rows[rows[0]][0]
            if s.temperature == 0:
                out[rows] = scores[rows].float()
                continue
            out[rows] = _gumbel(_filtered(s, scores[rows]), torch.stack([draws[r] for r in rows]))
        return out


def gumbel_perturb(s: EngineSampling, scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Temperature, top-k, top-p, then Gumbel noise from ``generator`` (on the CPU, so that the
    draws are the same on every device): the argmax is an exact sample from the filtered
    softmax(scores / T). Greedy (T = 0) returns the scores unchanged. Any leading shape."""
    if s.temperature == 0:
        return scores.float()
    return _gumbel(_filtered(s, scores), torch.rand(scores.shape, generator=generator))


def _filtered(s: EngineSampling, scores: torch.Tensor) -> torch.Tensor:
    """``scores`` / temperature, with what top-k and top-p leave out at -inf (per last-dim row)."""
    scores = scores.float() / s.temperature
    if s.top_k > 0 and s.top_k < scores.shape[-1]:
        kth = torch.topk(scores, s.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        drop_sorted = cumulative - torch.softmax(sorted_scores, dim=-1) > s.top_p  # keep the first over p
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return scores


def _gumbel(scores: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``scores`` plus Gumbel noise made from CPU uniform draws of the same shape."""
    uniform = uniform.clamp_(1e-20, 1.0).to(scores.device)
    return scores - torch.log(-torch.log(uniform))
